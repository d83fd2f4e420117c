"""``dist.get_backend()`` answers the real backend under ``dtprobe.attach`` (frameworks branch on it) while every
group's collectives are recorded, whichever way attach found torch.distributed: initialized by attach itself,
by the script before attach, or by the script on ``dtprobe_gloo`` named explicitly. 2 ranks, gloo; the worker
is ``tests/attach_backend_names_worker.py``."""

from __future__ import annotations

import json
import subprocess

import pytest

from dtprobe.store import RunStore

GROUPS = ("default", "new_group", "probe_new_group", "mesh_dp", "mesh_tp", "world")


def _run(tmp_path, repo_root, torchrun_cmd, child_env, scenario: str):
    run = tmp_path / scenario
    run.mkdir()
    cmd = torchrun_cmd(repo_root / "tests" / "attach_backend_names_worker.py", run, scenario, nproc=2)
    proc = subprocess.run(cmd, env=child_env(), timeout=240, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return RunStore.open(run), [json.loads((run / f"expect.rank{r}.json").read_text()) for r in (0, 1)]


@pytest.mark.multiproc
@pytest.mark.parametrize("scenario, backend", [
    ("before_init", "gloo"),                     # attach initializes: the plain backend, then wrapped
    ("after_init", "gloo"),                      # the script initializes: wrapped in place
    ("named_recording_backend", "dtprobe_gloo"),  # the script asked for dtprobe's backend: that is its name
])
def test_attach_keeps_every_groups_backend_name_and_records_each_group_when_initialized_by(
        tmp_path, repo_root, torchrun_cmd, child_env, scenario, backend):
    store, expect = _run(tmp_path, repo_root, torchrun_cmd, child_env, scenario)
    for ex in expect:
        assert ex["backend"] == {group: backend for group in GROUPS}

    lifecycle = store.table("lifecycle")
    assert sorted(lifecycle.groupby("rank")["event"].apply(list).tolist()) == [["attach", "close"]] * 2
    coll = store.table("collectives")
    # the DDP step: one all-reduce of all the gradients on the default group, on both ranks
    ddp = coll[coll["step"] == 0]
    assert ddp[["rank", "pg", "op", "num_bytes"]].sort_values("rank").values.tolist() == [
        [r, "world", "allreduce", expect[0]["grad_bytes"]] for r in (0, 1)]

    outside = coll[(coll["step"] == -1) & (coll["op"] == "allreduce")]
    for rank in (0, 1):
        mine = outside[outside["rank"] == rank].sort_values("enqueue_ns")
        # each group's all-reduce under its own name: the default group (also the mesh's dp axis), the plain
        # new_group, the probe's named group, the tp axis (this rank alone)
        assert mine[["pg", "pg_ranks", "num_bytes"]].values.tolist() == [
            ["world", "0,1", 12], [expect[rank]["sub_pg"], "0,1", 20], ["ckpt", "0,1", 24], ["world", "0,1", 36],
            ["tp", str(rank), 28]]
        assert (mine["end_ns"] >= mine["enqueue_ns"]).all()
