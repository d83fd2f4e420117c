"""The torchrun worker of ``dtprobe run``: ``python -m dtprobe.runtime.worker`` reads ``DTPROBE_JOB`` (job.json),
attaches the probe, trains, and closes. Started by ``runtime.launcher`` through ``torch.distributed.run``.

After the probe is closed (every row flushed), the ranks meet at a last barrier before exiting, so when any
node's agent exits (and node 0's launcher compacts the store) every rank's telemetry is already on disk.

``main`` is decorated with torchelastic's ``@record`` (``error_file.record``: the file is renamed into place
whole): an uncaught exception is written (type and message, traceback, time) to the error file torchrun names in
``TORCHELASTIC_ERROR_FILE``, i.e.
``<log dir>/<run>_*/attempt_<n>/<local rank>/error.json`` under the launcher's ``--log-dir``. Beside it the worker
writes ``worker.json`` (``WORKER_FILE``) first thing: ``{"rank", "local_rank", "node_rank", "pid", "restart",
"started_ns", "start"}`` (``start``: ``fork`` or ``exec``, ``runtime.fork_start``), and at a clean return
``"ended_ns"`` and ``"exit_code": 0`` too; the launcher reads both files to record each attempt's per-rank exits
in run.json (``runtime.launcher.read_attempts``).

A worker that has not joined the process group after half the job's timeout (``--timeout``) writes every thread's
Python stack to its stderr, torchrun's per-rank log (``stacks_if_slow``): when a start hangs, the log shows where,
before the other ranks give up waiting for it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import faulthandler
import json
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import dtprobe
from dtprobe.runtime.attempts import WORKER_FILE
from dtprobe.runtime.config import JobConfig, load_job
from dtprobe.runtime.error_file import record
from dtprobe.runtime.fork_start import started_by
from dtprobe.runtime.layout import resolve_dp
from dtprobe.runtime.parallel.mesh import ParallelDims
from dtprobe.runtime.train import train
from dtprobe.store.errors import ConfigError


def pick_device(kind: str, *, local_rank: int) -> torch.device:
    """``auto`` -> cuda:<local_rank> when CUDA is present, else cpu."""
    if kind == "cuda" or (kind == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise ConfigError("--device cuda but torch sees no CUDA device on this node; use --device cpu or auto.")
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def cores_for(local_rank: int, local_world_size: int, cores: list[int], *, model_position: int | None = None
              ) -> list[int]:
    """This worker's share of ``cores`` (the node's usable cores, sorted): a contiguous block of
    len(cores) // local_world_size when every worker gets at least one, else one core: round-robin by
    ``model_position`` (``model_position_of``: which tp and pp rank of its model replica it is) when the layout has
    one, else by local rank. So the ranks of one replica sit on different cores and compute concurrently, as on
    their own devices (a pipeline's stages overlap; a rank slowed by a sleep hands its core to the same rank of
    another replica, not to its own stage or tp peer, which would absorb the slowdown), and the same rank of every
    replica shares a core."""
    if local_world_size <= len(cores):
        k = len(cores) // local_world_size
        return cores[local_rank * k:(local_rank + 1) * k]
    return [cores[(local_rank if model_position is None else model_position) % len(cores)]]


def model_position_of(layout: Any, *, rank: int, world_size: int) -> int | None:
    """Which rank of its model replica global ``rank`` is under ``layout`` (``LayoutConfig``): pp rank x tp + tp
    rank, the same in every dp replica; None for a data-parallel layout (every rank is a whole replica)."""
    tp, pp = int(layout.tp), int(layout.pp)
    if tp * pp == 1:
        return None
    coords = ParallelDims(dp=resolve_dp(dp=int(layout.dp), tp=tp, pp=pp, world_size=world_size), tp=tp, pp=pp,
                          world_size=world_size).coords(rank)
    return coords["pp"] * tp + coords["tp"]


def bind_cores(local_rank: int, local_world_size: int, *, model_position: int | None = None) -> list[int]:
    """Bind every thread of this process (threads it starts later inherit it) to its share of the cores it may
    use (``cores_for``); returns them. Unbound, the workers of a CPU job migrate between cores and queue behind
    each other at random, which puts several times more noise on their step times (and arrival order) than a
    fixed placement does; DeepSpeed's ``--bind_cores_to_rank`` and torch.backends.xeon's launcher do the same."""
    cores = cores_for(local_rank, local_world_size, sorted(os.sched_getaffinity(0)), model_position=model_position)
    for tid in os.listdir("/proc/self/task") if os.path.isdir("/proc/self/task") else [0]:
        try:
            os.sched_setaffinity(int(tid), cores)
        except OSError:             # a thread that ended meanwhile
            pass
    return cores


def attach_for(job: JobConfig, device: torch.device) -> object:
    """``dtprobe.attach`` with the job's collect options; forces gloo when a CUDA box is asked to run on CPU."""
    collect = dataclasses.asdict(job.collect)
    backend = "gloo" if device.type == "cpu" and torch.cuda.is_available() else None
    return dtprobe.attach(job.run_dir, timeout_s=job.timeout_s, backend=backend, manage_status=False,
                          run_id=os.path.basename(os.path.normpath(job.run_dir)), **collect)


