"""The README's attach example (examples/attach_ddp.py) under torchrun: a user's own script gets the telemetry."""

from __future__ import annotations

import subprocess

import pytest

from dtprobe.runtime.model import build_model
from dtprobe.store import RunStore


@pytest.mark.multiproc
def test_attach_example_records_steps_ddp_allreduces_devices_and_a_finished_manifest(
        tmp_path, repo_root, torchrun_cmd, child_env):
    run = tmp_path / "attach-run"
    cmd = torchrun_cmd(repo_root / "examples" / "attach_ddp.py", run, nproc=2)
    proc = subprocess.run(cmd, env=child_env(), timeout=300, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]

    store = RunStore.open(run)
    assert store.manifest.status == "finished" and store.manifest.world_size == 2
    steps = store.table("steps")
    assert sorted(steps.groupby("rank").size().tolist()) == [8, 8]
    assert (steps["fwd_ns"] > 0).all() and (steps["tokens"] == 4 * 32).all()

    grad_bytes = sum(p.numel() * p.element_size() for p in build_model("tiny", seed=0).parameters())
    coll = store.table("collectives")
    allreduce = coll[(coll["op"] == "allreduce") & (coll["step"] >= 1)]
    per_step = allreduce.groupby(["rank", "step"])["num_bytes"].sum()
    assert set(per_step.tolist()) == {grad_bytes}
    assert set(store.table("devices")["rank"].tolist()) == {0, 1}
    traces = sorted(p.name for p in (run / "traces").rglob("*.json*"))
    assert len(traces) == 2
