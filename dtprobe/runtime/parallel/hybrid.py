"""``parallelize_model``: the built-in GPT on any dp x tp x pp x ZeRO layout on one DeviceMesh, with its optimizer
and train step; ``parallelize`` wraps it as the ``TrainParts`` the train loop (``runtime.train``) runs.

Order of application on each model part (the whole model, or each pipeline stage this rank holds), as in
torchtitan: split into stages -> tensor parallel on ``tp`` -> activation checkpointing -> data parallel /
ZeRO on ``dp`` -> ``PipelineStage`` on ``pp`` + the schedule. Everything is PyTorch's own building blocks
(DTensor, FSDP2, ``replicate``, ZeroRedundancyOptimizer, ``torch.distributed.pipelining``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from dtprobe.runtime.config import JobConfig
from dtprobe.runtime.layout import Layout
from dtprobe.runtime.model import build_model, lm_loss
from dtprobe.runtime.optimizers import build_optimizer, optimizer_kwargs
from dtprobe.runtime.parallel.ac import apply_ac
from dtprobe.runtime.parallel.grad_norm import clip_grad_norm
from dtprobe.runtime.parallel.memory import memory_row
from dtprobe.runtime.parallel.mesh import ParallelDims, axis_mesh, build_mesh, check_layout, virtual_stages
from dtprobe.runtime.parallel.pp import (PipelineTimer, SleepStage, StageSleep, build_schedule, local_stages,
                                         sleep_loss, stage_module)
from dtprobe.runtime.parallel.stage_sleep import parse_stage_sleep
from dtprobe.runtime.parallel.tp import apply_tp
from dtprobe.runtime.parallel.zero import allreduce_grads, apply_data_parallel
from dtprobe.runtime.step_api import PlainOps, TrainContext, TrainParts
from dtprobe.store.errors import ConfigError

Record = Callable[[str, dict[str, Any]], None]
"""``probe.record``: writes one row of a run-store table for this rank."""


@dataclass(kw_only=True)
class Parallelized:
    """A model laid out on the mesh, its optimizer and the train step; what ``parallelize`` returns."""

    model_parts: list[nn.Module]
    """What this rank trains: ``[model]`` (possibly DDP-wrapped) or its pipeline stage modules."""
    optimizer: torch.optim.Optimizer
    """Optimizer over every local part (a ZeroRedundancyOptimizer with zero 1); set ``param_groups`` lr on it."""
    dims: ParallelDims
    """Resolved degrees."""
    coords: dict[str, int]
    """This rank's index on each axis: ``{"pp": .., "dp": .., "tp": ..}``."""
    mesh: Any
    """The DeviceMesh (None for a single process)."""
    device: torch.device
    schedule: Any = None
    """The pipelining schedule (None without PP)."""
    stage_indices: list[int] = field(default_factory=list)
    """Global stage indices held by this rank (PP only)."""
    timer: PipelineTimer | None = None
    """Per-action pipeline timer (PP only); ``timer.rows`` holds the last step's actions."""
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = lm_loss
    """Loss of one micro-batch (mean over its tokens)."""
    max_norm: float = 0.0
    """Global gradient-norm clip; 0 disables it."""
    record: Record | None = None
    """``probe.record`` (memory rows every step, pipeline rows every action) or None."""
    grad_allreduce_group: Any = None
    """The dp group whose gradients ``train_step`` all-reduces itself (ZeRO-1 with pipeline stages), or None."""
    _scaler: Any = None
    _loss_factor: float = 1.0
    _raw_losses: dict[int, torch.Tensor] = field(default_factory=dict)

    def pipeline_loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """The schedule's loss: ``loss_fn``, times the injected-overflow factor at an ``--inject overflow`` step,
        scaled by the fp16 loss scaler when there is one (the schedule runs the backward itself, so the scaling
        has to happen inside the loss). The plain loss is kept, by the identity of the returned tensor, for the
        step's reported loss (torch also calls this once for shape inference on the first step; that call's
        result never reaches the schedule's ``losses``)."""
        loss = self.loss_fn(output, target)
        raw = loss.detach().float()
        if self._loss_factor != 1.0:
            loss = loss * self._loss_factor
        out = loss if self._scaler is None else self._scaler.scale(loss)
        self._raw_losses[id(out)] = raw
        return out

    @property
    def dp_rank(self) -> int:
        """Data shard index for the loader: TP and PP peers of one replica read the same batch."""
        return self.coords["dp"]

    @property
    def dp_size(self) -> int:
        return self.dims.dp

    @property
    def has_first_stage(self) -> bool:
        """True when this rank feeds the inputs (always without PP)."""
        return self.schedule is None or 0 in self.stage_indices

    @property
    def has_loss(self) -> bool:
        """True when this rank computes the loss (without PP every rank; with PP the last stage's ranks)."""
        return self.schedule is None or self.num_stages - 1 in self.stage_indices

    @property
    def num_stages(self) -> int:
        return self.dims.pp * max(1, len(self.stage_indices))

    def train_step(self, micro_batches: Sequence[Any], *, step: int, step_ctx: Any = None, ops: Any = None,
                   faults: Any = None, inject_overflow: bool = False) -> torch.Tensor | None:
        """One optimizer step over this rank's micro-batches (``runtime.data.Batch`` or ``(inputs, targets)``
        pairs of the dp shard; gradients are accumulated over them, or, with PP, they are concatenated and the
        schedule splits them into ``layout.microbatches``). Returns this rank's mean loss, or None on a pipeline
        rank without the loss. ``step_ctx`` is ``probe.step``'s context: phases fwd/bwd/opt are timed (with PP,
        fwd and bwd are the summed F and B/I/W actions of this rank's stages, as the schedule interleaves them).
        Gradients are clipped to ``max_norm`` (global norm over every layout axis) when it is > 0.
        ``ops`` are the precision ops (``runtime.precision.MixedPrecision``; fp32 when None), ``faults`` the
        runtime's ``FaultInjector`` (``in_compute``/``after_compute`` around the compute)."""
        phase = step_ctx.phase if step_ctx is not None else (lambda name: contextlib.nullcontext())
        ops = ops if ops is not None else PlainOps()
        pairs = [(b.inputs, b.targets) if hasattr(b, "inputs") else tuple(b) for b in micro_batches]
        self.optimizer.zero_grad(set_to_none=True)
        if self.schedule is None:
            model = self.model_parts[0]
            total = torch.zeros((), device=self.device)
            for i, (inputs, targets) in enumerate(pairs):
                _set_grad_sync(model, i == len(pairs) - 1)   # reduce gradients once, after the last micro-batch
                with phase("fwd"):
                    if i == 0 and faults is not None:
                        faults.in_compute(step)
                    with ops.autocast():
                        loss = self.loss_fn(model(inputs), targets) / len(pairs)
                with phase("bwd"):
                    ops.backward(loss, inject_overflow=inject_overflow and i == len(pairs) - 1)
                total += loss.detach().float()
            mean_loss: torch.Tensor | None = total
        else:
            assert self.timer is not None
            inputs = torch.cat([x for x, _ in pairs]) if len(pairs) > 1 else pairs[0][0]
            targets = torch.cat([y for _, y in pairs]) if len(pairs) > 1 else pairs[0][1]
            self.timer.start_step(step)
            losses: list[torch.Tensor] = []
            args = (inputs,) if self.has_first_stage else ()
            self._scaler = getattr(ops, "scaler", None)
            if self._scaler is not None:   # initialise the scale on ranks that never compute a loss
                self._scaler.scale(torch.zeros((), device=self.device))
            self._raw_losses = {}
            self._loss_factor = _overflow_factor(ops) if inject_overflow and self.has_loss else 1.0
            if faults is not None:
                faults.in_compute(step, per_action=True)     # a slowdown stretches each action (the timer)
            self.timer.faults = faults
            try:
                with ops.autocast():
                    if self.has_loss:
                        self.schedule.step(*args, target=targets, losses=losses)
                    else:
                        self.schedule.step(*args)
            finally:
                self._loss_factor = 1.0
            if inject_overflow and not self.has_loss:
                _poison_grads(self.parameters(), ops)   # no loss on this stage: make its own gradients inf
            fwd_ns, bwd_ns = self.timer.phase_ns()
            phase_ns = getattr(step_ctx, "phase_ns", None)
            if phase_ns is not None:
                phase_ns["fwd"] = phase_ns.get("fwd", 0) + fwd_ns
                phase_ns["bwd"] = phase_ns.get("bwd", 0) + bwd_ns
            mean_loss = torch.stack([self._raw_losses[id(x)] for x in losses]).mean() if losses else None
            self._raw_losses = {}
        if self.grad_allreduce_group is not None:
            with phase("bwd"):
                allreduce_grads(self.parameters(), self.grad_allreduce_group)
        if faults is not None:
            faults.after_compute()
        with phase("opt"):
            if self.max_norm > 0:
                ops.unscale(self.optimizer)
                pp_group = self.mesh["pp"].get_group() if self.dims.pp > 1 else None
                clip_grad_norm(self.parameters(), self.max_norm, pp_group=pp_group)
            ops.step(self.optimizer, step=step)
        if self.record is not None:
            self.record("memory", memory_row(self.model_parts, self.optimizer, step=step, device=self.device))
        return mean_loss

    def parameters(self) -> list[nn.Parameter]:
        """Every parameter this rank trains (all local stages)."""
        return [p for part in self.model_parts for p in part.parameters()]


