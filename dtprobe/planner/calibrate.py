"""Refit the planner's efficiencies from a measured run and compare prediction with measurement for its layout.

``calibrate(store) -> Calibration`` reads ``run.json`` (the ``dtprobe run`` job config), ``steps``,
``collectives`` and ``pipeline``; read by ``dtprobe plan --calibrate RUN`` and the dashboard's Planner page.

What is refit (all medians over the steps after ``warmup_steps``):

- achieved bandwidth and latency: a least-squares alpha-beta fit ``t = alpha * hops + bus_bytes / B`` over the
  collectives (each timed by its last arriver: the smallest enqueue-to-end time among the members);
- data-parallel overlap: 1 - exposed / total, where the exposed DP time of a step is the last DP collective
  (issued when backward ends) and the total is all of them, each timed by its last arriver;
- compute efficiency: the model's FLOPs per rank over the measured compute time (forward + backward minus TP
  collectives minus exposed DP time; with a pipeline, the busiest rank's summed F/B/I/W actions); time spent
  waiting for late ranks stays in compute (it is their compute variability);
- the pipeline hop time: the p2p latency with which the planner's pipeline model (schedule simulator)
  reproduces the measured pipeline span (send/recv latency, blocking sends, host work between actions);
- memory-bandwidth efficiency from the optimizer phase, and the data phase as fixed host overhead.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import pandas as pd

from dtprobe.planner.comm import BUS_FACTOR, HOPS
from dtprobe.planner.search import LAYOUT_COLUMNS
from dtprobe.planner.specs import GPU_PRESETS, ClusterSpec, DeviceSpec, ModelSpec, TrainingSpec, model_preset
from dtprobe.planner.step_time import Efficiency, evaluate
from dtprobe.runtime.layout import resolve_dp
from dtprobe.store.errors import ConfigError, TraceError

P2P_OPS = ("send", "recv")
NON_DP_GROUPS = ("tp", "pp", "ckpt")
NATURAL_VIRTUAL_STAGES = {"interleaved-1f1b": 2, "zbv": 2}
SMALL_BYTES = 64 * 1024
"""Messages below this are latency-bound: they fit alpha, not the bandwidth."""


@dataclass(kw_only=True, frozen=True)
class RunSetup:
    """What the run trained, on what, with which layout (from ``run.json``)."""

    model: ModelSpec
    cluster: ClusterSpec
    training: TrainingSpec
    layout: dict[str, Any]
    """LAYOUT_COLUMNS of the run."""


@dataclass(kw_only=True, frozen=True)
class Calibration:
    """Refit efficiencies and the predicted-vs-measured comparison for the run's own layout."""

    run_id: str
    setup: RunSetup
    """The run's model, cluster (device with the fitted latency) and layout."""
    efficiency: Efficiency
    """Refit efficiencies: pass to ``plan(..., efficiency=)``."""
    comparison: pd.DataFrame
    """Columns term, predicted_s, measured_s, error_frac (predicted / measured - 1); rows step_time_s,
    compute_s, tp_comm_s, dp_sync_s (exposed), pipeline_idle_s (bubble + p2p), optimizer_s, overhead_s."""
    num_steps: int
    """Steps measured (after the warm-up)."""
    notes: tuple[str, ...]
    """What could not be measured and was left at the preset."""

    @property
    def step_time_error_frac(self) -> float:
        """Predicted / measured step time - 1."""
        return float(self.comparison.iloc[0]["error_frac"])


def _get(config: dict, dotted: str, default: Any = ..., *, run: str) -> Any:
    node: Any = config
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            if default is not ...:
                return default
            raise TraceError(f"{run}/run.json: config.{dotted} is missing; --calibrate needs a run made by "
                             f"`dtprobe run` (its job config names model, layout and batch). Re-run with dtprobe run.")
        node = node[part]
    return node


