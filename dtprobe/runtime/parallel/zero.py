"""Data parallelism and ZeRO on the ``dp`` axis (DDP / ``replicate`` / ZeroRedundancyOptimizer / FSDP2);
applied by ``parallelize``.

| zero | gradients | optimizer states | parameters | built on |
|---|---|---|---|---|
| 0 | all-reduced | replicated | replicated | ``DistributedDataParallel`` alone, ``replicate`` in hybrids |
| 1 | all-reduced | sharded | replicated | DDP alone, ``allreduce_grads`` with PP; + ``ZeroRedundancyOptimizer`` |
| 2 | reduce-scattered | sharded | gathered once per step | FSDP2 ``fully_shard(reshard_after_forward=False)`` |
| 3 | reduce-scattered | sharded | gathered for forward and backward | ``fully_shard(reshard_after_forward=True)`` |

``nn.parallel.DistributedDataParallel`` is only used when dp is the only axis: it fails over DTensor (TP)
parameters and inside pipeline stages; hybrids use the DTensor-aware ``replicate`` or FSDP2 instead.
ZeroRedundancyOptimizer needs plain (non-DTensor) parameters, so ZeRO-1 with pipeline stages leaves them plain
and all-reduces the gradients itself after the schedule (one flat all-reduce per step); ZeRO-1 with TP is
refused by ``mesh.check_layout`` (use ZeRO-2/3).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


def apply_data_parallel(module: nn.Module, dp_mesh: Any, *, zero: int, only_dp: bool) -> nn.Module:
    """Wrap ``module`` (a whole GPT or one pipeline stage) for data parallelism over ``dp_mesh``.

    Returns the module to train: a ``DistributedDataParallel`` wrapper when ``only_dp`` and ``zero`` <= 1,
    else ``module`` itself, changed in place by FSDP2 / ``replicate``.
    """
    if zero >= 2:
        from torch.distributed.fsdp import fully_shard

        reshard = zero == 3
        blocks = getattr(module, "blocks", None)
        if blocks is not None:
            for block in blocks.values():
                fully_shard(block, mesh=dp_mesh, reshard_after_forward=reshard)
        fully_shard(module, mesh=dp_mesh, reshard_after_forward=reshard)
        return module
    if zero == 1 and not only_dp:
        return module   # plain parameters for ZeroRedundancyOptimizer; gradients: ``allreduce_grads``
    if only_dp:
        from torch.nn.parallel import DistributedDataParallel

        return DistributedDataParallel(module, process_group=dp_mesh.get_group())
    from torch.distributed._composable.replicate_with_fsdp import replicate

    replicate(module, mesh=dp_mesh)
    return module


def local_optimizer(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """The optimizer that holds this rank's states (ZeroRedundancyOptimizer keeps them in ``.optim``)."""
    return getattr(optimizer, "optim", optimizer)


def allreduce_grads(params: list[nn.Parameter], group: Any) -> None:
    """Average the gradients of ``params`` over ``group`` in one flat all-reduce (ZeRO-1 with pipeline stages,
    where neither DDP nor ``replicate`` can wrap the stage)."""
    import torch.distributed as dist
    from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return
    flat = _flatten_dense_tensors(grads)
    dist.all_reduce(flat, group=group)
    flat /= dist.get_world_size(group)
    for g, synced in zip(grads, _unflatten_dense_tensors(flat, grads)):
        g.copy_(synced)
