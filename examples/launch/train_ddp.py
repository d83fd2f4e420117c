"""Data-parallel training of a small MLP on synthetic data, in the style of pytorch/examples (DDP): a plain torchrun
script with no dtprobe code except an optional ``dtprobe.record`` (a no-op when not run by dtprobe).

Run it as is:              torchrun --nproc-per-node 2 examples/launch/train_ddp.py --epochs 1
or with dtprobe attached:  dtprobe launch --nproc 2 examples/launch/train_ddp.py --epochs 1

``--grad-accum K`` steps the optimizer every K batches; ``--amp`` uses fp16 autocast with a GradScaler and
``--overflow-step S`` makes step S's loss overflow (the scaler skips it); ``--fail-rank R --fail-step S`` makes
rank R raise at step S (``--fail-exit N``: call ``sys.exit(N)`` instead); ``--slow-data-rank R --slow-data-ms M
--slow-data-from B`` makes rank R's data pipeline M ms slower per batch from its batch B on (a slow disk or
decode); ``--rank0-work-ms M --rank0-work-from S`` makes rank 0 alone compute about M ms more after each optimizer
step from step S on (logging a weight spectrum every step: work only rank 0 runs), ``--rank0-batch-factor K``
makes its batches K times larger from step S on instead (uneven work in its forward and backward);
``--alloc-rank R --alloc-step S --alloc-mb N`` makes rank R allocate and hold N MiB at step S (a batch far larger
than the others': under a memory limit, a container's or a cgroup's, the kernel's OOM killer ends it; with
``--alloc-in-data-worker`` and ``--num-workers K``, a worker process of its DataLoader does, at its S-th batch).
``--ckpt-every N --ckpt-dir DIR`` saves the model and optimizer with torch.distributed.checkpoint every N optimizer
steps (``--ckpt-async``: ``async_save`` on a group of its own, as DCP asks, the previous save awaited first).
``--record`` reports loss and tokens.
``--hidden``/``--layers`` size the MLP (the default is tiny; the benchmark uses a step of realistic length).
``--report FILE``: rank 0 writes ``{"optimizer_steps", "loop_s"}`` there (the training loop's wall time, what
``benchmarks/`` compares between ``dtprobe launch`` and plain torchrun).
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset, default_collate
from torch.utils.data.distributed import DistributedSampler


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="DDP on synthetic data")
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--samples", type=int, default=256)
    parser.add_argument("--grad-accum", type=int, default=1)
    parser.add_argument("--hidden", type=int, default=64, help="width of the hidden layers")
    parser.add_argument("--layers", type=int, default=1, help="hidden layers (each after the first: hidden x hidden)")
    parser.add_argument("--lr", type=float, default=0.01)
    parser.add_argument("--amp", action="store_true")
    parser.add_argument("--overflow-step", type=int, default=-1)
    parser.add_argument("--fail-rank", type=int, default=-1)
    parser.add_argument("--fail-step", type=int, default=-1)
    parser.add_argument("--fail-exit", type=int, default=None)
    parser.add_argument("--slow-data-rank", type=int, default=-1)
    parser.add_argument("--slow-data-ms", type=float, default=0.0)
    parser.add_argument("--slow-data-from", type=int, default=0, help="the first batch it slows (0-based)")
    parser.add_argument("--rank0-work-ms", type=float, default=0.0,
                        help="rank 0 computes about this long after each optimizer step (0: never)")
    parser.add_argument("--rank0-batch-factor", type=int, default=1,
                        help="rank 0's batches are this many times larger (from --rank0-work-from on)")
    parser.add_argument("--rank0-work-from", type=int, default=0, help="the first optimizer step it does")
    parser.add_argument("--alloc-rank", type=int, default=-1)
    parser.add_argument("--alloc-step", type=int, default=-1)
    parser.add_argument("--alloc-mb", type=int, default=0)
    parser.add_argument("--alloc-in-data-worker", action="store_true",
                        help="allocate in a DataLoader worker process, from its --alloc-step'th batch")
    parser.add_argument("--num-workers", type=int, default=0, help="DataLoader worker processes")
    parser.add_argument("--ckpt-every", type=int, default=0, help="checkpoint every N optimizer steps (0: never)")
    parser.add_argument("--ckpt-dir", default="checkpoints")
    parser.add_argument("--ckpt-async", action="store_true")
    parser.add_argument("--record", action="store_true")
    parser.add_argument("--report", default=None)
    return parser.parse_args()


def _log_spectrum(model: nn.Module, seconds: float) -> None:
    """What a rank-0-only metric costs: singular values of the first weight, again until ``seconds`` of CPU pass."""
    weight = next(model.parameters()).detach()
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        torch.linalg.svdvals(weight)


class _Collate:
    """The DataLoader's collate function: ``default_collate``, after ``delay_ms`` from batch ``first`` on (the slow
    decode or disk of one node's data pipeline); with ``alloc_mb``, it allocates and holds that much at its batch
    ``alloc_at`` (each DataLoader worker process counts its own batches)."""

    def __init__(self, delay_ms: float, first: int, alloc_mb: int = 0, alloc_at: int = -1) -> None:
        self.delay_s, self.first, self.batches = delay_ms / 1e3, first, 0
        self.alloc_mb, self.alloc_at, self.held = alloc_mb, alloc_at, []

    def __call__(self, items: list) -> object:
        if self.delay_s and self.batches >= self.first:
            time.sleep(self.delay_s)
        if self.alloc_mb and self.batches == self.alloc_at:
            self.held.append(torch.ones(self.alloc_mb << 18))
        self.batches += 1
        return default_collate(items)


def main() -> None:
    args = parse_args()
    dist.init_process_group("gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(args.samples, 32), torch.randn(args.samples, 8))
    sampler = DistributedSampler(data, num_replicas=world_size, rank=rank, shuffle=True, seed=0)
    in_worker = rank == args.alloc_rank and args.alloc_in_data_worker
    loader = DataLoader(data, batch_size=args.batch_size, sampler=sampler, num_workers=args.num_workers,
                        persistent_workers=args.num_workers > 0,
                        collate_fn=_Collate(args.slow_data_ms if rank == args.slow_data_rank else 0.0,
                                            args.slow_data_from, args.alloc_mb if in_worker else 0, args.alloc_step))
    layers: list[nn.Module] = [nn.Linear(32, args.hidden), nn.ReLU()]
    for _ in range(args.layers - 1):
        layers += [nn.Linear(args.hidden, args.hidden), nn.ReLU()]
    model = DDP(nn.Sequential(*layers, nn.Linear(args.hidden, 8)))
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr)
    scaler = torch.amp.GradScaler("cpu", enabled=args.amp)
    held = []
    saving, ckpt_group = None, dist.new_group(backend="gloo") if args.ckpt_async else None
    step = 0
    start = time.perf_counter()
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        for i, (x, y) in enumerate(loader):
            if rank == 0 and args.rank0_batch_factor > 1 and step >= args.rank0_work_from:
                x, y = x.repeat(args.rank0_batch_factor, 1), y.repeat(args.rank0_batch_factor, 1)
            with torch.autocast("cpu", dtype=torch.float16, enabled=args.amp):
                loss = nn.functional.mse_loss(model(x), y)
            if step == args.overflow_step:
                loss = loss * 1e38
            if rank == args.fail_rank and step == args.fail_step:
                if args.fail_exit is not None:
                    sys.exit(args.fail_exit)
                raise RuntimeError(f"rank {rank} fails at step {step} (--fail-step)")
            if rank == args.alloc_rank and step == args.alloc_step and not held and not args.alloc_in_data_worker:
                held.append(torch.ones(args.alloc_mb << 18))   # float32: 4 bytes each, every page touched
            scaler.scale(loss / args.grad_accum).backward()
            if args.record:
                import dtprobe

                dtprobe.record(loss=loss.detach(), tokens=x.shape[0])
            if (i + 1) % args.grad_accum == 0:
                scaler.step(optimizer)
                scaler.update()
                optimizer.zero_grad()
                step += 1
                if rank == 0 and args.rank0_work_ms and step > args.rank0_work_from:
                    _log_spectrum(model, args.rank0_work_ms / 1e3)
                if args.ckpt_every and step % args.ckpt_every == 0:
                    state = {"model": model.state_dict(), "optim": optimizer.state_dict()}
                    where = f"{args.ckpt_dir}/step{step}"
                    if saving is not None:
                        saving.result()
                    if args.ckpt_async:
                        saving = dcp.async_save(state, checkpoint_id=where, process_group=ckpt_group)
                    else:
                        dcp.save(state, checkpoint_id=where)
    if saving is not None:
        saving.result()
    dist.barrier()
    loop_s = time.perf_counter() - start
    if rank == 0:
        print(f"done: {step} optimizer steps in {loop_s:.2f} s, last loss {loss.item():.4f}", flush=True)
        if args.report:
            with open(args.report, "w") as f:
                json.dump({"optimizer_steps": step, "loop_s": loop_s}, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
