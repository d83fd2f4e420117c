"""``RunStore.step_rows()``: the rows a store holds by step and by step block, read under its lock (what a step
window's derived frames are brought up to date from): counts equal to a fresh open's after every kind of read, and
block rows equal to the table's rows of those steps."""

from __future__ import annotations

import threading

import orjson
import pandas as pd
import pytest

from dtprobe.store import RunStore, compact
from dtprobe.store.partitions import NO_STEP_BLOCK
from dtprobe.synthetic import SyntheticRun

RANKS = 4
BUCKETS = 2
"""Collectives per step per rank of a ``SyntheticRun``."""


def counts_of(store: RunStore, name: str) -> dict[int, int]:
    with store.step_rows() as rows:
        return rows.counts(name)


def expected(steps: range, per_step: int, **extra: int) -> dict[int, int]:
    return {**{s: per_step for s in steps}, **{int(k): v for k, v in extra.items()}}


def write_setup_collective(run: SyntheticRun, rank: int) -> None:
    """A ``collectives`` row of ``rank`` outside any step (a set-up collective: no ``step``)."""
    path = run.run_dir / f"events/collectives/rank{rank:05d}.jsonl"
    line = orjson.loads(path.read_bytes().splitlines()[0])
    run.writers[rank].write("collectives", {k: v for k, v in line.items() if k not in ("rank", "step")})
    run.writers[rank].flush()


def test_step_rows_counts_rows_per_step_when_opened_and_after_refreshes_within_and_across_blocks(tmp_path):
    run = SyntheticRun(tmp_path / "live", num_ranks=RANKS)
    run.write_steps(18)
    store = RunStore.open(run.run_dir)
    assert counts_of(store, "collectives") == expected(range(18), RANKS * BUCKETS)
    assert counts_of(store, "steps") == expected(range(18), RANKS)

    run.write_steps(1)                                    # step 18: block 0 grows
    write_setup_collective(run, 2)
    store.refresh()
    assert counts_of(store, "collectives") == {**expected(range(19), RANKS * BUCKETS), NO_STEP_BLOCK: 1}
    run.write_steps(4)                                    # steps 19-22: across the block boundary at step 20
    store.refresh()
    want = {**expected(range(23), RANKS * BUCKETS), NO_STEP_BLOCK: 1}
    assert counts_of(store, "collectives") == want
    assert counts_of(RunStore.open(run.run_dir), "collectives") == want   # kept counts equal a fresh count
    assert counts_of(store, "faults") == {}               # no rows
    run.close_writers()


def test_step_rows_block_gives_the_tables_rows_of_the_blocks_steps_from_first_step(tmp_path):
    run = SyntheticRun(tmp_path / "live", num_ranks=RANKS)
    run.write_steps(25)
    write_setup_collective(run, 1)
    store = RunStore.open(run.run_dir)
    run.write_steps(10)                                   # steps 25-34: a refresh's chunk of block 1
    store.refresh()
    with store.step_rows() as rows:
        for block, first_step, steps in ((0, None, (0, 19)), (1, None, (20, 39)), (1, 27, (27, 39)),
                                         (1, 35, (35, 39)), (2, None, (40, 59))):
            got = rows.block("collectives", block, first_step=first_step)
            pd.testing.assert_frame_equal(got, store.table("collectives", steps=steps),
                                          obj=f"block {block} from {first_step}")
        outside = rows.block("collectives", NO_STEP_BLOCK)
    assert len(outside) == 1 and outside["step"].isna().all() and outside["rank"].tolist() == [1]
    run.close_writers()


def test_step_rows_counts_are_the_same_after_a_compacted_runs_rows_are_dropped_and_read_again(tmp_path):
    # a finished compacted run's table frame drops the Arrow rows it was built from (``_release_compacted``): the
    # next count reads the files again; events appended after the compaction count too
    run = SyntheticRun(tmp_path / "run", num_ranks=RANKS)
    run.write_steps(30)
    run.finish()
    compact(run.run_dir)
    store = RunStore.open(run.run_dir)
    want = expected(range(30), RANKS * BUCKETS)
    assert counts_of(store, "collectives") == want
    store.table("collectives")                            # frame built, the compacted rows dropped
    assert store.num_rows()["collectives"] == 30 * RANKS * BUCKETS
    assert counts_of(store, "collectives") == want


def test_step_rows_counts_include_the_head_once_a_tail_opened_store_loads_it(tmp_path):
    run = SyntheticRun(tmp_path / "live", num_ranks=RANKS)
    run.write_steps(30)
    store = RunStore.open(run.run_dir, tail_steps=5)
    assert store.tail_from_step == 25
    assert counts_of(store, "steps") == expected(range(25, 30), RANKS)
    store.load_head()
    assert counts_of(store, "steps") == expected(range(30), RANKS)
    run.close_writers()


def test_step_rows_counts_are_the_callers_copy_when_changed(tmp_path):
    run = SyntheticRun(tmp_path / "live", num_ranks=RANKS)
    run.write_steps(3)
    store = RunStore.open(run.run_dir)
    counts_of(store, "steps")[0] = 99
    assert counts_of(store, "steps") == expected(range(3), RANKS)
    run.close_writers()


def test_step_rows_holds_the_store_lock_so_a_refresh_waits_for_the_block_to_end(tmp_path):
    run = SyntheticRun(tmp_path / "live", num_ranks=RANKS)
    run.write_steps(3)
    store = RunStore.open(run.run_dir)
    run.write_steps(2)
    refreshed = threading.Event()
    refresher = threading.Thread(target=lambda: (store.refresh(), refreshed.set()))
    with store.step_rows() as rows:
        refresher.start()
        assert not refreshed.wait(0.3)                    # the refresh waits for the lock
        assert rows.counts("steps") == expected(range(3), RANKS)
        assert rows.block("steps", 0)["step"].max() == 2
    refresher.join(30)
    assert refreshed.is_set() and counts_of(store, "steps") == expected(range(5), RANKS)
    run.close_writers()


def test_step_rows_raises_when_used_after_its_block_ended(tmp_path):
    run = SyntheticRun(tmp_path / "live", num_ranks=RANKS)
    run.write_steps(2)
    store = RunStore.open(run.run_dir)
    with store.step_rows() as rows:
        pass
    with pytest.raises(RuntimeError, match="after its `with store.step_rows\\(\\)` block ended"):
        rows.counts("steps")
    with pytest.raises(RuntimeError, match="block ended"):
        rows.block("steps", 0)
    run.close_writers()
