"""A live refresh of a run longer than the live window (``DTPROBE_LIVE_WINDOW``: the dashboard opens the store from
its tail and analyzes a ``StepWindow``) derives only the steps appended since the previous refresh (the window's
derivation, ``RunStore.derived_table(from_step=...)``: a unit per step, the units that slid out of the window
dropped) and shows exactly what a fresh analysis of the same window shows without any derived frame."""

from __future__ import annotations

import orjson
import pytest

from dtprobe.analysis.derived_tables import KEY, LATENESS, deriver
from dtprobe.analysis.facade import open_source
from dtprobe.analysis.window import StepWindow
from dtprobe.dashboard import data, summary
from dtprobe.dashboard.paths import LIVE_WINDOW_ENV, resolve_choice
from dtprobe.overview import Overview, summarize
from dtprobe.store.schema import STEP_BLOCK_STEPS
from dtprobe.synthetic import SyntheticRun

from test_live_refresh_incremental import comparable, rows_from_step, write_half_a_step, write_the_other_half

WINDOW = 8


@pytest.fixture(autouse=True)
def small_window(monkeypatch):
    monkeypatch.setenv(LIVE_WINDOW_ENV, str(WINDOW))
    data.clear()
    yield
    data.clear()


def fresh_overview(run: SyntheticRun, *, from_rows: bool) -> Overview:
    """The Overview of the run's newest ``WINDOW`` steps from a store opened now from its tail, as the dashboard
    opens one; with ``from_rows`` the window passes on neither derived frames nor Arrow reads (the facade computes
    every frame from the window's rows, as before the window had them)."""
    store = open_source(run.run_dir, live_tail_steps=WINDOW)
    analysis = summary.analyze(store, "run", whole_run=False, window=WINDOW)
    assert isinstance(analysis.source, StepWindow)
    if from_rows:
        analysis.source.derived_table = None
        analysis.source.arrow = None
    return summarize(analysis, path=str(run.run_dir.resolve()))


def window_units(source) -> list[int]:
    """The steps of the units the open store's window derivation holds (it gives frames: not refused)."""
    derivation, = data.open_store(source)._live_derived._windows.values()
    assert derivation.reason is None
    return [u.first for u in derivation.units]


@pytest.mark.parametrize("num_ranks", [4, 16])
def test_live_refresh_of_a_run_longer_than_the_window_derives_only_the_new_steps_and_equals_a_fresh_analysis(
        tmp_path, num_ranks):
    run = SyntheticRun(tmp_path / "live", num_ranks=num_ranks, straggler_rank=2, delay_ms=40.0)
    run.write_steps(22)
    source = resolve_choice(tmp_path, "live")
    first = data.load_overview(source)
    assert first.window == "steps 14-21 (the last 8)"
    assert data.open_store(source).is_partial      # opened from its tail
    assert [f.ranks for f in first.findings if f.code == "STRAGGLER"] == [(2,)]
    assert comparable(first) == comparable(fresh_overview(run, from_rows=True))
    assert window_units(source) == list(range(14, 22))
    live = data.open_store(source)._live_derived

    # (what is appended, the first step whose rows the refresh derives, the window after it): a step; three steps;
    # half a step (some ranks flushed it) and then its other half (that step derived again, whole); two steps that
    # slide the window's start across the step block boundary; more steps than the window (every unit slides out)
    assert STEP_BLOCK_STEPS == 20
    appends = ((lambda: run.write_steps(1), 22, (15, 22)), (lambda: run.write_steps(3), 23, (18, 25)),
               (lambda: write_half_a_step(run), 26, (19, 26)), (lambda: write_the_other_half(run), 26, (19, 26)),
               (lambda: run.write_steps(2), 27, (21, 28)), (lambda: run.write_steps(12), 33, (33, 40)))
    for append, derived_from, (first_step, last_step) in appends:
        append()
        rows_before = live.num_rows_derived
        refreshed = data.load_overview(source)
        assert refreshed.window == f"steps {first_step}-{last_step} (the last 8)"
        assert live.num_rows_derived - rows_before == rows_from_step(run, derived_from)
        assert window_units(source) == list(range(first_step, last_step + 1))
        assert comparable(refreshed) == comparable(fresh_overview(run, from_rows=True))
        assert comparable(refreshed) == comparable(fresh_overview(run, from_rows=False))
        assert [f.ranks for f in refreshed.findings if f.code == "STRAGGLER"] == [(2,)]
    run.close_writers()


def test_a_window_keeps_no_derived_frames_while_pending_rows_lie_before_it(tmp_path):
    # the window reads ``pending`` whole (a collective in flight earlier is never dropped), so its collectives hold
    # a pending row of an older step; frames derived from the window's steps alone would not
    run = SyntheticRun(tmp_path / "live", num_ranks=4)
    run.write_steps(12)
    line = next(orjson.loads(b) for b in (run.run_dir / "events/collectives/rank00001.jsonl").read_bytes().splitlines()
                if orjson.loads(b).get("step") == 1)
    run.writers[1].write("pending", {k: v for k, v in line.items() if k not in ("rank", "end_ns")})
    run.writers[1].flush()
    store = open_source(run.run_dir, live_tail_steps=WINDOW)
    window = StepWindow(store, WINDOW)
    assert window.first_step > 1 and not store.table("pending").empty
    assert window.derived_table(LATENESS, KEY, deriver=deriver) is None
    run.close_writers()