def _overflow_factor(ops: Any) -> float:
    """The loss factor of an injected overflow (``runtime.precision.OVERFLOW_LOSS_FACTOR``); ConfigError without a
    loss scaler, as ``MixedPrecision.backward`` does on the other layouts."""
    from dtprobe.runtime.precision import OVERFLOW_LOSS_FACTOR

    if getattr(ops, "scaler", None) is None:
        raise ConfigError("--inject overflow needs --precision fp16: only fp16 has a loss scaler that detects the "
                          "inf gradients and skips the step; without it the weights would become inf.")
    return OVERFLOW_LOSS_FACTOR


def _poison_grads(params: list[nn.Parameter], ops: Any) -> None:
    """An injected overflow on a pipeline rank without the loss: set this rank's first local gradient to inf
    (what 1e38 x loss does to every gradient on the last stage), so the scaler's found_inf is set here."""
    _overflow_factor(ops)
    for p in params:
        if p.grad is not None:
            grad = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
            if grad.numel():
                with torch.no_grad():
                    grad.fill_(float("inf"))
                return


def _set_grad_sync(model: nn.Module, enabled: bool) -> None:
    """Turn gradient reduction on or off for the next backward (DDP ``require_backward_grad_sync``, FSDP2 /
    ``replicate`` ``set_requires_gradient_sync``); a no-op for a model without data parallelism."""
    if hasattr(model, "require_backward_grad_sync"):
        model.require_backward_grad_sync = enabled
    elif hasattr(model, "set_requires_gradient_sync"):
        model.set_requires_gradient_sync(enabled)