def worker_file() -> Path | None:
    """``<attempt dir>/<local rank>/worker.json`` (beside ``TORCHELASTIC_ERROR_FILE``); None outside torchrun or
    without ``--log-dir``."""
    error_file = os.environ.get("TORCHELASTIC_ERROR_FILE")
    return Path(error_file).with_name(WORKER_FILE) if error_file else None


def write_worker_file(**update: object) -> None:
    """Write (or update with ``update``) this worker's ``worker.json`` atomically; no-op without one."""
    path = worker_file()
    if path is None or not path.parent.is_dir():
        return
    try:
        info = json.loads(path.read_text())
    except (OSError, ValueError):
        info = {"rank": int(os.environ.get("RANK", "0")), "local_rank": int(os.environ.get("LOCAL_RANK", "0")),
                "node_rank": int(os.environ.get("GROUP_RANK", "0")), "pid": os.getpid(),
                "restart": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")), "started_ns": time.time_ns(),
                "start": started_by()}
    info.update(update)
    tmp = path.with_name(f".{WORKER_FILE}.tmp")
    tmp.write_text(json.dumps(info) + "\n")
    os.replace(tmp, path)


START_STACKS_MIN_S = 10.0
"""``stacks_if_slow`` around the attach waits at least this long, whatever the job's timeout."""


@contextlib.contextmanager
def stacks_if_slow(after_s: float) -> Iterator[None]:
    """Every thread's stack on stderr (``faulthandler``, so also while the main thread is blocked in C++) if the
    body is still running after ``after_s``; nothing if it returned before."""
    faulthandler.dump_traceback_later(after_s, exit=False, file=sys.stderr)
    try:
        yield
    finally:
        faulthandler.cancel_dump_traceback_later()


@record
def main() -> int:
    write_worker_file()
    path = os.environ.get("DTPROBE_JOB")
    if not path:
        print("dtprobe worker: DTPROBE_JOB is not set; start workers with `dtprobe run`.", file=sys.stderr)
        return 2
    job = load_job(path)
    device = pick_device(job.device, local_rank=int(os.environ.get("LOCAL_RANK", "0")))
    if job.cpu_bind == "auto" and device.type == "cpu":
        position = model_position_of(job.layout, rank=int(os.environ.get("RANK", "0")),
                                     world_size=int(os.environ.get("WORLD_SIZE", "1")))
        cores = bind_cores(int(os.environ.get("LOCAL_RANK", "0")), int(os.environ.get("LOCAL_WORLD_SIZE", "1")),
                           model_position=position)
        write_worker_file(cpus=cores)
    with stacks_if_slow(max(START_STACKS_MIN_S, job.timeout_s / 2)):
        probe = attach_for(job, device)
    status = "crashed"
    try:
        train(job, probe=probe, device=device)
        status = "finished"
    finally:
        probe.close(status=status)
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    write_worker_file(ended_ns=time.time_ns(), exit_code=0)
    return 0


if __name__ == "__main__":
    from dtprobe.runtime.quick_exit import quick_exit

    quick_exit(main())        # a clean return: exit hooks run, torch's teardown skipped (see runtime.quick_exit)
