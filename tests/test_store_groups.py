"""The ``groups`` table (schema version 2): each group's members written once per rank, ``collectives`` and
``pending`` rows naming it by ``pg``. Every reader gives the same frames as for the version-1 layout (members on
every row): JSONL, compacted, mixed; a lost groups row, a conflicting one and a reader racing the writer; the
writer hands ``groups`` to the OS first; the bytes of a row of a 1,024-rank group."""

from __future__ import annotations

import json
from pathlib import Path

import orjson
import pandas as pd
import pyarrow as pa
import pytest

from dtprobe import synthetic
from dtprobe.collectors.collective_recorder import CollectiveRecorder
from dtprobe.store import RunStore, TraceError, compact
from dtprobe.store import reader as reader_module
from dtprobe.store import writer as writer_module
from dtprobe.store.groups import GroupKeys, GroupLayout
from dtprobe.store.manifest import create_manifest, write_rank_info
from dtprobe.store.writer import RankWriter

T0 = synthetic.T0


def _rows() -> dict[str, list[dict]]:
    """dp x pp rows (dp groups "0,2" and "1,3", p2p on "pp" groups) plus pending rows of two restarts, one of them
    of a group whose name the rank used before for other members."""
    tables = synthetic.dp_pp_tables(num_steps=3)
    rows = {name: [{k: (None if pd.isna(v) else v) for k, v in r.items()} for r in df.to_dict(orient="records")]
            for name, df in tables.items()}
    rows["pending"] = [
        synthetic.pending_row(0, step=3, seq=4, t_ns=T0 + 10**9, pg="dp", pg_ranks="0,2"),
        synthetic.pending_row(0, step=3, seq=1, t_ns=T0 + 2 * 10**9, pg="dp", pg_ranks="0,1,2,3", restart=1),
        synthetic.pending_row(2, step=3, seq=4, t_ns=T0 + 10**9, pg="dp", pg_ranks="0,2"),
    ]
    # rank 1 re-creates "dp" with other members in the same attempt (a second mesh): told apart by its key
    rows["collectives"].append({**rows["collectives"][-1], "rank": 1, "pg": "dp", "pg_ranks": "1", "pg_size": 1,
                                "seq": 1, "enqueue_ns": T0 + 3 * 10**9, "end_ns": T0 + 3 * 10**9 + 5})
    return rows


def _write(run_dir: Path, rows: dict[str, list[dict]], *, version: int, world_size: int = 4) -> Path:
    """A run of ``rows`` in the layout of schema ``version``: 2, what dtprobe writes (members in ``groups``); 1, by
    hand, members on every row, no groups table, run.json ``schema_version`` 1."""
    create_manifest(run_dir, run_id=run_dir.name, command=["t"], config={}, world_size=world_size)
    for r in range(world_size):
        write_rank_info(run_dir, r, host="h", node_rank=0, local_rank=r, device="cpu", pid=r, clock_offset_ns=7 * r)
    writers = {r: RankWriter(run_dir, r) for r in range(world_size)}
    for table, table_rows in (GroupLayout().split(rows) if version == 2 else rows).items():
        for row in table_rows:
            writers[int(row["rank"])].write(table, {k: v for k, v in row.items() if k != "rank" and v is not None})
    for w in writers.values():
        w.close()
    if version == 1:
        manifest = run_dir / "run.json"
        manifest.write_text(json.dumps({**json.loads(manifest.read_text()), "schema_version": 1}))
    return run_dir


def _lines(path: Path) -> list[dict]:
    return [orjson.loads(line) for line in path.read_bytes().splitlines()]


def test_group_keys_give_a_reused_name_with_other_members_its_own_key():
    keys = GroupKeys()
    assert keys.key("dp", "0,2") == ("dp", True)
    assert keys.key("dp", "0,2") == ("dp", False)
    assert keys.key("dp", "0,1,2,3") == ("dp#2", True)
    assert keys.key("dp#2", "9") == ("dp#2#2", True)     # a name that looks like a key is never confused with one
    assert keys.key("dp", "0,1,2,3") == ("dp#2", False)