def parallelize_model(model: nn.Module, layout: Any, *, world_size: int, rank: int, device: torch.device,
                optimizer: str = "adamw", optimizer_kwargs: dict[str, Any] | None = None,
                init_mesh: Callable[..., Any] | None = None,
                max_norm: float = 0.0, record: Record | None = None, stage_sleep: StageSleep | None = None,
                global_batch: int | None = None, seq_len: int | None = None) -> Parallelized:
    """Lay the built-in GPT out on ``layout`` (a ``runtime.layout.Layout``) and build its optimizer (``optimizer``:
    a ``runtime.optimizers`` name, with ``optimizer_kwargs``).

    ``model`` is the full model, initialised identically on every rank (``build_model(name, seed=...)``).
    ``init_mesh`` is ``probe.init_device_mesh`` when instrumented (collectives then carry the axis names);
    ``record`` is ``probe.record`` (pipeline and memory rows); ``max_norm`` clips the global gradient norm.
    ``stage_sleep`` replaces each pipeline stage's compute by a fixed sleep. ``global_batch``/``seq_len`` are
    only used to validate the layout.
    """
    cfg = getattr(model, "cfg", None)
    dims = check_layout(layout, world_size=world_size, num_layers=len(model.blocks),
                        num_heads=getattr(cfg, "num_heads", None), batch_size=global_batch, seq_len=seq_len)
    if stage_sleep is not None and dims.pp == 1:
        raise ConfigError("--stage-sleep replaces pipeline-stage compute and needs --pp > 1; drop it or add --pp.")
    if stage_sleep is not None and dims.tp > 1:
        raise ConfigError("--stage-sleep stages have no tensors to shard; use it with --tp 1 (dp and pp only).")
    mesh = build_mesh(dims, device_type=device.type, init_mesh=init_mesh)
    coords = dims.coords(rank)
    model.to(device)
    tp_mesh, dp_mesh, pp_mesh = (axis_mesh(mesh, a) for a in ("tp", "dp", "pp"))
    kwargs = dict(optimizer_kwargs or {"lr": 1e-3})

    stage_indices: list[int] = []
    if dims.pp > 1:
        v = virtual_stages(layout)
        num_stages = dims.pp * v
        stage_indices = local_stages(layout.pp_schedule, pp=dims.pp, pp_rank=coords["pp"], virtual_stages=v)
        if stage_sleep is not None:
            parts = [SleepStage(stage_sleep, is_first=s == 0).to(device) for s in stage_indices]
        else:
            parts = [stage_module(model, s, num_stages) for s in stage_indices]
    else:
        parts = [model]

    if stage_sleep is None:
        for part in parts:
            if tp_mesh is not None:
                apply_tp(part, tp_mesh, sequence_parallel=bool(layout.sequence_parallel))
            apply_ac(part, layout.activation_checkpointing)
    if dp_mesh is not None:
        only_dp = dims.tp == 1 and dims.pp == 1
        parts = [apply_data_parallel(p, dp_mesh, zero=layout.zero, only_dp=only_dp) for p in parts]

    params = [p for part in parts for p in part.parameters()]
    zero_group = dp_mesh.get_group() if layout.zero == 1 and dp_mesh is not None else None
    result = Parallelized(model_parts=parts, dims=dims, coords=coords, mesh=mesh,
                          device=device, record=record, stage_indices=stage_indices, max_norm=max_norm,
                          loss_fn=sleep_loss if stage_sleep is not None else lm_loss,
                          optimizer=build_optimizer(params, name=optimizer, zero_group=zero_group, **kwargs))
    if layout.zero == 1 and dp_mesh is not None and dims.pp > 1:
        result.grad_allreduce_group = dp_mesh.get_group()
    if dims.pp > 1:
        from torch.distributed.pipelining import PipelineStage

        group = pp_mesh.get_group()
        stages = [PipelineStage(part, s, num_stages, device, group=group) for part, s in zip(parts, stage_indices)]
        result.timer = PipelineTimer(stages, record)
        result.schedule = build_schedule(stages, layout.pp_schedule, microbatches=layout.microbatches,
                                         loss_fn=result.pipeline_loss)
    return result


