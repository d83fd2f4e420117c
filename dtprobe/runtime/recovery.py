"""Checkpoint and resume for ``dtprobe run``: saves every K steps, and after a torchrun restart resumes from the
newest checkpoint that verifies; produces ``restart`` faults and the manifest's ``restarts`` list.

torchrun ``--max-restarts R`` (``JobConfig.max_restarts``, passed by the launcher) restarts every worker after
one fails; the restarted workers (``TORCHELASTIC_RESTART_COUNT`` = n > 0) write into the same run directory and
append to their telemetry. At setup, every rank loads the newest verified checkpoint (``Checkpointer``; corrupt
ones are skipped with a ``corrupt-ckpt`` fault naming the file, the reason and the step loaded instead) and
training continues at its step + 1.

The leader then writes one ``faults`` row ``kind="restart", injected=false`` with detail::

    {"restart": n, "from_step": first step run again, "checkpoint_step": step loaded (-1: none),
     "last_step": last step the previous attempt completed, "steps_lost": completed steps redone,
     "checkpoint": path or null}

and appends the same to ``run.json``'s ``restarts`` (``store.manifest.add_restart``). ``last_step`` comes from
the ranks' ``steps`` rows of earlier attempts (a SIGKILLed rank may have lost its last second of rows,
so ``steps_lost`` is then a lower bound).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import orjson

from dtprobe.runtime.checkpoint import Checkpointer, CheckpointConfig, TrainState
from dtprobe.runtime.config import register_section
from dtprobe.runtime.faults import FaultKind, job_faults_of, register_fault_kind
from dtprobe.runtime.train import TrainContext, TrainHooks, register_hooks
from dtprobe.store.schema import EVENTS_FILE


def last_completed_step(run_dir: str | Path, *, before_restart: int) -> int:
    """The highest completed step in any rank's ``steps`` rows of attempts before ``before_restart``; -1 if none.

    A step that raised still writes its row, without a loss, so only rows with a loss count (under pipeline
    parallelism only the last stage has losses: hence every rank's file is read).
    """
    last = -1
    for path in sorted((Path(run_dir) / EVENTS_FILE.format(table="steps", rank=0)).parent.glob("rank*.jsonl")):
        for line in path.read_bytes().splitlines():
            try:
                row = orjson.loads(line)
            except orjson.JSONDecodeError:
                continue                                  # a torn last line of a killed rank
            if (int(row.get("restart") or 0) < before_restart and row.get("step") is not None
                    and row.get("loss") is not None):
                last = max(last, int(row["step"]))
    return last


def _model_of(modules: list) -> Any:
    if len(modules) == 1:
        return modules[0]
    import torch.nn as nn

    return nn.ModuleList(modules)


class CheckpointHooks(TrainHooks):
    """The train loop's checkpoint/resume behaviour (registered with ``runtime.train.register_hooks``)."""

    def __init__(self, ctx: TrainContext, config: CheckpointConfig) -> None:
        probe, job = ctx.probe, ctx.job
        self.config = config
        slow = job_faults_of(job.faults, "slow-ckpt", rank=probe.rank)
        restart = int(getattr(probe, "restart", 0))
        corrupt = job_faults_of(job.faults, "corrupt-ckpt") if restart == 0 else []   # first attempt only
        group = None
        if config.async_save and probe.world_size > 1:
            group = probe.new_group(None, name="ckpt")   # async DCP needs its own group (deadlock otherwise)
        self.checkpointer = Checkpointer(
            config, probe.run_dir, rank=probe.rank, world_size=probe.world_size, is_leader=probe.is_leader,
            process_group=group, record=probe.record, fault=probe.fault,
            slow_delay_ms=int(sum(f.get("delay_ms") for f in slow)),
            corrupt_steps=frozenset(int(f.get("step")) for f in corrupt))
        extras = {"scaler": ctx.ops} if getattr(ctx.ops, "scaler", None) is not None else {}
        self.state = TrainState(_model_of(ctx.parts.modules), ctx.parts.optimizer, extras=extras)

    def setup(self, ctx: TrainContext) -> None:
        probe = ctx.probe
        restart = int(getattr(probe, "restart", 0))
        if not (self.config.resume or restart > 0):
            return
        loaded = self.checkpointer.load_latest(self.state)
        if loaded is not None:
            ctx.start_step = loaded + 1
        if restart > 0 and probe.is_leader:
            last = last_completed_step(probe.run_dir, before_restart=restart)
            ckpt_step = -1 if loaded is None else loaded
            lost = max(0, last - ckpt_step)
            ckpt_path = None if loaded is None else str(self.checkpointer.root / f"step{loaded:08d}")
            probe.fault("restart", step=ctx.start_step, injected=False, restart=restart,
                        from_step=ctx.start_step, checkpoint_step=ckpt_step, last_step=last, steps_lost=lost,
                        checkpoint=ckpt_path)
            probe.flush()
            from dtprobe.store import manifest

            try:
                manifest.add_restart(probe.run_dir, restart=restart, time_ns=time.time_ns(), steps_lost=lost,
                                     from_step=ctx.start_step)
            except FileNotFoundError:
                pass                                      # attach mode without a manifest yet

    def step_end(self, ctx: TrainContext, step: int) -> None:
        self.checkpointer.maybe_save(self.state, step=step)

    def close(self, ctx: TrainContext, status: str) -> None:
        if status == "finished":
            self.checkpointer.close()


def _hooks_factory(ctx: TrainContext) -> TrainHooks | None:
    config = ctx.job.section("ckpt")
    if config is None:
        return None
    if not config.enabled and int(getattr(ctx.probe, "restart", 0)) == 0:
        if job_faults_of(ctx.job.faults, "corrupt-ckpt") or job_faults_of(ctx.job.faults, "slow-ckpt"):
            from dtprobe.store.errors import ConfigError

            raise ConfigError("--inject slow-ckpt / corrupt-ckpt need checkpoints: add --ckpt-every K.")
        return None
    return CheckpointHooks(ctx, config)


register_section("ckpt", CheckpointConfig)
register_fault_kind(FaultKind(
    name="slow-ckpt", keys={"rank": int, "delay_ms": float}, required=("rank", "delay_ms"),
    example="slow-ckpt:rank=1,delay_ms=2000",
    help="rank R's checkpoint writes sleep delay_ms first (in the background with --ckpt-async)",
    check=lambda p: None if p["delay_ms"] > 0 else f"delay_ms={p['delay_ms']} must be > 0."))
register_fault_kind(FaultKind(
    name="corrupt-ckpt", keys={"step": int}, required=("step",), example="corrupt-ckpt:step=9",
    help="the checkpoint saved after step S is damaged right after its commit, first attempt only (a resume "
         "must skip it)"))
register_hooks(_hooks_factory)
