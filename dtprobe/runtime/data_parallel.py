"""Pure data parallel: the DDP-wrapped GPT, its AdamW, and the DDP train step; built by ``runtime.train``.

The step: for each gradient-accumulation micro-batch, forward (``fwd`` phase) and backward (``bwd`` phase) under
``no_sync`` except the last, so DDP all-reduces gradients once per step (bucketed, ``bucket_cap_mb``); then the
``opt`` phase: unscale (fp16), ``clip_grad_norm_``, ``optimizer.step``, ``zero_grad``. It returns the mean loss
as a tensor (the loop calls ``.item()`` once per step, as a plain training script logging its loss does).

``runtime.parallel.parallelize`` returns the same ``TrainParts`` for TP / PP / ZeRO layouts.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from dtprobe.runtime.model import build_model, lm_loss

if TYPE_CHECKING:
    from dtprobe.runtime.train import TrainContext

StepFn = Callable[["TrainContext", Any, int, list], torch.Tensor]
"""``train_step(ctx, s, step, micro_batches) -> mean loss`` (``s`` is the probe's step context for phases)."""


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
    """What a layout builder returns: the seam between the train loop and every parallelism."""

    modules: list[nn.Module]
    """The wrapped model (DDP) or this rank's pipeline stages; what checkpoints save."""
    optimizer: torch.optim.Optimizer
    """The optimizer (its param groups' ``lr`` is set by the loop every step)."""
    train_step: StepFn
    """One optimizer step over this rank's micro-batches; returns the mean loss (a tensor)."""
    dp_rank: int
    """This rank's index on the data-parallel axis (selects its data)."""
    dp_size: int
    """Data-parallel degree."""
    params: list[nn.Parameter] = field(default_factory=list)
    """Parameters to clip (defaults to every module's parameters)."""
    ops: Any = None
    """Precision ops (``MixedPrecision``-like); None -> the runtime builds them (sharded=False)."""


def build_data_parallel(job: Any, *, probe: Any, device: torch.device) -> TrainParts:
    """GPT preset on ``device`` wrapped in DDP (``bucket_cap_mb``), AdamW; compression hook if configured."""
    model = build_model(job.model.name, seed=job.train.seed).to(device)
    ddp = DDP(model, bucket_cap_mb=job.train.bucket_mb,
              device_ids=[device.index] if device.type == "cuda" else None)
    compression = job.section("compression")
    if compression is not None and compression.method != "none":
        from dtprobe.runtime.compression import register_compression

        register_compression(ddp, compression, record=probe.record)
    optimizer = torch.optim.AdamW(ddp.parameters(), lr=job.train.lr, betas=(0.9, 0.95),
                                  weight_decay=job.train.weight_decay)
    return TrainParts(modules=[ddp], optimizer=optimizer, train_step=ddp_train_step, dp_rank=probe.rank,
                      dp_size=probe.world_size, params=list(model.parameters()))


def ddp_train_step(ctx: "TrainContext", s: Any, step: int, batches: list) -> torch.Tensor:
    """Accumulate over ``batches`` (all-reduce on the last only), then clip and step. Returns the mean loss."""
    model, optimizer, ops = ctx.parts.modules[0], ctx.parts.optimizer, ctx.ops
    last = len(batches) - 1
    total = None
    for i, batch in enumerate(batches):
        with contextlib.nullcontext() if i == last else model.no_sync():
            with s.phase("fwd"):
                if i == 0:
                    ctx.faults.in_compute(step)
                with ops.autocast():
                    loss = lm_loss(model(batch.inputs), batch.targets)
                if len(batches) > 1:
                    loss = loss / len(batches)      # the step's loss and gradient are the mean over micro-batches
            with s.phase("bwd"):
                overflow = i == last and step in ctx.overflow_steps
                if overflow:
                    ctx.probe.fault("overflow", step=step, injected=True, loss_factor=1e38)
                ops.backward(loss, inject_overflow=overflow)
        total = loss.detach() if total is None else total + loss.detach()
    ctx.faults.after_compute()
    with s.phase("opt"):
        if ctx.job.train.clip > 0:
            ops.unscale(optimizer)
            torch.nn.utils.clip_grad_norm_(ctx.parts.params, ctx.job.train.clip)
        ops.step(optimizer, step=step)
        optimizer.zero_grad(set_to_none=True)
    return total

