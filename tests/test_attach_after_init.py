"""``dtprobe.attach`` after the script's own ``init_process_group("gloo")`` (issue 16 item 1): DDP, FSDP2 and a 2-D
DeviceMesh built after it are recorded per group, a group made before it is named in the warning and not recorded.
The worker is ``tests/attach_after_init_worker.py``."""

from __future__ import annotations

import json

import pytest

from dtprobe.store import RunStore

STEPS = 3


def _run(tmp_path, repo_root, torchrun_cmd, child_env, run_to_end_timeout, scenario: str, nproc: int):
    import subprocess

    run = tmp_path / scenario
    run.mkdir()
    cmd = torchrun_cmd(repo_root / "tests" / "attach_after_init_worker.py", run, scenario, nproc=nproc)
    proc = subprocess.run(cmd, env=child_env(), timeout=run_to_end_timeout, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    expect = [json.loads((run / f"expect.rank{r}.json").read_text()) for r in range(nproc)]
    warned = [(run / f"warnings.rank{r}.txt").read_text() for r in range(nproc)]
    store = RunStore.open(run)
    return store, expect, warned


@pytest.mark.multiproc
def test_attach_after_init_records_ddp_functional_and_later_groups_and_names_the_earlier_group(
        tmp_path, repo_root, torchrun_cmd, child_env):
    store, expect, warned = _run(tmp_path, repo_root, torchrun_cmd, child_env, 240, "ddp", 2)
    assert store.manifest.status == "finished"
    for text, ex in zip(warned, expect):
        assert "1 process group(s) created before attach are NOT recorded" in text
        assert f"'{ex['early_name']}' (made_before_attach, ranks [0, 1])" in text
    coll = store.table("collectives")
    steps = store.table("steps")
    assert sorted(steps.groupby("rank").size().tolist()) == [STEPS, STEPS]

    # DDP's reducer on the default group: one bucket, all the gradients, every step, on both ranks.
    grads = coll[(coll["pg"] == "world") & (coll["op"] == "allreduce") & (coll["step"] >= 0)]
    per_step = grads.groupby(["rank", "step"])["num_bytes"].sum()
    assert per_step.to_dict() == {(r, s): expect[0]["grad_bytes"] for r in (0, 1) for s in range(STEPS)}
    assert (grads["end_ns"] >= grads["enqueue_ns"]).all()

    outside = coll[coll["step"] == -1]
    # the group made after attach: its 5-float all-reduce; the one made before: not there (7 floats)
    late = outside[outside["pg"] == expect[0]["late_pg"]]
    assert late[["rank", "op", "num_bytes"]].values.tolist() == [[0, "allreduce", 20], [1, "allreduce", 20]]
    assert not (coll["num_bytes"] == 7 * 4).any()
    # the functional all-reduce resolves the default group by name: the recording group
    func = outside[(outside["pg"] == "world") & (outside["op"] == "allreduce") & (outside["num_bytes"] == 12)]
    assert sorted(func["rank"].tolist()) == [0, 1]


@pytest.mark.multiproc
def test_attach_after_init_records_fsdp2_all_gathers_and_reduce_scatters_on_the_default_group(
        tmp_path, repo_root, torchrun_cmd, child_env):
    store, expect, warned = _run(tmp_path, repo_root, torchrun_cmd, child_env, 240, "fsdp2", 2)
    assert warned == ["", ""]                    # nothing made before attach
    coll = store.table("collectives")
    coll = coll[coll["step"] >= 0]
    assert set(coll["pg"]) == {"world"} and set(coll["pg_ranks"]) == {"0,1"}
    by = coll.groupby(["rank", "step", "op"])["num_bytes"].agg(["size", "sum"])
    params = expect[0]["param_bytes"]
    for rank in (0, 1):
        for step in range(STEPS):
            # two layers gathered in forward and again in backward (resharded after forward), all parameters;
            # their gradients reduce-scattered once
            assert by.loc[(rank, step, "allgather")].tolist() == [4, 2 * params]
            assert by.loc[(rank, step, "reduce_scatter")].tolist() == [2, params]


@pytest.mark.multiproc
def test_attach_after_init_records_a_2d_mesh_per_axis_group_under_the_axis_names(
        tmp_path, repo_root, torchrun_cmd, child_env):
    store, expect, warned = _run(tmp_path, repo_root, torchrun_cmd, child_env, 420, "mesh2d", 4)
    assert warned == ["", "", "", ""]
    coll = store.table("collectives")
    coll = coll[coll["step"] >= 0]
    assert set(coll["pg"]) == {"dp", "tp"}
    for rank in range(4):
        mine = coll[coll["rank"] == rank]
        dp, tp = mine[mine["pg"] == "dp"], mine[mine["pg"] == "tp"]
        assert set(dp["pg_ranks"]) == {",".join(map(str, expect[rank]["dp_ranks"]))}
        assert set(tp["pg_ranks"]) == {",".join(map(str, expect[rank]["tp_ranks"]))}
        # FSDP2 over dp: one all-gather and one reduce-scatter of the local (tp-sharded) parameters per step
        assert sorted(dp["op"].value_counts().items()) == [("allgather", STEPS), ("reduce_scatter", STEPS)]
        ag = dp[dp["op"] == "allgather"].groupby("step")["num_bytes"].sum()
        rs = dp[dp["op"] == "reduce_scatter"].groupby("step")["num_bytes"].sum()
        assert ag.tolist() == rs.tolist() and ag.nunique() == 1 and ag.iloc[0] > 0
        # RowwiseParallel's output all-reduce over tp: the 4 x 16 float activations, once per step
        assert tp["op"].tolist() == ["allreduce"] * STEPS and set(tp["num_bytes"]) == {4 * 16 * 4}
