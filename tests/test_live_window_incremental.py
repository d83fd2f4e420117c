"""A live refresh of a run longer than the live window (a ``StepWindow`` over a tail-opened store) derives only the
steps it added (``analysis.window_derived``) and reads the failure verdicts' rows through the store, and shows
exactly what a full analysis of the same window's rows shows: the same Overview and the same findings with their
evidence, also when a straggler appears in the middle of the window."""

from __future__ import annotations

import dataclasses

import pandas as pd
import pytest

from dtprobe.analysis import window as window_module
from dtprobe.analysis.derived_tables import KEY, LATENESS, deriver
from dtprobe.analysis.facade import RunAnalysis, open_source
from dtprobe.analysis.window import StepWindow
from dtprobe.dashboard import data, summary
from dtprobe.dashboard.paths import LIVE_WINDOW_ENV, resolve_choice
from dtprobe.overview import summarize
from dtprobe.synthetic import SyntheticRun
from test_live_refresh_incremental import rows_from_step, write_half_a_step, write_the_other_half

WINDOW = 8
STRAGGLER = 3
STRAGGLER_FROM = 30


@pytest.fixture(autouse=True)
def live_window(monkeypatch):
    monkeypatch.setenv(LIVE_WINDOW_ENV, str(WINDOW))
    data.clear()
    yield
    data.clear()


def full_analysis(run: SyntheticRun) -> RunAnalysis:
    """The window's analysis computed from its rows alone, from a store opened now as the dashboard opens one: no
    derived frames, no Arrow reads (the whole window's collectives frame)."""
    store = open_source(run.run_dir, live_tail_steps=WINDOW)
    analysis = summary.analyze(store, "run", whole_run=False, window=WINDOW)
    assert isinstance(analysis.source, StepWindow)
    analysis.source.derived_table = lambda *args, **kwargs: None
    analysis.source.arrow = None
    return analysis


def assert_same(refreshed: RunAnalysis, full: RunAnalysis, path: str) -> None:
    for frame in ("rank_lateness", "comm_exposure", "collective_bandwidth", "late_rank_per_step", "straggler_scores",
                  "straggler_causes", "arrival_clocks"):
        pd.testing.assert_frame_equal(getattr(refreshed, frame)(), getattr(full, frame)())
    assert [f.to_json() for f in refreshed.findings()] == [f.to_json() for f in full.findings()]
    assert refreshed.key_figures() == full.key_figures()
    a, b = summarize(refreshed, path=path), summarize(full, path=path)
    assert dataclasses.replace(a, made_s=0.0) == dataclasses.replace(b, made_s=0.0)


def test_window_refresh_derives_only_new_steps_and_equals_a_full_analysis_as_a_straggler_appears(tmp_path):
    run = SyntheticRun(tmp_path / "live", num_ranks=4, straggler_rank=STRAGGLER, delay_ms=40.0)
    run.timeline.from_step = STRAGGLER_FROM
    run.write_steps(22)                                   # window: steps 14-21
    source = resolve_choice(tmp_path, "live")
    path = str(source.path)
    first = data.load_analysis(source)
    assert isinstance(first.source, StepWindow) and first.source.first_step == 14
    assert not [f for f in first.findings() if f.code == "STRAGGLER"]
    assert_same(first, full_analysis(run), path)
    store = data.open_store(source)
    frames = window_module._FRAMES[store]
    assert frames.invalid_reason() is None and first.source.derived_table(LATENESS, KEY, deriver=deriver) is not None

    # (what is appended, the first step whose rows the refresh derives): a step; three steps across a step block
    # boundary; half a step, then its other half (that step derived again, whole); steps into the straggler's
    # (it is late from step 30 on: part of the window, then all of it)
    appends = ((lambda: run.write_steps(1), 22), (lambda: run.write_steps(3), 23), (lambda: write_half_a_step(run), 26),
               (lambda: write_the_other_half(run), 26), (lambda: run.write_steps(7), 27),
               (lambda: run.write_steps(2), 34), (lambda: run.write_steps(3), 36))
    flagged = []
    for append, derived_from in appends:
        append()
        rows_before = frames.num_rows_derived
        refreshed = data.load_analysis(source)
        window = refreshed.source
        assert isinstance(window, StepWindow) and window.first_step == run.next_step - WINDOW
        assert_same(refreshed, full_analysis(run), path)
        assert frames.invalid_reason() is None
        assert frames.num_rows_derived - rows_before == rows_from_step(run, derived_from)
        assert all(u.last >= window.first_step for u in frames.units)   # units out of the window are dropped
        flagged.append([f.ranks for f in refreshed.findings() if f.code == "STRAGGLER"])
    # flagged once its late steps (30 on) are half of the window (steps 26-33), then as they fill it
    assert flagged == [[], [], [], [], [(STRAGGLER,)], [(STRAGGLER,)], [(STRAGGLER,)]]
    run.close_writers()


