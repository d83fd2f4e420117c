"""Framework integrations: callbacks that record a framework's training loop with ``dtprobe.attach``.

- ``dtprobe.integrations.hf.DtprobeCallback``: a Hugging Face ``transformers.TrainerCallback``
  (``pip install 'dtprobe[hf]'``).
- ``dtprobe.integrations.lightning.DtprobeCallback``: a ``lightning.pytorch.Callback``
  (``pip install 'dtprobe[lightning]'``).

Both attach once the framework has initialized the process group and before it wraps the model in DDP or FSDP
(so the wrapper's collectives are recorded), write one ``steps`` row per optimizer step with its loss, learning
rate and tokens when the framework exposes them (absent otherwise, never guessed), and close the probe when
training ends. Under ``dtprobe launch``, or after the script's own ``dtprobe.attach``, they record through the
probe already open instead (one recorder per process; its steps become the framework's) and leave closing it to
whoever opened it. ``optimizer_steps.OptimizerStepMarker`` is the part they share. This package imports neither
framework: each module imports its own when it is imported.
"""
