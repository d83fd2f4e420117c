"""``read_manifest`` parses a rank-info file again only when it changed: a live refresh of a 1,024-rank run lists
``ranks/`` instead of parsing every file, and still sees a rank that rewrote its file (a restart) or a new one."""

from __future__ import annotations

import json

import pytest

from dtprobe.store import manifest
from dtprobe.store.errors import TraceError
from dtprobe.store.manifest import create_manifest, read_manifest, write_rank_info


def make_run(tmp_path, num_ranks: int):
    run = tmp_path / "run"
    create_manifest(run, run_id="run", command=["test"], config={}, world_size=num_ranks)
    for rank in range(num_ranks):
        write_rank_info(run, rank, host="node0", node_rank=0, local_rank=rank, device="cpu", pid=100 + rank,
                        clock_offset_ns=0)
    return run


def test_read_manifest_parses_only_rank_files_that_changed(tmp_path, monkeypatch):
    run = make_run(tmp_path, 3)
    assert [r.pid for r in read_manifest(run).ranks] == [100, 101, 102]
    parsed = []
    parse = manifest._read_rank_info
    monkeypatch.setattr(manifest, "_read_rank_info", lambda path: parsed.append(path.name) or parse(path))
    assert [r.pid for r in read_manifest(run).ranks] == [100, 101, 102]
    assert parsed == []
    write_rank_info(run, 1, host="node1", node_rank=0, local_rank=1, device="cpu", pid=555, clock_offset_ns=7,
                    restart=1)
    write_rank_info(run, 3, host="node0", node_rank=0, local_rank=3, device="cpu", pid=103, clock_offset_ns=0)
    ranks = read_manifest(run).ranks
    assert sorted(parsed) == ["rank00001.json", "rank00003.json"]
    assert [(r.rank, r.pid, r.clock_offset_ns, r.restart) for r in ranks] == [
        (0, 100, 0, 0), (1, 555, 7, 1), (2, 102, 0, 0), (3, 103, 0, 0)]


def test_read_manifest_drops_a_removed_rank_file_and_reports_a_damaged_one_every_time(tmp_path):
    run = make_run(tmp_path, 2)
    read_manifest(run)
    (run / "ranks" / "rank00001.json").unlink()
    assert [r.rank for r in read_manifest(run).ranks] == [0]
    (run / "ranks" / "rank00000.json").write_text(json.dumps({"rank": 0}))
    for _ in range(2):
        with pytest.raises(TraceError, match="lacks the keys"):
            read_manifest(run)
