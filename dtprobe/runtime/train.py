"""The training loop of ``dtprobe run``: builds the parts for the layout, then runs steps under the probe.

Reads like a plain DDP script: for each step, the runtime's faults, the lr for the step (warmup, linear scaling
rule), ``probe.step`` with the ``data`` phase here and ``fwd``/``bwd``/``opt`` inside ``parts.train_step``, and
one ``loss.item()``. Everything optional (faults, hooks) is a do-nothing object when unused.

Seams:
- LAYOUTS: ``dtprobe.runtime.parallel.parallelize(job, layout, *, probe, device) -> TrainParts`` for every
  layout that is not pure DP (``Layout.is_pure_dp``); same contract as ``data_parallel.build_data_parallel``.
  The sampler follows ``TrainParts.dp_rank``/``dp_size`` (TP/PP peers of one dp rank get the same batch).
- RELIABILITY: precision comes from ``runtime.precision.MixedPrecision`` when the ``precision`` section is
  registered (``TrainParts.ops`` overrides it); checkpoint / recovery / hang register a hook factory with
  ``register_hooks(factory)``: ``factory(ctx) -> TrainHooks | None`` is called after the parts are built;
  ``setup`` may resume (set ``ctx.start_step``), ``step_end`` may checkpoint, ``close`` runs at the end.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from dtprobe.runtime.config import JobConfig, Layout
from dtprobe.runtime.data import Sampler, token_stream
from dtprobe.runtime.data_parallel import PlainOps, TrainParts, build_data_parallel
from dtprobe.runtime.faults import FaultInjector, job_faults_of
from dtprobe.runtime.model import model_config, warmup_lr
from dtprobe.store.errors import ConfigError


class TrainHooks:
    """Optional per-run behaviour (checkpoints, resume, hang watchdogs); every method is a no-op here."""

    def setup(self, ctx: "TrainContext") -> None:
        """After the parts are built, before step ``ctx.start_step``; may load a checkpoint and move start_step."""

    def step_end(self, ctx: "TrainContext", step: int) -> None:
        """After step ``step`` closed (its row written)."""

    def close(self, ctx: "TrainContext", status: str) -> None:
        """At the end of training (``finished``) or on an exception (``crashed``)."""


LOOP_TIMING_FILE = "loop_timing.json"

HOOK_FACTORIES: list[Callable[["TrainContext"], TrainHooks | None]] = []
"""Registered by plugin modules (``runtime.config.PLUGIN_MODULES``) at import time."""


def register_hooks(factory: Callable[["TrainContext"], TrainHooks | None]) -> None:
    HOOK_FACTORIES.append(factory)


@dataclass
class TrainContext:
    """Everything a step and a hook may need for one rank's training."""

    job: JobConfig
    layout: Layout
    probe: Any
    device: torch.device
    parts: TrainParts
    ops: Any
    """Precision ops: ``autocast()``, ``backward(loss, inject_overflow=)``, ``unscale(opt)``, ``step(opt, step=)``."""
    faults: FaultInjector
    overflow_steps: frozenset[int] = frozenset()
    """Steps where this rank injects a loss-scale overflow (``--inject overflow:...``, when registered)."""
    start_step: int = 0
    """First step to run (a resume hook moves it)."""
    peak_lr: float = 0.0
    """The lr after warmup (linear scaling rule applied)."""
    hooks: list[TrainHooks] = field(default_factory=list)


def build_context(job: JobConfig, *, probe: Any, device: torch.device) -> TrainContext:
    """Resolve the layout, build model/optimizer/step for it, and the precision ops and faults of this rank."""
    layout = job.resolve_layout()
    if layout.world_size != probe.world_size:
        raise ConfigError(f"the job was resolved for WORLD_SIZE {layout.world_size} but this worker sees "
                          f"{probe.world_size}; start workers with `dtprobe run`, not torchrun directly.")
    if layout.is_pure_dp:
        parts = build_data_parallel(job, probe=probe, device=device)
    else:
        try:
            from dtprobe.runtime.parallel import parallelize
        except ImportError as exc:
            raise ConfigError(f"layout tp={layout.tp} pp={layout.pp} zero={layout.zero} needs "
                              f"dtprobe.runtime.parallel.parallelize, which is not available ({exc}); use a pure "
                              f"data-parallel layout (--tp 1 --pp 1 --zero 0).") from None
        parts = parallelize(job, layout, probe=probe, device=device)
    ops = parts.ops if parts.ops is not None else _precision_ops(job, probe=probe, device=device)
    overflow = {f.get("step") for f in job_faults_of(job.faults, "overflow", rank=probe.rank)}
    ctx = TrainContext(job=job, layout=layout, probe=probe, device=device, parts=parts, ops=ops,
                       faults=FaultInjector(job.faults, rank=probe.rank, restart=getattr(probe, "restart", 0),
                                            probe=probe, burn=device.type == "cpu"),
                       overflow_steps=frozenset(overflow), peak_lr=job.train.peak_lr(parts.dp_size))
    ctx.hooks = [h for h in (factory(ctx) for factory in HOOK_FACTORIES) if h is not None]
    return ctx


