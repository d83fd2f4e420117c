"""The stage-trend view of STRAGGLER: a pipeline rank whose stage no other pipeline runs (pipeline parallelism
without data parallelism, e.g. a user's ``torch.distributed.pipelining`` script) has no peer to be compared with,
so it is compared with its own past: the run time of its actions (forward, backward; no wait for its input)
relative to the other ranks of its pipeline, in a window against the run's first window. Its own delay between
actions (``pipeline_delay``) is left out: on a host with fewer cores than ranks it holds the p2p transfers'
scheduling, which swings by multiples in clean runs. A rank whose stage got slower mid-run (a CPU quota, a throttled or
failing device, another process on its core) rises there while the others do not; a stage slower from the start
is the partition's imbalance (PIPELINE_BUBBLE's ``stage_imbalance``), which this view cannot tell from its work.
Read by the facade (``RunAnalysis.stragglers``)."""

from __future__ import annotations

import numpy as np
import pandas as pd

from dtprobe.analysis.findings import Finding, PredictedGain
from dtprobe.analysis.pipeline_delay import STAGE_EXCESS_COLUMNS
from dtprobe.analysis.straggler_scores import (MIN_CPU_WAIT_EXCESS_FRAC, MIN_WINDOW_S, medians_and_se, quota_held,
                                               window_length)
from dtprobe.analysis.stragglers import straggler_advice
from dtprobe.analysis.tables import step_durations
from dtprobe.store.columns import require_columns

TREND_COLUMNS = ["rank", "stage", "pipeline", "baseline_first_step", "baseline_last_step", "window_first_step",
                 "window_last_step", "baseline_rel", "window_rel", "rise", "rise_t", "run_ns_before",
                 "run_ns_after", "step_ns_before", "step_ns_after", "detected_at_step"]
MIN_STAGE_RISE = 0.10
"""A rank's actions' run time, relative to its pipeline peers' (median over a window), must have grown by at least
this share of the first window's: clean 2-stage runs of a 2-core host swing by about 5% between windows."""
MIN_STAGE_RISE_T = 6.0
"""...and by at least this many standard errors (of the two windows' medians, 1.4826 x MAD / sqrt(steps), as
the persistence view's): a host's spell of a few steps moves a median little and its spread much."""
MIN_STEP_RISE = 0.05
"""...and the job's median step in that window must be at least this much longer than in the first: a stage with
slack (it waits for its input either way) that got slower costs nothing."""
CRITICAL_GAIN_FRAC = 0.2
"""Critical when the predicted gain is at least this share of the step (the straggler detector's rule)."""


def stage_trends(stage_excess: pd.DataFrame, steps: pd.DataFrame, *,
                 replicas: dict[int, int] | None = None, steps_analyzed: list[int] | None = None,
                 window_steps: int = 20, min_window_s: float = MIN_WINDOW_S) -> pd.DataFrame:
    """Per pipeline rank with no other pipeline on its stage (``own_excess_rel`` of ``stage_excess`` null in each
    of its rows) and at least one peer in its pipeline: the first window after the run's first one (``baseline``;
    windows of ``straggler_scores.window_length`` steps of ``steps_analyzed`` (None: all), sliding by one) where its
    actions' run time per step (``run_ns``) relative to the median of its pipeline peers' qualifies:
    ``rise`` (window median over baseline median, minus 1) >= ``MIN_STAGE_RISE``, ``rise_t`` >=
    ``MIN_STAGE_RISE_T`` and the median step ``MIN_STEP_RISE`` longer; else the window with the largest rise,
    ``detected_at_step`` null. Ranks with fewer than two windows of steps have no row, and so have tensor-parallel
    ranks (two ranks of one model replica, ``replicas`` as ``pipeline_delay.pipeline_replicas`` gives it, on one
    stage): they wait for each other inside every action, so the slow one's peer grows alike. Columns:
    ``TREND_COLUMNS``."""
    require_columns(stage_excess, STAGE_EXCESS_COLUMNS, table="stage_excess")
    empty = pd.DataFrame({col: [] for col in TREND_COLUMNS})
    if stage_excess.empty:
        return empty
    unreplicated = stage_excess.groupby("rank")["own_excess_rel"].transform(lambda v: v.isna().all())
    d = stage_excess.loc[unreplicated.astype(bool), ["rank", "step", "pipeline", "stage", "run_ns"]]
    if steps_analyzed is not None:
        d = d[d["step"].isin(steps_analyzed)]
    if replicas:
        unit = d.drop_duplicates("rank").assign(replica=lambda f: f["rank"].map(replicas).fillna(f["pipeline"]))
        shared = unit.groupby(["replica", "stage"])["rank"].transform("size") > 1
        d = d[~d["rank"].isin(unit.loc[shared, "rank"])]
    step_ns = step_durations(steps).groupby("step")["step_ns"].median()
    w = window_length(window_steps, step_ns, min_window_s)
    rows = []
    for pipe, rows_of in d.groupby("pipeline"):
        times = rows_of.pivot_table(index="step", columns="rank", values="run_ns", aggfunc="first").dropna()
        if times.shape[1] < 2 or len(times) < 2 * w:
            continue
        values = times.to_numpy(dtype="float64")
        step_of = step_ns.reindex(times.index).to_numpy(dtype="float64")
        for i, rank in enumerate(times.columns):
            others = np.median(np.delete(values, i, axis=1), axis=1)
            rel = np.where(others > 0, values[:, i] / np.where(others > 0, others, 1.0), np.nan)
            stage = int(rows_of.loc[rows_of["rank"] == rank, "stage"].min())
            rows.append({"rank": int(rank), "stage": stage, "pipeline": int(pipe),
                         **_first_rise(times.index.to_numpy(), rel, values[:, i], step_of, w)})
    return pd.DataFrame(rows, columns=TREND_COLUMNS) if rows else empty


