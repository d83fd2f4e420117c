"""Compaction one rank block at a time: a run of several rank blocks and step blocks compacts to the files and rows
the whole-table compaction wrote (the partitions of the JSONL read), holding one rank block of a table at a time."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from dtprobe.analysis.derived_tables import deriver
from dtprobe.store import RunStore, compact
from dtprobe.store.frames import arrow_to_frame
from dtprobe.store.partitions import block_of, write_partitions
from dtprobe.store.schema import RANK_BLOCK_RANKS, SCHEMAS, STEP_BLOCK_STEPS, STEP_TABLES
from dtprobe.store.writer import RankWriter
from dtprobe.synthetic import dp_tables, write_run

WORLD = 2 * RANK_BLOCK_RANKS + 6
"""Three rank blocks, the last one partly filled."""
NUM_STEPS = 2 * STEP_BLOCK_STEPS + 5
"""Three step blocks."""


@pytest.fixture(scope="module")
def wide(tmp_path_factory) -> tuple[Path, RunStore]:
    """An uncompacted 70-rank, 45-step data-parallel run with re-measured clocks on two ranks, and the store that
    read its events."""
    run = write_run(tmp_path_factory.mktemp("wide") / "run", dp_tables(world=WORLD, num_steps=NUM_STEPS, num_buckets=2),
                    world_size=WORLD)
    first = RunStore.open(run).table("steps")["start_ns"].min()
    for rank, drift in ((3, 40_000), (RANK_BLOCK_RANKS + 1, -25_000)):
        w = RankWriter(run, rank)
        for i, offset in enumerate((0, drift, 2 * drift)):
            w.write("clock", {"restart": 0, "time_ns": int(first) + i * 2_000_000_000, "offset_ns": offset,
                              "rtt_ns": 1000, "event": "attach" if i == 0 else "remeasure"})
        w.close()
    return run, RunStore.open(run)


def test_a_run_of_several_rank_and_step_blocks_compacts_to_the_partitions_of_the_whole_tables(wide, tmp_path):
    run, events = wide
    rows = compact(run)
    marker = json.loads((run / "tables" / "_compacted.json").read_text())
    compacted = RunStore.open(run)
    for name in SCHEMAS:
        pd.testing.assert_frame_equal(compacted.table(name), events.table(name), check_exact=True, obj=name)
    for name in STEP_TABLES:
        whole = events.aligned_arrow(name)
        if not whole.num_rows:
            assert name not in rows
            continue
        files, ordered = write_partitions(whole, tmp_path, name, {"dtprobe.table": name})
        entry = marker["tables"][name]
        assert entry["files"] == [f.to_json() for f in files]
        assert entry["ordered"] == ordered
        assert entry["rows"] == rows[name] == whole.num_rows
        for f in files:   # same rows in the same order, file by file
            assert pq.read_table(run / "tables" / f.path).equals(pq.read_table(tmp_path / f.path)), f.path
    assert len({f["path"].split("/")[2] for f in marker["tables"]["collectives"]["files"]}) == 3  # rank blocks
    assert marker["tables"]["steps"]["step_blocks"] == {"0": 20, "1": 20, "2": 5}
    assert {r: (n, o) for r, (n, _, o) in marker["clock_samples"].items()} == {
        "3": (3, 80_000), str(RANK_BLOCK_RANKS + 1): (3, -50_000)}


def test_compaction_holds_one_rank_block_of_a_table_and_one_step_block_for_the_deriver(wide):
    run, events = wide
    held: list[tuple[str, int, int]] = []
    compact(run, derive=deriver(), observe=lambda table, block, rows: held.append((table, block, rows)))
    collectives = events.aligned_arrow("collectives")
    ranks = collectives.column("rank").to_numpy()
    per_rank_block = [int((ranks // RANK_BLOCK_RANKS == b).sum()) for b in range(3)]
    assert [(b, n) for t, b, n in held if t == "collectives"] == list(enumerate(per_rank_block))
    assert max(per_rank_block) < collectives.num_rows / 2
    blocks = {name: step_blocks(events.aligned_arrow(name)) for name in deriver().inputs}
    expected = [(b, sum(int((found == b).sum()) for found in blocks.values()))
                for b in sorted(set().union(*(found.tolist() for found in blocks.values())))]
    assert [(b, n) for t, b, n in held if t == "derived"] == expected
    assert len(expected) == 3 and max(n for _, n in expected) < sum(len(found) for found in blocks.values()) / 2


def test_derived_tables_of_a_streamed_compaction_equal_the_deriver_over_the_whole_tables_by_block(wide):
    run, events = wide
    compact(run, derive=deriver())
    marker = json.loads((run / "tables" / "_compacted.json").read_text())
    reference, inputs = deriver(), {name: events.aligned_arrow(name) for name in deriver().inputs}
    blocks = {name: step_blocks(rows) for name, rows in inputs.items()}
    for b in sorted(set().union(*(found.tolist() for found in blocks.values()))):
        frames = {name: arrow_to_frame(rows.filter(pa.array(blocks[name] == b)), name) for name, rows in inputs.items()}
        for name, frame in reference.derive(b, frames).items():
            files = [f for f in marker["derived"]["tables"][name]["files"] if f["step_block"] == b]
            if frame.empty:
                assert not files
                continue
            expected = pa.Table.from_pandas(frame, preserve_index=False)
            written = pq.read_table(run / "tables" / files[0]["path"]).cast(expected.schema)   # string widths
            assert written.equals(expected), (name, b)
    assert reference.invalid_reason() is None and "tables" in marker["derived"]


def step_blocks(rows: pa.Table):
    """The step block of every row (-1: outside steps)."""
    return block_of(rows.column("step").fill_null(-1).to_numpy())
