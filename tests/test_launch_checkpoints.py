"""A script's own checkpoints under ``dtprobe launch`` (``collectors.launch_checkpoints``): DCP saves and loads and
``torch.save`` to a file become ``checkpoints`` rows, and CHECKPOINT_STALL judges them."""

from __future__ import annotations

import io
import json
import sys
import time

import pandas as pd
import pytest
import torch
import torch.distributed.checkpoint as dcp   # imported by the script before its probe starts, as scripts do

from dtprobe.analysis.checkpoints import checkpoint_events
from dtprobe.collectors.launch_checkpoints import CheckpointTimer
from dtprobe.store import RunStore

LAUNCH_TIMEOUT_S = 240


@pytest.fixture
def timer():
    rows: list[dict] = []
    t = CheckpointTimer()
    original = torch.save
    t.install()
    t.start(lambda table, row: rows.append({"table": table, **row}), lambda: 7, 0)
    try:
        yield t, rows
    finally:
        t.close()
        assert torch.save is original               # close puts every function back


def test_a_torch_save_to_a_file_is_a_blocking_save_of_the_file_s_size_and_one_to_a_buffer_is_none(timer, tmp_path):
    _, rows = timer
    path = tmp_path / "model.pt"
    torch.save({"w": torch.ones(1000)}, path)
    torch.save({"w": torch.ones(1000)}, io.BytesIO())              # not a file: not a checkpoint
    [row] = rows
    assert (row["table"], row["step"], row["kind"], row["ok"], row["path"]) == ("checkpoints", 7, "save", True,
                                                                                 str(path))
    assert row["num_bytes"] == path.stat().st_size and row["blocking_ns"] > 0 and row["async_ns"] == 0
    assert row["total_ns"] == row["blocking_ns"]


def test_a_save_that_raises_is_recorded_failed(timer, tmp_path):
    _, rows = timer
    with pytest.raises(Exception):
        torch.save({"w": torch.ones(10)}, tmp_path / "no-such-dir" / "model.pt")
    [row] = rows
    assert row["ok"] is False and row["num_bytes"] is None


def test_a_save_on_another_thread_does_not_block_training(timer, tmp_path):
    import threading

    _, rows = timer
    worker = threading.Thread(target=torch.save, args=({"w": torch.ones(1000)}, tmp_path / "bg.pt"))
    worker.start()
    worker.join()
    [row] = rows
    assert row["blocking_ns"] == 0 and row["async_ns"] > 0 and row["total_ns"] == row["async_ns"]


def test_dcp_save_async_save_and_load_are_one_row_each_with_this_rank_s_shard_bytes(timer, tmp_path):
    _, rows = timer
    state = {"w": torch.ones(10_000)}
    dcp.save(state, checkpoint_id=tmp_path / "a", no_dist=True)
    future = dcp.async_save(state, checkpoint_id=tmp_path / "b", no_dist=True)
    future.result()
    deadline = time.monotonic() + 10
    while len(rows) < 2 and time.monotonic() < deadline:    # the async row is written by the future's callback
        time.sleep(0.01)
    dcp.load({"w": torch.zeros(10_000)}, checkpoint_id=tmp_path / "a", no_dist=True)
    shard = sum(p.stat().st_size for p in (tmp_path / "a").glob("__0_*.distcp"))
    assert [(r["kind"], r["path"]) for r in rows] == [("save", str(tmp_path / "a")), ("save", str(tmp_path / "b")),
                                                      ("load", str(tmp_path / "a"))]
    assert all(r["num_bytes"] == shard > 40_000 and r["ok"] for r in rows)
    assert rows[1]["async_ns"] > 0 and rows[1]["total_ns"] == rows[1]["blocking_ns"] + rows[1]["async_ns"]


def test_nothing_is_recorded_before_start_or_after_close(tmp_path):
    rows: list[dict] = []
    t = CheckpointTimer()
    t.install()
    try:
        torch.save({"w": torch.ones(10)}, tmp_path / "before.pt")
        t.start(lambda table, row: rows.append(row), lambda: 0, 0)
        torch.save({"w": torch.ones(10)}, tmp_path / "during.pt")
    finally:
        t.close()
    torch.save({"w": torch.ones(10)}, tmp_path / "after.pt")
    assert [r["path"] for r in rows] == [str(tmp_path / "during.pt")]


