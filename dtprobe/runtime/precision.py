"""Mixed precision for the runtime (``[precision]``, ``config_sections.PrecisionConfig``): autocast with fp32
master weights, fp16 loss scaling, one ``amp`` row per step.

Produces the ``amp`` table (per step and rank: ``scale_before``, ``scale_after``, ``found_inf``, ``skipped``) for
the analysis' AMP-overflow finding, and the ``--inject overflow:step=S[,rank=R]`` fault.

- ``fp32``: no autocast, no scaler, no ``amp`` rows.
- ``bf16``: ``torch.autocast(dtype=bfloat16)``; parameters (master weights) and optimizer state stay fp32; bf16
  has fp32's exponent range, so no loss scaling and no ``amp`` rows.
- ``fp16``: ``torch.autocast(dtype=float16)`` with dynamic loss scaling: ``torch.amp.GradScaler`` with DDP,
  ``LocalShardGradScaler`` with every other layout (ZeRO, FSDP2, TP, PP): it checks and unscales each rank's
  local gradients (the local shard of a DTensor gradient) and all-reduces ``found_inf`` over the world, so every
  rank (every pipeline stage, every TP/dp shard) skips the same step. An overflow halves the scale
  (``backoff_factor``) and skips ``optimizer.step``.

An injected overflow multiplies this rank's loss by ``1e38`` before ``backward``: with any loss scale >= 4 the
scaled loss and every gradient become inf; DDP/FSDP reductions spread the inf to all ranks, so every rank's
row shows ``found_inf`` and ``skipped`` and the scale halved, exactly as a real overflow would.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable

import torch

from dtprobe.runtime.config_sections import PrecisionConfig  # noqa: F401 (its config, re-exported)
from dtprobe.store.errors import ConfigError

AUTOCAST_DTYPES = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}
"""Autocast dtype of each ``PrecisionConfig.dtype`` (None: autocast off)."""
OVERFLOW_LOSS_FACTOR = 1e38
"""Factor an injected overflow multiplies the loss by; times any loss scale >= 4 it exceeds fp32's max (3.4e38)."""

Recorder = Callable[[str, dict[str, Any]], None]
"""``probe.record``: ``(table, row)``; the rank is filled in by the probe's writer."""


def local_shard_grad_scaler(device_type: str, **kwargs: Any) -> Any:
    """A ``ShardedGradScaler`` whose unscale works on every rank's local gradients, DTensor or not.

    torch's ``ShardedGradScaler`` hands all gradients to one ``_amp_foreach_non_finite_check_and_unscale_``
    call; with tensor parallelism that list mixes DTensor (sharded) and plain (LayerNorm) gradients and the call
    fails (``got mixed torch.Tensor and DTensor``). Here each DTensor gradient is replaced by its local shard
    (unscaled in place, so the DTensor sees it), and ``found_inf`` is then all-reduced over ``process_group``
    (default: the world) by ``ShardedGradScaler.unscale_``: a global verdict that is correct for replicated,
    sharded and pipeline-split gradients alike.
    """
    from collections import defaultdict

    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    class LocalShardGradScaler(ShardedGradScaler):
        def _unscale_grads_(self, optimizer: torch.optim.Optimizer, inv_scale: torch.Tensor,
                            found_inf: torch.Tensor, allow_fp16: bool = True) -> dict[torch.device, torch.Tensor]:
            grads: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = defaultdict(list)
            with torch.no_grad():
                for group in optimizer.param_groups:
                    for param in group["params"]:
                        grad = param.grad
                        if grad is None:
                            continue
                        if hasattr(grad, "to_local"):
                            grad = grad.to_local()
                        if not allow_fp16 and grad.dtype == torch.float16:
                            raise ValueError("Attempting to unscale FP16 gradients.")
                        if grad.numel():
                            grads[(grad.device, grad.dtype)].append(grad)
                found: dict[torch.device, torch.Tensor] = {}
                for (device, _), group_grads in grads.items():
                    if device not in found:
                        found[device] = found_inf.to(device, copy=True)
                    torch._amp_foreach_non_finite_check_and_unscale_(group_grads, found[device],
                                                                     inv_scale.to(device))
            if not found:   # no local gradient: still take part in the found_inf all-reduce
                assert self._scale is not None
                found[self._scale.device] = found_inf.to(self._scale.device, copy=True)
            return found

    return LocalShardGradScaler(device_type, **kwargs)


