"""How a run store holds the events rows it tails (``RunStore._append`` and ``_with_members``): a chunk per step
block, the group members of a refresh's new rows filled in one call, and every table equal to a fresh open's."""

from __future__ import annotations

import pandas as pd

from dtprobe.store import RunStore
from dtprobe.store import reader
from dtprobe.store.partitions import NO_STEP_BLOCK
from dtprobe.synthetic import SyntheticRun

TABLES = ("steps", "collectives", "devices")


def assert_same_tables(store: RunStore, fresh: RunStore) -> None:
    for name in TABLES:
        pd.testing.assert_frame_equal(store.table(name), fresh.table(name), obj=name)
        pd.testing.assert_frame_equal(store.table(name, steps=(20, 39)), fresh.table(name, steps=(20, 39)),
                                      obj=f"{name}, steps 20-39")


def raw_spans(store: RunStore, name: str) -> list[tuple[int, int] | None]:
    return [c.span for c in store._states[name].chunks if c.basis is None and c.rows.num_rows]


def test_rows_are_held_per_step_block_and_a_block_reads_only_its_chunks(tmp_path, monkeypatch):
    run = SyntheticRun(tmp_path / "live", num_ranks=4, straggler_rank=1)
    run.write_steps(45)                                   # blocks 0, 1 and 2 (20 steps per block) in one read
    store = RunStore.open(run.run_dir)
    spans = raw_spans(store, "collectives")
    assert sorted(s for s in spans if s is not None and s[0] >= 0) == [(0, 0), (1, 1), (2, 2)]
    for c in store._states["collectives"].chunks:         # each chunk holds only its block's rows
        if c.span is not None and c.span[0] != NO_STEP_BLOCK:
            steps = c.rows.column("step").to_numpy()
            assert (steps // 20 == c.span[0]).all()
    assert_same_tables(store, RunStore.open(run.run_dir))

    run.write_steps(10)                                   # steps 45-54: block 2 grows
    assert store.refresh()["collectives"]
    filtered = []
    real_filter = reader.filter_rows
    monkeypatch.setattr(reader, "filter_rows", lambda rows, expr: filtered.append(rows.num_rows) or
                        real_filter(rows, expr))
    with store.step_rows() as rows:
        block = rows.block("collectives", 2)
    assert sorted(block["step"].unique()) == list(range(40, 55))
    assert filtered == []                                 # its chunks taken whole, no other block's rows scanned
    monkeypatch.undo()
    assert_same_tables(store, RunStore.open(run.run_dir))
    run.close_writers()


def test_many_refreshes_merge_each_blocks_chunks_and_keep_the_rows(tmp_path, monkeypatch):
    monkeypatch.setattr(reader, "_MERGE_CHUNKS", 3)
    run = SyntheticRun(tmp_path / "live", num_ranks=2)
    run.write_steps(18)
    store = RunStore.open(run.run_dir)
    for _ in range(6):                                    # steps 18-29: blocks 0 and 1 grow, a chunk per refresh
        run.write_steps(2)
        store.refresh()
    spans = raw_spans(store, "collectives")
    assert len(spans) - len(set(spans)) <= 3              # merged per block once more than 3 extra chunks
    assert set(s for s in spans if s is not None and s[0] >= 0) == {(0, 0), (1, 1)}
    assert_same_tables(store, RunStore.open(run.run_dir))
    run.close_writers()


def test_a_refresh_fills_the_members_of_all_new_rows_in_one_call(tmp_path, monkeypatch):
    run = SyntheticRun(tmp_path / "live", num_ranks=8)
    run.write_steps(3)
    store = RunStore.open(run.run_dir)
    calls = []
    real_fill = reader.fill_members
    monkeypatch.setattr(reader, "fill_members", lambda rows, groups, name: calls.append(name) or
                        real_fill(rows, groups, name))
    monkeypatch.setattr(reader, "_BATCH_BYTES", 0)        # file by file, as a refresh of large steps reads them
    run.write_steps(2)
    assert store.refresh()["collectives"]
    assert calls.count("collectives") == 1                # eight ranks' files, one fill
    monkeypatch.undo()
    fresh = RunStore.open(run.run_dir)
    pd.testing.assert_frame_equal(store.table("collectives"), fresh.table("collectives"))
    assert store.table("collectives")["pg_ranks"].notna().all()
    run.close_writers()
