"""Pure data parallel (``Layout.is_pure_dp``): the DDP-wrapped GPT, its optimizer and the DDP train step, as the
``TrainParts`` the train loop (``runtime.train``) runs.

The step: for each gradient-accumulation micro-batch, forward (``fwd`` phase) and backward (``bwd`` phase) under
``no_sync`` except the last, so DDP all-reduces gradients once per step (bucketed, ``bucket_cap_mb``); then the
``opt`` phase: unscale (fp16), ``clip_grad_norm_``, ``optimizer.step``, ``zero_grad``. It returns the mean loss
as a tensor (the loop calls ``.item()`` once per step, as a plain training script logging its loss does).
Every other layout is ``parallel.hybrid``'s.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from dtprobe.runtime.config import JobConfig
from dtprobe.runtime.model import build_model, lm_loss
from dtprobe.runtime.optimizers import build_optimizer, optimizer_kwargs
from dtprobe.runtime.step_api import PlainOps, TrainContext, TrainParts


def build_ddp(job: JobConfig, *, probe: Any, device: torch.device) -> TrainParts:
    """GPT preset on ``device`` wrapped in DDP (``bucket_cap_mb``), the job's optimizer, precision ops, and its
    gradient-compression hook (``[compression]``) when one is set."""
    model = build_model(job.model.name, seed=job.train.seed).to(device)
    ddp = DDP(model, bucket_cap_mb=job.train.bucket_mb,
              device_ids=[device.index] if device.type == "cuda" else None)
    if job.compression.method != "none":
        from dtprobe.runtime.compression import register_compression

        register_compression(ddp, job.compression, record=probe.record)
    optimizer = build_optimizer(ddp.parameters(), name=job.train.optimizer, **optimizer_kwargs(job.train))
    return TrainParts(modules=[ddp], optimizer=optimizer, train_step=ddp_train_step, dp_rank=probe.rank,
                      dp_size=probe.world_size, ops=_precision_ops(job, probe=probe, device=device),
                      params=list(model.parameters()))


def _precision_ops(job: JobConfig, *, probe: Any, device: torch.device) -> Any:
    """fp32: ``PlainOps``; bf16/fp16: ``MixedPrecision`` with torch's ``GradScaler`` (DDP's gradients are whole)."""
    if job.precision.dtype == "fp32":
        return PlainOps()
    from dtprobe.runtime.precision import MixedPrecision

    return MixedPrecision(job.precision, device_type=device.type, record=probe.record)


def ddp_train_step(ctx: TrainContext, s: Any, step: int, batches: list) -> torch.Tensor:
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