def test_a_checkpoint_module_imported_after_start_is_timed_from_the_next_optimizer_step(tmp_path, monkeypatch):
    # Lightning's checkpoint writer, imported by the script after the probe attached: patched at the next step
    import types

    class TorchCheckpointIO:
        def save_checkpoint(self, checkpoint, path, storage_options=None):
            torch.save(checkpoint, io.BytesIO())             # Lightning's way: a buffer, then written by fsspec
            with open(path, "wb") as f:
                f.write(b"x" * 100)

    module = types.ModuleType("lightning_fabric.plugins.io.torch_io")
    module.TorchCheckpointIO = TorchCheckpointIO
    original = TorchCheckpointIO.save_checkpoint
    rows: list[dict] = []
    t = CheckpointTimer()
    t.install()
    t.start(lambda table, row: rows.append(row), lambda: 3, 0)
    try:
        monkeypatch.setitem(sys.modules, "lightning_fabric.plugins.io.torch_io", module)
        TorchCheckpointIO().save_checkpoint({}, tmp_path / "before.ckpt")        # no step yet since the import
        weight = torch.nn.Parameter(torch.ones(2))
        weight.grad = torch.ones(2)
        torch.optim.SGD([weight], lr=0.1).step()
        TorchCheckpointIO().save_checkpoint({}, tmp_path / "after.ckpt")
    finally:
        t.close()
    assert [(r["path"], r["num_bytes"], r["step"]) for r in rows] == [(str(tmp_path / "after.ckpt"), 100, 3)]
    assert TorchCheckpointIO.save_checkpoint is original


def test_a_rank_s_several_files_of_one_checkpoint_are_summed_before_the_slowest_rank_is_taken():
    # rank 0 writes the model then the optimizer (two torch.save calls), rank 1 one DCP shard
    rows = pd.DataFrame([
        {"rank": 0, "step": 4, "kind": "save", "blocking_ns": 30, "async_ns": 0, "total_ns": 30, "num_bytes": 3,
         "ok": True},
        {"rank": 0, "step": 4, "kind": "save", "blocking_ns": 50, "async_ns": 0, "total_ns": 50, "num_bytes": 5,
         "ok": True},
        {"rank": 1, "step": 4, "kind": "save", "blocking_ns": 60, "async_ns": 0, "total_ns": 60, "num_bytes": 4,
         "ok": True}])
    [event] = checkpoint_events(rows).to_dict("records")
    assert (event["slowest_rank"], event["blocking_max_ns"], event["blocking_mean_ns"], event["num_bytes"]) == (
        0, 80, 70, 12)


@pytest.mark.multiproc
@pytest.mark.parametrize("asynchronous", [False, True])
def test_launch_records_a_scripts_dcp_checkpoints_and_judges_their_stall(tmp_path, repo_root, run_cli, child_env,
                                                                         asynchronous):
    run, ckpt = tmp_path / "run", tmp_path / "ckpt"
    # 256 samples / 2 ranks / batch 16: 8 optimizer steps per rank, a checkpoint after every second one
    proc = run_cli("launch", "--nproc", "2", "--run-dir", run, "--no-devices",
                   repo_root / "examples" / "launch" / "train_ddp.py", "--ckpt-every", "2", "--ckpt-dir", ckpt,
                   *(["--ckpt-async"] if asynchronous else []), timeout_s=LAUNCH_TIMEOUT_S, env=child_env())
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = RunStore.open(run).table("checkpoints")
    for rank in (0, 1):
        mine = rows[rows["rank"] == rank].sort_values("step")
        # a save after optimizer step k (0-based k - 1) falls in the step that follows: k
        assert mine["step"].tolist() == [2, 4, 6, 8] and (mine["kind"] == "save").all()
        assert mine["path"].tolist() == [str(ckpt / f"step{k}") for k in (2, 4, 6, 8)]
        assert (mine["num_bytes"] > 0).all() and mine["ok"].all()
        assert (mine["async_ns"] > 0).all() if asynchronous else (mine["async_ns"] == 0).all()
    assert sorted(p.name for p in ckpt.iterdir()) == ["step2", "step4", "step6", "step8"]
    if not asynchronous:
        doc = json.loads(run_cli("analyze", run, "--format", "json", timeout_s=120, env=child_env()).stdout)
        [stall] = [f for f in doc["findings"] if f["code"] == "CHECKPOINT_STALL"]
        assert stall["evidence"]["num_saves"] == 4 and stall["evidence"]["interval_steps"] == 2
        assert stall["evidence"]["blocking_share_of_wall"] >= 0.05
