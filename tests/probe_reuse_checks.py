"""Checks shared by the tests of a framework callback that finds a probe already open (``tests/test_integration_hf.py``,
``tests/test_integration_lightning.py``): under ``dtprobe launch``, or after the script's own ``dtprobe.attach``."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Callable

import pandas as pd

from dtprobe.store import RunStore


def launch_with_callback(run_cli: Callable, env: dict[str, str], worker: Path, run: Path, callback_run: Path,
                         *args: str) -> None:
    """``dtprobe launch`` of ``worker`` on 2 ranks into ``run``, its callback given ``callback_run`` (first
    argument); checks that each rank's callback said it records into the worker's probe and that no second run
    directory was made."""
    proc = run_cli("launch", "--nproc", "2", "--run-dir", run, "--no-devices", worker, callback_run, *args,
                   timeout_s=600, env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    worker_logs = sorted(run.glob("logs/node0/*/attempt_0/*/stderr.log"))
    assert len(worker_logs) == 2
    for log in worker_logs:
        assert "records into the probe already open in this process" in log.read_text()
    assert not os.path.exists(callback_run)


def one_recorder_steps(run: Path, *, num_steps: int, grad_bytes: int) -> pd.DataFrame:
    """Checks one probe per rank (one attach and one close row, closed at exit by its opener, status finished),
    each optimizer step written once, DDP's gradients all-reduced once per step; returns the steps rows sorted
    by rank and step."""
    store = RunStore.open(run)
    assert store.manifest.status == "finished"
    lifecycle = store.table("lifecycle").sort_values(["rank", "time_ns"])
    assert lifecycle.groupby("rank")["event"].apply(list).to_dict() == {r: ["attach", "close"] for r in (0, 1)}
    assert set(lifecycle.query("event == 'close'")["reason"]) == {"exit"}
    steps = store.table("steps").sort_values(["rank", "step"])
    assert steps.groupby("rank")["step"].apply(list).to_dict() == {r: list(range(num_steps)) for r in (0, 1)}
    coll = store.table("collectives")
    # the gradients' all-reduces; a logged metric's sync (Lightning's sync_dist: a few bytes, run between two
    # steps) counts in the next step, which starts where the previous one ended
    grads = coll[(coll["op"] == "allreduce") & (coll["step"] >= 0) & (coll["num_bytes"] > 64)]
    grads = grads.groupby(["rank", "step"])["num_bytes"].sum()
    assert grads.to_dict() == {(r, s): grad_bytes for r in (0, 1) for s in range(num_steps)}
    return steps


def assert_recorded_after_training(run: Path) -> None:
    """The script's 3-float all-reduce after training is a row on both ranks: the callback left the probe open."""
    coll = RunStore.open(run).table("collectives")
    after = coll[(coll["step"] == -1) & (coll["num_bytes"] == 12)]
    assert sorted(after["rank"]) == [0, 1] and set(after["pg"]) == {"world"}
