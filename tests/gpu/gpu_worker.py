"""Workers of the two-GPU tests (``tests/gpu/test_gpu_multi.py``), one per torchrun rank:

    python -m torch.distributed.run --nproc-per-node 2 tests/gpu/gpu_worker.py ddp_straggler RUN_DIR
    python -m torch.distributed.run --nproc-per-node 2 tests/gpu/gpu_worker.py pipeline_exchange RUN_DIR

``ddp_straggler``: 2-rank DDP under ``dtprobe.attach`` (NCCL, recorded); rank 1's GPU runs a spinning kernel
(``torch.cuda._sleep``) before each forward, so its host enqueues on time and only the device is late.
``bound_groups``: groups created after attach bound the default NCCL group to the device (split from it).
``pipeline_exchange``: both ranks send and receive a large activation to and from each other at once through
``dist.batch_isend_irecv`` on the recording group (the pattern that deadlocks when the ops go out one by one).
"""

from __future__ import annotations

import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn

import dtprobe

SPIN_CYCLES = 40_000_000
"""GPU clock cycles rank 1 spins per step (tens of ms on a data-center GPU)."""


def ddp_straggler(run_dir: str) -> None:
    probe = dtprobe.attach(run_dir, timeout_s=120)
    rank = dist.get_rank()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(1024, 1024) for _ in range(6)]).to(device)
    ddp = nn.parallel.DistributedDataParallel(model, device_ids=[device.index])
    optimizer = torch.optim.SGD(ddp.parameters(), lr=1e-3)
    for step in range(40):
        with probe.step(step) as s:
            x = torch.randn(128, 1024, device=device)
            with s.phase("fwd"):
                if rank == 1:
                    torch.cuda._sleep(SPIN_CYCLES)
                loss = ddp(x).square().mean()
            with s.phase("bwd"):
                loss.backward()
            with s.phase("opt"):
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            s.record(loss=loss)            # .item(): the step's device work is done at its exit
    time.sleep(1.0)                        # NCCL's watchdog reports the last completions
    probe.close()


def pipeline_exchange(run_dir: str) -> None:
    probe = dtprobe.attach(run_dir, timeout_s=120)
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    peer = (rank + 1) % world
    numel = 64 * 1024 * 1024           # 256 MB of float32 each way: far above NCCL's eager buffers
    for step in range(3):
        with probe.step(step):
            out = torch.full((numel,), float(rank + step), device=device)
            into = torch.empty(numel, device=device)
            ops = [dist.P2POp(dist.isend, out, peer), dist.P2POp(dist.irecv, into, peer)]
            for work in dist.batch_isend_irecv(ops):
                work.wait()
            torch.cuda.synchronize()
            assert float(into[0]) == float(peer + step) and float(into[-1]) == float(peer + step)
    time.sleep(1.0)
    probe.close()


def bound_groups(run_dir: str) -> None:
    """attach binds the NCCL group to this rank's GPU (``device_id``); torch then splits later groups from its
    communicator: a ``new_group`` leaving rank 1 out (rank 1 only joins the split) and a 1 x 2 DeviceMesh (its
    axes split with ``split_group``) must build, and their collectives be recorded."""
    from torch.distributed.device_mesh import init_device_mesh

    probe = dtprobe.attach(run_dir, timeout_s=120)
    rank = dist.get_rank()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    assert dist.distributed_c10d._get_default_group().bound_device_id == device
    first = dist.new_group([0])
    mesh = probe.init_device_mesh("cuda", (1, 2), mesh_dim_names=("dp", "tp"))
    with probe.step(0):
        if rank == 0:
            dist.all_reduce(torch.ones(3, device=device), group=first)
        dist.all_reduce(torch.ones(5, device=device), group=mesh.get_group("tp"))
        torch.cuda.synchronize()
    time.sleep(1.0)
    probe.close()


if __name__ == "__main__":
    {"ddp_straggler": ddp_straggler, "pipeline_exchange": pipeline_exchange,
     "bound_groups": bound_groups}[sys.argv[1]](sys.argv[2])
