"""Compaction to Parquet: roundtrip equals the JSONL read, lines appended later, damaged tables, killed writers."""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path

import orjson
import pandas as pd
import pyarrow.parquet as pq
import pytest

from dtprobe.store import RunStore, TraceError, compact
from dtprobe.store.manifest import create_manifest, write_rank_info
from dtprobe.store.schema import SCHEMAS
from dtprobe.store.writer import RankWriter

T0 = 1_700_000_000_000_000_000
OFFSETS = {0: 0, 1: 1_000_000, 2: -250_000}
STEPS_FILE = "steps/step_block=0/rank_block=0/part-0.parquet"
"""The one partition of ``make_run``'s steps table (4 steps, 3 ranks), under ``tables/``."""


def make_run(run_dir: Path, *, steps: int = 4) -> Path:
    """3 ranks with distinct clock offsets: steps, collectives (with a null start_ns), devices, one fault."""
    create_manifest(run_dir, run_id=run_dir.name, command=["x"], config={}, world_size=len(OFFSETS))
    for rank, offset in OFFSETS.items():
        write_rank_info(run_dir, rank, host="h", node_rank=0, local_rank=rank, device="cpu", pid=rank,
                        clock_offset_ns=offset)
        w = RankWriter(run_dir, rank)
        for s in range(steps):
            t = T0 + s * 10_000
            w.write("steps", {"step": s, "start_ns": t, "end_ns": t + 9_000, "loss": 3.0 / (s + 1), "tokens": 32})
            for seq in (2 * s + 1, 2 * s + 2):
                w.write("collectives", {"pg": "world", "pg_ranks": "0,1,2", "pg_size": 3, "seq": seq,
                                        "op": "allreduce", "num_bytes": 1 << 20, "dtype": "float32",
                                        "enqueue_ns": t + seq + rank * 7, "end_ns": t + 5_000 + seq, "step": s,
                                        "timing": "host"})
            w.write("devices", {"host": "h", "time_ns": t, "source": "host", "cpu_frac": 0.5, "rss_bytes": 1 << 30})
        if rank == 1:
            w.write("faults", {"time_ns": T0 + 1, "step": 0, "kind": "straggler", "injected": True,
                               "detail": '{"delay_ms": 40}'})
        w.close()
    return run_dir


def jsonl_frames(run: Path) -> dict[str, pd.DataFrame]:
    store = RunStore.open(run)
    assert not store.is_compacted
    return {name: store.table(name) for name in SCHEMAS}


def test_compact_writes_partitions_of_step_tables_and_one_file_of_others_with_rows_per_table(tmp_path):
    run = make_run(tmp_path / "r")
    rows = compact(run)
    assert rows == {"steps": 12, "collectives": 24, "devices": 12, "faults": 1}
    tables = run / "tables"
    assert sorted(p.relative_to(tables).as_posix() for p in tables.rglob("*") if p.is_file()) == [
        "_compacted.json", "collectives/step_block=0/rank_block=0/part-0.parquet",
        "devices/step_block=-1/rank_block=0/part-0.parquet", "faults.parquet", STEPS_FILE]  # devices: no step
    marker = json.loads((tables / "_compacted.json").read_text())
    assert marker["schema_version"] == 3
    assert marker["tables"]["faults"] == {"rows": 1}
    assert marker["tables"]["steps"] == {"rows": 12, "ordered": True, "files": [
        {"path": STEPS_FILE, "rows": 12, "min_step": 0, "max_step": 3, "min_rank": 0, "max_rank": 2,
         "step_block": 0}], "step_blocks": {"0": 4}}
    assert marker["partitioning"] == {"tables": ["steps", "collectives", "devices"], "step_block_steps": 20,
                                      "rank_block_ranks": 32, "row_group_rows": 32768}
    assert not [p for p in run.iterdir() if p.name.startswith(".tables")]  # temp dirs swapped away
    assert (run / "events").is_dir()  # events are kept


def test_compacted_read_equals_jsonl_read_for_every_table(tmp_path):
    run = make_run(tmp_path / "r")
    before = jsonl_frames(run)
    compact(run)
    store = RunStore.open(run)
    assert store.is_compacted
    for name in SCHEMAS:
        pd.testing.assert_frame_equal(store.table(name), before[name], check_exact=True, obj=name)
    assert store.tables() == ["steps", "collectives", "devices", "faults"]


