"""Two or more GPUs, real NCCL: a 2-rank DDP job whose rank 1 GPU is slowed by a spinning kernel is named the
straggler on the device clock; a large activation exchanged both ways through ``batch_isend_irecv`` on the
recording group completes (coalesced) and is recorded per op with device times; groups created after attach bound
the default group to the device (a new_group leaving a rank out, a DeviceMesh) are split from its communicator and
recorded. Run: ``python3 -m pytest -m gpu``."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.multiproc,
    pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                       reason="needs two CUDA devices"),
]

WORKER = Path(__file__).resolve().parent / "gpu_worker.py"


@pytest.fixture
def torchrun(torchrun_cmd, child_env):
    """``torchrun(mode, run_dir)``: ``gpu_worker.py mode run_dir`` on 2 local ranks, to its end (10 min at most)."""
    def run(mode: str, run_dir: Path) -> None:
        proc = subprocess.run(torchrun_cmd(WORKER, mode, run_dir, nproc=2), env=child_env(), timeout=600,
                              capture_output=True, text=True)
        assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return run


def test_ddp_rank_slowed_on_its_gpu_is_named_the_straggler_on_the_device_clock(torchrun, run_cli, tmp_path):
    from dtprobe.store.resolve import open_source

    run_dir = tmp_path / "ddp"
    torchrun("ddp_straggler", run_dir)
    collectives = open_source(run_dir).table("collectives")
    assert set(collectives["timing"]) == {"cuda_event"}
    assert collectives["arrive_ns"].notna().all() and collectives["end_ns"].notna().all()
    assert (collectives["end_ns"] >= collectives["start_ns"]).all()
    steps = open_source(run_dir).table("steps")
    assert set(steps["clock"]) == {"device"}
    out = run_cli("analyze", str(run_dir), "--format", "json", timeout_s=600)
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    stragglers = [f for f in doc["findings"] if f["code"] == "STRAGGLER"]
    assert [f["ranks"] for f in stragglers] == [[1]], doc["findings"]
    assert stragglers[0]["evidence"]["clock"] == "device"


def test_large_activations_exchanged_through_batch_isend_irecv_complete_and_are_recorded(torchrun, tmp_path):
    from dtprobe.store.resolve import open_source

    run_dir = tmp_path / "pp"
    torchrun("pipeline_exchange", run_dir)
    rows = open_source(run_dir).table("collectives")
    p2p = rows[rows["op"].isin(["send", "recv"])]
    assert len(p2p) == 2 * 2 * 3                     # 2 ranks x (send + recv) x 3 steps: one row per op
    assert set(p2p["timing"]) == {"cuda_event"} and (p2p["num_bytes"] == 256 * 1024 * 1024).all()
    assert p2p["end_ns"].notna().all() and (p2p["end_ns"] > p2p["start_ns"]).all()
    # a coalesced block is one NCCL work: the send and recv of a rank and step share its start and end
    per_block = p2p.groupby(["rank", "step"])[["start_ns", "end_ns"]].nunique()
    assert (per_block == 1).all().all()


def test_groups_split_from_the_device_bound_default_group_build_and_are_recorded(torchrun, tmp_path):
    from dtprobe.store.resolve import open_source

    run_dir = tmp_path / "bound"
    torchrun("bound_groups", run_dir)
    rows = open_source(run_dir).table("collectives")
    rows = rows[rows["op"] == "allreduce"]
    assert sorted(map(tuple, rows[["rank", "pg_ranks", "num_bytes"]].values.tolist())) == [
        (0, "0", 12), (0, "0,1", 20), (1, "0,1", 20)]
    assert set(rows["timing"]) == {"cuda_event"}