def test_a_v2_run_reads_and_compacts_to_the_frames_of_the_same_run_in_the_v1_layout(tmp_path):
    rows = _rows()
    v1 = _write(tmp_path / "v1", rows, version=1)
    v2 = _write(tmp_path / "v2", rows, version=2)
    # the v2 events files: members once per (rank, restart, group), rows with the key only
    groups = _lines(v2 / "events/groups/rank00001.jsonl")
    assert [(g["pg"], g["name"], g["pg_ranks"]) for g in groups] == [("pp", "pp", "0,1"), ("dp", "dp", "1,3"),
                                                                    ("dp#2", "dp", "1")]
    assert all("pg_ranks" not in r and "pg_size" not in r
               for table in ("collectives", "pending") for r in _lines(v2 / f"events/{table}/rank00000.jsonl"))
    assert [g.get("restart") for g in _lines(v2 / "events/groups/rank00000.jsonl") if g["pg"] == "dp"] == [None, 0, 1]
    expected = {t: RunStore.open(v1).table(t) for t in ("collectives", "pending", "steps")}
    assert len(expected["collectives"]) == len(rows["collectives"]) and len(expected["pending"]) == 3
    assert set(expected["collectives"]["pg"]) == {"dp", "pp"}
    for run in (v2, v1):
        for when in ("events", "compacted"):
            if when == "compacted":
                compact(run)
            store = RunStore.open(run)
            assert store.is_compacted is (when == "compacted")
            for table, frame in expected.items():
                pd.testing.assert_frame_equal(store.table(table), frame, obj=f"{run.name} {when} {table}")


@pytest.mark.parametrize("version", [1, 2])
def test_member_lists_are_held_once_per_group_not_copied_per_row_when_read(tmp_path, version):
    rows = _rows()
    run = _write(tmp_path / f"v{version}", rows, version=version)
    written = sorted(r["pg_ranks"] for r in rows["collectives"])
    for when in ("events", "compacted"):
        if when == "compacted":
            compact(run)
        store = RunStore.open(run)
        held = store.aligned_arrow("collectives").column("pg_ranks").combine_chunks()
        assert pa.types.is_dictionary(held.type), when
        assert sorted(held.dictionary.to_pylist()) == sorted(set(written)), when     # each list once
        frame = store.table("collectives")["pg_ranks"]
        assert isinstance(frame.dtype, pd.CategoricalDtype), when
        assert list(frame.cat.categories) == sorted(set(written)), when
        assert sorted(frame.astype(object)) == written, when


def test_lines_appended_after_compaction_get_their_members_from_compacted_and_new_group_rows(tmp_path):
    rows = _rows()
    run = _write(tmp_path / "r", rows, version=2)
    compact(run)
    w = RankWriter(run, 3)
    w.write("groups", {"restart": 1, "pg": "world", "name": "world", "pg_ranks": "0,1,2,3", "pg_size": 4})
    for pg, seq, restart in (("dp", 9, None), ("world", 1, 1)):   # "dp" is in tables/groups.parquet only
        w.write("collectives", {"restart": restart, "pg": pg, "seq": seq, "op": "barrier",
                                "enqueue_ns": T0 + 5 * 10**9 + seq, "step": 9})
    w.close()
    coll = RunStore.open(run).table("collectives")
    late = coll[(coll["rank"] == 3) & (coll["step"] == 9)]
    assert late[["pg", "pg_ranks", "pg_size"]].values.tolist() == [["world", "0,1,2,3", 4], ["dp", "1,3", 2]]


def test_a_run_mixing_v1_rows_and_v2_rows_reads_each_correctly(tmp_path):
    run = tmp_path / "r"
    create_manifest(run, run_id="r", command=["t"], config={}, world_size=2)
    for r in range(2):
        write_rank_info(run, r, host="h", node_rank=0, local_rank=r, device="cpu", pid=r, clock_offset_ns=0)
    old, new = RankWriter(run, 0), RankWriter(run, 1)
    old.write("collectives", {"pg": "world", "pg_ranks": "0,1", "pg_size": 2, "seq": 1, "op": "allreduce",
                              "enqueue_ns": T0})
    new.write("groups", {"pg": "world", "name": "world", "pg_ranks": "0,1", "pg_size": 2})
    new.write("collectives", {"pg": "world", "seq": 1, "op": "allreduce", "enqueue_ns": T0})
    old.close()
    new.close()
    coll = RunStore.open(run).table("collectives")
    assert coll[["rank", "pg", "pg_ranks", "pg_size"]].values.tolist() == [[0, "world", "0,1", 2],
                                                                          [1, "world", "0,1", 2]]


