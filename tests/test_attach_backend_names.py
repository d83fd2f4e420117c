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


def test_attach_binds_an_nccl_group_it_initializes_to_the_device(monkeypatch):
    # device_id: torch connects the communicator at once and splits later groups from it (issue 15, item 2); the
    # recording groups made for them split too (test_split_options_follow_a_bound_default_group)
    import torch
    import torch.distributed as dist

    from dtprobe.collectors import attach as attach_module

    calls = []
    monkeypatch.setattr(dist, "init_process_group", lambda backend, **kw: calls.append((backend, kw)))
    monkeypatch.setattr(torch.cuda, "set_device", lambda index: calls.append(("set_device", index)))
    for name, value in {"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    attach_module._init_process_group("nccl", timeout_s=30, local_rank=1)
    (set_device, (backend, kwargs)) = calls
    assert set_device == ("set_device", 1) and backend == "nccl"
    assert kwargs["timeout"].total_seconds() == 30
    assert str(kwargs["device_id"]) == "cuda:1"


def test_split_options_follow_a_bound_default_group(monkeypatch):
    # What dtprobe_nccl's creator asks of a new group's options: split from the default group's communicator
    # exactly when torch would split its own NCCL group (a default group bound to a device), with torch's color
    from types import SimpleNamespace

    import torch
    import torch.distributed as dist

    from dtprobe.collectors import torch_internals

    c10d = dist.distributed_c10d
    source = object()
    default = SimpleNamespace(bound_device_id=None)
    monkeypatch.setattr(c10d, "is_initialized", lambda: True)
    monkeypatch.setattr(c10d, "_get_default_group", lambda: default)
    monkeypatch.setattr(c10d, "_get_split_source", lambda pg: source if pg is default else None)
    options = SimpleNamespace()
    assert torch_internals.split_from_bound_default(options, [0, 2]) is False and vars(options) == {}
    default.bound_device_id = torch.device("cuda", 0)
    assert torch_internals.split_from_bound_default(options, [0, 2]) is True
    assert options.split_from is source
    assert options.split_color == c10d._process_group_color([0, 2]) != c10d._process_group_color([1, 3])
    monkeypatch.setattr(c10d, "_get_split_source", lambda pg: None)      # a backend that cannot split
    assert torch_internals.split_from_bound_default(SimpleNamespace(), [0, 2]) is False


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
