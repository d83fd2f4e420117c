"""Collectors end to end: 2 ranks (spawned, CPU + gloo) attach, run explicit collectives, DDP, FSDP2, DTensor TP,
steps with phases, device sampling and a profiler window; the tests read the run directory they leave."""

from __future__ import annotations

import gzip
import json
import os
import textwrap
import warnings
from pathlib import Path

import pytest

from dtprobe.store import RunStore

pytestmark = pytest.mark.multiproc

WORLD = 2
DDP_PARAM_BYTES = (32 * 64 + 64 + 64 * 64 + 64 + 64 * 8 + 8) * 4
"""Gradient bytes of the tiny DDP model (fp32): Linear(32, 64) + Linear(64, 64) + Linear(64, 8)."""
FSDP_UNIT_BYTES = {(32 * 64 + 64) * 4, (64 * 8 + 8) * 4}
"""Unsharded bytes of each fully_shard unit (one per Linear)."""


def _worker(rank: int, port: int, run_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(WORLD),
                      LOCAL_RANK=str(rank), OMP_NUM_THREADS="1")
    os.environ.pop("DTPROBE_JOB", None)
    warnings.filterwarnings("ignore")
    import torch
    import torch.distributed as dist
    import torch.nn as nn

    import dtprobe

    torch.set_num_threads(1)
    probe = dtprobe.attach(run_dir, timeout_s=60, device_interval_s=0.2, profile_steps=(1, 2))

    # Explicit collectives on the default group ("world"), outside any step.
    t = torch.ones(10)
    dist.all_reduce(t)
    out = torch.empty(10 * WORLD)
    dist.all_gather_into_tensor(out, t)
    shard = torch.empty(5)
    dist.reduce_scatter_tensor(shard, t)
    dist.broadcast(t, src=0)
    dist.barrier()
    if rank == 0:
        dist.send(torch.ones(3), dst=1)
        dist.send(torch.ones(4, dtype=torch.float64), dst=1)
        dist.recv(torch.empty(6, dtype=torch.int32), src=1)
    else:
        dist.recv(torch.empty(3), src=0)
        dist.recv(torch.empty(4, dtype=torch.float64), src=0)
        dist.send(torch.ones(6, dtype=torch.int32), dst=0)

    # DDP, 4 steps with phases; small buckets so later steps use several.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 8))
    ddp = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=0.004)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    for step in range(4):
        with probe.step(step) as s:
            with s.phase("data"):
                x = torch.randn(16, 32)
            for _ in range(2):                       # gradient accumulation: fwd/bwd twice
                with s.phase("fwd"):
                    loss = ddp(x).pow(2).mean()
                with s.phase("bwd"):
                    loss.backward()
            with s.phase("opt"):
                opt.step()
                opt.zero_grad()
            s.record(loss=loss, tokens=16, lr=0.1)

    # FSDP2 over a 1-D "dp" mesh (the mesh reuses the default group, recorded as "dp" from now on).
    from torch.distributed.fsdp import fully_shard

    mesh = probe.init_device_mesh("cpu", (WORLD,), mesh_dim_names=("dp",))
    fmodel = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 8))
    for layer in (fmodel[0], fmodel[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(fmodel, mesh=mesh)
    fopt = torch.optim.SGD(fmodel.parameters(), lr=0.1)
    for step in (10, 11):
        with probe.step(step):
            fmodel(torch.randn(16, 32)).pow(2).mean().backward()
            fopt.step()
            fopt.zero_grad()

    # DTensor tensor parallel over a "tp" axis (the same 2 ranks: the default group, now recorded as "tp").
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    import torch.distributed._functional_collectives as funcol

    tp_mesh = probe.init_device_mesh("cpu", (WORLD,), mesh_dim_names=("tp",))
    tmodel = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 16))
    parallelize_module(tmodel, tp_mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    with probe.step(15):
        tmodel(torch.randn(4, 16)).sum().backward()
        gathered = funcol.all_gather_tensor(torch.ones(3), 0, tp_mesh)
        assert gathered.sum().item() == 3 * WORLD

    # A named subgroup.
    ckpt = probe.new_group(list(range(WORLD)), name="ckpt")
    with probe.step(20):
        dist.all_reduce(torch.ones(7, dtype=torch.float16), group=ckpt)
    probe.fault("straggler", step=20, injected=True, delay_ms=40)
    probe.close()
    from dtprobe.runtime.quick_exit import quick_exit
    quick_exit(0)               # the spawned rank ends without torch's teardown (seconds per rank)


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory, free_port) -> Path:
    import torch.multiprocessing as mp

    run = tmp_path_factory.mktemp("collectors") / "run"
    ctx = mp.start_processes(_worker, args=(free_port(), str(run)), nprocs=WORLD, join=False,
                             start_method="spawn")
    try:
        while not ctx.join(timeout=240):
            pass
    except Exception:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
        raise
    return run


