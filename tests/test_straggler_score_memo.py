"""``straggler_scores`` with a ``ScoreMemo`` (a live run scored again after each refresh) gives exactly what it
gives without one, while the scored steps slide and grow, a straggler appears, and an older step's rows change."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from dtprobe.analysis.arrivals import LATENESS_COLUMNS
from dtprobe.analysis.score_memo import ScoreMemo
from dtprobe.analysis.straggler_scores import straggler_scores

WORLD, TP = 32, 8
STRAGGLER, LATE_FROM = 13, 40


def lateness_rows(steps: range, *, seed: int) -> pd.DataFrame:
    """``rank_lateness`` rows of a tp8 x dp4 layout for ``steps``: noise, and rank 13 late from step 40 on."""
    rng = np.random.default_rng(seed)
    groups = [("tp", list(range(n * TP, (n + 1) * TP))) for n in range(WORLD // TP)]
    groups += [("dp", list(range(t, WORLD, TP))) for t in range(TP)]
    parts = []
    for pg, members in groups:
        step = np.repeat(np.array(list(steps)), len(members))
        rank = np.tile(np.array(members), len(steps))
        late = np.where((rank == STRAGGLER) & (step >= LATE_FROM), 0.2, 0.0)
        frac = rng.normal(0.0, 0.02, len(step)) + late
        parts.append(pd.DataFrame({
            "pg": pg, "pg_ranks": ",".join(map(str, members)), "step": step, "rank": rank,
            "lateness_ns": frac * 1e8, "victims_wait_ns": rng.normal(1e6, 1e5, len(step)),
            "is_last": rng.random(len(step)) < 1 / len(members), "step_ns": 1e8, "lateness_frac": frac,
            "pre_excess_frac": rng.normal(0.0, 0.01, len(step)) + late / 2,
            "comm_excess_frac": rng.normal(0.0, 0.01, len(step)) - late / 2}))
    return pd.concat(parts, ignore_index=True)[LATENESS_COLUMNS]


def throttled_rows(steps: range) -> pd.DataFrame:
    step = np.repeat(np.array(list(steps)), WORLD)
    rank = np.tile(np.arange(WORLD), len(steps))
    return pd.DataFrame({"rank": rank, "step": step,
                         "cpu_throttled_frac": np.where(rank == 5, 0.1, 0.0) + (step % 3) * 0.001})


@pytest.mark.parametrize("with_throttle", [False, True])
def test_scores_with_a_memo_equal_scores_without_one_as_the_window_slides(with_throttle):
    memo = ScoreMemo()
    rows = {s: lateness_rows(range(s, s + 1), seed=s) for s in range(90)}
    first, last = 0, 30
    # (first, last) step scored after each refresh: grows, slides by one, by several, jumps past the memo's windows,
    # and one step's rows change (a late rank's row arriving: the windows over it are scored again)
    for first, last in ((0, 30), (0, 31), (1, 32), (5, 36), (6, 37), (10, 44), (11, 45), (12, 46), (60, 89)):
        if (first, last) == (11, 45):
            rows[40] = lateness_rows(range(40, 41), seed=1000)
        lateness = pd.concat([rows[s] for s in range(first, last + 1)], ignore_index=True)
        throttled = throttled_rows(range(first, last + 1)) if with_throttle else None
        kw = dict(cpu_throttled=throttled, window_steps=8, min_lateness_frac=0.05, min_positive_frac=0.8)
        with_memo = straggler_scores(lateness, memo=memo, **kw)
        pd.testing.assert_frame_equal(with_memo, straggler_scores(lateness, **kw))
    assert with_memo.loc[with_memo["rank"] == STRAGGLER, "detected_at_step"].notna().all()


def test_memo_reuses_the_windows_of_unchanged_steps_only(monkeypatch):
    from dtprobe.analysis import straggler_scores as scores_module

    computed = []
    figures = scores_module._window_figures
    monkeypatch.setattr(scores_module, "_window_figures",
                        lambda column, win_start, wlen, span, todo, **kw: computed.append(int(todo.sum()))
                        or figures(column, win_start, wlen, span, todo, **kw))
    memo = ScoreMemo()
    rows = {s: lateness_rows(range(s, s + 1), seed=s) for s in range(32)}
    straggler_scores(pd.concat([rows[s] for s in range(30)], ignore_index=True), window_steps=8, memo=memo)
    straggler_scores(pd.concat([rows[s] for s in range(1, 31)], ignore_index=True), window_steps=8, memo=memo)
    members = WORLD * 2                       # (group, rank) pairs: each rank is in a tp and a dp group
    assert computed == [members * (30 - 8 + 1), members]      # one new window per (group, rank)
