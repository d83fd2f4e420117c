"""Pipeline-parallel training with ``torch.distributed.pipelining`` (one stage per rank, a ``Schedule1F1B`` or
``ScheduleGPipe`` over micro-batches), in the style of torchtitan's pipeline setup: a plain torchrun script that
initializes its own process group and has no dtprobe code.

Run it as is:              torchrun --nproc-per-node 2 examples/launch/train_pipeline.py --steps 4
or with dtprobe attached:  dtprobe launch --nproc 2 examples/launch/train_pipeline.py --steps 4
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe


def main() -> None:
    parser = argparse.ArgumentParser(description="pipeline parallelism on synthetic data")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--dim", type=int, default=32)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--schedule", choices=["1f1b", "gpipe"], default="1f1b")
    args = parser.parse_args()

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(rank)
    part = nn.Sequential(nn.Linear(args.dim, 4 * args.dim), nn.ReLU(), nn.Linear(4 * args.dim, args.dim))
    stage = PipelineStage(part, rank, world, torch.device("cpu"))
    schedule_class = Schedule1F1B if args.schedule == "1f1b" else ScheduleGPipe
    schedule = schedule_class(stage, n_microbatches=args.microbatches,
                              loss_fn=lambda out, target: (out - target).square().mean())
    optim = torch.optim.SGD(part.parameters(), lr=1e-3)
    data = torch.Generator().manual_seed(0)          # every stage draws the same batches
    losses: list[torch.Tensor] = []                 # the last stage's, one per micro-batch
    for _ in range(args.steps):
        x = torch.randn(args.batch_size, args.dim, generator=data)
        target = torch.randn(args.batch_size, args.dim, generator=data)
        optim.zero_grad()
        losses.clear()
        # the first stage feeds the batch, the last one the targets; stages between take their input from the last
        inputs = (x,) if rank == 0 else ()
        schedule.step(*inputs, **({"target": target, "losses": losses} if rank == world - 1 else {}))
        optim.step()
    if losses:
        print(f"last stage: {args.steps} steps, last loss {torch.stack(losses).mean().item():.4f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
