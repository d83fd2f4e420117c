"""run.json and ranks/*.json: atomic writes, status transitions, restarts, rank infos, list_runs."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from dtprobe.store import TraceError, is_run_dir, list_runs, run_mtime_ns
from dtprobe.store.manifest import (RankInfo, Restart, add_restart, create_manifest, read_manifest, set_status,
                                    write_rank_info)
from dtprobe.store.schema import SCHEMA_VERSION
from dtprobe.store.writer import RankWriter


def new_run(path: Path, *, world_size: int = 2, nnodes: int = 1) -> Path:
    create_manifest(path, run_id=path.name, command=["dtprobe", "run", "--layout.dp=2"],
                    config={"layout": {"dp": 2}}, world_size=world_size, nnodes=nnodes)
    return path


def test_create_manifest_writes_running_run_with_schema_version(tmp_path):
    before = time.time_ns()
    run = new_run(tmp_path / "a", world_size=4, nnodes=2)
    m = read_manifest(run)
    assert (m.run_id, m.status, m.world_size, m.nnodes, m.schema_version) == ("a", "running", 4, 2, SCHEMA_VERSION)
    assert m.command == ["dtprobe", "run", "--layout.dp=2"] and m.config == {"layout": {"dp": 2}}
    assert before <= m.created_ns <= time.time_ns() and m.ended_ns is None
    assert m.restarts == () and m.ranks == () and m.nodes == ()
    assert [p.name for p in run.iterdir()] == ["run.json"]  # no temp files left behind


@pytest.mark.parametrize("status,ended", [("finished", True), ("crashed", True), ("running", False)])
def test_set_status_sets_ended_ns_only_for_terminal_states(tmp_path, status, ended):
    run = new_run(tmp_path / "a")
    set_status(run, status, error="rank 1 exited with code 1")
    m = read_manifest(run)
    assert m.status == status
    assert (m.ended_ns is not None) == ended
    assert m.extra == {"error": "rank 1 exited with code 1"}


@pytest.mark.parametrize("update", [
    lambda run: set_status(run, "finished"),
    lambda run: add_restart(run, restart=1, time_ns=0, steps_lost=None, from_step=None),
])
def test_updates_raise_file_not_found_when_run_has_no_manifest_yet(tmp_path, update):
    (tmp_path / "attach_run").mkdir()
    with pytest.raises(FileNotFoundError, match="run.json"):
        update(tmp_path / "attach_run")
    assert list((tmp_path / "attach_run").iterdir()) == []  # no lock file litter


def test_set_status_rejects_unknown_status(tmp_path):
    with pytest.raises(ValueError, match="paused"):
        set_status(new_run(tmp_path / "a"), "paused")


def test_add_restart_appends_records_and_reopens_the_run(tmp_path):
    run = new_run(tmp_path / "a")
    set_status(run, "crashed")
    add_restart(run, restart=1, time_ns=123, steps_lost=5, from_step=10)
    add_restart(run, restart=2, time_ns=456, steps_lost=None, from_step=None)
    m = read_manifest(run)
    assert m.restarts == (Restart(restart=1, time_ns=123, steps_lost=5, from_step=10),
                          Restart(restart=2, time_ns=456, steps_lost=None, from_step=None))
    assert m.status == "running" and m.ended_ns is None


def test_concurrent_status_updates_do_not_lose_restarts(tmp_path, start_python):
    run = new_run(tmp_path / "a")
    code = ("import sys; from dtprobe.store.manifest import add_restart\n"
            "for j in range(10): add_restart(sys.argv[1], restart=int(sys.argv[2]) * 10 + j, time_ns=j, "
            "steps_lost=None, from_step=None)")
    procs = [start_python(code, run, str(i)) for i in range(4)]
    assert [p.wait(timeout=60) for p in procs] == [0, 0, 0, 0]
    assert sorted(r.restart for r in read_manifest(run).restarts) == list(range(40))


def test_rank_infos_are_sorted_and_nodes_derived(tmp_path):
    run = new_run(tmp_path / "a", world_size=3, nnodes=2)
    for rank, host, node in ((2, "gpu-b", 1), (0, "gpu-a", 0), (1, "gpu-a", 0)):
        write_rank_info(run, rank, host=host, node_rank=node, local_rank=rank % 2, device=f"cuda:{rank % 2}",
                        pid=1000 + rank, clock_offset_ns=-7 * rank, restart=1)
    m = read_manifest(run)
    assert [r.rank for r in m.ranks] == [0, 1, 2]
    assert m.ranks[2] == RankInfo(rank=2, host="gpu-b", node_rank=1, local_rank=0, device="cuda:0", pid=1002,
                                  clock_offset_ns=-14, restart=1)
    assert m.nodes == ((0, "gpu-a"), (1, "gpu-b"))
    assert m.clock_offsets_ns == {0: 0, 1: -7, 2: -14}
    assert m.rank_info(1).host == "gpu-a" and m.rank_info(5) is None


def test_rank_info_whose_rank_disagrees_with_file_name_is_refused(tmp_path):
    run = new_run(tmp_path / "a")
    write_rank_info(run, 1, host="h", node_rank=0, local_rank=1, device="cpu", pid=1, clock_offset_ns=0)
    os.rename(run / "ranks" / "rank00001.json", run / "ranks" / "rank00004.json")
    with pytest.raises(TraceError, match=r"rank00004.json' says rank 1 but its name says rank 4"):
        read_manifest(run)


def _steps(run: Path, rank: int, steps: range) -> None:
    write_rank_info(run, rank, host="h", node_rank=0, local_rank=rank, device="cpu", pid=1, clock_offset_ns=0)
    w = RankWriter(run, rank)
    for s in steps:
        w.write("steps", {"step": s, "start_ns": s})
    w.close()


def test_list_runs_reports_status_world_size_steps_and_skips_non_runs(tmp_path):
    a = new_run(tmp_path / "a", world_size=2)
    _steps(a, 0, range(5))
    _steps(a, 1, range(4))
    set_status(a, "finished")
    b = new_run(tmp_path / "b", world_size=8)
    set_status(b, "crashed")
    new_run(tmp_path / "c", world_size=1)
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "run.json").write_text('{"hello": 1}')
    (tmp_path / "not_a_run").mkdir()
    (tmp_path / "link").symlink_to(a)
    (tmp_path / "file.txt").write_text("x")

    runs = list_runs(tmp_path).set_index("name")
    assert sorted(runs.index) == ["a", "b", "bad", "c"]
    assert runs.loc[["a", "b", "c", "bad"], "status"].tolist() == ["finished", "crashed", "running", "invalid"]
    assert runs.loc[["a", "b", "c"], "world_size"].tolist() == [2, 8, 1]
    assert runs.loc[["a", "b", "c"], "num_steps"].tolist() == [5, 0, 0]
    assert "is not ours" in runs.loc["bad", "error"]
    assert runs.loc[["a", "b", "c"], "error"].isna().all()
    assert (runs.loc[["a", "b", "c"], "age_s"] >= 0).all() and (runs.loc[["a", "b", "c"], "age_s"] < 600).all()
    assert list(list_runs(tmp_path)["name"][:3]) == ["c", "b", "a"]  # newest first
    assert runs.loc[["a", "b", "c"], "num_restarts"].tolist() == [0, 0, 0]


def test_list_runs_counts_restarts_and_idle_time_since_last_write(tmp_path):
    run = new_run(tmp_path / "a")
    _steps(run, 0, range(3))
    add_restart(run, restart=1, time_ns=1, steps_lost=2, from_step=1)
    old = time.time() - 3600
    for path in [run / "run.json", *run.rglob("*.json*")]:
        os.utime(path, (old, old))
    row = list_runs(tmp_path).iloc[0]
    assert row["num_restarts"] == 1
    assert 3590 < row["idle_s"] < 3700
    w = RankWriter(run, 0)
    w.write("steps", {"step": 3})
    w.close()
    assert list_runs(tmp_path).iloc[0]["idle_s"] < 60
    assert abs(run_mtime_ns(run) - (run / "events" / "steps" / "rank00000.jsonl").stat().st_mtime_ns) == 0


def test_list_runs_includes_root_when_it_is_a_run(tmp_path):
    run = new_run(tmp_path / "solo")
    runs = list_runs(run)
    assert runs["name"].tolist() == ["solo"] and runs["path"].tolist() == [str(run)]
    assert is_run_dir(run) and not is_run_dir(tmp_path)


def test_list_runs_rejects_missing_root(tmp_path):
    with pytest.raises(TraceError, match=r"'.*nope' is not a directory"):
        list_runs(tmp_path / "nope")


def test_manifest_is_plain_json_readable_by_other_tools(tmp_path):
    run = new_run(tmp_path / "a")
    data = json.loads((run / "run.json").read_text())
    assert data["format"] == "dtprobe-run" and data["schema_version"] == SCHEMA_VERSION
