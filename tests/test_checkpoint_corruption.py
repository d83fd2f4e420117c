"""Checkpoints damaged on disk from outside the job (a data file truncated, one bit flipped; no ``--inject``) are
rejected before they are loaded, and the ``corrupt-ckpt`` fault says which file failed and what was loaded instead."""

from __future__ import annotations

import json
import os
import signal
import sys
import warnings
from pathlib import Path

import pytest
import torch
from background_run import background_run, run_logs_tail, wait_for

from dtprobe.runtime.checkpoint import COMMIT_FILE, CheckpointConfig, Checkpointer, TrainState
from dtprobe.runtime.model import build_model


def _state(seed: int) -> TrainState:
    model = build_model("tiny", seed=seed)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randint(0, 256, (2, 8))).float().mean().backward()
    opt.step()
    return TrainState(model, opt)


def _checkpointer(run_dir: Path, faults: list) -> Checkpointer:
    return Checkpointer(CheckpointConfig(every=5, keep=0), run_dir, rank=0, world_size=1, is_leader=True,
                        fault=lambda kind, **kw: faults.append((kind, kw)))


def truncate(path: Path) -> None:
    """Cut the last byte of ``path`` (what a full disk or a torn copy leaves)."""
    with open(path, "r+b") as f:
        f.truncate(path.stat().st_size - 1)


def flip_one_bit(path: Path) -> None:
    """Flip the lowest bit of the middle byte of ``path`` (a storage bit error)."""
    with open(path, "r+b") as f:
        f.seek(path.stat().st_size // 2)
        byte = f.read(1)[0]
        f.seek(path.stat().st_size // 2)
        f.write(bytes([byte ^ 0x01]))


def largest_data_file(ckpt: Path) -> Path:
    return max(ckpt.glob("*.distcp"), key=lambda p: p.stat().st_size)


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")          # DCP warns that it runs without a process group
        yield


@pytest.mark.parametrize("damage,reason", [(truncate, "truncated"), (flip_one_bit, "CRC32")])
@pytest.mark.parametrize("which", ["data", ".metadata"])
def test_damaged_newest_checkpoint_is_rejected_naming_the_file_and_the_step_loaded_instead(
        tmp_path, damage, reason, which):
    faults: list = []
    saved = _state(seed=1)
    ck = _checkpointer(tmp_path, faults)
    ck.save(saved, step=4)
    expected = {k: v.clone() for k, v in saved.model.state_dict().items()}
    ck.save(_state(seed=3), step=9)
    newest = tmp_path / "checkpoints" / "step00000009"
    target = largest_data_file(newest) if which == "data" else newest / ".metadata"
    damage(target)
    fresh = _state(seed=2)
    assert _checkpointer(tmp_path, faults).load_latest(fresh) == 4
    assert all(torch.equal(expected[k], v) for k, v in fresh.model.state_dict().items())
    ((kind, detail),) = faults
    assert kind == "corrupt-ckpt" and detail["injected"] is False and detail["step"] == 9
    assert {k: detail[k] for k in ("path", "file", "ckpt_step", "fallback_step")} == {
        "path": str(newest), "file": target.name, "ckpt_step": 9, "fallback_step": 4}
    assert reason in detail["reason"] and str(target) in detail["reason"]


def test_no_usable_checkpoint_left_gives_null_fallback_for_every_rejected_one(tmp_path, capsys):
    faults: list = []
    ck = _checkpointer(tmp_path, faults)
    state = _state(seed=1)
    for step in (4, 9):
        ck.save(state, step=step)
    root = tmp_path / "checkpoints"
    flip_one_bit(largest_data_file(root / "step00000009"))
    truncate(root / "step00000004" / COMMIT_FILE)
    assert _checkpointer(tmp_path, faults).load_latest(_state(seed=2)) is None
    assert [(d["ckpt_step"], d["file"], d["fallback_step"]) for _, d in faults] == [
        (9, largest_data_file(root / "step00000009").name, None), (4, COMMIT_FILE, None)]
    assert "training starts from step 0" in capsys.readouterr().err


# ------------------------------------------------------------------------------ 2 ranks through dtprobe run


def _has_commit(ckpts: Path, step: int) -> bool:
    return (ckpts / f"step{step:08d}" / COMMIT_FILE).is_file()


@pytest.mark.multiproc
@pytest.mark.parametrize("damage", [truncate, flip_one_bit])
def test_checkpoint_damaged_on_disk_before_a_restart_is_skipped_by_the_restart(tmp_path, damage, child_env):
    run_dir = tmp_path / "run"
    ckpts = run_dir / "checkpoints"
    cmd = [sys.executable, "-m", "dtprobe.cli", "run", "--run-dir", str(run_dir), "--no-devices", "--timeout", "60",
           "--batch-size", "2", "--seq-len", "16", "--nproc", "2", "--steps", "30", "--ckpt-every", "5",
           "--ckpt-keep", "0", "--max-restarts", "1"]
    with background_run(cmd, env=child_env()) as proc:
        wait_for(lambda: _has_commit(ckpts, 9), timeout=240, proc=proc, what="the checkpoint of step 9", poll_s=0.02)
        damage(largest_data_file(ckpts / "step00000009"))     # from outside, while the job runs
        os.kill(json.loads((run_dir / "ranks" / "rank00001.json").read_text())["pid"], signal.SIGKILL)
        _, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-3000:] + "\n" + run_logs_tail(run_dir)
    from dtprobe.store import RunStore

    faults = RunStore.open(run_dir).table("faults")
    corrupt = faults[faults["kind"] == "corrupt-ckpt"]
    assert not corrupt["injected"].any() and list(corrupt["rank"]) == [0]
    detail = json.loads(corrupt["detail"].iloc[0])
    assert detail["ckpt_step"] == 9 and detail["fallback_step"] == 4 and detail["file"].endswith(".distcp")
    (restart,) = [json.loads(d) for d in faults[faults["kind"] == "restart"]["detail"]]
    assert restart["checkpoint_step"] == 4 and restart["from_step"] == 5
