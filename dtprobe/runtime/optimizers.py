"""The runtime's optimizers: AdamW and the large-batch LAMB and LARS, built by ``build_optimizer`` for every layout
(``parallel.ddp``, ``parallel.hybrid``); ``--optimizer`` (``TrainConfig.optimizer``) picks one.

LAMB (You et al. 2019, "Large Batch Optimization for Deep Learning") and LARS (You et al. 2017, "Large Batch
Training of Convolutional Networks") scale each parameter's step by a trust ratio of norms of the *whole*
parameter. On layouts that shard a parameter (FSDP2 / ZeRO-2/3 and tensor parallel: DTensor parameters) each rank
holds a slice, so the squared norms of the local slices are summed over the mesh dimensions the parameter is
sharded on, one all-reduce per (mesh, sharded dimensions) and optimizer step: the ratio is the unsharded
model's. ZeRO-1 (``ZeroRedundancyOptimizer``) partitions whole parameters between ranks, so its local norms are
already whole. Parameters with fewer than 2 dimensions (biases, LayerNorm weights) form a second param group
without weight decay and without a trust ratio, as in the papers' BERT and ResNet recipes.

Optimizer state is kept like the parameter (a DTensor state for a DTensor parameter), so DCP checkpoints
(``runtime.checkpoint``) save and reshard it as they do AdamW's.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from dtprobe.runtime.config import OPTIMIZERS, TrainConfig
from dtprobe.store.errors import ConfigError

BETAS = (0.9, 0.95)
"""Adam moments' decay rates of the runtime's AdamW and LAMB (GPT-style training)."""
LARS_MOMENTUM = 0.9
"""Momentum of the runtime's LARS (the paper's)."""


class LAMB(torch.optim.Optimizer):
    """Adam moments with bias correction; the step ``r = m_hat / (sqrt(v_hat) + eps) + weight_decay * w`` is
    scaled by the trust ratio ``||w|| / ||r||`` (1 when either norm is 0, or when the group's ``trust_ratio`` is
    False): ``w -= lr * ratio * r``."""

    def __init__(self, params: Iterable[Any], *, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-6, weight_decay: float = 0.0, trust_ratio: bool = True) -> None:
        if not lr > 0 or not eps >= 0 or not weight_decay >= 0 or not all(0 <= b < 1 for b in betas):
            raise ValueError(f"LAMB: lr ({lr}) > 0, eps ({eps}) >= 0, weight_decay ({weight_decay}) >= 0 and "
                             f"betas {betas} in [0, 1) are required.")
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                                      trust_ratio=trust_ratio))

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = _closure_loss(closure)
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            params, weights, updates = [], [], []
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["step"] = torch.tensor(0.0)
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["step"] += 1
                t = float(state["step"])
                g = _local(p.grad, like=p)
                m, v = _local(state["exp_avg"]), _local(state["exp_avg_sq"])
                m.lerp_(g, 1 - beta1)
                v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
                update = (m / (1 - beta1 ** t)) / ((v / (1 - beta2 ** t)).sqrt_().add_(group["eps"]))
                w = _local(p)
                if group["weight_decay"]:
                    update.add_(w, alpha=group["weight_decay"])
                params.append(p)
                weights.append(w)
                updates.append(update)
            if not params:
                continue
            if group["trust_ratio"]:
                w_norm, u_norm = whole_norms(params, [weights, updates])
                ratios = torch.where((w_norm > 0) & (u_norm > 0), w_norm / u_norm, 1.0).tolist()
            else:
                ratios = [1.0] * len(params)
            for w, update, ratio in zip(weights, updates, ratios):
                w.add_(update, alpha=-group["lr"] * ratio)
        return loss


class LARS(torch.optim.Optimizer):
    """Momentum SGD with a layer-wise learning rate: ``d = grad + weight_decay * w``, local lr
    ``trust_coefficient * ||w|| / (||grad|| + weight_decay * ||w||)`` (1 when a norm is 0 or the group's
    ``trust_ratio`` is False), ``buf = momentum * buf + lr * local_lr * d``, ``w -= buf``."""

    def __init__(self, params: Iterable[Any], *, lr: float = 1.0, momentum: float = 0.9,
                 weight_decay: float = 0.0, trust_coefficient: float = 0.001, trust_ratio: bool = True) -> None:
        if not lr > 0 or not 0 <= momentum < 1 or not weight_decay >= 0 or not trust_coefficient > 0:
            raise ValueError(f"LARS: lr ({lr}) > 0, momentum ({momentum}) in [0, 1), weight_decay "
                             f"({weight_decay}) >= 0 and trust_coefficient ({trust_coefficient}) > 0 are required.")
        super().__init__(params, dict(lr=lr, momentum=momentum, weight_decay=weight_decay,
                                      trust_coefficient=trust_coefficient, trust_ratio=trust_ratio))

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = _closure_loss(closure)
        for group in self.param_groups:
            wd = group["weight_decay"]
            params, weights, grads = [], [], []
            for p in group["params"]:
                if p.grad is not None:
                    params.append(p)
                    weights.append(_local(p))
                    grads.append(_local(p.grad, like=p))
            if not params:
                continue
            if group["trust_ratio"]:
                w_norm, g_norm = whole_norms(params, [weights, grads])
                local_lr = torch.where((w_norm > 0) & (g_norm > 0),
                                       group["trust_coefficient"] * w_norm / (g_norm + wd * w_norm), 1.0).tolist()
            else:
                local_lr = [1.0] * len(params)
            for p, w, g, ratio in zip(params, weights, grads, local_lr):
                step = g.add(w, alpha=wd) if wd else g.clone()
                step.mul_(group["lr"] * ratio)
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                buf = _local(state["momentum_buffer"])
                buf.mul_(group["momentum"]).add_(step)
                w.sub_(buf)
        return loss


def whole_norms(params: list[torch.Tensor], tensors: list[list[torch.Tensor]]) -> list[torch.Tensor]:
    """For each list in ``tensors`` (local slices laid out like ``params``): the 2-norms of the whole tensors,
    as one float tensor per list. Where a parameter is a DTensor sharded on some mesh dimensions, the squared
    local norms are summed over those dimensions' process groups (one all-reduce per group of parameters that
    share a mesh and sharded dimensions); every rank of such a group must pass the same parameters in the same
    order, which the ranks of one model do."""
    squares = torch.stack([torch.stack([t.float().pow(2).sum() for t in ts]) for ts in tensors], dim=1)
    shards: dict[tuple[Any, tuple[int, ...]], list[int]] = {}
    for i, p in enumerate(params):
        mesh = getattr(p, "device_mesh", None)
        if mesh is None:
            continue
        dims = tuple(d for d, placement in enumerate(p.placements) if placement.is_shard())
        if dims:
            shards.setdefault((mesh, dims), []).append(i)
    if shards:
        import torch.distributed as dist

        for (mesh, dims), rows in shards.items():
            index = torch.tensor(rows, device=squares.device)
            part = squares.index_select(0, index)
            for dim in dims:
                dist.all_reduce(part, group=mesh.get_group(dim))
            squares.index_copy_(0, index, part)
    return list(squares.sqrt().unbind(1))


def _closure_loss(closure: Callable[[], Any] | None) -> Any:
    """``closure()`` with gradients enabled (``Optimizer.step``'s contract: it re-evaluates the loss), or None."""
    if closure is None:
        return None
    with torch.enable_grad():
        return closure()


def _local(t: torch.Tensor, *, like: torch.Tensor | None = None) -> torch.Tensor:
    """The local tensor of a DTensor (an alias: in-place updates change the DTensor), laid out like ``like``
    first when it is a DTensor placed differently; a plain tensor as it is."""
    if not hasattr(t, "to_local"):
        return t
    if like is not None and tuple(t.placements) != tuple(like.placements):
        t = t.redistribute(like.device_mesh, like.placements)
    return t.to_local()


OPTIMIZER_CLASSES: dict[str, type[torch.optim.Optimizer]] = {"adamw": torch.optim.AdamW, "lamb": LAMB,
                                                             "lars": LARS}
"""``TrainConfig.optimizer`` names to classes."""
assert tuple(OPTIMIZER_CLASSES) == OPTIMIZERS


def param_groups(params: Iterable[nn.Parameter], *, name: str) -> list[dict[str, Any]]:
    """``adamw``: one group (decoupled weight decay on every parameter). ``lamb``/``lars``: the matrices, then the
    parameters with fewer than 2 dimensions (biases, norm weights) with ``weight_decay`` 0 and no trust ratio.
    DTensor parameters report their global shape, so the split is the same on every layout."""
    params = list(params)
    if name == "adamw":
        return [{"params": params}]
    matrices = [p for p in params if p.ndim >= 2]
    vectors = [p for p in params if p.ndim < 2]
    groups = [{"params": matrices}] if matrices else []
    if vectors:
        groups.append({"params": vectors, "weight_decay": 0.0, "trust_ratio": False})
    return groups


def optimizer_kwargs(train: TrainConfig) -> dict[str, Any]:
    """The constructor keywords of ``train.optimizer`` from the job's ``[train]`` table (the lr is the loop's
    starting value: ``runtime.train`` sets every group's lr each step)."""
    if train.optimizer == "lars":
        return {"lr": train.lr, "momentum": LARS_MOMENTUM, "weight_decay": train.weight_decay}
    return {"lr": train.lr, "betas": BETAS, "weight_decay": train.weight_decay}


def build_optimizer(params: Iterable[nn.Parameter], *, name: str = "adamw", zero_group: Any = None,
                    **kwargs: Any) -> torch.optim.Optimizer:
    """The optimizer ``name`` over ``params`` with ``kwargs`` (``optimizer_kwargs``); with ``zero_group`` (ZeRO-1)
    a ``ZeroRedundancyOptimizer`` that partitions whole parameters, and their states, over that group."""
    if name not in OPTIMIZER_CLASSES:
        raise ConfigError(f"train.optimizer = {name!r}; use --optimizer with one of {list(OPTIMIZER_CLASSES)}.")
    cls, groups = OPTIMIZER_CLASSES[name], param_groups(params, name=name)
    if zero_group is not None:
        from torch.distributed.optim import ZeroRedundancyOptimizer

        return ZeroRedundancyOptimizer(groups, optimizer_class=cls, process_group=zero_group,
                                       parameters_as_bucket_view=True, **kwargs)
    return cls(groups, **kwargs)


__all__ = ["LAMB", "LARS", "OPTIMIZER_CLASSES", "build_optimizer", "optimizer_kwargs", "param_groups",
           "whole_norms"]
