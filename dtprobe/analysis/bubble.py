"""Measured pipeline bubble per rank/stage vs the schedule's ideal, and the PIPELINE_BUBBLE detector.

The bubble of a rank in a step is the idle share of the step's pipeline window (first action start to last
action end over all pipeline ranks) not covered by its F/B/I/W actions (``dtprobe.intervals.bubble_frac``, the
one definition, shared with ``dtprobe.runtime.parallel.bubble``). The ideal comes from
``dtprobe.schedule_sim.simulate`` fed with the measured mean action costs per stage (so stage imbalance is
part of the ideal, p2p latency and contention are not); doubling the micro-batches (same global batch, half
the cost per micro-batch) gives the predicted gain.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np
import pandas as pd

from dtprobe.analysis.clocks import HOST
from dtprobe.analysis.findings import Finding, PredictedGain
from dtprobe.intervals import bubble_frac
from dtprobe.store.columns import require_columns

BUBBLE_COLUMNS = ["rank", "stages", "step", "window_ns", "busy_ns", "bubble_frac", "num_microbatches"]
BY_RANK_COLUMNS = ["rank", "stages", "num_steps", "bubble_frac", "busy_ns", "window_ns"]

_SCHEDULE_ALIASES = {
    "gpipe": "gpipe", "schedulegpipe": "gpipe", "1f1b": "1f1b", "schedule1f1b": "1f1b",
    "interleaved1f1b": "interleaved-1f1b", "scheduleinterleaved1f1b": "interleaved-1f1b",
    "zerobubble": "zero-bubble", "interleavedzerobubble": "zero-bubble", "scheduleinterleavedzerobubble": "zero-bubble",
    "zbv": "zbv", "zbvzerobubble": "zbv", "schedulezbvzerobubble": "zbv",
}


def normalize_schedule(name: str | None) -> str | None:
    """Map a schedule name as configured (``GPipe``, ``Interleaved1F1B``, ``zero-bubble`` ...) to the
    simulator's name, or None if unknown."""
    if not name:
        return None
    return _SCHEDULE_ALIASES.get(re.sub(r"[^a-z0-9]", "", str(name).lower()))


def pipeline_bubble(pipeline: pd.DataFrame) -> pd.DataFrame:
    """Per (rank, step): pipeline window, busy time (union of its actions), bubble fraction, micro-batches seen.
    Columns: ``BUBBLE_COLUMNS``."""
    require_columns(pipeline, ["rank", "stage", "step", "microbatch", "action", "start_ns", "end_ns"],
                    table="pipeline")
    p = pipeline.dropna(subset=["start_ns", "end_ns", "step"])
    if p.empty:
        return pd.DataFrame({col: [] for col in BUBBLE_COLUMNS})
    window = p.groupby("step").agg(a=("start_ns", "min"), b=("end_ns", "max"))
    rows = []
    for (rank, step), grp in p.groupby(["rank", "step"], sort=True):
        a, b = window.loc[step, "a"], window.loc[step, "b"]
        busy, frac = bubble_frac(grp["start_ns"].astype("int64").to_numpy(), grp["end_ns"].astype("int64").to_numpy(),
                                 window_ns=int(b - a))
        rows.append({"rank": int(rank), "stages": ",".join(str(int(s)) for s in sorted(grp["stage"].unique())),
                     "step": int(step), "window_ns": int(b - a), "busy_ns": busy, "bubble_frac": frac,
                     "num_microbatches": int(grp["microbatch"].nunique())})
    return pd.DataFrame(rows)[BUBBLE_COLUMNS]


def bubble_by_rank(bubble: pd.DataFrame, *, step_ids: list[int] | None = None) -> pd.DataFrame:
    """Mean bubble per rank over ``step_ids`` (all when None). Columns: ``BY_RANK_COLUMNS``."""
    require_columns(bubble, BUBBLE_COLUMNS, table="pipeline_bubble")
    b = bubble if step_ids is None or not set(step_ids) & set(bubble["step"]) else bubble[bubble["step"].isin(step_ids)]
    if b.empty:
        return pd.DataFrame({col: [] for col in BY_RANK_COLUMNS})
    out = b.groupby(["rank", "stages"]).agg(num_steps=("step", "nunique"), bubble_frac=("bubble_frac", "mean"),
                                            busy_ns=("busy_ns", "mean"), window_ns=("window_ns", "mean"))
    return out.reset_index()[BY_RANK_COLUMNS]