def _rows(run: Path, table: str, rank: int) -> list[dict]:
    path = run / "events" / table / f"rank{rank:05d}.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line]


def _coll(run: Path, rank: int, **match) -> list[dict]:
    return [r for r in _rows(run, "collectives", rank) if all(r.get(k) == v for k, v in match.items())]


def test_attach_writes_manifest_and_rank_info_with_clock_offset(run_dir):
    manifest = json.loads((run_dir / "run.json").read_text())
    assert manifest["status"] == "finished" and manifest["world_size"] == WORLD
    for rank in range(WORLD):
        info = json.loads((run_dir / "ranks" / f"rank{rank:05d}.json").read_text())
        assert info["rank"] == rank and info["device"] == "cpu" and info["pid"] > 0
        assert abs(info["clock_offset_ns"]) < 50_000_000        # same host: well under 50 ms
    assert json.loads((run_dir / "ranks" / "rank00000.json").read_text())["clock_offset_ns"] == 0


@pytest.mark.parametrize("op,num_bytes,dtype", [
    ("allreduce", 40, "float32"),
    ("allgather", 40 * WORLD, "float32"),          # gathered output
    ("reduce_scatter", 40, "float32"),             # full input, not the shard (NCCL semantics)
    ("broadcast", 40, "float32"),
    ("barrier", 0, None),
])
def test_explicit_collectives_record_op_bytes_and_same_seq_on_every_rank(run_dir, op, num_bytes, dtype):
    per_rank = [[r for r in _coll(run_dir, rank, pg="world", step=-1, op=op) if r.get("peer") is None]
                for rank in range(WORLD)]
    firsts = [rows[0] for rows in per_rank]
    for row in firsts:
        assert row["num_bytes"] == num_bytes and row.get("dtype") == dtype
        assert "pg_ranks" not in row and row["timing"] == "host"   # the members are in the group's row
        assert row["enqueue_ns"] <= row["end_ns"]
    assert firsts[0]["seq"] == firsts[1]["seq"]
    for rank in range(WORLD):
        [group] = [g for g in _rows(run_dir, "groups", rank) if g["pg"] == "world"]
        assert group == {"rank": rank, "pg": "world", "name": "world", "pg_ranks": "0,1", "pg_size": WORLD,
                         "restart": 0}
    coll = RunStore.open(run_dir).table("collectives")
    world = coll[(coll["pg"] == "world") & coll["peer"].isna()]
    assert set(world["pg_ranks"]) == {"0,1"} and set(world["pg_size"]) == {WORLD}


def test_explicit_collectives_come_first_in_issue_order(run_dir):
    ops = [r["op"] for r in _coll(run_dir, 0, pg="world") if r.get("peer") is None][:5]
    assert ops == ["allreduce", "allgather", "reduce_scatter", "broadcast", "barrier"]
    assert [r["seq"] for r in _coll(run_dir, 0, pg="world") if r.get("peer") is None][:5] == [1, 2, 3, 4, 5]


def test_send_recv_numbered_per_peer_and_direction_so_pairs_share_seq(run_dir):
    sends0 = _coll(run_dir, 0, op="send")
    recvs1 = _coll(run_dir, 1, op="recv")
    assert [(r["seq"], r["peer"], r["num_bytes"], r["dtype"]) for r in sends0] == [
        (1, 1, 12, "float32"), (2, 1, 32, "float64")]
    assert [(r["seq"], r["peer"], r["num_bytes"], r["dtype"]) for r in recvs1] == [
        (1, 0, 12, "float32"), (2, 0, 32, "float64")]
    assert [(r["seq"], r["peer"], r["num_bytes"]) for r in _coll(run_dir, 1, op="send")] == [(1, 0, 24)]
    assert [(r["seq"], r["peer"], r["num_bytes"]) for r in _coll(run_dir, 0, op="recv")] == [(1, 1, 24)]
    assert all(r["end_ns"] >= r["enqueue_ns"] for r in sends0 + recvs1)