class MixedPrecision:
    """The step's precision policy: ``autocast()`` around forward, ``backward(loss)``, ``step(opt, step=)``.

    ``sharded=True`` (every layout but plain DDP) uses ``local_shard_grad_scaler`` (``found_inf`` all-reduced
    over ``process_group``, default the world). ``record`` receives one ``amp`` row per fp16 step.
    """

    def __init__(self, config: PrecisionConfig, *, device_type: str = "cpu", sharded: bool = False,
                 process_group: Any = None, record: Recorder | None = None) -> None:
        self.config = config
        self.device_type = device_type
        self._record = record or (lambda table, row: None)
        self.scaler: Any = None
        self.last_row: dict[str, Any] | None = None
        if config.uses_loss_scaling:
            kwargs = dict(init_scale=config.init_scale, growth_interval=config.growth_interval,
                          backoff_factor=config.backoff_factor)
            if sharded:
                extra = {} if process_group is None else {"process_group": process_group}
                self.scaler = local_shard_grad_scaler(device_type, **kwargs, **extra)
            else:
                self.scaler = torch.amp.GradScaler(device_type, **kwargs)

    def autocast(self) -> contextlib.AbstractContextManager:
        """Context for the forward pass (and loss); a no-op for fp32."""
        dtype = AUTOCAST_DTYPES[self.config.dtype]
        if dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device_type, dtype=dtype)

    def backward(self, loss: torch.Tensor, *, inject_overflow: bool = False) -> None:
        """``loss.backward()``, scaled under fp16. ``inject_overflow`` forces inf gradients (fp16 only; the train
        loop writes the ``faults`` row)."""
        if inject_overflow:
            if self.scaler is None:
                raise ConfigError(
                    f"--inject overflow needs --precision fp16 (got {self.config.dtype}): only fp16 has a loss "
                    f"scaler that detects the inf gradients and skips the step; without it the weights would "
                    f"become inf.")
            loss = loss * OVERFLOW_LOSS_FACTOR
        if self.scaler is not None:
            loss = self.scaler.scale(loss)
        loss.backward()

    def unscale(self, optimizer: torch.optim.Optimizer) -> None:
        """Unscale gradients in place (call before gradient clipping); ``step`` does it if you do not."""
        if self.scaler is not None:
            self.scaler.unscale_(optimizer)
            self._unscaled = True

    def step(self, optimizer: torch.optim.Optimizer, *, step: int) -> dict[str, Any] | None:
        """``optimizer.step()`` (skipped by the scaler on overflow) and, under fp16, the ``amp`` row it records."""
        if self.scaler is None:
            optimizer.step()
            return None
        scale_before = float(self.scaler.get_scale())
        if not getattr(self, "_unscaled", False):
            self.scaler.unscale_(optimizer)
        self._unscaled = False
        # After unscale_ (which all-reduces found_inf under ShardedGradScaler) the per-device flags are final.
        found = self.scaler._found_inf_per_device(optimizer)
        found_inf = bool(sum(float(v.item()) for v in found.values()) > 0)
        self.scaler.step(optimizer)
        self.scaler.update()
        scale_after = float(self.scaler.get_scale())
        row = {"step": int(step), "scale_before": scale_before, "scale_after": scale_after,
               "found_inf": found_inf, "skipped": found_inf}
        self.last_row = row
        self._record("amp", row)
        return row

    def state_dict(self) -> dict[str, Any]:
        """The scaler's state (scale, growth tracker) for checkpoints; empty without a scaler."""
        return {} if self.scaler is None else self.scaler.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.scaler is not None and state:
            self.scaler.load_state_dict(state)


