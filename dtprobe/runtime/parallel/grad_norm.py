"""Global gradient-norm clipping over any layout (DTensor shards of TP/FSDP2, replicas, pipeline stages); used by
``Parallelized.train_step``.

The norm is that of the unsplit model's gradient: DTensor gradients are grouped by (mesh, placements) and each
group's norm is reduced over its mesh in one collective; plain gradients are identical on the ranks that
hold them (DDP/ZeRO-1 replicas, TP-replicated LayerNorms); with pipeline parallelism each rank's squared
norm covers only its stages, so the squares are summed over the ``pp`` group.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn


def total_grad_norm(params: Iterable[nn.Parameter], *, pp_group: Any = None) -> torch.Tensor:
    """The 2-norm of all gradients of the (unsplit) model, as a plain scalar tensor on every rank."""
    groups: dict[Any, list[torch.Tensor]] = {}
    for p in params:
        g = p.grad
        if g is None:
            continue
        mesh = getattr(g, "device_mesh", None)
        key = "local" if mesh is None else (id(mesh), tuple(g.placements))
        groups.setdefault(key, []).append(g)
    squares = []
    for key, grads in groups.items():
        norm = torch.nn.utils.get_total_norm(grads, norm_type=2.0)
        if key != "local":
            norm = norm.full_tensor()
        squares.append(norm.float() ** 2)
    total_sq = torch.stack(squares).sum() if squares else torch.zeros(())
    if pp_group is not None:
        import torch.distributed as dist

        dist.all_reduce(total_sq, group=pp_group)
    return total_sq.sqrt()


def clip_grad_norm(params: list[nn.Parameter], max_norm: float, *, pp_group: Any = None) -> torch.Tensor:
    """Scale gradients so their global norm is at most ``max_norm``; returns the norm before clipping."""
    norm = total_grad_norm(params, pp_group=pp_group)
    coef = max_norm / (float(norm) + 1e-6)
    if coef < 1.0:
        with torch.no_grad():
            for p in params:
                if p.grad is not None:
                    p.grad.mul_(coef)   # a Python float: valid for plain and DTensor grads alike
    return norm