@dataclass(frozen=True, kw_only=True)
class PipelineShape:
    """What the schedule simulator needs, read from the pipeline table (and the config for the schedule name)."""

    schedule: str
    """Simulator schedule name."""
    schedule_source: str
    """``config`` when the run's config named it, else ``inferred`` (from the action order)."""
    num_ranks: int
    """Pipeline ranks p (stages / virtual stages)."""
    num_stages: int
    """Global stages."""
    virtual_stages: int
    """Stages per rank v."""
    num_microbatches: int
    """Micro-batches per step m."""
    costs: dict
    """(stage, action) -> mean measured duration (ns)."""


def pipeline_shape(pipeline: pd.DataFrame, *, schedule: str | None = None) -> PipelineShape | None:
    """Infer p, v, m and the mean action costs from the pipeline table; None without pipeline rows."""
    p = pipeline.dropna(subset=["start_ns", "end_ns", "stage"])
    if p.empty:
        return None
    stages = sorted(int(s) for s in p["stage"].unique())
    ranks_per_pipeline = p.groupby("stage")["rank"].nunique().max()  # dp replicas of one stage
    per_rank = p.groupby("rank")["stage"].nunique().max()
    v = int(per_rank)
    n_stages = len(stages)
    num_ranks = max(1, n_stages // v)
    m = int(p.groupby(["rank", "step"])["microbatch"].nunique().max())
    dur = (p["end_ns"] - p["start_ns"]).astype("float64")
    costs = {(int(s), str(a)): float(c) for (s, a), c in dur.groupby([p["stage"], p["action"]]).mean().items()}
    name = normalize_schedule(schedule)
    source = "config"
    if name is None:
        source = "inferred"
        actions = set(p["action"].astype(str))
        if {"I", "W"} & actions:
            name = "zbv" if v == 2 and _is_v_shape(p, num_ranks) else "zero-bubble"
        elif v > 1:
            name = "interleaved-1f1b"
        else:
            name = _gpipe_or_1f1b(p)
    del ranks_per_pipeline
    return PipelineShape(schedule=name, schedule_source=source, num_ranks=num_ranks, num_stages=n_stages,
                         virtual_stages=v, num_microbatches=m, costs=costs)


def _is_v_shape(p: pd.DataFrame, num_ranks: int) -> bool:
    held = p.groupby("rank")["stage"].apply(lambda s: tuple(sorted(int(x) for x in s.unique())))
    return all(len(st) == 2 and st[0] + st[1] == 2 * num_ranks - 1 for st in held)


def _gpipe_or_1f1b(p: pd.DataFrame) -> str:
    """From the action order of one rank of the first stage in its last whole step (as many backwards as
    forwards): GPipe runs every forward before the first backward. A step cut short (a run stopped after its
    forwards) would read as GPipe."""
    first = p[p["stage"] == p["stage"].min()]
    first = first[first["rank"] == first["rank"].min()]
    action = first["action"].astype(str)
    forwards = (action == "F").groupby(first["step"]).sum()
    backwards = (action == "B").groupby(first["step"]).sum().reindex(forwards.index, fill_value=0)
    whole = forwards.index[(forwards > 0) & (forwards == backwards)]
    step = whole.max() if len(whole) else first["step"].max()
    seq = first[first["step"] == step].sort_values("start_ns")["action"].astype(str).tolist()
    if "B" not in seq:
        return "gpipe"
    first_b = seq.index("B")
    return "gpipe" if "F" not in seq[first_b:] else "1f1b"


def whole_rounds(shape: PipelineShape, num_microbatches: int) -> int:
    """``num_microbatches`` as ``shape``'s schedule can simulate it: interleaved 1F1B runs its micro-batches in
    rounds of ``num_ranks``, so rounded up to whole rounds; unchanged for the other schedules."""
    m = num_microbatches
    if shape.schedule == "interleaved-1f1b" and m % shape.num_ranks:
        m += shape.num_ranks - m % shape.num_ranks
    return m


def ideal_bubble(shape: PipelineShape, *, microbatch_factor: float = 1.0) -> tuple[float, float]:
    """(ideal bubble fraction, makespan in ns) of ``shape``'s schedule with its measured costs, with
    ``microbatch_factor`` times the micro-batches (costs divided by the factor: same global batch)."""
    from dtprobe.schedule_sim import simulate

    m = whole_rounds(shape, max(1, int(round(shape.num_microbatches * microbatch_factor))))
    scale = shape.num_microbatches / m
    costs = {k: v * scale for k, v in shape.costs.items()}
    f = [costs.get((s, "F"), 1.0) for s in range(shape.num_stages)]
    b = [costs.get((s, "B"), costs.get((s, "I"), 1.0) + costs.get((s, "W"), 0.0)) for s in range(shape.num_stages)]
    w = None
    if any(k[1] == "W" for k in costs):
        w = [costs.get((s, "W"), b[s] / 2) for s in range(shape.num_stages)]
    res = simulate(shape.schedule, num_ranks=shape.num_ranks, num_microbatches=m,
                   virtual_stages=shape.virtual_stages, cost_f=f, cost_b=b, cost_w=w)
    return float(res.bubble_frac), float(res.makespan)


def detect_pipeline_bubble(by_rank: pd.DataFrame, shape: PipelineShape | None, *, step_ns: float | None,
                           min_bubble_frac: float = 0.10, clock: str = HOST) -> list[Finding]:
    """PIPELINE_BUBBLE (warning: costs time, never breaks a run) when the mean measured bubble is at least
    ``min_bubble_frac``; compares with the ideal and
    predicts the step-time gain of doubling the micro-batches (simulated, scaled by the pipeline's share of
    the step). ``clock``: the clock of the pipeline rows measured (``clocks.clock_of(pipeline.clock)``)."""
    require_columns(by_rank, BY_RANK_COLUMNS, table="bubble_by_rank")
    if by_rank.empty or shape is None:
        return []
    measured = float(by_rank["bubble_frac"].mean())
    if measured < min_bubble_frac:
        return []
    ideal, makespan = ideal_bubble(shape)
    ideal2, makespan2 = ideal_bubble(shape, microbatch_factor=2.0)
    window = float(by_rank["window_ns"].mean())
    share = min(1.0, window / step_ns) if step_ns else 1.0
    gain = max(0.0, 1 - makespan2 / makespan) * share
    m = shape.num_microbatches
    excess = measured - ideal
    imbalance = max(shape.costs.get((s, "F"), 0) + shape.costs.get((s, "B"), 0) for s in range(shape.num_stages))
    mean_cost = np.mean([shape.costs.get((s, "F"), 0) + shape.costs.get((s, "B"), 0)
                         for s in range(shape.num_stages)]) or 1.0
    advice = [f"Raise the micro-batches from {m} to {2 * m} (same global batch): ideal bubble "
              f"{ideal:.0%} -> {ideal2:.0%}."]
    if shape.schedule in ("gpipe", "1f1b"):
        advice.append("An interleaved (virtual stages) or zero-bubble schedule shrinks it further.")
    if excess > 0.1:
        advice.append(f"The measured bubble exceeds the ideal by {excess:.0%}: check p2p waits and stage balance.")
    return [Finding(
        code="PIPELINE_BUBBLE", severity="warning",
        ranks=tuple(int(r) for r in by_rank["rank"]), group="pp",
        title=(f"pipeline idles {measured:.0%} of the step ({shape.schedule}, {shape.num_ranks} stages, "
               f"{m} micro-batches; ideal {ideal:.0%})"),
        evidence={
            "clock": clock, "schedule": shape.schedule, "schedule_source": shape.schedule_source,
            "num_stages": shape.num_stages, "num_pp_ranks": shape.num_ranks,
            "virtual_stages": shape.virtual_stages, "num_microbatches": m,
            "measured_bubble_frac": measured, "ideal_bubble_frac": ideal,
            "excess_over_ideal_frac": excess, "ideal_bubble_frac_2x_microbatches": ideal2,
            "stage_imbalance": float(imbalance / mean_cost),
            "pipeline_share_of_step": share,
            "per_rank": [{"rank": int(r.rank), "stages": r.stages, "bubble_frac": float(r.bubble_frac)}
                         for r in by_rank.itertuples(index=False)],
        },
        recommendation=" ".join(advice),
        predicted_gain=PredictedGain(metric="step_time", frac=gain),
        rows=by_rank,
    )]
