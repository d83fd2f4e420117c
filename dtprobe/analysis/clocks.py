"""Which clock a timing-based finding was judged on: the vocabulary of every finding's ``evidence.clock`` and the
rule that names it from the rows it used; read by the straggler, exposure, bubble and bandwidth detectors.

- ``host``: host timestamps (enqueue and completion as the host saw them; phases and pipeline actions timed
  on the host). The only clock of CPU/gloo runs; on CUDA it measures kernel launch, not execution.
- ``device``: device times (CUDA events recorded on the caller's stream, NCCL's own start/end, kernels of a
  trace), converted to the Unix clock by the collector or aligned from the collectives' ends on a trace folder
  (``evidence.aligned_by`` then says ``device_collectives``).
- ``mixed``: the rows used came from both (e.g. some ranks timed on the device, others on the host).
"""

from __future__ import annotations

import pandas as pd

HOST, DEVICE, MIXED = "host", "device", "mixed"
CLOCKS = (HOST, DEVICE, MIXED)
"""Values of ``evidence.clock``."""

DEVICE_TIMING = "cuda_event"
"""``collectives.timing`` of rows whose start_ns/end_ns are NCCL's device times."""


def clock_of(labels: pd.Series) -> str:
    """The clock of rows labelled ``labels`` (``steps.clock`` / ``pipeline.clock`` values, or already ``host`` /
    ``device``): one value when they agree, ``mixed`` when not; null labels (runs written before the column, CPU
    runs) are ``host``."""
    values = set(labels.fillna(HOST).astype(str).unique()) if len(labels) else {HOST}
    return values.pop() if len(values) == 1 else MIXED


def clock_of_timing(timing: pd.Series) -> str:
    """The clock of collectives rows by their ``timing`` (``cuda_event`` -> device, anything else -> host)."""
    if not len(timing):
        return HOST
    return clock_of((timing.fillna(HOST).astype(str) == DEVICE_TIMING).map({True: DEVICE, False: HOST}))
