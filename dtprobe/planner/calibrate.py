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
- the pipeline hop time: median time from a stage's output to the next stage's start on another rank
  (send/recv latency, blocking sends and the schedule's host work between actions), simulated as p2p latency;
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
    """Columns term, predicted_s, measured_s, error_frac (predicted / measured - 1); first row step_time_s."""
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
    dp = int(_get(cfg, "layout.dp", -1, run=run))
    dp = world // (tp * pp) if dp == -1 else dp
    if dp * tp * pp != world:
        raise TraceError(f"{run}/run.json: layout dp{dp} x tp{tp} x pp{pp} != world_size {world}")
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
    """(alpha seconds, bandwidth bytes/s or None): least squares over the median time of each (op, n, size);
    latency only when every message is under ``SMALL_BYTES``, bandwidth only when there is one large size."""
    c = inst[inst["op"].isin(list(BUS_FACTOR)) & (inst["num_bytes"] > 0) & (inst["n"] > 1)]
    if c.empty:
        return None
    g = c.groupby(["op", "n", "num_bytes"], observed=True)["dur_ns"].median().reset_index()
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


def _pipeline_hop_s(pipe: pd.DataFrame) -> float | None:
    """Effective hop time: median time from a stage's output being ready (producer's F, or B/I, end) to the
    consumer's start on another rank, over every hop. It includes what a plain latency misses (a send that
    blocks until the receiver posts its recv, the schedule's own host work between actions)."""
    p = pipe[["rank", "step", "stage", "microbatch", "action", "start_ns", "end_ns"]].copy()
    p["kind"] = p["action"].replace({"I": "B"})
    p = p[p["kind"].isin(["F", "B"])].sort_values(["rank", "step", "start_ns"])
    ends = p.set_index(["step", "stage", "microbatch", "kind"])[["end_ns", "rank"]]
    src_stage = np.where(p["kind"] == "F", p["stage"] - 1, p["stage"] + 1)
    key = pd.MultiIndex.from_arrays([p["step"], src_stage, p["microbatch"], p["kind"]])
    src = ends.reindex(key)
    gap = p["start_ns"].to_numpy() - src["end_ns"].to_numpy()
    hops = (src["rank"].to_numpy() != p["rank"].to_numpy()) & ~np.isnan(gap.astype(float)) & (gap >= 0)
    return float(np.median(gap[hops].astype(float))) / 1e9 if hops.any() else None


def calibrate(store, *, device: DeviceSpec | None = None, warmup_steps: int = 3) -> Calibration:
    """Refit efficiencies from ``store`` (a ``dtprobe.store.RunStore``) and compare for the run's layout."""
    manifest = store.manifest
    run = str(store.path)
    setup = run_setup(manifest, device=device)
    world = setup.cluster.world_size
    steps = _steady_steps(store.table("steps"), world=world, warmup_steps=warmup_steps, run=run)
    kept = set(steps["step"].unique())
    measured_step = float(((steps["end_ns"] - steps["start_ns"]) / 1e9).median())
    phases = steps.groupby("step")[["data_ns", "fwd_ns", "bwd_ns", "opt_ns"]].mean() / 1e9
    notes: list[str] = []
    hop_s = None

    coll = store.table("collectives")
    inst = _instances(coll[coll["step"].isin(kept)], steps) if not coll.empty else _instances(coll, steps)
    dev = setup.cluster.device
    fit = _fit_alpha_beta(inst)
    bw_eff = 0.8 if fit is None or fit[1] is None else fit[1] / dev.intra_bw_bytes_per_s
    if fit is None:
        notes.append("no collectives recorded: bandwidth and latency left at the preset")
    else:
        dev = replace(dev, intra_latency_s=fit[0])
        if fit[1] is None:
            notes.append(f"only messages under {SMALL_BYTES // 1024} KiB: bandwidth left at 0.8 of the preset")
    cluster = replace(setup.cluster, device=dev)

    # per step, averaged over the groups of an axis: TP time inside forward/backward, and the DP tail (the last
    # DP collective, issued when backward ends) and total; waiting for late ranks stays in compute
    fb = inst[inst["in_fwd_bwd"]]
    tp = fb[fb["pg"] == "tp"]
    tp_s = (tp.groupby(["step", "pg_ranks"], observed=True)["dur_ns"].sum().groupby(level="step").mean() / 1e9
            if not tp.empty else pd.Series(0.0, index=phases.index))
    dp = fb[~fb["pg"].isin(NON_DP_GROUPS)]
    if not dp.empty:
        last = dp.sort_values("enq_ns").groupby(["step", "pg", "pg_ranks"], observed=True).tail(1)
        exp_dp_s = last.groupby("step")["dur_ns"].mean() / 1e9
        tot_dp_s = dp.groupby(["step", "pg", "pg_ranks"], observed=True)["dur_ns"].sum().groupby(
            level="step").mean() / 1e9
    else:
        exp_dp_s = tot_dp_s = pd.Series(0.0, index=phases.index)
    pipe = store.table("pipeline") if setup.layout["pp"] > 1 else pd.DataFrame()
    pipe = pipe[pipe["step"].isin(kept)] if not pipe.empty else pipe
    if setup.layout["pp"] > 1 and not pipe.empty:
        hop_s = _pipeline_hop_s(pipe)
        busy = ((pipe["end_ns"] - pipe["start_ns"]).groupby([pipe["step"], pipe["rank"]]).sum() / 1e9)
        busiest = busy.groupby(level="step").max()
        compute = float((busiest - tp_s.reindex(busiest.index, fill_value=0.0)).median())
    else:
        if setup.layout["pp"] > 1:
            notes.append("no pipeline table: compute taken from the fwd/bwd phases, which include the bubble")
        fb = phases["fwd_ns"] + phases["bwd_ns"]
        compute = float((fb - tp_s.reindex(fb.index, fill_value=0.0)
                         - exp_dp_s.reindex(fb.index, fill_value=0.0)).median())
    if not compute > 0:
        raise TraceError(f"{run}: measured compute time is {compute:.3g} s after removing communication; the "
                         f"steps/collectives tables disagree (clock or phase timing problem)")

    # the model at efficiency 1 gives the ideal times; measured / ideal = 1 / efficiency
    row = pd.DataFrame([setup.layout])[LAYOUT_COLUMNS]
    ideal = evaluate(row, model=setup.model, cluster=cluster, training=setup.training,
                     eff=Efficiency(compute=1.0, bw_intra=bw_eff, bw_inter=bw_eff, dp_overlap=0.0,
                                    memory_bw=1.0)).iloc[0]
    compute_eff = (ideal["compute_s"] + ideal["recompute_s"]) / compute
    dp_total = float(tot_dp_s.median()) if len(tot_dp_s) else 0.0
    dp_exposed = float(exp_dp_s.median()) if len(exp_dp_s) else 0.0
    overlap = float(np.clip(1 - dp_exposed / dp_total, 0, 1)) if dp_total > 0 else 0.8
    if dp_total <= 0 and setup.layout["dp"] > 1:
        notes.append("no data-parallel collectives: overlap left at 0.8")
    opt_measured = float(phases["opt_ns"].median())
    mem_eff = ideal["optimizer_s"] / opt_measured if opt_measured > 0 else 0.7
    eff = Efficiency(compute=float(compute_eff), bw_intra=bw_eff, bw_inter=bw_eff if cluster.num_nodes > 1 else 0.8,
                     dp_overlap=overlap, memory_bw=float(max(mem_eff, 1e-6)),
                     overhead_s=float(phases["data_ns"].median()), p2p_latency_s=hop_s)
    pred = evaluate(row, model=setup.model, cluster=cluster, training=setup.training, eff=eff).iloc[0]

    measured_bubble = None
    if setup.layout["pp"] > 1:
        measured_bubble = max(measured_step - compute - float(phases["opt_ns"].median())
                              - float(phases["data_ns"].median()), 0.0)
    terms = [
        ("step_time_s", pred["step_time_s"], measured_step),
        ("compute_s", pred["compute_s"] + pred["recompute_s"], compute),
        ("tp_comm_s", pred["tp_comm_s"], float(tp_s.median()) if len(tp_s) else 0.0),
        ("dp_sync_s", pred["dp_sync_s"] + pred["zero3_gather_s"], dp_exposed),
        ("bubble_s", pred["bubble_s"] + pred["pp_p2p_s"], measured_bubble),
        ("optimizer_s", pred["optimizer_s"], opt_measured),
        ("overhead_s", pred["overhead_s"], float(phases["data_ns"].median())),
    ]
    comparison = pd.DataFrame(terms, columns=["term", "predicted_s", "measured_s"]).astype(
        {"predicted_s": float, "measured_s": float})
    comparison["error_frac"] = comparison["predicted_s"] / comparison["measured_s"].where(
        comparison["measured_s"] > 0) - 1
    setup = replace(setup, cluster=cluster)
    return Calibration(run_id=manifest.run_id, setup=setup, efficiency=eff, comparison=comparison,
                       num_steps=len(kept), notes=tuple(notes))
