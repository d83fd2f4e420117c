"""FSDP2 (``fully_shard``) training of a small residual MLP stack, in the style of pytorch/examples' FSDP2 example:
a plain torchrun script that initializes its own process group and has no dtprobe code.

Run it as is:              torchrun --nproc-per-node 2 examples/launch/train_fsdp2.py --steps 4
or with dtprobe attached:  dtprobe launch --nproc 2 examples/launch/train_fsdp2.py --steps 4
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import fully_shard


class Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, 4 * dim)
        self.fc2 = nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.relu(self.fc1(self.norm(x))))


class Model(nn.Module):
    def __init__(self, dim: int, num_layers: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Block(dim) for _ in range(num_layers))
        self.head = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def main() -> None:
    parser = argparse.ArgumentParser(description="FSDP2 on synthetic data")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--dim", type=int, default=32)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=8)
    args = parser.parse_args()

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = Model(args.dim, args.layers)
    for layer in model.layers:
        fully_shard(layer)
    fully_shard(model)
    optim = torch.optim.Adam(model.parameters(), lr=1e-3)
    torch.manual_seed(rank)
    for step in range(args.steps):
        x = torch.randn(args.batch_size, args.dim)
        optim.zero_grad()
        loss = model(x).square().mean()
        loss.backward()
        optim.step()
    if rank == 0:
        print(f"done: {args.steps} steps, last loss {loss.item():.4f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
