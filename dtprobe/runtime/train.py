"""The training loop of ``dtprobe run``: builds the parts for the layout, then runs steps under the probe.

Reads like a plain DDP script. Before the first step: the layout's parts (``parallel.ddp`` or
``parallel.hybrid``), checkpointing (``runtime.recovery``: resume after a restart) and the hang watchdog
(``runtime.hang``). Each step: the faults due at its start (``runtime.faults``), the lr for the step (warmup,
linear scaling rule), ``probe.step`` with the ``data`` phase here and ``fwd``/``bwd``/``opt`` inside
``parts.train_step``, one ``loss.item()``, then a checkpoint when one is due. Whatever is off (checkpoints, the
watchdog, faults) is a do-nothing object, so the loop has no ``if enabled``.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import torch

from dtprobe.runtime.config import JobConfig
from dtprobe.runtime.data import Sampler, token_stream
from dtprobe.runtime.faults import FaultInjector, job_faults_of
from dtprobe.runtime.hang import build_watchdog
from dtprobe.runtime.layout import Layout
from dtprobe.runtime.model import model_config, warmup_lr
from dtprobe.runtime.parallel.ddp import build_ddp
from dtprobe.runtime.parallel.hybrid import parallelize
from dtprobe.runtime.recovery import build_checkpointing
from dtprobe.runtime.step_api import TrainContext, TrainParts
from dtprobe.store.errors import ConfigError

LOOP_TIMING_FILE = "loop_timing.json"


def build_parts(job: JobConfig, layout: Layout, *, probe: Any, device: torch.device) -> TrainParts:
    """Model, optimizer, precision ops and train step of this rank for ``layout``."""
    if layout.is_pure_dp:
        return build_ddp(job, probe=probe, device=device)
    return parallelize(job, layout, probe=probe, device=device)


def build_context(job: JobConfig, *, probe: Any, device: torch.device) -> TrainContext:
    """Resolve the layout, build its parts, and this rank's faults."""
    layout = job.resolve_layout()
    if layout.world_size != probe.world_size:
        raise ConfigError(f"the job was resolved for WORLD_SIZE {layout.world_size} but this worker sees "
                          f"{probe.world_size}; start workers with `dtprobe run`, not torchrun directly.")
    parts = build_parts(job, layout, probe=probe, device=device)
    overflow = {f.get("step") for f in job_faults_of(job.faults, "overflow", rank=probe.rank)}
    return TrainContext(job=job, layout=layout, probe=probe, device=device, parts=parts,
                        faults=FaultInjector(job.faults, rank=probe.rank, restart=getattr(probe, "restart", 0),
                                             probe=probe, burn=device.type == "cpu"),
                        overflow_steps=frozenset(overflow), peak_lr=job.train.peak_lr(parts.dp_size))


def train(job: JobConfig, *, probe: Any, device: torch.device) -> TrainContext:
    """Run ``job.train.steps`` steps on this rank; returns the context (tests read it)."""
    ctx = build_context(job, probe=probe, device=device)
    checkpointing = build_checkpointing(job, probe=probe, parts=ctx.parts)
    watchdog = build_watchdog(job, probe=probe)
    ctx.start_step = checkpointing.resume()        # after a restart: the step after the newest good checkpoint
    watchdog.start()
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
                # a pipeline rank without the last stage has no loss (None -> null in steps)
                s.record(loss=None if loss is None else loss.item(), tokens=tokens_per_step, lr=lr)
            checkpointing.save(step)
        status = "finished"
    finally:
        checkpointing.close(status)
        watchdog.stop()
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
          f"{job.train.seq_len} tok, {job.train.optimizer} peak lr {ctx.peak_lr:.3g} ({rule}), warmup "
          f"{job.train.warmup}, clip {job.train.clip}, bucket {job.train.bucket_mb} MiB, data {job.train.data}, "
          f"device {ctx.device}",
          flush=True)