def test_ddp_allreduce_bytes_per_step_equal_gradient_bytes_on_every_rank(run_dir):
    for rank in range(WORLD):
        for step in range(4):
            buckets = _coll(run_dir, rank, op="allreduce", step=step)
            # 2 backward passes per step (gradient accumulation): each all-reduces every gradient once
            assert sum(r["num_bytes"] for r in buckets) == 2 * DDP_PARAM_BYTES, (rank, step, buckets)
            assert all(r["pg"] == "world" and r["end_ns"] >= r["enqueue_ns"] for r in buckets), buckets
        # the very first backward runs as one bucket; DDP then rebuilds buckets of <= 4 KB (+ one tensor)
        first = min(_coll(run_dir, rank, op="allreduce", step=0), key=lambda r: r["seq"])
        assert first["num_bytes"] == DDP_PARAM_BYTES, first
        step3 = _coll(run_dir, rank, op="allreduce", step=3)
        assert len(step3) == 4, step3                                             # 2 buckets x 2 backwards
    # rows are written in completion order; the same seq on both ranks is the same bucket
    by_seq = [{r["seq"]: r["num_bytes"] for r in _coll(run_dir, rank, op="allreduce", step=3)}
              for rank in range(WORLD)]
    assert by_seq[0] == by_seq[1], by_seq


def test_fsdp2_records_allgather_and_reduce_scatter_on_the_mesh_axis_group(run_dir):
    for rank in range(WORLD):
        for step in (10, 11):
            rows = _coll(run_dir, rank, step=step)
            assert {r["pg"] for r in rows} == {"dp"}
            gathers = [r for r in rows if r["op"] == "allgather"]
            scatters = [r for r in rows if r["op"] == "reduce_scatter"]
            assert gathers and scatters
            assert {r["num_bytes"] for r in gathers} == FSDP_UNIT_BYTES             # unsharded output
            assert {r["num_bytes"] for r in scatters} == FSDP_UNIT_BYTES            # full gradient input


def test_dtensor_tp_collectives_are_recorded_on_the_tp_axis(run_dir):
    for rank in range(WORLD):
        rows = _coll(run_dir, rank, step=15)
        assert {r["pg"] for r in rows} == {"tp"}
        # RowwiseParallel all-reduces the (4, 16) fp32 output; the functional all-gather outputs 2 x 3 floats
        assert {"op": "allreduce", "num_bytes": 4 * 16 * 4} in [{"op": r["op"], "num_bytes": r["num_bytes"]}
                                                               for r in rows]
        assert {"op": "allgather", "num_bytes": 3 * WORLD * 4} in [{"op": r["op"], "num_bytes": r["num_bytes"]}
                                                                  for r in rows]


def test_named_subgroup_records_its_name_and_own_seq(run_dir):
    for rank in range(WORLD):
        (row,) = _coll(run_dir, rank, step=20)
        assert (row["pg"], row["seq"], row["op"], row["num_bytes"], row["dtype"]) == (
            "ckpt", 1, "allreduce", 14, "float16")


def test_steps_rows_have_accumulated_phases_and_recorded_values(run_dir):
    for rank in range(WORLD):
        steps = {r["step"]: r for r in _rows(run_dir, "steps", rank)}
        assert sorted(steps) == [0, 1, 2, 3, 10, 11, 15, 20]
        for step in range(4):
            row = steps[step]
            assert row["start_ns"] < row["end_ns"]
            assert all(row[f"{p}_ns"] > 0 for p in ("data", "fwd", "bwd", "opt"))
            phases = sum(row[f"{p}_ns"] for p in ("data", "fwd", "bwd", "opt"))
            assert phases <= row["end_ns"] - row["start_ns"]
            assert row["tokens"] == 16 and row["lr"] == 0.1 and row["loss"] > 0 and row["restart"] == 0
        assert "fwd_ns" not in steps[10]


