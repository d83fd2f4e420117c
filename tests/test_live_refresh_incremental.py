"""A live refresh of a running run's Overview (``dashboard.data.load_overview``, what ``live_overview`` runs in
the background) derives only the steps appended since the previous refresh (``store.live_derived``: a unit per
refresh, not the newest step block again) and shows exactly what a fresh analysis of the same window shows."""

from __future__ import annotations

import dataclasses

import pandas as pd
import pytest

from dtprobe.analysis.facade import open_source
from dtprobe.dashboard import data, summary
from dtprobe.dashboard.paths import resolve_choice
from dtprobe.overview import Overview, summarize
from dtprobe.synthetic import SyntheticRun

DERIVED_INPUTS = ("collectives", "pending", "steps")
"""The tables the derived per-step frames are computed from (``derived_tables.LatenessExposure.inputs``)."""


@pytest.fixture(autouse=True)
def no_open_sources():
    data.clear()
    yield
    data.clear()


def fresh_overview(run: SyntheticRun, *, from_rows: bool) -> Overview:
    """The Overview of the run as it is on disk, from a store opened now as the dashboard opens one; with
    ``from_rows`` the store keeps no derived frames (the facade computes them from the rows)."""
    window = data.live_window_steps()
    store = open_source(run.run_dir, live_tail_steps=window)
    if from_rows:
        store.derived_table = lambda *args, **kwargs: None
    return summarize(summary.analyze(store, "run", whole_run=False, window=window), path=str(run.run_dir.resolve()))


def comparable(overview: Overview) -> Overview:
    return dataclasses.replace(overview, made_s=0.0)


def write_half_a_step(run: SyntheticRun) -> None:
    """The next step's rows of the lower half of the ranks only (the others have not flushed theirs yet); the
    rest follows with the next ``write_steps``."""
    rows = run._layout.split(run.timeline.next_rows(1))
    late = {table: [r for r in table_rows if r["rank"] >= run.num_ranks // 2] for table, table_rows in rows.items()}
    for table, table_rows in rows.items():
        for row in table_rows:
            if row["rank"] < run.num_ranks // 2:
                run.writers[row["rank"]].write(table, {k: v for k, v in row.items() if k != "rank"})
    for w in run.writers:
        w.flush()
    run.pending_half = late


def write_the_other_half(run: SyntheticRun) -> None:
    for table, table_rows in run.pending_half.items():
        for row in table_rows:
            run.writers[row["rank"]].write(table, {k: v for k, v in row.items() if k != "rank"})
    for w in run.writers:
        w.flush()


def rows_from_step(run: SyntheticRun, step: int) -> int:
    """Rows of the derived frames' input tables at ``step`` or later, as a fresh open reads them."""
    store = open_source(run.run_dir)
    return sum(int((store.table(t)["step"] >= step).sum()) for t in DERIVED_INPUTS)


@pytest.mark.parametrize("num_ranks", [4, 16])
def test_live_refresh_derives_only_the_new_steps_and_equals_a_fresh_analysis_of_the_window(tmp_path, num_ranks):
    run = SyntheticRun(tmp_path / "live", num_ranks=num_ranks, straggler_rank=2, delay_ms=40.0)
    run.write_steps(17)
    source = resolve_choice(tmp_path, "live")
    first = data.load_overview(source)
    assert [f.ranks for f in first.findings if f.code == "STRAGGLER"] == [(2,)]
    assert comparable(first) == comparable(fresh_overview(run, from_rows=False))
    live = data.open_store(source)._live_derived

    # (what is appended, the first step whose rows the refresh derives): a step; two steps into the next step
    # block; half a step (some ranks flushed it) and then its other half (that step derived again, whole); a step
    # block's worth at once
    appends = ((lambda: run.write_steps(1), 17), (lambda: run.write_steps(2), 18), (lambda: write_half_a_step(run), 20),
               (lambda: write_the_other_half(run), 20), (lambda: run.write_steps(1), 21),
               (lambda: run.write_steps(20), 22))
    for append, derived_from in appends:
        append()
        rows_before = live.num_rows_derived
        refreshed = data.load_overview(source)
        assert live.num_rows_derived - rows_before == rows_from_step(run, derived_from)
        assert refreshed.num_steps == fresh_overview(run, from_rows=False).num_steps
        assert comparable(refreshed) == comparable(fresh_overview(run, from_rows=False))
        assert comparable(refreshed) == comparable(fresh_overview(run, from_rows=True))
        assert [f.ranks for f in refreshed.findings if f.code == "STRAGGLER"] == [(2,)]
    run.close_writers()


def test_a_collective_across_two_refreshes_steps_derives_whole_blocks_and_equals_a_fresh_analysis(tmp_path):
    # rank 1 counts the collective of step 5 in step 6 (ranks at different steps in it): steps 0-5 arrive in one
    # refresh, 6-9 in the next, so the collective's rows are in two units of step block 0 -- which the deriver
    # refuses; the store then derives whole blocks, as a fresh open does
    from dtprobe.analysis import RunAnalysis
    from dtprobe.analysis.derived_tables import KEY, LATENESS, deriver
    from dtprobe.store import RunStore
    from dtprobe.store.manifest import create_manifest, write_rank_info
    from dtprobe.store.writer import RankWriter
    from dtprobe.synthetic import GroupLayout, lockstep_tables

    rows = lockstep_tables(world=2, num_steps=10)
    for row in rows["collectives"]:
        if row["rank"] == 1 and row["step"] == 5:
            row["step"] = 6
    run = tmp_path / "run"
    create_manifest(run, run_id="run", command=["synthetic"], config={}, world_size=2)
    for r in range(2):
        write_rank_info(run, r, host="node0", node_rank=0, local_rank=r, device="cpu", pid=100 + r, clock_offset_ns=0)
    writers, layout = {r: RankWriter(run, r, flush_interval_s=3600) for r in range(2)}, GroupLayout()

    def write(part: dict[str, list[dict]]) -> None:
        for table, table_rows in layout.split(part).items():
            for row in table_rows:
                writers[int(row["rank"])].write(table, {k: v for k, v in row.items() if k != "rank" and v is not None})
        for w in writers.values():
            w.flush()

    write({t: [r for r in table_rows if r.get("step", 0) <= 5 and t != "lifecycle"] for t, table_rows in rows.items()})
    store = RunStore.open(run)
    assert store.derived_table(LATENESS, KEY, deriver=deriver) is not None
    write({t: [r for r in table_rows if r.get("step", 0) > 5 and t != "lifecycle"] for t, table_rows in rows.items()})
    store.refresh()
    fresh = RunStore.open(run)
    kept = store.derived_table(LATENESS, KEY, deriver=deriver)
    assert kept is not None
    pd.testing.assert_frame_equal(kept, fresh.derived_table(LATENESS, KEY, deriver=deriver))
    derivation, = store._live_derived._derivations.values()
    assert derivation.whole_blocks and [u.block for u in derivation.units] == [0]
    raw = RunStore.open(run)
    raw.derived_table = lambda *args, **kwargs: None
    kept_analysis, raw_analysis = RunAnalysis(store), RunAnalysis(raw)
    pd.testing.assert_frame_equal(kept_analysis.rank_lateness(), raw_analysis.rank_lateness())
    assert [f.to_json() for f in kept_analysis.findings()] == [f.to_json() for f in raw_analysis.findings()]
    assert kept_analysis.key_figures() == raw_analysis.key_figures()
    for w in writers.values():
        w.close()