def parallelize(job: JobConfig, layout: Layout, *, probe: Any, device: torch.device) -> TrainParts:
    """The job's GPT on ``layout`` (any layout but pure DP, which is ``parallel.ddp``'s) as ``TrainParts``.

    Collectives of the mesh's axis groups are recorded as ``pg`` = ``dp``/``tp``/``pp`` (the probe names the
    mesh); pipeline actions and per-step memory go to the ``pipeline`` and ``memory`` tables. fp16 loss scaling
    uses ``precision.local_shard_grad_scaler`` (found_inf all-reduced over the world), so every rank
    agrees on skipping a step; ``--inject overflow`` works on every layout (faults row written here).
    """
    tcfg = job.train
    model = build_model(job.model.name, seed=tcfg.seed)
    init_mesh = getattr(probe, "init_device_mesh", None)
    par = parallelize_model(
        model, layout, world_size=probe.world_size, rank=probe.rank, device=device,
        optimizer=tcfg.optimizer, optimizer_kwargs=optimizer_kwargs(tcfg),
        init_mesh=init_mesh, record=probe.record, max_norm=tcfg.clip,
        stage_sleep=parse_stage_sleep(layout.stage_sleep),
        global_batch=tcfg.batch_size * tcfg.grad_accum * layout.dp, seq_len=tcfg.seq_len)
    ops: Any = PlainOps()
    if job.precision.dtype != "fp32":
        from dtprobe.runtime.precision import MixedPrecision

        ops = MixedPrecision(job.precision, device_type=device.type, sharded=True, record=probe.record)

    def train_step(ctx: TrainContext, s: Any, step: int, batches: list) -> torch.Tensor | None:
        overflow = step in ctx.overflow_steps
        if overflow:   # the faults row, as the DDP step writes it (how: loss x 1e38, or inf grads without a loss)
            from dtprobe.runtime.precision import OVERFLOW_LOSS_FACTOR

            detail = ({"loss_factor": OVERFLOW_LOSS_FACTOR} if par.has_loss else
                      {"inf_grads": True, "stages": par.stage_indices})
            ctx.probe.fault("overflow", step=step, injected=True, **detail)
        return par.train_step(batches, step=step, step_ctx=s, ops=ctx.ops, faults=ctx.faults,
                              inject_overflow=overflow)

    return TrainParts(modules=par.model_parts, optimizer=par.optimizer, train_step=train_step,
                      dp_rank=par.dp_rank, dp_size=par.dp_size, ops=ops, params=par.parameters())