def test_device_sampler_writes_host_rows_without_nvml(run_dir):
    for rank in range(WORLD):
        rows = _rows(run_dir, "devices", rank)
        assert len(rows) >= 2                                # at start and at close, at least
        assert {r["source"] for r in rows} == {"host"}
        assert all(r["rss_bytes"] > 10_000_000 and 0 <= r["cpu_frac"] <= 1 and r["load1"] >= 0 for r in rows)
        assert [r["time_ns"] for r in rows] == sorted(r["time_ns"] for r in rows)


def test_fault_rows_carry_json_detail(run_dir):
    (row,) = _rows(run_dir, "faults", 0)
    assert (row["kind"], row["step"], row["injected"], json.loads(row["detail"])) == (
        "straggler", 20, True, {"delay_ms": 40})


def test_profiler_window_traces_keep_spacing_for_hta_rank_regex(run_dir):
    window = run_dir / "traces" / "steps1-2"
    names = sorted(p.name for p in window.iterdir())
    assert names == ["rank00000.pt.trace.json.gz", "rank00001.pt.trace.json.gz"]
    text = gzip.open(window / names[1], "rt").read()
    assert '"rank": 1' in text
    trace = json.loads(text)
    steps = {e["name"] for e in trace["traceEvents"] if e.get("name", "").startswith("ProfilerStep#")}
    assert steps == {"ProfilerStep#1", "ProfilerStep#2"}


def test_hta_reads_the_profiler_window_with_both_ranks(run_dir):
    from hta.trace_analysis import TraceAnalysis

    ta = TraceAnalysis(trace_dir=str(run_dir / "traces" / "steps1-2"))
    assert sorted(ta.t.traces) == [0, 1]
    assert all(len(ta.t.get_trace(r)) > 0 for r in (0, 1))


CRASH_SCRIPT = textwrap.dedent("""
    import dtprobe
    with dtprobe.attach({run!r}, timeout_s=30, devices=False) as probe:
        with probe.step(0):
            pass
        raise RuntimeError("boom")
""")


def test_attach_context_marks_the_run_crashed_on_exception(tmp_path, run_python):
    run = tmp_path / "crash"
    proc = run_python(CRASH_SCRIPT.format(run=str(run)), timeout_s=120)
    assert proc.returncode == 1 and "boom" in proc.stderr
    manifest = json.loads((run / "run.json").read_text())
    assert manifest["status"] == "crashed" and manifest["ended_ns"] is not None
    assert [r["step"] for r in _rows(run, "steps", 0)] == [0]


def test_attach_disabled_returns_a_null_probe_that_writes_nothing(tmp_path, run_python):
    proc = run_python(textwrap.dedent("""
        import torch, torch.distributed as dist, dtprobe
        probe = dtprobe.attach({run!r} + "/off", enabled=False)
        with probe.step(0) as s:
            with s.phase("fwd"):
                dist.all_reduce(torch.ones(2))
        probe.close()
        print(type(probe).__name__, dist.get_backend())
    """).format(run=str(tmp_path)), timeout_s=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["NullProbe", "gloo"]
    assert not (tmp_path / "off").exists()


def test_attach_after_plain_init_records_the_default_group_and_later_groups_without_warning(tmp_path, run_python):
    proc = run_python(textwrap.dedent("""
        import warnings
        import torch, torch.distributed as dist, dtprobe
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            probe = dtprobe.attach({run!r} + "/late", devices=False)
        print("WARNED" if any("NOT recorded" in str(w.message) for w in caught) else "SILENT")
        dist.all_reduce(torch.ones(2))
        dist.all_reduce(torch.ones(3), group=probe.new_group([0], name="mine"))
        probe.close()
    """).format(run=str(tmp_path)), timeout_s=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["SILENT"]     # no group made before attach (issue 16: wrapped in place)
    rows = _rows(tmp_path / "late", "collectives", 0)
    assert [(r["pg"], r["op"], r["num_bytes"]) for r in rows] == [("world", "allreduce", 8), ("mine", "allreduce", 12)]