def test_a_v2_row_whose_group_row_is_lost_is_an_error_naming_both_files_on_every_read(tmp_path):
    run = _write(tmp_path / "r", _rows(), version=2)
    groups_file = run / "events/groups/rank00002.jsonl"
    groups_file.write_bytes(b"")                   # lost (a copy without it, a truncation)
    message = r"events/collectives/rank00002.jsonl' has rows of group 'dp' \(restart None\) \(and 1 more groups\)" \
              r", but '.*events/groups/rank00002.jsonl' has no row for it"
    with pytest.raises(TraceError, match=message):
        RunStore.open(run)
    store = RunStore.open(run, tables=("steps",))
    with pytest.raises(TraceError, match=message):
        store.table("collectives")
    with pytest.raises(TraceError, match=message):   # the cursors went back: still an error, never fewer rows
        store.table("collectives")
    with pytest.raises(TraceError, match=message):
        compact(run)


def test_a_v1_row_without_members_stays_without_them_unless_the_run_has_groups(tmp_path):
    run = _write(tmp_path / "r", {"collectives": [{"rank": 0, "pg": "world", "seq": 1, "op": "barrier",
                                                   "enqueue_ns": T0}]}, version=1, world_size=1)
    coll = RunStore.open(run).table("collectives")
    assert coll["pg"].tolist() == ["world"] and coll["pg_ranks"].isna().all() and coll["pg_size"].isna().all()
    w = RankWriter(run, 0)                         # a newer dtprobe appends to it: its rows name groups it wrote
    w.write("groups", {"pg": "dp", "name": "dp", "pg_ranks": "0", "pg_size": 1})
    w.close()
    with pytest.raises(TraceError, match=r"has rows of group 'world' \(restart None\), but .* has no row for it"):
        RunStore.open(run)


def test_repeated_group_rows_count_once_and_conflicting_ones_are_an_error(tmp_path):
    run = tmp_path / "r"
    create_manifest(run, run_id="r", command=["t"], config={}, world_size=1)
    write_rank_info(run, 0, host="h", node_rank=0, local_rank=0, device="cpu", pid=0, clock_offset_ns=0)
    w = RankWriter(run, 0)
    group = {"restart": 0, "pg": "tp", "name": "tp", "pg_ranks": "0", "pg_size": 1}
    w.write("groups", group)
    w.write("collectives", {"restart": 0, "pg": "tp", "seq": 1, "op": "allreduce", "enqueue_ns": T0})
    w.write("groups", group)                       # the same process attached again
    w.write("collectives", {"restart": 0, "pg": "tp", "seq": 2, "op": "allreduce", "enqueue_ns": T0 + 1})
    w.flush()
    assert RunStore.open(run).table("collectives")["pg_ranks"].tolist() == ["0", "0"]
    w.write("groups", {**group, "pg_ranks": "0,1", "pg_size": 2})
    w.close()
    with pytest.raises(TraceError, match=r"rank 0 has two 'groups' rows for group 'tp' \(restart 0\) with "
                                         r"different members \('0' and '0,1'\)"):
        RunStore.open(run)


def test_a_reader_that_reads_groups_just_before_the_writer_appends_still_fills_the_rows(tmp_path, monkeypatch):
    run = _write(tmp_path / "r", {"steps": [{"rank": 0, "step": 0, "start_ns": T0}]}, version=2, world_size=1)
    store = RunStore.open(run)
    real = reader_module._events_files
    appended = []

    def events_files(run_dir, name):
        if name == "collectives" and not appended:   # the rank writes right after this refresh read groups/
            w = RankWriter(run, 0)
            w.write("collectives", {"pg": "dp", "seq": 1, "op": "allreduce", "enqueue_ns": T0})
            w.write("groups", {"pg": "dp", "name": "dp", "pg_ranks": "0", "pg_size": 1})
            w.close()
            appended.append(True)
        return real(run_dir, name)

    monkeypatch.setattr(reader_module, "_events_files", events_files)
    store.refresh()
    assert appended and store.table("collectives")[["pg", "pg_ranks", "pg_size"]].values.tolist() == [["dp", "0", 1]]


