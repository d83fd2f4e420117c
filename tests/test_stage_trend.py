"""The stage-trend view of STRAGGLER (``dtprobe.analysis.stage_trend``): a pipeline rank that no other pipeline
can be compared with is compared with its own first steps, relative to its pipeline peers."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from dtprobe.analysis import stage_trend as tr
from dtprobe.analysis.pipeline_delay import STAGE_EXCESS_COLUMNS

MS = 1_000_000


def _pipeline(run_ms: dict[int, np.ndarray], *, step_ms: np.ndarray, replicated: bool = False
              ) -> tuple[pd.DataFrame, pd.DataFrame]:
    """The stage_excess rows and steps of one pipeline whose rank r runs stage r, from each rank's actions' run
    time per step; its own delay adds up to 30 ms of noise to each step's own time, which the view does not read."""
    n = len(step_ms)
    noise = np.random.default_rng(99)
    excess = pd.DataFrame([
        {"rank": r, "step": s, "pipeline": 0, "stage": r, "run_ns": run[s] * MS,
         "own_ns": (run[s] + noise.uniform(0, 30)) * MS,
         "own_excess_frac": 0.0 if replicated else np.nan, "own_excess_rel": 0.0 if replicated else np.nan}
        for r, run in run_ms.items() for s in range(n)])[STAGE_EXCESS_COLUMNS]
    starts = np.concatenate([[0.0], np.cumsum(step_ms)[:-1]])
    steps = pd.DataFrame([{"rank": r, "step": s, "start_ns": int(starts[s] * MS),
                           "end_ns": int((starts[s] + step_ms[s]) * MS)} for r in run_ms for s in range(n)])
    return excess, steps


def _run(slow_from: int | None, *, factor: float = 2.0, seed: int = 0, n: int = 80, stages: int = 2,
         slow_rank: int = 1, from_start: bool = False):
    # each stage's actions take 80 ms +- 5% per step; the slowed rank's grows by `factor` from `slow_from` on, and the
    # step (the pipeline runs at its slowest stage's pace) with it
    rng = np.random.default_rng(seed)
    run = {r: 80.0 * (1 + rng.normal(0, 0.05, n)) for r in range(stages)}
    step = 105.0 * (1 + rng.normal(0, 0.03, n))
    if slow_from is not None:
        k = np.arange(n) >= (0 if from_start else slow_from)
        run[slow_rank] = np.where(k, run[slow_rank] * factor, run[slow_rank])
        step = np.where(k, step + 80.0 * (factor - 1), step)
    return run, step


def test_a_stage_slowed_mid_run_is_named_with_its_window_gain_and_the_first_window_as_baseline():
    run, step = _run(slow_from=40)
    trends = tr.stage_trends(*_pipeline(run, step_ms=step)).set_index("rank")
    assert trends.loc[1, "baseline_first_step"] == 0 and trends.loc[1, "baseline_last_step"] == 19
    assert 40 <= trends.loc[1, "detected_at_step"] <= 40 + 20          # within a window of the slowdown
    # the first window past the verdict's bar holds some steps of each kind: its median lies between 1x and 2x
    assert tr.MIN_STAGE_RISE <= trends.loc[1, "rise"] <= 1.15 and trends.loc[1, "rise_t"] >= tr.MIN_STAGE_RISE_T
    assert pd.isna(trends.loc[0, "detected_at_step"])                  # its peer only looks faster
    [f] = tr.detect_stage_trends(trends.reset_index())
    assert (f.code, f.ranks, f.group, f.evidence["detected_by"], f.evidence["cause"]) == (
        "STRAGGLER", (1,), "pp", "stage_trend", "compute")
    # back to its first window's run time: what its actions grew by, of the window's step
    ev = f.evidence
    grew = ev["actions_ms_after"] - ev["actions_ms_before"]
    assert f.predicted_gain.frac == pytest.approx(grew / ev["step_ms_after"], rel=1e-3)
    assert 0.3 <= f.predicted_gain.frac <= 0.5 and f.severity == "critical"
    assert f.evidence["window"][1] == f.evidence["detected_at_step"]
    # a rank another finding names already is not named twice
    assert tr.detect_stage_trends(trends.reset_index(), named={1}) == []


@pytest.mark.parametrize("seed", range(5))
def test_steady_stages_of_a_noisy_host_are_not_named(seed):
    run, step = _run(slow_from=None, seed=seed)
    assert tr.detect_stage_trends(tr.stage_trends(*_pipeline(run, step_ms=step))) == []


