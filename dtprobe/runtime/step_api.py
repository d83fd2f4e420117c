"""The step API shared by the train loop (``runtime.train``) and every layout (``runtime.parallel.ddp``,
``runtime.parallel.hybrid``): what a layout builds (``TrainParts``), what its step reads (``TrainContext``) and
the fp32 precision ops (``PlainOps``). A leaf: it imports the job config and the fault injector, never a layout
or the loop.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import nn

from dtprobe.runtime.config import JobConfig
from dtprobe.runtime.faults import FaultInjector
from dtprobe.runtime.layout import Layout

StepFn = Callable[["TrainContext", Any, int, list], "torch.Tensor | None"]
"""``train_step(ctx, s, step, micro_batches) -> mean loss`` (``s`` is the probe's step context for phases; None on
a pipeline rank without the loss)."""


class PlainOps:
    """fp32 step ops (no autocast, no loss scaling): the do-nothing twin of ``runtime.precision.MixedPrecision``."""

    scaler = None

    def autocast(self) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def backward(self, loss: torch.Tensor, *, inject_overflow: bool = False) -> None:
        loss.backward()

    def unscale(self, optimizer: torch.optim.Optimizer) -> None:
        pass

    def step(self, optimizer: torch.optim.Optimizer, *, step: int) -> None:
        optimizer.step()


@dataclass
class TrainParts:
    """What a layout builds: the seam between the train loop and every parallelism."""

    modules: list[nn.Module]
    """The wrapped model (DDP) or this rank's pipeline stages; what checkpoints save."""
    optimizer: torch.optim.Optimizer
    """The optimizer (its param groups' ``lr`` is set by the loop every step)."""
    train_step: StepFn
    """One optimizer step over this rank's micro-batches; returns the mean loss (a tensor)."""
    dp_rank: int
    """This rank's index on the data-parallel axis (selects its data; TP/PP peers of one replica share it)."""
    dp_size: int
    """Data-parallel degree."""
    ops: Any = field(default_factory=PlainOps)
    """Precision ops: ``autocast()``, ``backward(loss, inject_overflow=)``, ``unscale(opt)``, ``step(opt, step=)``
    (``PlainOps`` or ``runtime.precision.MixedPrecision``)."""
    params: list[nn.Parameter] = field(default_factory=list)
    """Parameters to clip."""


@dataclass
class TrainContext:
    """Everything a step may read on one rank."""

    job: JobConfig
    layout: Layout
    probe: Any
    """The rank's ``dtprobe.attach`` probe (steps, faults, rows)."""
    device: torch.device
    parts: TrainParts
    faults: FaultInjector
    """The runtime's faults at fixed points of the step (crash, hang, straggler)."""
    overflow_steps: frozenset[int] = frozenset()
    """Steps where this rank injects a loss-scale overflow (``--inject overflow:...``)."""
    start_step: int = 0
    """First step to run (moved by a resume from a checkpoint)."""
    peak_lr: float = 0.0
    """The lr after warmup (linear scaling rule applied)."""

    @property
    def ops(self) -> Any:
        """The layout's precision ops."""
        return self.parts.ops


__all__ = ["PlainOps", "StepFn", "TrainContext", "TrainParts"]
