"""``RecordingProcessGroup.split_group``: what ``dist.split_group`` and a DeviceMesh of a device-bound group call
on the parent. The recording group forwards the split to the group it wraps and returns the sub-group wrapped
the same way, so the sub-group's collectives are recorded (under its own key) and a rank outside the split gets
None. 2 ranks on gloo, which splits at the C++ level here (``dist.split_group`` itself asks for an
accelerator)."""

from __future__ import annotations

import subprocess
import textwrap

import pytest

from dtprobe.store import RunStore

WORKER = textwrap.dedent("""
    import datetime, json, sys
    from pathlib import Path
    import torch, torch.distributed as dist
    import dtprobe
    from dtprobe.collectors.pg_wrapper import RecordingProcessGroup

    run = Path(sys.argv[1])
    probe = dtprobe.attach(run, devices=False, timeout_s=60)
    parent = dist.distributed_c10d._get_default_group()
    rank = dist.get_rank()
    pair = parent.split_group([0, 1], timeout=datetime.timedelta(seconds=60), group_name="dtprobe_split_pair")
    alone = parent.split_group([0], timeout=datetime.timedelta(seconds=60), group_name="dtprobe_split_first")
    pair.allreduce([torch.ones(3)]).wait()                 # 12 bytes on the sub-group of both ranks
    if alone is not None:
        alone.allreduce([torch.ones(5)]).wait()            # 20 bytes on rank 0's own sub-group
    out = {"pair": isinstance(pair, RecordingProcessGroup), "pair_size": pair.size(), "pair_rank": pair.rank(),
           "pair_name": pair.group_name, "alone": None if alone is None else isinstance(alone, RecordingProcessGroup),
           "pair_devices": sorted(d.type for d in pair._inner._device_types),
           "pair_one_backend": pair._inner._get_backend(torch.device("cpu"))
           is pair._inner._get_backend(torch.device("cuda"))}
    (run / f"split.rank{rank}.json").write_text(json.dumps(out))
    probe.close()
    dist.destroy_process_group()
    from dtprobe.runtime.quick_exit import quick_exit
    quick_exit(0)                                          # no torch teardown (seconds per rank) after the work
""")


@pytest.mark.multiproc
def test_a_split_of_a_recording_group_is_a_recording_group_whose_collectives_are_recorded(
        tmp_path, torchrun_cmd, child_env):
    (tmp_path / "worker.py").write_text(WORKER)
    run = tmp_path / "run"
    run.mkdir()
    proc = subprocess.run(torchrun_cmd(tmp_path / "worker.py", run, nproc=2), env=child_env(), timeout=240,
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    import json
    outs = [json.loads((run / f"split.rank{r}.json").read_text()) for r in (0, 1)]
    assert [(o["pair"], o["pair_size"], o["pair_rank"], o["pair_name"]) for o in outs] == [
        (True, 2, r, "dtprobe_split_pair") for r in (0, 1)]
    assert [o["alone"] for o in outs] == [True, None]
    # like the parent (gloo for cpu and cuda), one child backend serves both device types: it was split once
    assert [(o["pair_devices"], o["pair_one_backend"]) for o in outs] == [(["cpu", "cuda"], True)] * 2
    coll = RunStore.open(run).table("collectives")
    rows = coll[coll["op"] == "allreduce"].sort_values(["rank", "enqueue_ns"])
    assert rows[["rank", "pg_ranks", "num_bytes"]].values.tolist() == [
        [0, "0,1", 12], [0, "0", 20], [1, "0,1", 12]]
    assert rows["pg"].str.startswith("g").all()        # named after their torch group, not the parent "world"


class _FakeBackend:
    def __init__(self, name: str) -> None:
        self._name = name

    def name(self) -> str:
        return self._name


class _FakeGroup:
    """What ``split_each_backend_once`` uses of a ProcessGroup: device types, backends, split, registration."""

    def __init__(self, backends: dict[str, _FakeBackend]) -> None:
        self.backends = backends
        self.splits: list[tuple[list[int], dict]] = []

    @property
    def _device_types(self):
        import torch
        return [torch.device(t) for t in self.backends]

    def _get_backend(self, device):
        return self.backends[device.type]

    def split_group(self, ranks, *args, **kwargs):
        self.splits.append((list(ranks), kwargs))
        types = [d.type for d in kwargs.get("device_types") or self._device_types]
        return _FakeGroup({t: _FakeBackend(self.backends[t].name()) for t in types})

    def _register_backend(self, device, backend_type, backend) -> None:
        self.backends[device.type] = backend


def test_a_backend_serving_two_device_types_is_split_once_from_cpu():
    import torch

    from dtprobe.collectors.pg_wrapper import split_each_backend_once

    gloo = _FakeBackend("gloo")
    parent = _FakeGroup({"cuda": gloo, "cpu": gloo})          # torch lists cuda first for a gloo world
    sub = split_each_backend_once(parent, [0, 1], group_name="pair")
    ((ranks, kwargs),) = parent.splits
    assert ranks == [0, 1] and kwargs == {"device_types": [torch.device("cpu")], "group_name": "pair"}
    assert sorted(sub.backends) == ["cpu", "cuda"] and sub.backends["cuda"] is sub.backends["cpu"]


def test_distinct_backends_and_named_device_types_are_split_as_asked():
    import torch

    from dtprobe.collectors.pg_wrapper import split_each_backend_once

    mixed = _FakeGroup({"cpu": _FakeBackend("gloo"), "cuda": _FakeBackend("nccl")})
    split_each_backend_once(mixed, [0], group_name="a")
    gloo = _FakeBackend("gloo")
    shared = _FakeGroup({"cuda": gloo, "cpu": gloo})
    split_each_backend_once(shared, [0], group_name="b", device_types=[torch.device("cuda")])
    assert [kw for _, kw in mixed.splits + shared.splits] == [
        {"group_name": "a"}, {"group_name": "b", "device_types": [torch.device("cuda")]}]
