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
    ("no_backend", "undefined"),                 # init_process_group() without one: torch's own answer, kept
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


# ---- NCCL, without a GPU: what can be checked of the path on this CPU build ----

_NCCL_DEFAULT_GROUP = """
import json
import torch, torch.distributed as dist
from dtprobe.collectors import attach as attach_module

dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
world = dist.distributed_c10d._world
old = world.default_pg
world.pg_map[old] = ("nccl", world.pg_map[old][1])
world.pg_backend_config[old] = "cuda:nccl"
"""
"""Child-process prelude: a 1-rank gloo default group registered as torch registers an NCCL one (``old``: "nccl" in
``pg_map`` and the backend config)."""


@pytest.mark.parametrize("bind_device, device_id", [(False, None), (True, "cuda:1")])
def test_attach_binds_an_nccl_group_to_the_device_only_when_it_will_not_be_recorded(monkeypatch, bind_device,
                                                                                   device_id):
    # A bound default group makes torch split later groups from its communicator (ncclCommSplit on every rank of
    # the parent), which the dtprobe_nccl groups made for the members do not join: an unrecorded job only binds.
    import torch
    import torch.distributed as dist

    from dtprobe.collectors import attach as attach_module

    calls = []
    monkeypatch.setattr(dist, "init_process_group", lambda backend, **kw: calls.append((backend, kw)))
    monkeypatch.setattr(torch.cuda, "set_device", lambda index: calls.append(("set_device", index)))
    for name, value in {"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    attach_module._init_process_group("nccl", timeout_s=30, local_rank=1, bind_device=bind_device)
    (set_device, (backend, kwargs)) = calls
    assert set_device == ("set_device", 1) and backend == "nccl"
    assert kwargs["timeout"].total_seconds() == 30
    assert (str(kwargs["device_id"]) if "device_id" in kwargs else None) == device_id


def test_attach_after_an_nccl_init_records_the_default_group_under_the_name_nccl_with_device_timing(run_python,
                                                                                                    tmp_path):
    # NCCL's device timing (nccl.time_rows) needs CUDA, so the test records the call.
    code = _NCCL_DEFAULT_GROUP + """
import sys
import dtprobe
from dtprobe.collectors.pg_wrapper import RecordingProcessGroup

timed = []
attach_module.nccl.time_rows = lambda pg, recorder, *, device_timing: timed.append((pg, device_timing))
probe = dtprobe.attach(sys.argv[1], devices=False, nccl_timing=False)
default = dist.group.WORLD
print(json.dumps({"backend": dist.get_backend(), "wrapped": isinstance(default, RecordingProcessGroup)
                  and default.inner is old, "timed": [(pg is default, flag) for pg, flag in timed]}))
probe.close()
"""
    proc = run_python(code, tmp_path / "run", timeout_s=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out == {"backend": "nccl", "wrapped": True, "timed": [[True, False]]}


def test_attach_after_an_nccl_init_bound_to_a_device_warns_that_later_groups_would_be_split(run_python):
    # torch splits groups created after a bound default group from its communicator; the recording groups made
    # for them do not split, so non-members would wait in the split forever: the user is told before it happens.
    code = _NCCL_DEFAULT_GROUP + """
import warnings

attach_module.nccl.time_rows = lambda pg, recorder, *, device_timing: None
messages = {}
for bound in (None, torch.device("cuda", 0)):
    old.bound_device_id = bound
    dist.distributed_c10d._update_default_pg(old)          # attach again on the plain group
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        attach_module._record_initialized_groups(nccl_timing=False)
    messages[str(bound)] = [str(w.message) for w in caught]
old.bound_device_id = None
print(json.dumps(messages))
"""
    proc = run_python(code, timeout_s=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["None"] == []
    (message,) = out["cuda:0"]
    assert "bound to cuda:0" in message and "init_process_group without device_id" in message
