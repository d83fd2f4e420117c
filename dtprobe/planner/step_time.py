"""Memory per GPU and predicted step time of candidate layouts (vectorised over a DataFrame); read by the search.

Per optimizer step, on the busiest pipeline rank (seconds):

- ``compute_s``: m micro-batches x 3 x forward FLOPs / (tp pp) / (peak[precision] x compute_efficiency);
  forward FLOPs per token = 2 x weight matmuls + 4 s h per layer (attention scores).
- ``recompute_s``: the re-run forward: all of it (full) or the attention scores (selective).
- ``tp_comm_s``: per layer and micro-batch, two all-reduces (or all-gather + reduce-scatter with SP) of
  ``s b h`` activations in forward and two in backward (four with separate q/k/v linears; two more with full
  recompute); not overlapped.
- ``dp_sync_s``: the gradient all-reduce (ZeRO-0), reduce-scatter once (ZeRO-1) or per micro-batch
  (ZeRO-2/3, which keep only a gradient shard), exposed part = max(t (1 - overlap), t - one micro-batch's
  backward); plus the post-step all-gather of updated weight shards (ZeRO-1/2), not overlapped.
- ``zero3_gather_s``: ZeRO-3 weight all-gathers in forward and backward, exposed the same way.
- ``pp_p2p_s``: what the point-to-point transfers (alpha + activation bytes / bandwidth per hop, or the
  calibrated hop time) add to the simulated pipeline makespan.
- ``bubble_s``: the pipeline idle time from ``dtprobe.schedule_sim`` (``planner.pipeline``).
- ``optimizer_s``: the optimizer step reading/writing its local state at memory bandwidth.
- ``overhead_s``: host time per step (data loading; 0 unless calibrated).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd

from dtprobe.planner.comm import collective_time, link
from dtprobe.planner.memory import RECOMPUTE, activation_bytes_per_layer, logits_bytes, state_bytes
from dtprobe.planner.pipeline import pipeline_shape
from dtprobe.planner.specs import GIB, ClusterSpec, ModelSpec, TrainingSpec
from dtprobe.store.errors import ConfigError

TIME_COLUMNS = ("compute_s", "recompute_s", "tp_comm_s", "dp_sync_s", "zero3_gather_s", "pp_p2p_s", "bubble_s",
                "optimizer_s", "overhead_s")
"""Step-time breakdown columns; ``step_time_s`` is their sum."""
MEMORY_COLUMNS = ("weights_gib", "grads_gib", "optimizer_gib", "activations_gib", "logits_gib",
                  "zero3_buffer_gib", "total_gib", "usable_gib")
"""Memory columns (per GPU, worst pipeline rank)."""


@dataclass(kw_only=True, frozen=True)
class Efficiency:
    """Achieved fractions of the peaks; defaults are typical of large-model training, `--calibrate` refits."""

    compute: float = 0.5
    """Achieved share of the dense peak FLOP/s in forward/backward (model FLOPs utilisation of the kernels)."""
    bw_intra: float = 0.8
    """Achieved share of the intra-node link bandwidth (bus bandwidth / link peak)."""
    bw_inter: float = 0.8
    """Achieved share of the per-GPU network bandwidth."""
    dp_overlap: float = 0.8
    """Share of data-parallel communication hidden behind backward compute."""
    memory_bw: float = 0.7
    """Achieved share of memory bandwidth in the optimizer step."""
    overhead_s: float = 0.0
    """Fixed host time per step (data loading, launch); measured by calibration."""
    p2p_latency_s: float | None = None
    """Measured time of one pipeline hop (send to the next stage's start); None = alpha + bytes / bandwidth."""

    def __post_init__(self) -> None:
        for key in ("compute", "bw_intra", "bw_inter", "memory_bw"):   # > 1: the declared peak is too low
            if not getattr(self, key) > 0:
                raise ConfigError(f"efficiency.{key} = {getattr(self, key)} must be > 0")
        if not 0 <= self.dp_overlap <= 1:
            raise ConfigError(f"efficiency.dp_overlap = {self.dp_overlap} must be in [0, 1]")


def _exposed(t, window, overlap):
    """Communication left visible when ``overlap`` of it may hide behind ``window`` seconds of compute."""
    return np.maximum(t * (1 - overlap), t - window)


def evaluate(cands: pd.DataFrame, *, model: ModelSpec, cluster: ClusterSpec, training: TrainingSpec,
             eff: Efficiency, keep_all_times: bool = True) -> pd.DataFrame:
    """Add memory (``*_gib``), ``fits``, the time breakdown (``*_s``) and ``step_time_s`` to candidate rows.

    With ``keep_all_times=False`` (the search) the p2p term is only simulated for layouts that fit.

    ``cands`` columns: dp, tp, pp, zero, micro_batch, grad_accum, recompute, schedule, virtual_stages.
    """
    dev = cluster.device
    s, h, L, V = training.seq_len, model.hidden, model.num_layers, model.vocab_size
    dp, tp, pp = (cands[c].to_numpy(dtype=float) for c in ("dp", "tp", "pp"))
    zero, mb, m, v = (cands[c].to_numpy(dtype=float) for c in ("zero", "micro_batch", "grad_accum",
                                                                  "virtual_stages"))
    rec = cands["recompute"].map(RECOMPUTE.index).to_numpy()
    sp = training.sequence_parallel & (tp > 1)
    act_b = training.activation_bytes

    # pipeline shape (cached simulation per distinct schedule / p / m / v / ratio)
    fwd_flops_tok = model.matmul_flops_per_token(s)
    layer_fwd_tok = 2.0 * (model.params_per_layer - 2 * h) + 4.0 * s * h
    sel_frac = 4.0 * s * h * L / fwd_flops_tok            # attention scores' share of the forward
    rec_frac = np.where(rec == 2, L * layer_fwd_tok / fwd_flops_tok, np.where(rec == 1, sel_frac, 0.0))

    peak = dev.peak(training.precision) * eff.compute
    f_mb = mb * s * fwd_flops_tok / (tp * pp) / peak          # forward of one micro-batch on one rank

    # TP: all-reduces (or all-gather + reduce-scatter with SP) of s*b*h activations, per layer and pass
    tp_bw, tp_lat = link(span=tp, gpus_per_node=cluster.gpus_per_node, intra_bw=dev.intra_bw_bytes_per_s,
                         inter_bw=dev.inter_bw_bytes_per_s, intra_latency=dev.intra_latency_s,
                         inter_latency=dev.inter_latency_s, bw_eff=np.where(tp <= cluster.gpus_per_node,
                                                                            eff.bw_intra, eff.bw_inter))
    t_ar = collective_time("allreduce", num_bytes=s * mb * h * act_b, n=tp, bw=tp_bw, latency=tp_lat)
    tp_f_mb = 2 * t_ar * L / pp                    # attention + MLP, forward
    bwd_ars = 2 if model.fused_qkv else 4         # separate q/k/v linears each all-reduce their input gradient
    tp_b_mb = t_ar * L / pp * (bwd_ars + np.where(rec == 2, 2, 0))   # backward (+ the re-run forward)

    fm = f_mb + tp_f_mb
    bm = 2 * f_mb + rec_frac * f_mb + tp_b_mb
    ratio = np.round(bm / np.maximum(fm, 1e-30) * 4) / 4
    # pipeline point-to-point: one activation (or its gradient) per hop, on the critical path as simulated
    pp_bw, pp_lat = link(span=tp * dp * pp, gpus_per_node=cluster.gpus_per_node, intra_bw=dev.intra_bw_bytes_per_s,
                         inter_bw=dev.inter_bw_bytes_per_s, intra_latency=dev.intra_latency_s,
                         inter_latency=dev.inter_latency_s,
                         bw_eff=np.where(tp * dp * pp <= cluster.gpus_per_node, eff.bw_intra, eff.bw_inter))
    hop = collective_time("send", num_bytes=s * mb * h * act_b / np.where(sp, tp, 1), n=pp, bw=pp_bw, latency=pp_lat)
    if eff.p2p_latency_s is not None:
        hop = np.full(len(cands), eff.p2p_latency_s)
    lat_ratio = hop / np.maximum(fm / v, 1e-30)
    shapes = {}
    p2p_units = np.zeros(len(cands))
    idle_units = np.zeros(len(cands))
    infl_first = np.ones(len(cands))
    infl_last = np.ones(len(cands))
    last_is_first = pp == 1
    schedules = cands["schedule"].to_numpy()
    for i in np.flatnonzero(pp > 1):
        key = (schedules[i], int(pp[i]), int(m[i]), int(v[i]), float(ratio[i]))
        shape = shapes.get(key)
        if shape is None:
            shape = shapes[key] = pipeline_shape(*key)
        idle_units[i] = shape.idle_per_chunk_f
        infl_first[i] = shape.inflight_first
        infl_last[i] = shape.inflight_last
        last_is_first[i] = shape.last_rank == 0
    bubble = idle_units * fm / v

    # memory on the first and on the last pipeline rank; report the larger
    layers_rank = L / pp
    body = layers_rank * model.params_per_layer
    p_first = (body + model.embedding_params + np.where(last_is_first, model.head_params, 0)) / tp
    p_last = (body + model.head_params + np.where(pp == 1, model.embedding_params, 0)) / tp
    act_layer = activation_bytes_per_layer(s=s, b=mb, h=h, a=model.num_heads, t=tp, f=model.ffn_hidden,
                                           kv_heads=model.kv_heads, gated_mlp=model.gated_mlp, sp=sp,
                                           recompute=rec, bytes_per_value=act_b)
    layers_chunk = L / (pp * v)
    logits = logits_bytes(s=s, b=mb, vocab=V, t=tp, bytes_per_value=act_b)
    z3_buf = np.where(zero >= 3, 2 * model.params_per_layer / tp * training.param_bytes, 0.0)

    def rank_memory(params, inflight, holds_last):
        w, g, o = state_bytes(params=params, dp=dp, zero=zero, param_bytes=training.param_bytes,
                              grad_bytes=training.grad_bytes, optimizer_bytes=training.optimizer_bytes)
        act = inflight * layers_chunk * act_layer
        lg = np.where(holds_last, logits, 0.0)
        return np.stack([w, g, o, act, lg, z3_buf])

    first = rank_memory(p_first, infl_first, last_is_first)
    last = rank_memory(p_last, infl_last, np.ones(len(cands), dtype=bool))
    worst = np.where(last.sum(axis=0) > first.sum(axis=0), last, first)
    out = cands.copy()
    for name, row in zip(MEMORY_COLUMNS[:6], worst):
        out[name] = row / GIB
    out["total_gib"] = worst.sum(axis=0) / GIB
    out["usable_gib"] = dev.memory_gib * (1 - training.memory_margin_frac)
    out["fits"] = out["total_gib"] <= out["usable_gib"]
    fits = out["fits"].to_numpy()
    for i in np.flatnonzero((pp > 1) & (fits | keep_all_times)):   # p2p latency: only where the time matters
        p2p_units[i] = pipeline_shape(schedules[i], int(pp[i]), int(m[i]), int(v[i]), float(ratio[i]),
                                      float(lat_ratio[i])).p2p_per_chunk_f

    # data parallel sync and ZeRO traffic (worst stage's local parameters)
    p_local = np.maximum(p_first, p_last)
    dp_span = tp * dp
    dp_bw, dp_lat = link(span=dp_span, gpus_per_node=cluster.gpus_per_node, intra_bw=dev.intra_bw_bytes_per_s,
                         inter_bw=dev.inter_bw_bytes_per_s, intra_latency=dev.intra_latency_s,
                         inter_latency=dev.inter_latency_s,
                         bw_eff=np.where(dp_span <= cluster.gpus_per_node, eff.bw_intra, eff.bw_inter))
    grad_bytes = p_local * training.grad_bytes
    weight_bytes = p_local * training.param_bytes
    ar = collective_time("allreduce", num_bytes=grad_bytes, n=dp, bw=dp_bw, latency=dp_lat)
    rs = collective_time("reduce_scatter", num_bytes=grad_bytes, n=dp, bw=dp_bw, latency=dp_lat)
    ag = collective_time("allgather", num_bytes=weight_bytes, n=dp, bw=dp_bw, latency=dp_lat)
    bwd_window = 2 * f_mb
    sync = np.where(zero == 0, _exposed(ar, bwd_window, eff.dp_overlap),
                    np.where(zero == 1, 1, m) * _exposed(rs, bwd_window, eff.dp_overlap))
    sync = sync + np.where((zero == 1) | (zero == 2), ag, 0.0)   # updated weight shards gathered after the step
    gathers = np.where(zero >= 3, m * (_exposed(ag, f_mb, eff.dp_overlap) + _exposed(ag, bwd_window, eff.dp_overlap)
                                       ), 0.0)

    opt_params = p_local / np.where(zero >= 1, dp, 1)
    opt_bytes = opt_params * (2 * training.optimizer_bytes + training.grad_bytes + training.param_bytes)

    out["compute_s"] = m * 3 * f_mb
    out["recompute_s"] = m * rec_frac * f_mb
    out["tp_comm_s"] = m * (tp_f_mb + tp_b_mb)
    out["dp_sync_s"] = sync
    out["zero3_gather_s"] = gathers
    out["pp_p2p_s"] = p2p_units * fm / v
    out["bubble_s"] = bubble
    out["optimizer_s"] = opt_bytes / (dev.mem_bw_bytes_per_s * eff.memory_bw)
    out["overhead_s"] = eff.overhead_s
    out["step_time_s"] = out[list(TIME_COLUMNS)].sum(axis=1)
    tokens = training.global_batch * s
    out["tokens_per_s"] = tokens / out["step_time_s"]
    out["mfu_frac"] = tokens * 3 * fwd_flops_tok / (out["step_time_s"] * cluster.world_size
                                                     * dev.peak(training.precision))
    return out