def run_setup(manifest, *, device: DeviceSpec | None = None) -> RunSetup:
    """The run's model, cluster and layout from its manifest; ``device`` overrides the one the ranks report."""
    run = str(manifest.path)
    cfg = manifest.config or {}
    model = model_preset(_get(cfg, "model.name", run=run))
    tp, pp = int(_get(cfg, "layout.tp", 1, run=run)), int(_get(cfg, "layout.pp", 1, run=run))
    world = int(manifest.world_size)
    try:
        dp = resolve_dp(dp=int(_get(cfg, "layout.dp", -1, run=run)), tp=tp, pp=pp, world_size=world)
    except ConfigError as exc:
        raise TraceError(f"{run}/run.json: {exc}") from None
    batch = int(_get(cfg, "train.batch_size", run=run))
    accum = int(_get(cfg, "train.grad_accum", 1, run=run))
    if pp > 1:
        chunks = int(_get(cfg, "layout.microbatches", 0, run=run)) or 2 * pp
        micro_batch, m = batch // chunks, chunks * accum
        schedule = str(_get(cfg, "layout.pp_schedule", "1f1b", run=run))
        v = int(_get(cfg, "layout.virtual_stages", 0, run=run)) or NATURAL_VIRTUAL_STAGES.get(schedule, 1)
    else:
        micro_batch, m, schedule, v = batch, accum, "none", 1
    if device is None:
        kinds = {str(r.device).split(":")[0] for r in manifest.ranks} or {"cpu"}
        if kinds != {"cpu"}:
            raise ConfigError(f"{run}: the ranks ran on {sorted(kinds)}; name the device preset with --gpu "
                              f"({', '.join(GPU_PRESETS)})")
        device = GPU_PRESETS["cpu"]
    nnodes = max(int(manifest.nnodes or 1), 1)
    cluster = ClusterSpec(device=device, num_nodes=nnodes, gpus_per_node=world // nnodes)
    training = TrainingSpec(global_batch=batch * accum * dp, seq_len=int(_get(cfg, "train.seq_len", run=run)),
                            precision=str(_get(cfg, "precision.dtype", "fp32", run=run)),
                            sequence_parallel=bool(_get(cfg, "layout.sequence_parallel", False, run=run)))
    layout = dict(dp=dp, tp=tp, pp=pp, zero=int(_get(cfg, "layout.zero", 0, run=run)), micro_batch=micro_batch,
                  grad_accum=m, recompute=str(_get(cfg, "layout.activation_checkpointing", "none", run=run)),
                  schedule=schedule, virtual_stages=v)
    return RunSetup(model=model, cluster=cluster, training=training, layout=layout)


def _steady_steps(steps: pd.DataFrame, *, world: int, warmup_steps: int, run: str) -> pd.DataFrame:
    if steps.empty:
        raise TraceError(f"{run}: the steps table is empty; calibrate needs a run that trained some steps")
    complete = steps.groupby("step")["rank"].nunique()
    keep = complete[complete == world].index
    keep = keep[keep >= keep.min() + warmup_steps] if len(keep) > warmup_steps else keep[-1:]
    if len(keep) == 0:
        raise TraceError(f"{run}: no step was recorded by all {world} ranks; was the run cut short?")
    return steps[steps["step"].isin(keep)]


def _instances(coll: pd.DataFrame, steps: pd.DataFrame) -> pd.DataFrame:
    """One row per collective instance (step, pg, pg_ranks, seq) as its last arriver saw it: ``dur_ns`` = the
    smallest enqueue-to-end time among the members, ``in_fwd_bwd`` = issued inside the forward/backward phases."""
    c = coll[~coll["op"].isin(P2P_OPS)]
    if c.empty:
        return pd.DataFrame(columns=["step", "pg", "pg_ranks", "seq", "op", "n", "num_bytes", "enq_ns", "dur_ns",
                                     "in_fwd_bwd"])
    win = steps[["rank", "step", "start_ns", "data_ns", "fwd_ns", "bwd_ns"]].rename(columns={"start_ns": "step_ns"})
    c = c.merge(win, on=["rank", "step"], how="inner")
    lo = c["step_ns"] + c["data_ns"].fillna(0)
    hi = lo + c["fwd_ns"].fillna(0) + c["bwd_ns"].fillna(0)
    c = c.assign(dur_ns=c["end_ns"] - c["enqueue_ns"], in_fwd_bwd=(c["enqueue_ns"] >= lo) & (c["enqueue_ns"] <= hi))
    return c.groupby(["step", "pg", "pg_ranks", "seq"], observed=True).agg(
        op=("op", "first"), n=("pg_size", "first"), num_bytes=("num_bytes", "first"), enq_ns=("enqueue_ns", "max"),
        dur_ns=("dur_ns", "min"), in_fwd_bwd=("in_fwd_bwd", "all")).reset_index()


def _fit_alpha_beta(inst: pd.DataFrame) -> tuple[float, float | None] | None:
    """(alpha seconds, bandwidth bytes/s or None): least squares over the mean time of each (op, n, size);
    latency only when every message is under ``SMALL_BYTES``, bandwidth only when there is one large size."""
    c = inst[inst["op"].isin(list(BUS_FACTOR)) & (inst["num_bytes"] > 0) & (inst["n"] > 1)]
    if c.empty:
        return None
    g = c.groupby(["op", "n", "num_bytes"], observed=True)["dur_ns"].mean().reset_index()   # totals matter
    hops = np.array([HOPS[o](n) for o, n in zip(g["op"], g["n"])], dtype=float)
    bus = np.array([BUS_FACTOR[o](n) * b for o, n, b in zip(g["op"], g["n"], g["num_bytes"])], dtype=float)
    t = g["dur_ns"].to_numpy(dtype=float) / 1e9
    if bus.max() < SMALL_BYTES:        # only latency-bound messages: alpha only
        return float(np.median(t / hops)), None
    if len(g) == 1:                    # one large size: bandwidth only
        return 0.0, float(bus[0] / t[0])
    (alpha, inv_bw), *_ = np.linalg.lstsq(np.stack([hops, bus], axis=1), t, rcond=None)
    if alpha < 0 or inv_bw <= 0:
        big = bus >= SMALL_BYTES
        return 0.0, float(bus[big].sum() / t[big].sum())
    return float(alpha), float(1.0 / inv_bw)


def _fit_hop(row: pd.DataFrame, setup: RunSetup, cluster: ClusterSpec, eff: Efficiency, *, span_s: float) -> float:
    """Effective pipeline hop time: the p2p latency with which the planner's pipeline model (compute + bubble
    + p2p, from ``dtprobe.schedule_sim``) reproduces the measured pipeline span. It absorbs what a plain
    latency misses on gloo (sends that block until the receiver posts its recv, host work between actions).
    Bisection: the modelled span grows with the latency."""
    def span(hop: float) -> float:
        out = evaluate(row, model=setup.model, cluster=cluster, training=setup.training,
                       eff=replace(eff, p2p_latency_s=hop)).iloc[0]
        return float(out["compute_s"] + out["recompute_s"] + out["bubble_s"] + out["pp_p2p_s"])

    lo, hi = 0.0, span_s
    if span(lo) >= span_s:
        return 0.0
    for _ in range(30):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if span(mid) < span_s else (lo, mid)
    return (lo + hi) / 2


@dataclass(kw_only=True, frozen=True)
class Measured:
    """Medians over the steady steps of a run (seconds)."""

    step_s: float
    """Step time (per rank: end - start)."""
    compute_s: float
    """Forward + backward minus TP collectives minus exposed DP; with a pipeline the busiest rank's actions."""
    tp_s: float
    """TP collectives issued inside forward/backward (last arriver's times, summed per step)."""
    dp_exposed_s: float
    """The last DP collective of the step (issued when backward ends)."""
    dp_total_s: float
    """All DP collectives of the step."""
    optimizer_s: float
    """The optimizer phase."""
    data_s: float
    """The data phase."""
    pipeline_span_s: float | None
    """First action start to last action end of the pipeline (None without a pipeline table)."""
    fit: tuple[float, float | None] | None
    """(alpha, bandwidth) of the collectives, or None."""
    num_steps: int
    """Steps measured."""


def measure(store, setup: RunSetup, *, warmup_steps: int) -> tuple[Measured, list[str]]:
    """The measured terms of ``store``'s steady steps, and notes on what could not be measured."""
    run = str(store.path)
    steps = _steady_steps(store.table("steps"), world=setup.cluster.world_size, warmup_steps=warmup_steps, run=run)
    kept = set(steps["step"].unique())
    phases = steps.groupby("step")[["data_ns", "fwd_ns", "bwd_ns", "opt_ns"]].mean() / 1e9
    notes: list[str] = []
    coll = store.table("collectives")
    inst = _instances(coll[coll["step"].isin(kept)] if not coll.empty else coll, steps)
    fit = _fit_alpha_beta(inst)
    if fit is None:
        notes.append("no collectives recorded: bandwidth and latency left at the preset")
    elif fit[1] is None:
        notes.append(f"only messages under {SMALL_BYTES // 1024} KiB: bandwidth left at 0.8 of the preset")

    # per step, averaged over the groups of an axis; waiting for late ranks stays in compute
    fb = inst[inst["in_fwd_bwd"].astype(bool)]
    tp = fb[fb["pg"] == "tp"]
    zeros = pd.Series(0.0, index=phases.index)
    tp_s = (tp.groupby(["step", "pg_ranks"], observed=True)["dur_ns"].sum().groupby(level="step").mean() / 1e9
            if not tp.empty else zeros)
    dp = fb[~fb["pg"].isin(NON_DP_GROUPS)]
    exp_dp_s = tot_dp_s = zeros
    if not dp.empty:
        last = dp.sort_values("enq_ns").groupby(["step", "pg", "pg_ranks"], observed=True).tail(1)
        exp_dp_s = last.groupby("step")["dur_ns"].mean() / 1e9
        tot_dp_s = dp.groupby(["step", "pg", "pg_ranks"], observed=True)["dur_ns"].sum().groupby(
            level="step").mean() / 1e9
    elif setup.layout["dp"] > 1:
        notes.append("no data-parallel collectives: overlap left at 0.8")

    span_s = None
    pipe = store.table("pipeline") if setup.layout["pp"] > 1 else pd.DataFrame()
    pipe = pipe[pipe["step"].isin(kept)] if not pipe.empty else pipe
    if not pipe.empty:
        span_s = float((pipe.groupby("step")["end_ns"].max() - pipe.groupby("step")["start_ns"].min()).median()
                       / 1e9)
        busy = (pipe["end_ns"] - pipe["start_ns"]).groupby([pipe["step"], pipe["rank"]]).sum() / 1e9
        busiest = busy.groupby(level="step").max()
        compute = float((busiest - tp_s.reindex(busiest.index, fill_value=0.0)).median())
    else:
        if setup.layout["pp"] > 1:
            notes.append("no pipeline table: compute taken from the fwd/bwd phases, which include the bubble")
        fwd_bwd = phases["fwd_ns"] + phases["bwd_ns"]
        compute = float((fwd_bwd - tp_s.reindex(fwd_bwd.index, fill_value=0.0)
                         - exp_dp_s.reindex(fwd_bwd.index, fill_value=0.0)).median())
    if not compute > 0:
        raise TraceError(f"{run}: measured compute time is {compute:.3g} s after removing communication; the "
                         f"steps/collectives tables disagree (clock or phase timing problem)")
    measured = Measured(step_s=float(((steps["end_ns"] - steps["start_ns"]) / 1e9).median()), compute_s=compute,
                        tp_s=float(tp_s.median()), dp_exposed_s=float(exp_dp_s.median()),
                        dp_total_s=float(tot_dp_s.median()), optimizer_s=float(phases["opt_ns"].median()),
                        data_s=float(phases["data_ns"].median()), pipeline_span_s=span_s, fit=fit,
                        num_steps=len(kept))
    return measured, notes


def calibrate(store, *, device: DeviceSpec | None = None, warmup_steps: int = 3) -> Calibration:
    """Refit efficiencies from ``store`` (a ``dtprobe.store.RunStore``) and compare for the run's layout."""
    setup = run_setup(store.manifest, device=device)
    got, notes = measure(store, setup, warmup_steps=warmup_steps)
    dev = setup.cluster.device
    bw_eff = 0.8 if got.fit is None or got.fit[1] is None else got.fit[1] / dev.intra_bw_bytes_per_s
    if got.fit is not None:
        dev = replace(dev, intra_latency_s=got.fit[0])
    cluster = replace(setup.cluster, device=dev)

    # the model at efficiency 1 gives the ideal times; measured / ideal = 1 / efficiency
    row = pd.DataFrame([setup.layout])[LAYOUT_COLUMNS]
    ideal = evaluate(row, model=setup.model, cluster=cluster, training=setup.training,
                     eff=Efficiency(compute=1.0, bw_intra=bw_eff, bw_inter=bw_eff, dp_overlap=0.0,
                                    memory_bw=1.0)).iloc[0]
    overlap = float(np.clip(1 - got.dp_exposed_s / got.dp_total_s, 0, 1)) if got.dp_total_s > 0 else 0.8
    mem_eff = ideal["optimizer_s"] / got.optimizer_s if got.optimizer_s > 0 else 0.7
    eff = Efficiency(compute=float((ideal["compute_s"] + ideal["recompute_s"]) / got.compute_s), bw_intra=bw_eff,
                     bw_inter=bw_eff if cluster.num_nodes > 1 else 0.8, dp_overlap=overlap,
                     memory_bw=float(max(mem_eff, 1e-6)), overhead_s=got.data_s)
    if got.pipeline_span_s is not None:
        eff = replace(eff, p2p_latency_s=_fit_hop(row, setup, cluster, eff, span_s=got.pipeline_span_s))
    pred = evaluate(row, model=setup.model, cluster=cluster, training=setup.training, eff=eff).iloc[0]

    pipeline_idle = (max(got.step_s - got.compute_s - got.optimizer_s - got.data_s, 0.0)
                     if setup.layout["pp"] > 1 else None)
    terms = [
        ("step_time_s", pred["step_time_s"], got.step_s),
        ("compute_s", pred["compute_s"] + pred["recompute_s"], got.compute_s),
        ("tp_comm_s", pred["tp_comm_s"], got.tp_s),
        ("dp_sync_s", pred["dp_sync_s"] + pred["zero3_gather_s"], got.dp_exposed_s),
        ("pipeline_idle_s", pred["bubble_s"] + pred["pp_p2p_s"], pipeline_idle),   # bubble + p2p
        ("optimizer_s", pred["optimizer_s"], got.optimizer_s),
        ("overhead_s", pred["overhead_s"], got.data_s),
    ]
    comparison = pd.DataFrame(terms, columns=["term", "predicted_s", "measured_s"]).astype(
        {"predicted_s": float, "measured_s": float})
    comparison["error_frac"] = comparison["predicted_s"] / comparison["measured_s"].where(
        comparison["measured_s"] > 0) - 1
    return Calibration(run_id=store.manifest.run_id, setup=replace(setup, cluster=cluster), efficiency=eff,
                       comparison=comparison, num_steps=got.num_steps, notes=tuple(notes))
