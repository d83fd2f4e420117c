"""``DtprobeCallback``: a Hugging Face ``transformers.TrainerCallback`` that records a ``Trainer`` run with dtprobe;
the run directory it writes is read by ``dtprobe analyze`` and the dashboard like any other run.

Install and use (``pip install 'dtprobe[hf]'``)::

    from dtprobe.integrations.hf import DtprobeCallback
    args = TrainingArguments(..., logging_steps=1)                 # a loss per step (see "Loss" below)
    trainer = Trainer(model, args, train_dataset=ds, callbacks=[DtprobeCallback("runs/hf-run")])
    trainer.train()

    torchrun --nproc-per-node 2 train.py                            # or accelerate launch train.py

``DtprobeCallback(run_dir, **attach_options)``: ``attach_options`` go to ``dtprobe.attach`` (``collectives``,
``devices``, ``profile_steps``, ``timeout_s``, ...).

- **Attach** at ``on_init_end``, the end of ``Trainer.__init__``: ``TrainingArguments`` (through Accelerate) has
  initialized torch.distributed by then, so ``dtprobe.attach`` finds the default group already there (see its
  docstring for what it records of it), and ``train()`` has not yet wrapped the model in DDP or FSDP, so the
  wrapper's collectives go through the group attach records. A callback added later
  (``trainer.add_callback``) attaches at ``on_train_begin``, after the wrapping, and warns that the wrapper's
  collectives may be missing. A probe already open in the process (``dtprobe launch``, the script's own
  ``dtprobe.attach``) is reused, not attached again (``optimizer_steps``).
- **Steps**: one ``steps`` row per optimizer step, numbered by ``state.global_step`` from 0; a step spans the
  end of the previous one (the first: ``on_step_begin``) to ``on_step_end`` (after the optimizer and scheduler
  step): the Trainer fetches a step's batches and exchanges the ranks' token counts before ``on_step_begin``, and
  that belongs to the step (``OptimizerStepMarker``). Its ``data_ns`` phase is the time the DataLoader took to hand
  over its batches, its ``opt_ns`` phase ``optimizer.step()`` (``on_pre_optimizer_step`` to
  ``on_optimizer_step``).
- **Loss**: the Trainer exposes no per-rank loss to callbacks, only its logged ``logs["loss"]``: the mean over
  all ranks of the loss since the previous log. A step records it when that log covers this step alone (with
  ``logging_steps=1``, every step; every rank records the same value); other steps have no loss, and a warning
  at attach says so when ``logging_steps`` is not 1.
- **Learning rate**: the first parameter group's ``lr`` when ``optimizer.step()`` returns, before the scheduler
  steps: the rate this step used, which is what the Trainer logs as ``learning_rate``.
- **Tokens**: this rank's elements of the model's main input (``model.main_input_name``, ``input_ids`` for
  language models, padding included) summed over the step's micro-batches, counted by a forward pre-hook on the
  model; absent when a micro-batch passes no such tensor.
- **Close** at ``on_train_end`` (status "finished"), when the callback attached the probe. The Trainer has no
  exception hook: a ``train()`` that raises leaves the probe to its exit handler, which closes it as "crashed"
  when the exception ends the process.
"""

from __future__ import annotations

import os
import warnings
from typing import Any

import torch

try:
    from transformers import TrainerCallback
except ImportError as exc:
    raise ImportError("dtprobe.integrations.hf needs transformers: pip install 'dtprobe[hf]'") from exc

from dtprobe.integrations.optimizer_steps import OptimizerStepMarker


class DtprobeCallback(TrainerCallback):
    """Records a ``Trainer.train()`` into ``run_dir``; see the module docstring for what each hook records."""

    def __init__(self, run_dir: str | os.PathLike, **attach_options: Any) -> None:
        self.marker = OptimizerStepMarker(run_dir, attach_options)
        self._input_name = "input_ids"
        self._hook: Any = None
        self._counting = False
        self._lr: float | None = None
        self._last_loss_log_step = 0

    @property
    def probe(self) -> Any:
        """The ``Probe`` once attached (when the Trainer is built), else None."""
        return self.marker.probe

    def on_init_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.marker.attach(framework="Hugging Face")

    def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
        if self.marker.probe is None:
            warnings.warn(
                "dtprobe: the callback attaches at train begin, after the Trainer wrapped the model (DDP, FSDP), so "
                "the wrapper's collectives may not be recorded. Pass it as Trainer(callbacks=[DtprobeCallback(...)]) "
                "to attach when the Trainer is built.", stacklevel=2)
        self.marker.attach(framework="Hugging Face")
        self._last_loss_log_step = state.global_step
        if model is not None:
            self._input_name = getattr(model, "main_input_name", "input_ids")
            self._hook = model.register_forward_pre_hook(self._count_inputs, with_kwargs=True)
        strategy = getattr(args.logging_strategy, "value", args.logging_strategy)
        if strategy != "steps" or state.logging_steps != 1:
            warnings.warn(
                f"dtprobe: the Trainer logs its loss with logging_strategy={strategy!r}, "
                f"logging_steps={state.logging_steps}, so only steps logged alone get a loss in the steps table. "
                f"Set TrainingArguments(logging_steps=1) to record the loss of every step.", stacklevel=2)

    def _count_inputs(self, module: Any, args: tuple, kwargs: dict[str, Any]) -> None:
        if self._counting:
            inputs = kwargs.get(self._input_name)
            self.marker.count_tokens(inputs.numel() if isinstance(inputs, torch.Tensor) else None)

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.marker.step_is_open:            # the previous step waited for a log that did not come
            self.marker.end(lr=self._lr)
        self._lr = None
        self.marker.begin(state.global_step)
        self._counting = True

    def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._counting = False
        self.marker.begin_optimizer()

    def on_optimizer_step(self, args: Any, state: Any, control: Any, optimizer: Any = None,
                          **kwargs: Any) -> None:
        self.marker.end_optimizer()
        if optimizer is not None:
            self._lr = float(optimizer.param_groups[0]["lr"])

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._counting = False
        # The Trainer's DefaultFlowCallback runs first and has set control.should_log for this step; the log
        # follows this hook, so a log of this step alone closes the step in on_log with its loss.
        if control.should_log and state.global_step - self._last_loss_log_step == 1:
            return
        self.marker.end(lr=self._lr)

    def on_log(self, args: Any, state: Any, control: Any, logs: dict[str, float] | None = None,
               **kwargs: Any) -> None:
        if not logs or "loss" not in logs:     # evaluation metrics, the final train_* summary
            return
        covers_one_step = state.global_step - self._last_loss_log_step == 1
        self._last_loss_log_step = state.global_step
        if self.marker.step_is_open:
            self.marker.end(loss=logs["loss"] if covers_one_step else None, lr=self._lr)

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._counting = False
        if self.marker.step_is_open:
            self.marker.end(lr=self._lr)
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        self.marker.close("finished")
