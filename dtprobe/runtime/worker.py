"""The torchrun worker of ``dtprobe run``: ``python -m dtprobe.runtime.worker`` reads ``DTPROBE_JOB`` (job.json),
attaches the probe, trains, and closes. Started by ``runtime.launcher`` through ``torch.distributed.run``.

After the probe is closed (every row flushed), the ranks meet at a last barrier before exiting, so when any
node's agent exits (and node 0's launcher compacts the store) every rank's telemetry is already on disk.
"""

from __future__ import annotations

import dataclasses
import os
import sys

import torch
import torch.distributed as dist

import dtprobe
from collectors.pg_wrapper import GLOO_BACKEND
from dtprobe.runtime.config import JobConfig, load_job
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


def attach_for(job: JobConfig, device: torch.device) -> object:
    """``dtprobe.attach`` with the job's collect options; forces gloo when a CUDA box is asked to run on CPU."""
    collect = dataclasses.asdict(job.collect)
    backend = None
    if device.type == "cpu" and torch.cuda.is_available():
        backend = GLOO_BACKEND if job.collect.enabled and job.collect.collectives else "gloo"
    return dtprobe.attach(job.run_dir, timeout_s=job.timeout_s, backend=backend, manage_status=False,
                          run_id=os.path.basename(os.path.normpath(job.run_dir)), **collect)


def main() -> int:
    path = os.environ.get("DTPROBE_JOB")
    if not path:
        print("dtprobe worker: DTPROBE_JOB is not set; start workers with `dtprobe run`.", file=sys.stderr)
        return 2
    job = load_job(path)
    device = pick_device(job.device, local_rank=int(os.environ.get("LOCAL_RANK", "0")))
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
    return 0


if __name__ == "__main__":
    sys.exit(main())
