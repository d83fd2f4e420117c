"""``phases.phase_at``: the phase of its step a rank was in at a moment, from the steps table's phase durations."""

from __future__ import annotations

import pandas as pd

from dtprobe.analysis.phases import phase_at

MS = 1_000_000


def _steps(*rows: tuple[int, int, int, tuple[int, int, int, int]]) -> pd.DataFrame:
    """(step, start ms, end ms, (data, fwd, bwd, opt) ms) of rank 0."""
    return pd.DataFrame([{"rank": 0, "step": step, "start_ns": start * MS, "end_ns": end * MS,
                          **{f"{p}_ns": d * MS for p, d in zip(("data", "fwd", "bwd", "opt"), durations)}}
                         for step, start, end, durations in rows])


def test_phases_that_fill_the_step_follow_each_other_from_its_start():
    steps = _steps((3, 0, 100, (10, 30, 40, 20)))
    assert [phase_at(steps, 0, 3, t * MS) for t in (5, 10, 39, 40, 79, 80, 99, 100)] == [
        "data", "fwd", "fwd", "bwd", "bwd", "opt", "opt", None]
    assert phase_at(steps, 0, 3, -1) is None and phase_at(steps, 1, 3, 5 * MS) is None


def test_a_gap_before_the_optimizer_is_the_backward_s_and_the_optimizer_ends_the_step():
    # hook-timed phases leave out the wait for DDP's gradient all-reduces after the last gradient hook: 20 ms
    # between the backward's 40 ms and the optimizer's 60 ms; an all-reduce issued at 45 ms is the backward's
    steps = _steps((3, 0, 70, (10, 10, 20, 10)))
    assert [phase_at(steps, 0, 3, t * MS) for t in (5, 15, 30, 45, 59, 60, 69, 70)] == [
        "data", "fwd", "bwd", "bwd", "bwd", "opt", "opt", None]


def test_a_step_without_a_row_is_estimated_from_the_previous_step_s_durations():
    steps = _steps((3, 0, 70, (10, 10, 20, 10)))
    assert [phase_at(steps, 0, 4, (70 + t) * MS) for t in (5, 35, 45, 55)] == ["data", "bwd", "opt", None]
    assert phase_at(steps, 0, 6, 200 * MS) is None