def _first_rise(steps: np.ndarray, rel: np.ndarray, run: np.ndarray, step_of: np.ndarray, w: int) -> dict:
    """The figures of the first qualifying window after the first ``w`` steps (else of the largest rise)."""
    base, base_se = medians_and_se(rel[None, :w])
    windows = np.lib.stride_tricks.sliding_window_view(rel[w:], w)          # window k: steps w+k .. 2w+k-1
    med, se = medians_and_se(windows)
    with np.errstate(divide="ignore", invalid="ignore"):
        rise = med / base[0] - 1
        t = (med - base[0]) / np.hypot(se, base_se[0])
    step_before = float(np.nanmedian(step_of[:w]))
    step_after = np.nanmedian(np.lib.stride_tricks.sliding_window_view(step_of[w:], w), axis=1)
    ok = (rise >= MIN_STAGE_RISE) & (t >= MIN_STAGE_RISE_T) & (step_after >= (1 + MIN_STEP_RISE) * step_before)
    found = bool(ok.any())
    k = int(np.argmax(ok)) if found else int(np.nanargmax(np.where(np.isnan(rise), -np.inf, rise)))
    start = w + k
    return {"baseline_first_step": int(steps[0]), "baseline_last_step": int(steps[w - 1]),
            "window_first_step": int(steps[start]), "window_last_step": int(steps[start + w - 1]),
            "baseline_rel": float(base[0]), "window_rel": float(med[k]), "rise": float(rise[k]),
            "rise_t": float(t[k]), "run_ns_before": float(np.median(run[:w])),
            "run_ns_after": float(np.median(run[start:start + w])), "step_ns_before": step_before,
            "step_ns_after": float(step_after[k]), "detected_at_step": int(steps[start + w - 1]) if found else None}