def test_the_writer_hands_groups_to_the_os_before_any_other_table(tmp_path, monkeypatch):
    order = []
    real_open = writer_module._open_for_append

    class Logged:
        def __init__(self, f, name):
            self.f, self.name = f, name

        def write(self, data):
            order.append(self.name)
            return self.f.write(data)

        def close(self):
            self.f.close()

    monkeypatch.setattr(writer_module, "_open_for_append", lambda path: Logged(real_open(path), path.parent.name))
    w = RankWriter(tmp_path, 0)
    w.write("collectives", {"pg": "tp", "seq": 1})   # the collectives buffer exists before the groups one
    w.flush()
    w.write("collectives", {"pg": "dp", "seq": 1})
    w.write("groups", {"pg": "dp", "name": "dp", "pg_ranks": "0", "pg_size": 1})
    w.close()
    assert order == ["collectives", "groups", "collectives"]


def test_a_row_of_a_1024_rank_group_costs_no_more_than_a_row_of_a_2_rank_group(tmp_path):
    members = ",".join(map(str, range(1024)))
    sizes = {}
    for name, ranks, size in (("big", members, 1024), ("small", "0,1", 2)):
        run = tmp_path / name
        create_manifest(run, run_id=name, command=["t"], config={}, world_size=1)
        write_rank_info(run, 0, host="h", node_rank=0, local_rank=0, device="cpu", pid=0, clock_offset_ns=0)
        writer, recorder = RankWriter(run, 0), CollectiveRecorder()
        recorder.start(writer, flush_interval_s=3600)
        key = recorder.group_key("dp", ranks, size)
        for seq in range(1, 1001):
            recorder.emit((key, seq, "allreduce", 1 << 20, "float32", seq // 10, "host", T0 + seq, 0, T0 + seq + 9))
        recorder.stop()
        writer.close()
        sizes[name] = (run / "events/collectives/rank00000.jsonl").stat().st_size / 1000
        assert (run / "events/groups/rank00000.jsonl").stat().st_size > len(ranks)   # the members, once
        coll = RunStore.open(run).table("collectives")
        assert len(coll) == 1000 and set(coll["pg_ranks"]) == {ranks} and set(coll["pg_size"]) == {size}
    assert sizes["big"] == sizes["small"] < 200     # bytes per row; the v1 layout repeated 4,009 more per row
    assert len(orjson.dumps({"pg_ranks": members})) > 4000


def test_a_torn_last_groups_line_is_skipped_and_cut_by_the_restarted_rank(tmp_path):
    run = _write(tmp_path / "r", {"steps": [{"rank": 0, "step": 0, "start_ns": T0}]}, version=2, world_size=1)
    w = RankWriter(run, 0)
    w.write("groups", {"restart": 0, "pg": "dp", "name": "dp", "pg_ranks": "0", "pg_size": 1})
    w.write("collectives", {"restart": 0, "pg": "dp", "seq": 1, "op": "allreduce", "enqueue_ns": T0})
    w.close()
    groups_file = run / "events/groups/rank00000.jsonl"
    with open(groups_file, "ab") as f:             # killed while writing its next group's line: no row names it yet
        f.write(b'{"rank":0,"restart":0,"pg":"tp","na')
    store = RunStore.open(run)
    assert store.table("collectives")[["pg", "pg_ranks"]].values.tolist() == [["dp", "0"]]
    assert store.table("groups")["pg"].tolist() == ["dp"]
    w = RankWriter(run, 0)                         # the restarted rank cuts the torn line, then writes its groups
    w.write("groups", {"restart": 1, "pg": "dp", "name": "dp", "pg_ranks": "0", "pg_size": 1})
    w.write("collectives", {"restart": 1, "pg": "dp", "seq": 1, "op": "allreduce", "enqueue_ns": T0 + 10})
    w.close()
    assert [line["restart"] for line in _lines(groups_file)] == [0, 1]
    store.refresh()
    coll = store.table("collectives")
    assert coll[["restart", "pg", "pg_ranks", "pg_size"]].values.tolist() == [[0, "dp", "0", 1], [1, "dp", "0", 1]]