def test_compacted_parquet_holds_clock_aligned_times(tmp_path):
    run = make_run(tmp_path / "r")
    compact(run)
    steps = pq.read_table(run / "tables" / STEPS_FILE).to_pandas()
    r1 = steps[steps["rank"] == 1]
    assert r1["start_ns"].tolist() == [T0 + 1_000_000 + s * 10_000 for s in range(4)]
    marker = json.loads((run / "tables" / "_compacted.json").read_text())
    assert marker["clock_offsets_ns"] == {"0": 0, "1": 1_000_000, "2": -250_000}
    size = (run / "events" / "steps" / "rank00001.jsonl").stat().st_size
    assert marker["events"]["events/steps/rank00001.jsonl"] == [size, 4]


def test_lines_appended_after_compaction_are_read_once(tmp_path):
    run = make_run(tmp_path / "r")
    compact(run)
    w = RankWriter(run, 2)  # e.g. rank 2 after a restart
    w.write("steps", {"step": 4, "start_ns": T0 + 40_000, "restart": 1})
    w.write("amp", {"step": 4, "scale_before": 65536.0, "scale_after": 32768.0, "found_inf": True})
    w.close()
    store = RunStore.open(run)
    steps = store.table("steps")
    assert len(steps) == 13
    last = steps[steps["rank"] == 2].iloc[-1]
    assert (last["step"], last["start_ns"], last["restart"]) == (4, T0 + 40_000 - 250_000, 1)
    assert store.table("amp")["scale_after"].tolist() == [32768.0]
    assert store.refresh() == {}

    rows = compact(run)  # recompaction folds the new lines in; no duplicates
    assert rows["steps"] == 13 and rows["amp"] == 1
    pd.testing.assert_frame_equal(RunStore.open(run).table("steps"), steps)


def test_changed_clock_offset_after_compaction_shifts_compacted_rows(tmp_path):
    run = make_run(tmp_path / "r")
    compact(run)
    write_rank_info(run, 1, host="h", node_rank=0, local_rank=1, device="cpu", pid=1, clock_offset_ns=3_000_000)
    steps = RunStore.open(run).table("steps")
    assert steps.loc[steps["rank"] == 1, "start_ns"].iloc[0] == T0 + 3_000_000
    assert steps.loc[steps["rank"] == 0, "start_ns"].iloc[0] == T0


def test_compacted_run_still_loads_after_events_are_deleted(tmp_path):
    run = make_run(tmp_path / "r")
    before = jsonl_frames(run)
    compact(run)
    for path in sorted((run / "events").rglob("*.jsonl")):
        path.unlink()
    store = RunStore.open(run)
    pd.testing.assert_frame_equal(store.table("collectives"), before["collectives"])


@pytest.mark.parametrize("damage,match", [
    ("drop_column", r"part-0.parquet' lacks the columns \['loss'\] of the 'steps' table"),
    ("no_marker", r"holds Parquet files but no _compacted.json"),
    ("truncated_events", r"rank00000.jsonl' is \d+ bytes, shorter than the \d+ bytes already read"),
    ("garbage_parquet", r"steps/step_block=0/rank_block=0/part-0.parquet' is not a readable Parquet file"),
])
def test_damaged_compaction_gives_trace_error_with_fix(tmp_path, damage, match):
    run = make_run(tmp_path / "r")
    compact(run)
    parquet = run / "tables" / STEPS_FILE
    if damage == "drop_column":
        # a file without dtprobe's schema metadata (another tool, or a pre-metadata dtprobe) missing a column
        pq.write_table(pq.read_table(parquet).drop_columns(["loss"]).replace_schema_metadata(None), parquet)
    elif damage == "no_marker":
        (run / "tables" / "_compacted.json").unlink()
    elif damage == "truncated_events":
        (run / "events" / "steps" / "rank00000.jsonl").write_bytes(b"")
    elif damage == "garbage_parquet":
        parquet.write_bytes(b"not parquet")
    with pytest.raises(TraceError, match=match) as err:
        RunStore.open(run)
    assert "dtprobe compact" in str(err.value) or "Restore" in str(err.value)


def test_column_added_to_the_schema_after_compaction_reads_as_null(tmp_path):
    run = make_run(tmp_path / "r")
    compact(run)
    parquet = run / "tables" / STEPS_FILE
    table = pq.read_table(parquet)
    assert table.schema.metadata and b"dtprobe.schema_version" in table.schema.metadata
    assert table.column("tokens").null_count == 0
    pq.write_table(table.drop_columns(["tokens"]), parquet)   # as if `tokens` had been added to the schema later
    steps = RunStore.open(run).table("steps")
    assert steps["tokens"].isna().all() and len(steps) == table.num_rows
    assert steps["loss"].notna().any()


