"""The layout's DeviceMesh (axes ``pp``, ``dp``, ``tp``) and this rank's coordinates; read by every layout module.

Axes of degree 1 are left out of the mesh, so a collective's group name is always a real parallel axis. The
order is ``pp`` (outermost), ``dp``, ``tp`` (innermost, adjacent ranks), as in torchtitan: TP groups are
consecutive ranks, which on a GPU cluster keeps the chattiest traffic inside a node.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any, Callable

from dtprobe.runtime.layout import AC_MODES, PP_SCHEDULES, ZERO_STAGES, resolve_dp
from dtprobe.store.errors import ConfigError

AXES = ("pp", "dp", "tp")
"""Mesh axis names, outermost first; they are also the ``pg`` names in the collectives table."""


@dataclass(kw_only=True, frozen=True)
class ParallelDims:
    """Resolved degrees of one run plus this rank's coordinates; validated against the world size."""

    dp: int
    """Data-parallel degree (replicas, or shards with ZeRO)."""
    tp: int
    """Tensor-parallel degree."""
    pp: int
    """Pipeline ranks (a rank may hold several stages with virtual stages)."""
    world_size: int
    """dp * tp * pp."""

    def __post_init__(self) -> None:
        for axis in AXES:
            value = getattr(self, axis)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"layout.{axis} = {value!r}; it must be an integer >= 1.")
        resolve_dp(dp=self.dp, tp=self.tp, pp=self.pp, world_size=self.world_size)

    @property
    def axes(self) -> tuple[str, ...]:
        """The mesh axes with degree > 1, outermost first."""
        return tuple(axis for axis in AXES if getattr(self, axis) > 1)

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(getattr(self, axis) for axis in self.axes)

    def coords(self, rank: int) -> dict[str, int]:
        """This global rank's index on every axis (``pp``, ``dp``, ``tp``; 0 on axes of degree 1)."""
        tp_rank = rank % self.tp
        dp_rank = (rank // self.tp) % self.dp
        pp_rank = rank // (self.tp * self.dp)
        return {"pp": pp_rank, "dp": dp_rank, "tp": tp_rank}


def check_layout(layout: Any, *, world_size: int, num_layers: int | None = None,
                 seq_len: int | None = None, batch_size: int | None = None,
                 num_heads: int | None = None) -> ParallelDims:
    """Validate a ``LayoutConfig`` (runtime.layout) against the world and the model; return the degrees.

    Called by the launcher before it starts any process (so a bad layout never launches) and again by
    ``parallelize`` inside each rank. ``batch_size`` is the global batch (sequences per step).
    """
    dims = ParallelDims(dp=layout.dp, tp=layout.tp, pp=layout.pp, world_size=world_size)
    if layout.zero not in ZERO_STAGES:
        raise ConfigError(f"layout.zero = {layout.zero!r}; choose 0 (plain DP), 1 (optimizer states sharded), "
                          f"2 (+ gradients) or 3 (+ parameters).")
    if layout.pp_schedule not in PP_SCHEDULES:
        raise ConfigError(f"layout.pp_schedule = {layout.pp_schedule!r}; choose one of {', '.join(PP_SCHEDULES)}.")
    if layout.activation_checkpointing not in AC_MODES:
        raise ConfigError(f"layout.activation_checkpointing = {layout.activation_checkpointing!r}; choose one of "
                          f"{', '.join(AC_MODES)}.")
    stages_per_rank = virtual_stages(layout)
    if dims.pp > 1:
        if layout.pp_schedule in ("gpipe", "1f1b") and stages_per_rank != 1:
            raise ConfigError(f"layout.virtual_stages = {stages_per_rank} with pp_schedule={layout.pp_schedule}, "
                              f"which holds one stage per rank; use interleaved-1f1b, zero-bubble or zbv, "
                              f"or set --virtual-stages 1.")
        if layout.pp_schedule == "zbv" and stages_per_rank != 2:
            raise ConfigError(f"layout.virtual_stages = {stages_per_rank} with pp_schedule=zbv, which holds "
                              f"exactly 2 stages per rank (V shape); set --virtual-stages 2.")
        m = layout.microbatches
        if m < 1:
            raise ConfigError(f"layout.microbatches = {m}; it must be >= 1 (e.g. 2 * pp = {2 * dims.pp}).")
        if layout.pp_schedule == "interleaved-1f1b":
            rounds = max(1, m // dims.pp)
            if m % rounds:
                raise ConfigError(f"layout.microbatches = {m} with pp = {dims.pp}: interleaved-1f1b runs "
                                  f"{rounds} rounds and needs microbatches % rounds == 0; use a multiple of "
                                  f"{dims.pp}.")
        num_stages = dims.pp * stages_per_rank
        if num_layers is not None and num_layers < num_stages and not getattr(layout, "stage_sleep", ""):
            raise ConfigError(f"the model has {num_layers} layers but the pipeline has {num_stages} stages "
                              f"(pp {dims.pp} x virtual_stages {stages_per_rank}); every stage needs a block. "
                              f"Use a deeper model (--model small: 8 layers, medium: 12) or fewer stages.")
        if batch_size is not None and (batch_size // dims.dp) % m:
            raise ConfigError(f"the per-replica batch ({batch_size} / dp {dims.dp} = {batch_size // dims.dp}) "
                              f"is not divisible by layout.microbatches = {m}; pick a batch size that is a "
                              f"multiple of dp * microbatches = {dims.dp * m}.")
    else:
        if stages_per_rank != 1 and layout.virtual_stages not in (None, 0, 1):
            warnings.warn("layout.virtual_stages has no effect without pipeline parallelism (pp = 1).",
                          stacklevel=2)
    if batch_size is not None and batch_size % dims.dp:
        raise ConfigError(f"the global batch ({batch_size}) is not divisible by layout.dp = {dims.dp}; use a "
                          f"multiple of {dims.dp}.")
    if dims.tp > 1 and num_heads is not None and num_heads % dims.tp:
        raise ConfigError(f"the model has {num_heads} attention heads, not divisible by layout.tp = {dims.tp}; "
                          f"use a tp degree that divides {num_heads}.")
    if layout.sequence_parallel:
        if dims.tp == 1:
            warnings.warn("layout.sequence_parallel has no effect without tensor parallelism (tp = 1).",
                          stacklevel=2)
        elif seq_len is not None and seq_len % dims.tp:
            raise ConfigError(f"sequence parallel splits the sequence ({seq_len} tokens) over tp = {dims.tp} "
                              f"ranks; use a sequence length that is a multiple of {dims.tp}.")
    if layout.zero >= 1 and dims.dp == 1:
        warnings.warn(f"layout.zero = {layout.zero} has no effect with dp = 1: there is nothing to shard over.",
                      stacklevel=2)
    if layout.zero == 1 and dims.tp > 1 and dims.dp > 1:
        raise ConfigError("layout.zero = 1 with tensor parallelism: ZeroRedundancyOptimizer cannot partition "
                          "DTensor parameters. Use --zero 2 or --zero 3 (FSDP2 on the dp axis) with --tp.")
    return dims


def virtual_stages(layout: Any) -> int:
    """Stages per pipeline rank: ``layout.virtual_stages`` if set (> 0), else 2 for the interleaved and
    V-shaped schedules and 1 otherwise."""
    value = getattr(layout, "virtual_stages", None)
    if value:
        return int(value)
    return 2 if layout.pp_schedule in ("interleaved-1f1b", "zbv") else 1


def loss_rank(layout: Any) -> int:
    """The global rank that reports the training loss: rank 0 without pipeline parallelism, else the first
    rank (dp 0, tp 0) of the pipeline rank that holds the last stage (``pp - 1``, or 0 for the V-shaped zbv).
    Its ``steps`` rows carry the loss; the launcher's progress bar and summary read them."""
    if layout.pp <= 1:
        return 0
    from dtprobe.schedule_sim import stage_ranks

    v = virtual_stages(layout)
    held = stage_ranks(layout.pp_schedule, num_ranks=layout.pp, virtual_stages=v)
    pp_rank = next(r for r, stages in enumerate(held) if layout.pp * v - 1 in stages)
    return pp_rank * layout.dp * layout.tp


def build_mesh(dims: ParallelDims, *, device_type: str,
               init_mesh: Callable[..., Any] | None = None) -> Any:
    """The DeviceMesh over the axes of degree > 1, or None for a single process.

    ``init_mesh`` is ``probe.init_device_mesh`` when the run is instrumented (its groups record collectives
    under the axis names); it defaults to ``torch.distributed.device_mesh.init_device_mesh``.
    """
    if not dims.axes:
        return None
    if init_mesh is None:
        from torch.distributed.device_mesh import init_device_mesh as init_mesh
    return init_mesh(device_type, dims.shape, mesh_dim_names=dims.axes)


def axis_mesh(mesh: Any, axis: str) -> Any:
    """The 1-D sub-mesh of ``axis`` or None when that axis has degree 1."""
    if mesh is None or axis not in (mesh.mesh_dim_names or ()):
        return None
    return mesh[axis]