def test_a_collective_across_two_steps_makes_the_window_compute_from_its_rows(tmp_path):
    # rank 1 counts a collective of step 17 in step 18 (ranks at different steps in it): a window starting at step 18
    # would cut it, so the window gives no derived frames and the facade computes from the rows, with the same result
    run = SyntheticRun(tmp_path / "live", num_ranks=4, straggler_rank=2, delay_ms=40.0)
    run.write_steps(17)
    rows = run._layout.split(run.timeline.next_rows(3))
    moved = False
    for row in rows["collectives"]:
        if row["rank"] == 1 and row["step"] == 17 and not moved:
            row["step"], moved = 18, True
    for table, table_rows in rows.items():
        for row in table_rows:
            run.writers[row["rank"]].write(table, {k: v for k, v in row.items() if k != "rank"})
    for w in run.writers:
        w.flush()
    source = resolve_choice(tmp_path, "live")
    analysis = data.load_analysis(source)
    assert analysis.source.derived_table(LATENESS, KEY, deriver=deriver) is None
    assert window_module._FRAMES[data.open_store(source)].invalid_reason() is not None
    assert_same(analysis, full_analysis(run), str(source.path))
    run.close_writers()


def test_a_window_with_an_unfinished_collective_equals_a_full_analysis(tmp_path):
    # rank 1 is inside the collective after its last completed one (a pending row of the window's last step): the
    # failure verdicts read it through the window's Arrow reads, the derived frames hold it as an unfinished row
    run = SyntheticRun(tmp_path / "live", num_ranks=4, straggler_rank=2, delay_ms=40.0)
    run.write_steps(17)
    done = open_source(run.run_dir).table("collectives")
    done = done[done["rank"] == 1].iloc[-1]
    pending = {"rank": 1, "restart": 0, "pg": done["pg"], "pg_ranks": str(done["pg_ranks"]),
               "pg_size": int(done["pg_size"]), "seq": int(done["seq"]) + 1, "op": done["op"],
               "num_bytes": int(done["num_bytes"]), "dtype": done["dtype"], "enqueue_ns": int(done["end_ns"]) + 1000,
               "step": int(done["step"]), "timing": "host"}
    for table, table_rows in run._layout.split({"pending": [pending]}).items():
        for row in table_rows:
            run.writers[1].write(table, {k: v for k, v in row.items() if k != "rank" and v is not None})
    run.writers[1].flush()
    source = resolve_choice(tmp_path, "live")
    analysis = data.load_analysis(source)
    assert analysis.source.derived_table(LATENESS, KEY, deriver=deriver) is not None
    full = full_analysis(run)
    assert len(analysis.unfinished_collectives()) == 1
    for frame in ("unfinished_collectives", "stalls", "last_seen", "collective_mismatches"):
        pd.testing.assert_frame_equal(getattr(analysis, frame)(), getattr(full, frame)())
    assert_same(analysis, full, str(source.path))
    run.close_writers()


def test_a_collective_numbering_going_back_makes_the_window_compute_from_its_rows(tmp_path):
    # the ranks number their collectives from 1 again at step 20 (as a restarted job does): the window's
    # unique_seq renumbers them, which frames derived a refresh at a time would not, so the window gives none
    run = SyntheticRun(tmp_path / "live", num_ranks=4, straggler_rank=2, delay_ms=40.0)
    run.write_steps(20)
    source = resolve_choice(tmp_path, "live")
    assert data.load_analysis(source).source.derived_table(LATENESS, KEY, deriver=deriver) is not None
    run.timeline.seq = 0
    run.write_steps(3)
    analysis = data.load_analysis(source)
    assert analysis.source.derived_table(LATENESS, KEY, deriver=deriver) is None
    assert "numbering" in window_module._FRAMES[data.open_store(source)].invalid_reason()
    assert_same(analysis, full_analysis(run), str(source.path))
    run.close_writers()
