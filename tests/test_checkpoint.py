"""Checkpoint commit protocol: atomic commit marker, verification, corruption, pruning, resume (single process)."""

from __future__ import annotations

import os
import warnings

import orjson
import pytest
import torch

from dtprobe.runtime.checkpoint import (
    COMMIT_FILE, LATEST_FILE, CheckpointConfig, Checkpointer, CorruptCheckpoint, TrainState, committed_checkpoints,
    corrupt_checkpoint, verify_checkpoint)
from dtprobe.runtime.model import build_model
from dtprobe.store.errors import ConfigError


def _state(seed: int = 0) -> TrainState:
    model = build_model("tiny", seed=seed)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randint(0, 256, (2, 8))
    model(x).float().mean().backward()
    opt.step()
    return TrainState(model, opt)


def _checkpointer(run_dir, *, rows=None, faults=None, **kwargs) -> Checkpointer:
    config = CheckpointConfig(every=kwargs.pop("every", 5), keep=kwargs.pop("keep", 2))
    return Checkpointer(config, run_dir, rank=0, world_size=1, is_leader=True,
                        record=lambda t, r: rows.append((t, r)) if rows is not None else None,
                        fault=lambda kind, **kw: faults.append((kind, kw)) if faults is not None else None, **kwargs)


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")          # DCP warns that it runs without a process group
        yield


@pytest.mark.parametrize("step,saves", [(3, False), (4, True), (9, True), (10, False)])
def test_checkpoint_saves_after_every_kth_step(tmp_path, step, saves):
    assert _checkpointer(tmp_path).should_save(step) is saves


def test_checkpoint_commit_writes_marker_with_checksums_and_swaps_pointer(tmp_path):
    rows = []
    ck = _checkpointer(tmp_path, rows=rows)
    ck.save(_state(), step=4)
    root = tmp_path / "checkpoints"
    assert (root / LATEST_FILE).read_text().strip() == "step00000004"
    assert not list(root.glob(".tmp-*"))
    marker = verify_checkpoint(root / "step00000004")
    assert marker["step"] == 4 and ".metadata" in marker["files"]
    assert all(set(v) == {"num_bytes", "crc32"} for v in marker["files"].values())
    (table, row), = rows
    assert table == "checkpoints" and row["kind"] == "save" and row["ok"] and row["async_ns"] == 0
    assert row["num_bytes"] > 0 and row["total_ns"] == row["blocking_ns"] > 0


def test_checkpoint_keeps_only_the_newest_n_commits(tmp_path):
    ck = _checkpointer(tmp_path, keep=2)
    state = _state()
    for step in (4, 9, 14):
        ck.save(state, step=step)
    assert [s for s, _ in committed_checkpoints(tmp_path / "checkpoints")] == [14, 9]


def test_checkpoint_verify_rejects_damaged_truncated_and_unfinished_checkpoints(tmp_path):
    ck = _checkpointer(tmp_path, keep=0)
    state = _state()
    for step in (4, 9, 14):
        ck.save(state, step=step)
    root = tmp_path / "checkpoints"
    corrupt_checkpoint(root / "step00000014")
    with pytest.raises(CorruptCheckpoint, match="CRC32"):
        verify_checkpoint(root / "step00000014")
    data = next((root / "step00000009").glob("*.distcp"))
    with open(data, "r+b") as f:
        f.truncate(10)
    with pytest.raises(CorruptCheckpoint, match="truncated"):
        verify_checkpoint(root / "step00000009")
    (root / "step00000004" / COMMIT_FILE).write_text("{")
    with pytest.raises(CorruptCheckpoint, match="unreadable commit marker"):
        verify_checkpoint(root / "step00000004")


def test_checkpoint_load_skips_corrupt_newest_and_restores_the_previous_exactly(tmp_path):
    faults, rows = [], []
    ck = _checkpointer(tmp_path, keep=0, faults=faults, rows=rows, corrupt_steps=frozenset({9}))
    saved = _state(seed=1)
    ck.save(saved, step=4)
    expected = {k: v.clone() for k, v in saved.model.state_dict().items()}
    ck.save(saved, step=9)                         # damaged right after its commit
    assert faults[0][0] == "corrupt-ckpt" and faults[0][1]["injected"] is True
    fresh = _state(seed=2)
    loaded = _checkpointer(tmp_path, faults=faults, rows=rows).load_latest(fresh)
    assert loaded == 4 and fresh.step == 4
    assert all(torch.equal(expected[k], v) for k, v in fresh.model.state_dict().items())
    kind, detail = faults[-1]
    assert kind == "corrupt-ckpt" and detail["injected"] is False and detail["step"] == 9
    assert "step00000009" in detail["reason"]
    assert rows[-1][1]["kind"] == "load" and rows[-1][1]["step"] == 4


