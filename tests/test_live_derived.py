"""The derived per-step tables of a run read from its events (``store.live_derived`` through
``RunStore.derived_table``): equal to the frames computed from the rows, and after a refresh recomputed only for
the step blocks whose rows changed."""

from __future__ import annotations

import pandas as pd

from dtprobe.analysis import RunAnalysis
from dtprobe.analysis.derived_tables import BANDWIDTH, EXPOSURE, KEY, LATENESS, deriver
from dtprobe.store import RunStore
from dtprobe.synthetic import MS, T0, SyntheticRun, lockstep_tables, write_rows_run


def from_rows(store: RunStore) -> RunStore:
    """The same store with no derived frames: the facade computes from the rows."""
    store.derived_table = lambda *args, **kwargs: None
    return store


def described(analysis: RunAnalysis) -> list[dict]:
    return [f.to_json() for f in analysis.findings()]


def assert_same_analysis(kept: RunAnalysis, raw: RunAnalysis) -> None:
    pd.testing.assert_frame_equal(kept.rank_lateness(), raw.rank_lateness())
    pd.testing.assert_frame_equal(kept.comm_exposure(), raw.comm_exposure())
    pd.testing.assert_frame_equal(kept.collective_bandwidth(), raw.collective_bandwidth())
    pd.testing.assert_frame_equal(kept.late_rank_per_step(), raw.late_rank_per_step())
    assert described(kept) == described(raw)
    assert kept.key_figures() == raw.key_figures()


def test_live_run_refresh_derives_only_the_new_step_block_and_equals_a_fresh_analysis(tmp_path):
    run = SyntheticRun(tmp_path / "live", num_ranks=4, straggler_rank=2, delay_ms=40.0)
    run.write_steps(20)                                   # step block 0 (20 steps per block)
    store = RunStore.open(run.run_dir)
    first = RunAnalysis(store)
    assert [f.ranks for f in first.findings() if f.code == "STRAGGLER"] == [(2,)]
    assert store._live_derived.num_derived == 1
    assert_same_analysis(first, RunAnalysis(from_rows(RunStore.open(run.run_dir))))

    for num_steps, derived in ((10, 1), (15, 2)):          # steps 20-29: block 1 is new; 30-44: block 1 grows,
        run.write_steps(num_steps)                         # block 2 is new; block 0 is reused
        before = store._live_derived.num_derived
        assert store.refresh()
        again = RunAnalysis(store)
        assert sorted(again.rank_lateness()["step"].unique()) == list(range(1, run.next_step))
        assert store._live_derived.num_derived == before + derived
        assert_same_analysis(again, RunAnalysis(RunStore.open(run.run_dir)))
        assert_same_analysis(again, RunAnalysis(from_rows(RunStore.open(run.run_dir))))

    store.refresh()                                       # nothing new: nothing derived
    RunAnalysis(store).rank_lateness()
    assert store._live_derived.num_derived == 1 + 1 + 2
    run.close_writers()


def test_a_late_row_in_an_older_block_derives_every_block_again(tmp_path):
    # rank 1's steps row of step 3 arrives after block 2 began (rows of blocks before the kept states changed)
    rows = lockstep_tables(world=2, num_steps=50)
    late = [r for r in rows["steps"] if r["rank"] == 1 and r["step"] == 3]
    rows["steps"] = [r for r in rows["steps"] if r not in late]
    run = write_rows_run(tmp_path / "run", rows, world_size=2, status="running")
    store = RunStore.open(run)
    before = store.derived_table(EXPOSURE, KEY, deriver=deriver)
    assert store._live_derived.num_derived == 3
    with open(run / "events" / "steps" / "rank00001.jsonl", "a") as fh:
        fh.write(pd.Series(late[0]).dropna().to_json() + "\n")
    store.refresh()
    after = store.derived_table(EXPOSURE, KEY, deriver=deriver)
    assert store._live_derived.num_derived == 3 + 3
    def step_ns(exposure: pd.DataFrame) -> float:
        return exposure.loc[(exposure["rank"] == 1) & (exposure["step"] == 3), "step_ns"].item()

    assert pd.isna(step_ns(before)) and step_ns(after) == 100 * MS
    assert_same_analysis(RunAnalysis(store), RunAnalysis(from_rows(RunStore.open(run))))


def test_derived_tables_of_a_restarted_numbering_are_not_given(tmp_path):
    # a torchrun restart inside a step block: seq restarts from 1, the blocks' frames would differ from the run's
    rows = lockstep_tables(world=2, num_steps=6)
    again = lockstep_tables(world=2, num_steps=6, first_step=6, t0=T0 + 1_000 * MS, restart=1)
    merged = {t: rows[t] + again[t] for t in rows}
    run = write_rows_run(tmp_path / "run", merged, world_size=2, status="running")
    store = RunStore.open(run)
    assert store.derived_table(LATENESS, KEY, deriver=deriver) is None
    assert_same_analysis(RunAnalysis(store), RunAnalysis(from_rows(RunStore.open(run))))


def test_derived_tables_need_a_deriver_and_the_whole_run(tmp_path):
    run = SyntheticRun(tmp_path / "live", num_ranks=2)
    run.write_steps(25)
    run.close_writers()
    assert RunStore.open(run.run_dir).derived_table(LATENESS, KEY) is None
    assert RunStore.open(run.run_dir, tail_steps=3).derived_table(LATENESS, KEY, deriver=deriver) is None
    store = RunStore.open(run.run_dir)
    window = store.derived_table(EXPOSURE, KEY, deriver=deriver, steps=(18, 21))     # across the block boundary
    whole = store.derived_table(EXPOSURE, KEY, deriver=deriver)
    pd.testing.assert_frame_equal(window, whole[whole["step"].between(18, 21)].reset_index(drop=True))
    assert set(window["step"]) == {18, 19, 20, 21}
    assert not store.derived_table(BANDWIDTH, KEY, deriver=deriver).empty
