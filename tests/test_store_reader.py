"""RunStore: JSONL roundtrip with schema dtypes, torn and corrupt lines, clock alignment, refresh, clear errors."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest

from dtprobe.store import RunStore, TraceError
from dtprobe.store.frames import PANDAS_DTYPES, conform, empty_frame, frame_from_rows
from dtprobe.store.manifest import create_manifest, write_rank_info
from dtprobe.store.schema import SCHEMA_VERSION, SCHEMAS
from dtprobe.store.writer import RankWriter

T0 = 1_700_000_000_000_000_000
WORLD_GROUP = {"pg": "world", "name": "world", "pg_ranks": "0,1", "pg_size": 2}
"""The ``groups`` row a rank writes before its first collective on the default group of 2 ranks."""


def make_run(run_dir: Path, *, offsets: dict[int, int], steps: int = 3) -> Path:
    """A run with one steps row per (rank, step) and one straggler fault written by the last rank."""
    create_manifest(run_dir, run_id=run_dir.name, command=["train.py"], config={"lr": 0.1},
                    world_size=len(offsets))
    for rank, offset in offsets.items():
        write_rank_info(run_dir, rank, host="h0", node_rank=0, local_rank=rank, device="cpu", pid=100 + rank,
                        clock_offset_ns=offset)
        writer = RankWriter(run_dir, rank)
        for step in range(steps):
            writer.write("steps", {"step": step, "start_ns": T0 + step * 1000, "end_ns": T0 + step * 1000 + 900,
                                   "fwd_ns": 300 + rank, "loss": 2.0 - 0.25 * step, "tokens": 64})
        if rank == max(offsets):
            writer.write("faults", {"time_ns": T0 + 5, "step": 1, "kind": "straggler", "injected": True,
                                    "detail": json.dumps({"delay_ms": 40})})
        writer.close()
    return run_dir


def events(run_dir: Path, table: str, rank: int) -> Path:
    return run_dir / "events" / table / f"rank{rank:05d}.jsonl"


def append(path: Path, data: bytes) -> None:
    with open(path, "ab") as f:
        f.write(data)


def test_reader_roundtrips_writer_rows_with_schema_columns_and_dtypes(tmp_path):
    run = make_run(tmp_path / "r", offsets={0: 0, 1: 0})
    steps = RunStore.open(run).table("steps")

    assert list(steps.columns) == list(SCHEMAS["steps"])
    assert {c: str(t) for c, t in steps.dtypes.items()} == {
        c: PANDAS_DTYPES[t] for c, t in SCHEMAS["steps"].items()}
    assert steps[["rank", "step"]].values.tolist() == [[0, 0], [0, 1], [0, 2], [1, 0], [1, 1], [1, 2]]
    assert steps["loss"].tolist() == [2.0, 1.75, 1.5] * 2
    assert steps["fwd_ns"].tolist() == [300, 300, 300, 301, 301, 301]
    assert steps["opt_ns"].isna().all() and steps["lr"].isna().all()  # never written -> null
    faults = RunStore.open(run).table("faults")
    assert faults[["rank", "kind", "injected"]].values.tolist() == [[1, "straggler", True]]
    assert json.loads(faults["detail"].iloc[0]) == {"delay_ms": 40}


def test_reader_returns_empty_schema_frame_when_table_was_never_written(tmp_path):
    store = RunStore.open(make_run(tmp_path / "r", offsets={0: 0}))
    coll = store.table("collectives")
    assert coll.empty
    pd.testing.assert_frame_equal(coll, empty_frame("collectives"))
    assert store.tables() == ["steps", "faults"]


def test_reader_adds_each_ranks_clock_offset_to_time_columns_only(tmp_path):
    run = make_run(tmp_path / "r", offsets={0: 0, 1: 1_000_000})
    steps = RunStore.open(run).table("steps")
    r0, r1 = steps[steps["rank"] == 0], steps[steps["rank"] == 1]
    assert r0["start_ns"].tolist() == [T0, T0 + 1000, T0 + 2000]
    assert r1["start_ns"].tolist() == [T0 + 1_000_000, T0 + 1_001_000, T0 + 1_002_000]
    assert r1["end_ns"].tolist() == [T0 + 1_000_900, T0 + 1_001_900, T0 + 1_002_900]
    assert r1["fwd_ns"].tolist() == [301] * 3  # durations are not shifted
    assert RunStore.open(run).table("faults")["time_ns"].tolist() == [T0 + 5 + 1_000_000]


def test_reader_skips_torn_last_line_then_reads_it_once_completed(tmp_path):
    run = make_run(tmp_path / "r", offsets={0: 0})
    line = json.dumps({"rank": 0, "step": 3, "start_ns": T0 + 3000, "loss": 1.25}).encode()
    append(events(run, "steps", 0), line[:17])
    store = RunStore.open(run)
    assert store.table("steps")["step"].tolist() == [0, 1, 2]

    append(events(run, "steps", 0), line[17:] + b"\n")
    assert store.refresh() == {"steps": 1}
    steps = store.table("steps")
    assert steps["step"].tolist() == [0, 1, 2, 3]
    assert steps["loss"].iloc[-1] == 1.25


@pytest.mark.parametrize("bad_line,why", [
    (b'{"rank": 0, "step": 3, "sta\n', "not valid JSON"),
    (b'[1, 2, 3]\n', "not an object"),
    (b'{"rank": 0, "step": "three"}\n', "does not match the 'steps' table schema"),
])
def test_reader_names_file_and_line_when_a_middle_line_is_corrupt(tmp_path, bad_line, why):
    run = make_run(tmp_path / "r", offsets={0: 0})
    path = events(run, "steps", 0)
    append(path, bad_line + b'{"rank": 0, "step": 4}\n')
    with pytest.raises(TraceError, match=why) as err:
        RunStore.open(run)
    assert f"'{path}' line 4 " in str(err.value)
    assert "sed -i '4d'" in str(err.value)


def test_reader_reports_line_number_of_corruption_found_by_refresh(tmp_path):
    run = make_run(tmp_path / "r", offsets={0: 0})
    store = RunStore.open(run)
    append(events(run, "steps", 0), b'{"rank": 0, "step": 3}\n{"rank": 0, broken}\n{"rank": 0, "step": 5}\n')
    with pytest.raises(TraceError, match=r"line 5 is not valid JSON"):
        store.refresh()


def test_refresh_returns_only_new_rows_per_table(tmp_path):
    run = make_run(tmp_path / "r", offsets={0: 0, 1: 500})
    store = RunStore.open(run)
    assert store.refresh() == {}
    w1 = RankWriter(run, 1)
    w1.write("steps", {"step": 3, "start_ns": T0 + 3000})
    w1.write("groups", WORLD_GROUP)
    w1.write("collectives", {"pg": "world", "seq": 1, "op": "allreduce", "num_bytes": 4096, "enqueue_ns": T0})
    w1.write("collectives", {"pg": "world", "seq": 2, "op": "allreduce", "num_bytes": 4096, "enqueue_ns": T0 + 9})
    w1.close()
    assert store.refresh() == {"steps": 1, "collectives": 2, "groups": 1}
    assert store.refresh() == {}
    assert store.num_rows()["steps"] == 7 and store.num_rows()["collectives"] == 2
    assert len(store.table("steps")) == 7
    coll = store.table("collectives")
    assert coll["seq"].tolist() == [1, 2]
    assert coll["enqueue_ns"].tolist() == [T0 + 500, T0 + 509]
    assert coll["pg_ranks"].tolist() == ["0,1", "0,1"] and coll["pg_size"].tolist() == [2, 2]
    assert store.tables() == ["steps", "collectives", "faults", "groups"]


def test_refresh_picks_up_a_new_rank_file_and_changed_status(tmp_path):
    run = make_run(tmp_path / "r", offsets={0: 0})
    store = RunStore.open(run, tables=("steps",))
    write_rank_info(run, 1, host="h1", node_rank=1, local_rank=0, device="cpu", pid=7, clock_offset_ns=-20)
    w = RankWriter(run, 1)
    w.write("steps", {"step": 0, "start_ns": T0 + 100})
    w.close()
    from dtprobe.store.manifest import set_status
    set_status(run, "finished")
    assert store.refresh() == {"steps": 1}
    assert store.manifest.status == "finished" and store.manifest.ended_ns is not None
    assert store.manifest.nodes == ((0, "h0"), (1, "h1"))
    steps = store.table("steps")
    assert steps.loc[steps["rank"] == 1, "start_ns"].tolist() == [T0 + 80]


def test_table_result_can_be_modified_without_changing_the_store(tmp_path):
    store = RunStore.open(make_run(tmp_path / "r", offsets={0: 0}))
    df = store.table("steps")
    df["extra"] = 1
    df.loc[0, "loss"] = 99.0
    again = store.table("steps")
    assert "extra" not in again.columns and again["loss"].iloc[0] == 2.0


def test_reader_refuses_rank_with_events_but_no_rank_info(tmp_path):
    run = make_run(tmp_path / "r", offsets={0: 0})
    w = RankWriter(run, 3)
    w.write("steps", {"step": 0, "start_ns": T0})
    w.close()
    with pytest.raises(TraceError, match=r"rank 3 has events in .*rank00003.jsonl.* but no rank info file"):
        RunStore.open(run)


def test_reader_refuses_row_whose_rank_differs_from_its_file(tmp_path):
    run = make_run(tmp_path / "r", offsets={0: 0, 1: 0})
    append(events(run, "steps", 0), b'{"rank": 1, "step": 9}\n')
    with pytest.raises(TraceError, match=r"line 4 has rank 1, but the file belongs to rank 0"):
        RunStore.open(run)


def test_reader_fills_missing_rank_from_file_name(tmp_path):
    run = make_run(tmp_path / "r", offsets={0: 0, 1: 0})
    append(events(run, "steps", 1), b'{"step": 9}\n')
    steps = RunStore.open(run).table("steps")
    assert steps.loc[steps["step"] == 9, "rank"].tolist() == [1]


@pytest.mark.parametrize("setup,match", [
    ("no_run_json", r"is not a dtprobe run: no run.json in it\. Point at a directory made by `dtprobe run`"),
    ("missing_dir", r"is not a dtprobe run: no such directory"),
    ("foreign_run_json", r"is not a dtprobe run: run.json is not ours \(it lacks the keys \['format', "
                         r"'schema_version', 'world_size'\]"),
    ("not_json", r"run.json' is not a dtprobe run manifest: it is not readable JSON"),
    ("newer_schema", rf"schema_version {SCHEMA_VERSION + 1}, but this dtprobe reads only up to "
                     rf"{SCHEMA_VERSION}\. Upgrade dtprobe"),
    ("older_schema", r"schema_version 0, older than this dtprobe's"),
    ("bad_status", r"status is 'paused', expected one of \['running', 'finished', 'crashed'\]"),
    ("bad_rank_info", r"rank00000.json' lacks the keys \['clock_offset_ns'\]"),
])
def test_open_raises_clear_trace_error_for_foreign_or_unsupported_dirs(tmp_path, setup, match):
    run = tmp_path / "r"
    if setup != "missing_dir":
        make_run(run, offsets={0: 0})
    manifest = json.loads((run / "run.json").read_text()) if run.exists() else {}
    if setup == "no_run_json":
        (run / "run.json").unlink()
    elif setup == "foreign_run_json":
        (run / "run.json").write_text(json.dumps({"run_id": "x", "status": "running", "model": "bert"}))
    elif setup == "not_json":
        (run / "run.json").write_text("{oops")
    elif setup in ("newer_schema", "older_schema", "bad_status"):
        key, value = {"newer_schema": ("schema_version", SCHEMA_VERSION + 1),
                      "older_schema": ("schema_version", 0), "bad_status": ("status", "paused")}[setup]
        manifest[key] = value
        (run / "run.json").write_text(json.dumps(manifest))
    elif setup == "bad_rank_info":
        info = run / "ranks" / "rank00000.json"
        data = json.loads(info.read_text())
        del data["clock_offset_ns"]
        info.write_text(json.dumps(data))
    with pytest.raises(TraceError, match=match) as err:
        RunStore.open(run)
    assert str(run) in str(err.value)


def test_table_rejects_unknown_table_name(tmp_path):
    store = RunStore.open(make_run(tmp_path / "r", offsets={0: 0}))
    with pytest.raises(TraceError, match=r"unknown table 'step'; the run store has \["):
        store.table("step")


def test_frame_from_rows_matches_reader_dtypes():
    df = frame_from_rows("collectives", [{"rank": 0, "seq": 1, "op": "allreduce", "num_bytes": 8}])
    assert list(df.columns) == list(SCHEMAS["collectives"])
    assert str(df["seq"].dtype) == "Int64" and str(df["op"].dtype) == "string"
    assert df["enqueue_ns"].isna().all()
    with pytest.raises(KeyError, match="bytes"):
        frame_from_rows("collectives", [{"rank": 0, "bytes": 8}])


def test_refresh_keeps_rows_of_good_files_when_another_file_is_corrupt(tmp_path):
    run = make_run(tmp_path / "r", offsets={0: 0, 1: 0})
    store = RunStore.open(run)
    append(events(run, "steps", 0), b'{"rank": 0, "step": 3}\n')
    append(events(run, "steps", 1), b'{"rank": 1, "step": 3, oops}\n{"rank": 1, "step": 4}\n')
    with pytest.raises(TraceError, match=r"rank00001.jsonl' line 4 "):
        store.refresh()
    lines = events(run, "steps", 1).read_bytes().splitlines(keepends=True)
    events(run, "steps", 1).write_bytes(b"".join(lines[:3] + lines[4:]))  # the fix the message suggests
    assert store.refresh() == {"steps": 1}
    steps = store.table("steps")
    assert steps[["rank", "step"]].values.tolist() == [[0, 0], [0, 1], [0, 2], [0, 3], [1, 0], [1, 1], [1, 2], [1, 4]]
    pd.testing.assert_frame_equal(steps, RunStore.open(run).table("steps"))


def test_conform_adds_missing_columns_as_null_and_casts_to_schema_dtypes():
    df = pd.DataFrame({"step": [2, 1], "rank": [3, 3], "loss": [0.5, None], "other": ["x", "y"]})
    out = conform(df, "steps")
    assert list(out.columns) == list(SCHEMAS["steps"])
    assert str(out["rank"].dtype) == "Int32" and str(out["start_ns"].dtype) == "Int64"
    assert out["step"].tolist() == [2, 1] and out["start_ns"].isna().all()
    assert out["loss"].iloc[0] == 0.5 and pd.isna(out["loss"].iloc[1])


@pytest.mark.parametrize("line,column,expected", [
    (b'{"rank": 0, "step": 3, "tokens": 64.0}\n', "tokens", 64),  # integral float into an int column
    (b'{"rank": 0, "step": 3, "loss": 2}\n', "loss", 2.0),  # int into a float column
    (b'{"rank": 0, "step": 3, "loss": null}\n', "loss", None),
    (b'{"rank": 0, "step": 3, "future_column": [1, 2]}\n', "step", 3),  # unknown keys ignored
])
def test_reader_accepts_lossless_json_number_forms(tmp_path, line, column, expected):
    run = make_run(tmp_path / "r", offsets={0: 0})
    append(events(run, "steps", 0), line)
    value = RunStore.open(run).table("steps")[column].iloc[-1]
    assert (pd.isna(value) if expected is None else value == expected)


def test_reader_refuses_fractional_value_in_int_column(tmp_path):
    run = make_run(tmp_path / "r", offsets={0: 0})
    append(events(run, "steps", 0), b'{"rank": 0, "step": 3, "tokens": 64.5}\n')
    with pytest.raises(TraceError, match=r"line 4 does not match the 'steps' table schema"):
        RunStore.open(run)


def test_reader_reads_a_line_longer_than_the_arrow_block(tmp_path):
    run = make_run(tmp_path / "r", offsets={0: 0})
    detail = "x" * (5 << 20)
    w = RankWriter(run, 0)
    w.write("faults", {"time_ns": T0, "kind": "hang", "detail": detail})
    w.write("faults", {"time_ns": T0 + 1, "kind": "crash"})
    w.close()
    faults = RunStore.open(run).table("faults")
    assert faults["kind"].tolist() == ["hang", "crash", "straggler"] and faults["detail"].iloc[0] == detail


def test_reader_reads_in_bounded_pieces_with_same_result(tmp_path, monkeypatch):
    import dtprobe.store.jsonl as jsonl

    run = make_run(tmp_path / "r", offsets={0: 0, 1: 1_000_000}, steps=50)
    append(events(run, "steps", 1), b'{"rank": 1, "step": 50, "lo')  # torn last line
    expected = RunStore.open(run).table("steps")
    monkeypatch.setattr(jsonl, "_READ_BYTES", 100)  # lines are ~110 bytes: every read ends mid-line
    got = RunStore.open(run).table("steps")
    pd.testing.assert_frame_equal(got, expected)
    assert len(got) == 100
    append(events(run, "steps", 0), b'{"rank": 0, "step": 50}\n{"rank": 0, oops}\n{"rank": 0, "step": 52}\n')
    with pytest.raises(TraceError, match=r"rank00000.jsonl' line 52 is not valid JSON"):
        RunStore.open(run)


def test_store_shared_by_threads_reads_each_row_once(tmp_path):
    import threading

    run = make_run(tmp_path / "r", offsets={0: 0}, steps=0)
    store = RunStore.open(run)
    stop = threading.Event()

    def reader() -> None:
        while not stop.is_set():
            store.refresh()
            store.table("steps")

    threads = [threading.Thread(target=reader) for _ in range(3)]
    for t in threads:
        t.start()
    w = RankWriter(run, 0, flush_interval_s=0.0)
    for step in range(2000):
        w.write("steps", {"step": step})
    w.close()
    stop.set()
    for t in threads:
        t.join(timeout=60)
    store.refresh()
    assert store.table("steps")["step"].tolist() == list(range(2000))


# ------------------------------------------------------------------------------------------------ many ranks, windows


def test_many_ranks_are_parsed_side_by_side_with_the_same_rows_as_one_by_one(tmp_path, monkeypatch):
    from dtprobe.store import reader

    run = make_run(tmp_path / "r", offsets={r: 100 * r for r in range(12)}, steps=5)
    parallel = RunStore.open(run)
    monkeypatch.setattr(reader, "_PARSE_THREADS", 1)
    serial = RunStore.open(run)
    assert len(serial.table("steps")) == 60
    pd.testing.assert_frame_equal(parallel.table("steps"), serial.table("steps"))
    assert parallel.cursors() == serial.cursors()


def test_a_damaged_file_among_many_is_named_and_the_other_ranks_rows_are_kept(tmp_path):
    run = make_run(tmp_path / "r", offsets={r: 0 for r in range(10)}, steps=2)
    store = RunStore.open(run)
    for rank in range(10):
        damage = b'{"step": 3, bad}\n{"step": 4}\n' if rank == 6 else b""
        append(events(run, "steps", rank), b'{"step": 2}\n' + damage)
    with pytest.raises(TraceError) as err:
        store.refresh()
    assert f"'{events(run, 'steps', 6)}' line 4 is not valid JSON" in str(err.value)
    assert store.num_rows()["steps"] == 20 + 9  # the nine intact files advanced; rank 6 stays where it was
    assert store.cursors()["events/steps/rank00006.jsonl"][1] == 2


def test_a_step_window_equals_the_filtered_whole_table_and_skips_rows_outside_steps(tmp_path):
    run = make_run(tmp_path / "r", offsets={0: 0, 1: 700}, steps=6)
    w = RankWriter(run, 1)
    w.write("groups", WORLD_GROUP)
    w.write("collectives", {"pg": "world", "seq": 1, "op": "barrier", "enqueue_ns": T0, "step": -1})
    for step in range(6):
        w.write("collectives", {"pg": "world", "seq": step + 2, "op": "allreduce", "enqueue_ns": T0 + step,
                                "step": step})
    w.close()
    store = RunStore.open(run)
    assert store.last_step() == 5 and store.num_steps() == 6 and store.last_step("collectives") == 5
    for table in ("steps", "collectives"):
        whole = store.table(table)
        window = store.table(table, min_step=4)
        expected = whole[whole["step"] >= 4].reset_index(drop=True)
        pd.testing.assert_frame_equal(window.reset_index(drop=True), expected)
    assert sorted(store.table("steps", min_step=4)["step"].unique()) == [4, 5]
    win = store.table("steps", min_step=4)
    assert win.loc[(win["rank"] == 1) & (win["step"] == 4), "start_ns"].item() == T0 + 4000 + 700  # aligned
    assert len(store.table("faults", min_step=4)) == 0 and len(store.table("faults", min_step=1)) == 1


def test_a_refresh_parses_the_small_increments_of_every_rank_in_one_call_with_the_same_rows(tmp_path, monkeypatch):
    from dtprobe.store import jsonl, reader

    run = make_run(tmp_path / "r", offsets={r: 10 * r for r in range(12)}, steps=3)
    store = RunStore.open(run)
    calls = []
    real = jsonl.pajson.read_json
    monkeypatch.setattr(jsonl.pajson, "read_json", lambda *a, **k: calls.append(1) or real(*a, **k))
    for rank in range(12):  # one rank's line has no "rank" key: it is filled in from the file, as one by one
        line = b'{"step": 3, "start_ns": 5}\n' if rank == 7 else b'{"rank": %d, "step": 3, "start_ns": 5}\n' % rank
        append(events(run, "steps", rank), line + b'{"rank": %d, "step": 4, "sta' % rank)  # + a torn line
    assert store.refresh() == {"steps": 12} and len(calls) == 1
    monkeypatch.setattr(reader, "_BATCH_BYTES", 0)
    one_by_one = RunStore.open(run)
    pd.testing.assert_frame_equal(store.table("steps"), one_by_one.table("steps"))
    assert store.cursors() == one_by_one.cursors()
    assert store.table("steps").query("step == 3")["start_ns"].tolist() == [5 + 10 * r for r in range(12)]


# ------------------------------------------------------------------------------------------------ tail-first open


def _long_run(run_dir: Path, *, ranks: int = 3, steps: int = 50) -> Path:
    """Steps and collectives (two per step, a step -1 one every 10 steps, as checkpoint barriers are) per rank."""
    create_manifest(run_dir, run_id=run_dir.name, command=["t"], config={}, world_size=ranks)
    for rank in range(ranks):
        write_rank_info(run_dir, rank, host="h", node_rank=0, local_rank=rank, device="cpu", pid=rank,
                        clock_offset_ns=0)
        w = RankWriter(run_dir, rank)
        w.write("groups", {**WORLD_GROUP, "pg_ranks": ",".join(map(str, range(ranks))), "pg_size": ranks})
        seq = 0
        for step in range(steps):
            w.write("steps", {"step": step, "start_ns": T0 + step, "end_ns": T0 + step + 1})
            for _ in range(2):
                seq += 1
                w.write("collectives", {"pg": "world", "seq": seq, "op": "allreduce", "enqueue_ns": T0 + seq,
                                        "step": step})
            if step % 10 == 9:
                seq += 1
                w.write("collectives", {"pg": "world", "seq": seq, "op": "barrier", "enqueue_ns": T0 + seq, "step": -1})
        w.write("faults", {"time_ns": T0, "step": 2, "kind": "restart", "injected": False})
        w.close()
    return run_dir


def test_a_tail_open_reads_only_the_newest_steps_and_load_head_completes_it(tmp_path):
    run = _long_run(tmp_path / "r")
    full = RunStore.open(run)
    tail = RunStore.open(run, tail_steps=15)
    assert tail.is_partial and tail.tail_from_step == 35 and not full.is_partial
    assert tail.num_rows()["steps"] == 3 * 15 and tail.num_rows()["faults"] == 3  # rare events: whole
    assert tail.last_step() == 49 and tail.num_steps() == 50 == full.num_steps()
    for table in ("steps", "collectives"):
        pd.testing.assert_frame_equal(tail.table(table, min_step=35), full.table(table, min_step=35))
    assert tail.cursors() == full.cursors()  # exact byte and line positions: errors name the right line
    tail_collectives = 3 * (15 * 2 + 2)  # two per step and the step -1 barriers after step 39 and step 49
    assert tail.num_rows()["collectives"] == tail_collectives
    assert tail.load_head() == len(full.table("steps")) - 45 + len(full.table("collectives")) - tail_collectives
    assert not tail.is_partial and tail.tail_from_step is None
    for table in ("steps", "collectives", "faults"):
        pd.testing.assert_frame_equal(tail.table(table), full.table(table))


def test_a_tail_open_of_a_short_run_reads_everything(tmp_path):
    run = _long_run(tmp_path / "r", steps=8)
    store = RunStore.open(run, tail_steps=15)
    assert not store.is_partial and store.num_rows()["steps"] == 24


def test_a_tail_open_keeps_new_lines_and_skips_a_torn_one(tmp_path):
    run = _long_run(tmp_path / "r")
    append(events(run, "steps", 1), b'{"step": 50, "start_ns": 7}\n{"step": 51, "sta')
    tail = RunStore.open(run, tail_steps=10)
    assert tail.tail_from_step == 41 and sorted(tail.table("steps").query("rank == 1")["step"]) == list(range(41, 51))
    append(events(run, "steps", 1), b'rt_ns": 8}\n')
    assert tail.refresh() == {"steps": 1}
    bad = events(run, "steps", 2)
    append(bad, b'{"step": 50, oops}\n')
    with pytest.raises(TraceError, match=f"'{bad}' line 51 is not valid JSON"):
        tail.refresh()
