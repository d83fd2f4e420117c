"""Parallel layouts of the built-in GPT (DP, ZeRO-1/2/3, TP, sequence parallel, PP schedules, 3-D hybrids);
``parallelize`` is what the runtime's train loop calls.

Modules: ``mesh`` (degrees, validation, DeviceMesh), ``tp``, ``zero`` (DP/ZeRO on the dp axis), ``pp``
(stages, schedules, action timing, sleep stages), ``ac`` (activation checkpointing), ``memory`` (per-rank
bytes), ``bubble`` (measured vs ideal pipeline bubble), ``hybrid`` (composition: ``parallelize``).
Import torch-heavy submodules lazily: ``from dtprobe.runtime.parallel import parallelize`` loads them.
"""

from __future__ import annotations

from typing import Any

__all__ = ["Parallelized", "ParallelDims", "StageSleep", "check_layout", "parallelize", "parallelize_model",
           "parse_stage_sleep"]


def __getattr__(name: str) -> Any:
    if name in ("parallelize", "parallelize_model", "Parallelized"):
        from dtprobe.runtime.parallel import hybrid

        return getattr(hybrid, name)
    if name in ("ParallelDims", "check_layout"):
        from dtprobe.runtime.parallel import mesh

        return getattr(mesh, name)
    if name in ("StageSleep", "parse_stage_sleep"):
        from dtprobe.runtime.parallel import stage_sleep as pp

        return getattr(pp, name)
    raise AttributeError(name)