def test_a_stage_slower_from_the_start_or_replicated_elsewhere_or_costing_no_step_is_not_this_views():
    # slower from the first step: the partition's imbalance, nothing to compare with
    run, step = _run(slow_from=0, from_start=True)
    assert tr.detect_stage_trends(tr.stage_trends(*_pipeline(run, step_ms=step))) == []
    # another pipeline runs the same stage: the stage view compares them, this one has no row
    run, step = _run(slow_from=40)
    assert tr.stage_trends(*_pipeline(run, step_ms=step, replicated=True)).empty
    # ranks 0 and 1 are tensor-parallel peers of one replica on stage 0 (rank 2 runs stage 1): neither can be told
    excess, steps = _pipeline(run, step_ms=step)
    excess.loc[excess["rank"] == 1, "stage"] = 0
    trends = tr.stage_trends(excess, steps, replicas={0: 0, 1: 0})
    assert trends.empty
    # slower by 60% mid-run but the step did not grow (the stage had slack): no gain, no verdict
    run, step = _run(slow_from=40, factor=1.6)
    step = 105.0 * np.ones(len(step))
    trends = tr.stage_trends(*_pipeline(run, step_ms=step))
    assert trends.set_index("rank").loc[1, "rise"] > tr.MIN_STAGE_RISE
    assert tr.detect_stage_trends(trends) == []


def test_the_middle_stage_of_three_is_named_and_its_neighbours_are_not():
    run, step = _run(slow_from=30, stages=3, factor=1.5)
    trends = tr.stage_trends(*_pipeline(run, step_ms=step))
    assert [f.ranks for f in tr.detect_stage_trends(trends)] == [(1,)]


def _counter(column: str, n: int, *, rank1_from: int, before: float, after: float, peer: float) -> pd.DataFrame:
    """Per-step host counter shares of a 2-stage pipeline: rank 0 at ``peer`` throughout, rank 1 at ``before``
    until step ``rank1_from``, then ``after``."""
    return pd.DataFrame([{"rank": r, "step": s, column: peer if r == 0 else before if s < rank1_from else after}
                         for r in (0, 1) for s in range(n)])


def test_the_stage_trend_finding_names_the_quota_or_the_shared_core_the_kernel_counted():
    run, step = _run(slow_from=40)
    trends = tr.stage_trends(*_pipeline(run, step_ms=step)).reset_index(drop=True)
    n, clean_wait = len(step), _counter("cpu_wait_frac", len(step), rank1_from=40, before=0.02, after=0.02, peer=0.02)
    # without the counters, or with counters that explain nothing: the general advice
    [plain] = tr.detect_stage_trends(trends)
    [counted] = tr.detect_stage_trends(trends, cpu_throttled=_counter("cpu_throttled_frac", n, rank1_from=40,
                                                                        before=0.0, after=0.0, peer=0.0),
                                       cpu_wait=clean_wait)
    assert counted.recommendation == plain.recommendation and "what changed on its host" in plain.recommendation
    assert plain.evidence["cpu_wait_frac"] is None and counted.evidence["cpu_wait_frac"] == pytest.approx(0.02)
    # its cgroup throttled from step 40 on (the kernel counts that as run-queue wait too): the quota
    [quota] = tr.detect_stage_trends(trends, cpu_throttled=_counter("cpu_throttled_frac", n, rank1_from=40,
                                                                      before=0.0, after=0.4, peer=0.0),
                                     cpu_wait=_counter("cpu_wait_frac", n, rank1_from=40, before=0.02, after=0.4,
                                                       peer=0.02))
    assert "throttled by its quota" in quota.title and "CPU quota" in quota.recommendation
    assert quota.evidence["cpu_throttled_frac"] > 0.1 and quota.evidence["peer_cpu_throttled_frac"] == 0.0
    # its main thread waits for a CPU from step 40 on, its peer's does not: another process on its core
    [shared] = tr.detect_stage_trends(trends, cpu_wait=_counter("cpu_wait_frac", n, rank1_from=40, before=0.02,
                                                                after=0.3, peer=0.02))
    assert "waited for a CPU" in shared.title and "Another process" in shared.recommendation
    # the same wait from the start (its core shared before the slowdown too): not what slowed it
    [always] = tr.detect_stage_trends(trends, cpu_wait=_counter("cpu_wait_frac", n, rank1_from=0, before=0.3,
                                                                after=0.3, peer=0.02))
    assert always.recommendation == plain.recommendation