def train(job: JobConfig, *, probe: Any, device: torch.device) -> TrainContext:
    """Run ``job.train.steps`` steps on this rank; returns the context (tests read it)."""
    ctx = build_context(job, probe=probe, device=device)
    for hook in ctx.hooks:
        hook.setup(ctx)
    parts, tcfg = ctx.parts, job.train
    sampler = Sampler(token_stream(tcfg.data, seed=tcfg.seed), batch_size=tcfg.batch_size, seq_len=tcfg.seq_len,
                      grad_accum=tcfg.grad_accum, dp_rank=parts.dp_rank, dp_size=parts.dp_size, seed=tcfg.seed,
                      device=device)
    tokens_per_step = tcfg.batch_size * tcfg.grad_accum * tcfg.seq_len
    if probe.is_leader:
        log_start(ctx)
    status = "crashed"
    loop_start = time.perf_counter()
    first_done = loop_start
    try:
        for step in range(ctx.start_step, tcfg.steps):
            if step == ctx.start_step + 1:
                first_done = time.perf_counter()
            ctx.faults.at_step_start(step)
            lr = warmup_lr(step, base_lr=ctx.peak_lr, warmup_steps=tcfg.warmup)
            for group in parts.optimizer.param_groups:
                group["lr"] = lr
            with probe.step(step) as s:
                with s.phase("data"):
                    batches = sampler.micro_batches(step)
                loss = parts.train_step(ctx, s, step, batches)
                # LAYOUTS: a pipeline rank without the last stage has no loss (None -> null in steps).
                s.record(loss=None if loss is None else loss.item(), tokens=tokens_per_step, lr=lr)
            for hook in ctx.hooks:
                hook.step_end(ctx, step)
        status = "finished"
    finally:
        for hook in ctx.hooks:
            hook.close(ctx, status)
    if probe.is_leader:
        write_loop_timing(job, steps=tcfg.steps - ctx.start_step, loop_s=time.perf_counter() - loop_start,
                          first_step_s=first_done - loop_start)
    return ctx


def write_loop_timing(job: JobConfig, *, steps: int, loop_s: float, first_step_s: float) -> None:
    """``<run>/loop_timing.json``: the leader's wall time of the whole loop, measured outside the steps (so it
    exists with telemetry off too; the launcher's summary and the overhead benchmark read it)."""
    later = steps - 1
    timing = {"steps": steps, "loop_s": loop_s, "first_step_s": first_step_s,
              "mean_step_s_after_first": (loop_s - first_step_s) / later if later > 0 else None}
    (Path(job.run_dir) / LOOP_TIMING_FILE).write_text(json.dumps(timing, indent=1) + "\n")


def _precision_ops(job: JobConfig, *, probe: Any, device: torch.device) -> Any:
    config = job.section("precision")
    if config is None or config.dtype == "fp32":
        return PlainOps()
    from dtprobe.runtime.precision import MixedPrecision

    return MixedPrecision(config, device_type=device.type, record=probe.record)


def log_start(ctx: TrainContext) -> None:
    """The derived quantities, once, on the leader (to the worker log)."""
    job, parts = ctx.job, ctx.parts
    shape = model_config(job.model.name)
    grad_bytes = sum(p.numel() * p.element_size() for m in parts.modules for p in m.parameters() if p.requires_grad)
    rule = (f"linear rule: {job.train.lr:g} x {job.train.global_batch(parts.dp_size)}/{job.train.reference_batch}"
            if job.train.lr_scaling == "linear" else "no scaling")
    print(f"[dtprobe] {time.strftime('%H:%M:%S')} model {job.model.name} ({shape.num_params / 1e6:.2f}M params, "
          f"{grad_bytes / 2**20:.2f} MiB of gradients on this rank), layout dp={ctx.layout.dp} tp={ctx.layout.tp} "
          f"pp={ctx.layout.pp} zero={ctx.layout.zero}, global batch {job.train.global_batch(parts.dp_size)} seq x "
          f"{job.train.seq_len} tok, peak lr {ctx.peak_lr:.3g} ({rule}), warmup {job.train.warmup}, "
          f"clip {job.train.clip}, bucket {job.train.bucket_mb} MiB, data {job.train.data}, device {ctx.device}",
          flush=True)