def test_checkpoint_load_returns_none_without_checkpoints_and_ignores_unfinished_saves(tmp_path):
    tmp = tmp_path / "checkpoints" / ".tmp-step00000004"
    tmp.mkdir(parents=True)
    (tmp / ".metadata").write_bytes(b"partial")
    ck = _checkpointer(tmp_path)
    assert not tmp.exists()                         # the leader cleans unfinished saves of a crashed attempt
    assert ck.load_latest(_state()) is None


def test_checkpoint_slow_injection_delays_the_write(tmp_path):
    rows, faults = [], []
    ck = _checkpointer(tmp_path, rows=rows, faults=faults, slow_delay_ms=300)
    ck.save(_state(), step=4)
    assert rows[0][1]["total_ns"] >= 0.3e9
    assert faults == [("slow-ckpt", {"step": 4, "injected": True, "delay_ms": 300})]


@pytest.mark.parametrize("kwargs,match", [({"every": -1}, "ckpt.every = -1"), ({"keep": -2}, "ckpt.keep = -2")])
def test_checkpoint_config_rejects_bad_values(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        CheckpointConfig(**kwargs)


def test_commit_marker_is_json_listing_every_file(tmp_path):
    _checkpointer(tmp_path).save(_state(), step=4)
    path = tmp_path / "checkpoints" / "step00000004"
    marker = orjson.loads((path / COMMIT_FILE).read_bytes())
    assert set(marker["files"]) == {p.name for p in path.iterdir() if p.name != COMMIT_FILE}
    assert all(marker["files"][n]["num_bytes"] == os.path.getsize(path / n) for n in marker["files"])


def test_checkpoint_async_save_returns_before_the_slow_write_and_commits_on_close(tmp_path):
    rows = []
    config = CheckpointConfig(every=5, async_save=True)
    ck = Checkpointer(config, tmp_path, rank=0, world_size=1, is_leader=True, record=lambda t, r: rows.append(r),
                      slow_delay_ms=4000)
    state = _state()
    ck.save(state, step=4)
    assert rows == [] and not (tmp_path / "checkpoints" / "step00000004").exists()    # still writing
    ck.close()
    (row,) = rows
    assert row["ok"] and row["async_ns"] >= 4e9 and row["blocking_ns"] < row["async_ns"]
    assert row["total_ns"] == row["blocking_ns"] + row["async_ns"]
    verify_checkpoint(tmp_path / "checkpoints" / "step00000004")


def test_each_rank_checksums_the_files_it_wrote_and_the_commit_reads_only_the_rest(tmp_path, monkeypatch):
    # the leader's commit would otherwise read every rank's data again: on one rank's training, growing with the
    # world size. Here the writer checksums its data file once, the commit only DCP's .metadata
    import dtprobe.runtime.checkpoint as ckpt

    read = []
    real = ckpt._crc32
    monkeypatch.setattr(ckpt, "_crc32", lambda p: read.append(p.name) or real(p))
    _checkpointer(tmp_path).save(_state(), step=4)
    path = tmp_path / "checkpoints" / "step00000004"
    data = sorted(p.name for p in path.iterdir() if p.suffix == ".distcp")
    assert data and sorted(read) == sorted(data + [".metadata"])
    assert not [p for p in path.iterdir() if p.name.endswith(ckpt.CHECKSUM_SUFFIX)]
    marker = verify_checkpoint(path)
    assert set(marker["files"]) == set(data) | {".metadata"}


def test_a_checksum_that_does_not_fit_its_file_is_not_taken(tmp_path):
    # a file rewritten after its checksum (another size), or a checksum file that cannot be read: the commit
    # checksums the file itself, and the marker verifies
    import dtprobe.runtime.checkpoint as ckpt

    path = tmp_path / "ck"
    path.mkdir()
    for name, body in (("__0_0.distcp", b"a" * 100), ("__1_0.distcp", b"b" * 50), (".metadata", b"m" * 10)):
        (path / name).write_bytes(body)
    ckpt.write_checksums(path, ["__0_0.distcp", "__1_0.distcp"])
    (path / "__0_0.distcp").write_bytes(b"c" * 120)
    (path / ("__1_0.distcp" + ckpt.CHECKSUM_SUFFIX)).write_bytes(b"{not json")
    marker = ckpt.write_commit(path, step=1, world_size=2)
    assert marker["files"]["__0_0.distcp"] == {"num_bytes": 120, "crc32": ckpt._crc32(path / "__0_0.distcp")}
    assert marker["files"]["__1_0.distcp"]["crc32"] == ckpt._crc32(path / "__1_0.distcp")
    verify_checkpoint(path)
