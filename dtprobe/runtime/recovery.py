"""Checkpoint and resume for ``dtprobe run``: saves every K steps, and after a torchrun restart resumes from the
newest checkpoint that verifies; produces ``restart`` faults and the manifest's ``restarts`` list.

torchrun ``--max-restarts R`` (``JobConfig.max_restarts``, passed by the launcher) restarts every worker after
one fails; the restarted workers (``TORCHELASTIC_RESTART_COUNT`` = n > 0) write into the same run directory and
append to their telemetry. Before the first step (``Checkpointing.resume``), every rank loads the newest verified
checkpoint (``Checkpointer``; corrupt ones are skipped with a ``corrupt-ckpt`` fault naming the file, the reason and
the step loaded instead) and training continues at its step + 1.

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

from dtprobe.runtime.checkpoint import Checkpointer, TrainState
from dtprobe.runtime.config import JobConfig
from dtprobe.runtime.faults import job_faults_of
from dtprobe.runtime.step_api import TrainParts
from dtprobe.store import manifest
from dtprobe.store.errors import ConfigError
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


class Checkpointing:
    """The train loop's checkpoints: ``resume`` before the first step, ``save`` after every step (a checkpoint
    every ``ckpt.every`` steps), ``close`` at the end (waits for an async save)."""

    def __init__(self, job: JobConfig, *, probe: Any, parts: TrainParts) -> None:
        self.config, self.probe = job.ckpt, probe
        slow = job_faults_of(job.faults, "slow-ckpt", rank=probe.rank)
        restart = int(getattr(probe, "restart", 0))
        corrupt = job_faults_of(job.faults, "corrupt-ckpt") if restart == 0 else []   # first attempt only
        group = None
        if job.ckpt.async_save and probe.world_size > 1:
            group = probe.new_group(None, name="ckpt")   # async DCP needs its own group (deadlock otherwise)
        self.checkpointer = Checkpointer(
            job.ckpt, probe.run_dir, rank=probe.rank, world_size=probe.world_size, is_leader=probe.is_leader,
            process_group=group, record=probe.record, fault=probe.fault,
            slow_delay_ms=int(sum(f.get("delay_ms") for f in slow)),
            corrupt_steps=frozenset(int(f.get("step")) for f in corrupt))
        extras = {"scaler": parts.ops} if getattr(parts.ops, "scaler", None) is not None else {}
        self.state = TrainState(_model_of(parts.modules), parts.optimizer, extras=extras)

    def resume(self) -> int:
        """The first step to run: after the newest verified checkpoint when resuming (always after a restart),
        else 0. After a restart the leader records it (``restart`` fault row, manifest's ``restarts``)."""
        probe = self.probe
        restart = int(getattr(probe, "restart", 0))
        if not (self.config.resume or restart > 0):
            return 0
        loaded = self.checkpointer.load_latest(self.state)
        start_step = 0 if loaded is None else loaded + 1
        if restart > 0 and probe.is_leader:
            last = last_completed_step(probe.run_dir, before_restart=restart)
            ckpt_step = -1 if loaded is None else loaded
            lost = max(0, last - ckpt_step)
            ckpt_path = None if loaded is None else str(self.checkpointer.root / f"step{loaded:08d}")
            probe.fault("restart", step=start_step, injected=False, restart=restart,
                        from_step=start_step, checkpoint_step=ckpt_step, last_step=last, steps_lost=lost,
                        checkpoint=ckpt_path)
            probe.flush()
            try:
                manifest.add_restart(probe.run_dir, restart=restart, time_ns=time.time_ns(), steps_lost=lost,
                                     from_step=start_step)
            except FileNotFoundError:
                pass                                      # attach mode without a manifest yet
        return start_step

    def save(self, step: int) -> None:
        """After step ``step``: a checkpoint when it is due."""
        self.checkpointer.maybe_save(self.state, step=step)

    def close(self, status: str) -> None:
        if status == "finished":
            self.checkpointer.close()


class NoCheckpointing:
    """Checkpoints off (and no restart to resume): every call does nothing."""

    def resume(self) -> int:
        return 0

    def save(self, step: int) -> None:
        pass

    def close(self, status: str) -> None:
        pass


def build_checkpointing(job: JobConfig, *, probe: Any, parts: TrainParts) -> Checkpointing | NoCheckpointing:
    """Checkpointing for ``job.ckpt``; also on a restarted attempt without checkpoints, which records the
    restart (nothing to load: training starts again at step 0)."""
    if not job.ckpt.enabled and int(getattr(probe, "restart", 0)) == 0:
        if job_faults_of(job.faults, "corrupt-ckpt") or job_faults_of(job.faults, "slow-ckpt"):
            raise ConfigError("--inject slow-ckpt / corrupt-ckpt need checkpoints: add --ckpt-every K.")
        return NoCheckpointing()
    return Checkpointing(job, probe=probe, parts=parts)