def detect_stage_trends(trends: pd.DataFrame, *, named: set[int] = frozenset(), clock: str | None = None,
                        cpu_throttled: pd.DataFrame | None = None, cpu_wait: pd.DataFrame | None = None
                        ) -> list[Finding]:
    """STRAGGLER (``detected_by: stage_trend``, group ``pp``, cause ``compute``) for each detected row of
    ``stage_trends`` whose rank no other straggler finding names (``named``). The predicted gain: the rank's own
    actions' run time back to the first window's, at most what the step grew, as a share of the window's step.
    With the host counters per step (``cpu_throttle.cpu_throttled_per_step``, ``cpu_wait_per_step``), the title and
    advice name what the kernel counted over its window (``_window_shares``): its cgroup's quota
    (``straggler_scores.quota_held`` against the largest of the other ranks' throttled shares), else a shared core (its
    run-queue wait beyond the other ranks' at least ``MIN_CPU_WAIT_EXCESS_FRAC``, and grown by as much since its
    baseline window)."""
    require_columns(trends, TREND_COLUMNS, table="stage_trends")
    out = []
    for r in trends[trends["detected_at_step"].notna()].itertuples(index=False):
        if int(r.rank) in named:
            continue
        gain_ns = max(0.0, min(r.run_ns_after - r.run_ns_before, r.step_ns_after - r.step_ns_before))
        gain = gain_ns / r.step_ns_after if r.step_ns_after > 0 else 0.0
        first, last = int(r.window_first_step), int(r.window_last_step)
        base = (int(r.baseline_first_step), int(r.baseline_last_step))
        thr, peer_thr = _window_shares(cpu_throttled, "cpu_throttled_frac", int(r.rank), (first, last))
        wait, peer_wait = _window_shares(cpu_wait, "cpu_wait_frac", int(r.rank), (first, last))
        base_wait, base_peer_wait = _window_shares(cpu_wait, "cpu_wait_frac", int(r.rank), base)
        quota = quota_held(thr, peer_thr)
        # its extra wait for a CPU came with the slowdown (the kernel counts a quota's throttling as wait too)
        shared = (not quota and None not in (wait, peer_wait, base_wait, base_peer_wait)
                  and wait - peer_wait >= MIN_CPU_WAIT_EXCESS_FRAC
                  and (wait - peer_wait) - (base_wait - base_peer_wait) >= MIN_CPU_WAIT_EXCESS_FRAC)
        reason = (f"; its CPU cgroup was throttled by its quota for {thr:.0%} of the time" if quota else
                  f"; its main thread waited for a CPU {wait:.0%} of the time (its peers at most {peer_wait:.0%}; "
                  f"{base_wait:.0%} and {base_peer_wait:.0%} before)" if shared else "")
        out.append(Finding(
            code="STRAGGLER", severity="critical" if gain >= CRITICAL_GAIN_FRAC else "warning",
            ranks=(int(r.rank),), group="pp",
            title=(f"rank {r.rank}'s forward and backward on pipeline stage {r.stage} grew from "
                   f"{r.run_ns_before / 1e6:.1f} to {r.run_ns_after / 1e6:.1f} ms per step (steps {first}-{last} "
                   f"against {int(r.baseline_first_step)}-{int(r.baseline_last_step)}; {r.rise:+.0%} relative to its "
                   f"pipeline peers, {r.rise_t:.1f} standard errors), and the step from "
                   f"{r.step_ns_before / 1e6:.1f} to {r.step_ns_after / 1e6:.1f} ms{reason}; cause: compute"),
            evidence={
                "rank": int(r.rank), "pg": "pp", "stage": int(r.stage), "pipeline": int(r.pipeline),
                "clock": clock, "detected_by": "stage_trend", "cause": "compute",
                "detected_at_step": int(r.detected_at_step), "window": [first, last],
                "baseline_window": [int(r.baseline_first_step), int(r.baseline_last_step)],
                "actions_ms_before": round(r.run_ns_before / 1e6, 3),
                "actions_ms_after": round(r.run_ns_after / 1e6, 3),
                "relative_to_peers_before": float(r.baseline_rel), "relative_to_peers_after": float(r.window_rel),
                "rise": float(r.rise), "rise_t": float(r.rise_t),
                "step_ms_before": round(r.step_ns_before / 1e6, 3), "step_ms_after": round(r.step_ns_after / 1e6, 3),
                "cpu_throttled_frac": thr, "peer_cpu_throttled_frac": peer_thr, "cpu_wait_frac": wait,
                "peer_cpu_wait_frac": peer_wait,
            },
            recommendation=(straggler_advice("compute", int(r.rank), cpu_quota=quota, core_shared=shared)
                            if quota or shared else
                            f"Rank {r.rank}'s stage became slower during the run while the other stages did not: "
                            "look at what changed on its host or device then (another process on its cores, a CPU "
                            "quota, clocks or thermal throttling, a failing device). No other pipeline runs its "
                            "stage, so only its own earlier steps are there to compare it with."),
            predicted_gain=PredictedGain(metric="step_time", frac=float(gain)),
        ))
    return out


def _window_shares(per_step: pd.DataFrame | None, column: str, rank: int, steps: tuple[int, int]
                   ) -> tuple[float | None, float | None]:
    """``rank``'s mean ``column`` over ``steps`` (inclusive) and the largest of the other ranks' means; None where
    unknown (no counter, no sampled step)."""
    if per_step is None or per_step.empty:
        return None, None
    inside = per_step[per_step["step"].between(*steps)]
    means = inside.groupby("rank")[column].mean().dropna()
    own = float(means[rank]) if rank in means.index else None
    others = means.drop(rank, errors="ignore")
    return own, float(others.max()) if len(others) else None