def test_store_loads_after_writer_is_sigkilled_mid_run(tmp_path, start_python):
    run = tmp_path / "r"
    create_manifest(run, run_id="r", command=["x"], config={}, world_size=1)
    write_rank_info(run, 0, host="h", node_rank=0, local_rank=0, device="cpu", pid=0, clock_offset_ns=0)
    code = ("import sys, itertools\n"
            "from dtprobe.store.writer import RankWriter\n"
            "w = RankWriter(sys.argv[1], 0, flush_interval_s=0.0)\n"
            "w.write('groups', {'pg': 'world' * 50, 'name': 'world', 'pg_ranks': '0', 'pg_size': 1})\n"
            "for s in itertools.count():\n"
            "    w.write('steps', {'step': s, 'start_ns': s, 'loss': 1.0 / (s + 1)})\n"
            "    w.write('collectives', {'seq': s, 'op': 'allreduce', 'pg': 'world' * 50})\n")
    proc = start_python(code, run)
    path = run / "events" / "steps" / "rank00000.jsonl"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and (not path.exists() or path.stat().st_size < 200_000):
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    assert path.stat().st_size >= 200_000, "writer did not write enough before the deadline"

    store = RunStore.open(run)
    steps = store.table("steps")
    complete = path.read_bytes().count(b"\n")
    assert len(steps) == complete > 1000
    assert steps["step"].tolist() == list(range(complete))  # nothing lost but possibly the torn last line
    coll = store.table("collectives")
    assert len(coll) >= complete - 1 and set(coll["pg"]) == {"world"} and set(coll["pg_ranks"]) == {"0"}
    assert compact(run)["steps"] == complete


def test_restarted_writer_cuts_torn_line_left_by_killed_predecessor(tmp_path, start_python):
    run = tmp_path / "r"
    create_manifest(run, run_id="r", command=["x"], config={}, world_size=1)
    write_rank_info(run, 0, host="h", node_rank=0, local_rank=0, device="cpu", pid=0, clock_offset_ns=0)
    code = ("import os, sys, orjson\n"
            "from dtprobe.store.writer import RankWriter\n"
            "w = RankWriter(sys.argv[1], 0)\n"
            "for s in range(100): w.write('steps', {'step': s})\n"
            "w.flush()\n"
            "f = open(w.run_dir / 'events/steps/rank00000.jsonl', 'ab', buffering=0)\n"
            "f.write(orjson.dumps({'rank': 0, 'step': 100, 'loss': 0.5})[:13])\n"
            "os._exit(9)\n")
    assert start_python(code, run).wait(timeout=60) == 9
    path = run / "events" / "steps" / "rank00000.jsonl"
    assert not path.read_bytes().endswith(b"\n")
    store = RunStore.open(run)
    assert store.table("steps")["step"].tolist() == list(range(100))

    w = RankWriter(run, 0)  # the restarted rank appends to the same file
    w.write("steps", {"step": 100, "restart": 1})
    w.close()
    assert store.refresh() == {"steps": 1}
    assert store.table("steps")["step"].tolist() == list(range(101))
    assert RunStore.open(run).table("steps")["restart"].tolist()[-1] == 1
    assert all(orjson.loads(line) for line in path.read_bytes().splitlines())


def test_live_refresh_while_a_writer_appends_matches_a_fresh_read(tmp_path, start_python):
    run = tmp_path / "r"
    create_manifest(run, run_id="r", command=["x"], config={}, world_size=1)
    write_rank_info(run, 0, host="h", node_rank=0, local_rank=0, device="cpu", pid=0, clock_offset_ns=0)
    code = ("import sys\n"
            "from dtprobe.store.writer import RankWriter\n"
            "w = RankWriter(sys.argv[1], 0, flush_interval_s=0.0)\n"
            "for s in range(20000):\n"
            "    w.write('steps', {'step': s, 'start_ns': s, 'loss': 0.5})\n"
            "w.close()\n")
    store = RunStore.open(run)
    proc = start_python(code, run)
    total = 0
    while proc.poll() is None:
        total += store.refresh().get("steps", 0)
    assert proc.wait(timeout=60) == 0
    total += store.refresh().get("steps", 0)
    assert total == 20000
    steps = store.table("steps")
    assert steps["step"].tolist() == list(range(20000))
    pd.testing.assert_frame_equal(steps, RunStore.open(run).table("steps"))


def test_compact_of_run_without_events_writes_marker_and_later_events_are_read(tmp_path):
    run = tmp_path / "r"
    create_manifest(run, run_id="r", command=["x"], config={}, world_size=1)
    write_rank_info(run, 0, host="h", node_rank=0, local_rank=0, device="cpu", pid=0, clock_offset_ns=0)
    assert compact(run) == {}
    assert sorted(p.name for p in (run / "tables").iterdir()) == ["_compacted.json"]
    w = RankWriter(run, 0)
    w.write("steps", {"step": 0})
    w.close()
    store = RunStore.open(run)
    assert store.is_compacted and store.table("steps")["step"].tolist() == [0]
