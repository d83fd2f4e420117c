"""The layout of a run (``[layout]``: dp x tp x pp, ZeRO, pipeline schedule) and the one world-size check;
read by the job config, the parallel layouts (``parallel.mesh``) and the planner's calibration. Torch-free.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from dtprobe.runtime.options import option
from dtprobe.store.errors import ConfigError

ZERO_STAGES = (0, 1, 2, 3)
PP_SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b", "zero-bubble", "zbv")
AC_MODES = ("none", "selective", "full")


def resolve_dp(*, dp: int, tp: int, pp: int, world_size: int) -> int:
    """The data-parallel degree on ``world_size`` ranks (``dp = -1``: every rank left after tp * pp).

    The one check that the degrees multiply to the world size; the ConfigError names the keys, the numbers
    and the fix.
    """
    model_ranks = tp * pp
    resolved = world_size // model_ranks if dp == -1 else dp
    if resolved < 1 or resolved * model_ranks != world_size:
        shown = resolved if dp != -1 else f"-1 -> {resolved}"
        fix = (f"Set --dp -1 (or --dp {world_size // model_ranks}) to use every rank"
               if world_size % model_ranks == 0 else
               f"Choose --tp/--pp whose product divides {world_size}")
        needed = max(resolved, 1) * model_ranks
        raise ConfigError(
            f"layout.dp({shown}) * layout.tp({tp}) * layout.pp({pp}) = {max(resolved, 0) * model_ranks}, "
            f"but WORLD_SIZE = {world_size} (--nproc x --nnodes). {fix}, or launch {needed} processes "
            f"(--nproc {needed} --nnodes 1).")
    return resolved


@dataclass(kw_only=True, frozen=True)
class LayoutConfig:
    """How ranks split the work: data parallel alone (``parallel.ddp``) or any dp x tp x pp x ZeRO layout
    (``parallel.hybrid``, which validates the combinations with the model in ``parallel.mesh.check_layout``)."""

    dp: int = option(-1)
    """Data-parallel degree; -1 uses every rank left after tp * pp."""
    tp: int = option(1)
    """Tensor-parallel degree; 1 disables TP."""
    pp: int = option(1)
    """Pipeline ranks; 1 disables PP."""
    zero: int = option(0)
    """ZeRO stage over the dp axis: 0 (plain DDP), 1 (optimizer state), 2 (+ gradients), 3 (+ parameters)."""
    pp_schedule: str = option("1f1b")
    """Pipeline schedule (with pp > 1): gpipe, 1f1b, interleaved-1f1b, zero-bubble or zbv."""
    microbatches: int = option(0)
    """Pipeline micro-batches per step (with pp > 1); 0 = 2 * pp. Must divide the per-rank batch size."""
    virtual_stages: int = option(0)
    """Pipeline stages per rank; 0 = the schedule's natural count (2 for interleaved-1f1b and zbv, else 1)."""
    sequence_parallel: bool = option(False)
    """Shard LayerNorm/dropout activations along the sequence over the tp axis (needs tp > 1)."""
    activation_checkpointing: str = option("none")
    """Recompute activations in backward: none, selective or full."""
    stage_sleep: str = option("", metavar="fwd_ms=F,bwd_ms=B")
    """Replace every pipeline stage's compute by a fixed sleep per micro-batch, ``fwd_ms=F,bwd_ms=B`` (needs
    pp > 1; deterministic bubbles for tests and demos, the loss is then meaningless); empty = real compute."""

    def __post_init__(self) -> None:
        if self.dp != -1 and self.dp < 1:
            raise ConfigError(f"layout.dp = {self.dp}; use a degree >= 1, or -1 for every rank left after tp * pp.")
        for key in ("tp", "pp"):
            if getattr(self, key) < 1:
                raise ConfigError(f"layout.{key} = {getattr(self, key)}; it must be >= 1 (1 disables it).")
        if self.zero not in ZERO_STAGES:
            raise ConfigError(f"layout.zero = {self.zero}; use one of {list(ZERO_STAGES)} (0 = off).")
        if self.microbatches < 0 or self.virtual_stages < 0:
            raise ConfigError(f"layout.microbatches ({self.microbatches}) and layout.virtual_stages "
                              f"({self.virtual_stages}) must be >= 0 (0 = automatic).")
        if self.pp_schedule not in PP_SCHEDULES:
            raise ConfigError(f"layout.pp_schedule = {self.pp_schedule!r}; use one of {list(PP_SCHEDULES)}.")
        if self.stage_sleep:   # 'fwd_ms=F,bwd_ms=B': a ConfigError naming the flag
            from dtprobe.runtime.parallel.stage_sleep import parse_stage_sleep

            parse_stage_sleep(self.stage_sleep)
        if self.activation_checkpointing not in AC_MODES:
            raise ConfigError(f"layout.activation_checkpointing = {self.activation_checkpointing!r}; use one of "
                              f"{list(AC_MODES)}.")

    def resolve(self, world_size: int) -> "Layout":
        """Concrete degrees for ``world_size`` ranks; ConfigError naming the flags when they do not multiply up."""
        dp = resolve_dp(dp=self.dp, tp=self.tp, pp=self.pp, world_size=world_size)
        values = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        values.update(dp=dp, microbatches=self.microbatches or (2 * self.pp if self.pp > 1 else 1))
        return Layout(**values)


@dataclass(kw_only=True, frozen=True)
class Layout(LayoutConfig):
    """A ``LayoutConfig`` resolved against the world size: ``dp`` and ``microbatches`` are concrete. Drop-in for
    ``parallel.mesh.check_layout`` and the layouts of ``runtime.parallel``."""

    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.pp

    @property
    def is_pure_dp(self) -> bool:
        """Plain DDP: no TP, no PP, no ZeRO (``parallel.ddp``; anything else is ``parallel.hybrid``'s)."""
        return self.tp == 1 and self.pp == 1 and self.zero == 0 and not self.stage_sleep


__all__ = ["AC_MODES", "Layout", "LayoutConfig", "PP_SCHEDULES", "ZERO_STAGES", "resolve_dp"]
