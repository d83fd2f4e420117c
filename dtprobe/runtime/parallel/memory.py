"""Per-rank memory accounting (parameter, gradient, optimizer-state bytes; device peak or host RSS): one
``memory`` row per step, written by ``Parallelized.train_step``, read by the analysis and the planner's
calibration.

Bytes count what this rank holds: the local shard of a DTensor (TP, FSDP2), only the partition of optimizer
states a ZeroRedundancyOptimizer keeps. ``peak_bytes`` is CUDA's peak allocated memory since the last row; on
CPU it stays null (no allocator peak), and ``rss_bytes`` carries the process's resident set size instead.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from dtprobe.runtime.parallel.zero import local_optimizer


def _local_bytes(t: torch.Tensor | None) -> int:
    if t is None:
        return 0
    to_local = getattr(t, "to_local", None)
    if to_local is not None:
        t = to_local()
    return t.numel() * t.element_size()


def param_bytes(modules: Iterable[nn.Module]) -> int:
    """Bytes of this rank's parameters (local shards)."""
    return sum(_local_bytes(p) for m in modules for p in m.parameters())


def grad_bytes(modules: Iterable[nn.Module]) -> int:
    """Bytes of this rank's gradients (local shards; 0 for parameters without a gradient)."""
    return sum(_local_bytes(p.grad) for m in modules for p in m.parameters())


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of the optimizer states this rank keeps (e.g. AdamW's exp_avg and exp_avg_sq; step counters too)."""
    total = 0
    for state in local_optimizer(optimizer).state.values():
        for value in state.values():
            if isinstance(value, torch.Tensor):
                total += _local_bytes(value)
    return total


def memory_row(modules: list[nn.Module], optimizer: torch.optim.Optimizer, *, step: int,
               device: torch.device) -> dict[str, Any]:
    """The ``memory`` table row for this rank now (call after the optimizer step, before zeroing grads)."""
    row: dict[str, Any] = {
        "step": step,
        "param_bytes": param_bytes(modules),
        "grad_bytes": grad_bytes(modules),
        "optim_bytes": optimizer_state_bytes(optimizer),
    }
    if device.type == "cuda":
        row["peak_bytes"] = int(torch.cuda.max_memory_allocated(device))
        torch.cuda.reset_peak_memory_stats(device)
    import psutil

    row["rss_bytes"] = int(psutil.Process().memory_info().rss)
    return row
