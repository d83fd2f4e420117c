"""dtprobe's CUDA/NCCL code paths, driven without a GPU through the stand-in of ``tests/cuda_standin.py``: collective
rows matched to NCCL completions by sequence number (shuffled across streams, per-peer p2p, coalesced blocks),
arrival/start/end on the device clock resolved to Unix time, steady-clock WorkInfo times converted, completions
after close, the hang watchdog's progress with and without timing, reference-event drift, step phases and pipeline
actions on device events with NVTX ranges, and MFU from a recorded device name."""

from __future__ import annotations

import datetime
import json
import random
import time

import pytest
import torch
from torch._C._distributed_c10d import OpType

from dtprobe.collectors import nccl
from dtprobe.collectors.cuda_clock import DeviceClock
from dtprobe.collectors.collective_recorder import CollectiveRecorder
from dtprobe.collectors.pg_wrapper import RecordingProcessGroup

from collector_fakes import ListWriter
from cuda_standin import BOOT_UNIX_NS, Device, HostClock, StandinCuda, StandinNcclGroup

US = 1_000
MS = 1_000_000


def _setup(durations, *, drift=0.0, refresh_s=30.0, world=4):
    host = HostClock()
    sim = Device(host, drift=drift)
    cuda = StandinCuda(sim)
    inner = StandinNcclGroup(cuda, durations=durations)
    recorder, writer = CollectiveRecorder(), ListWriter()
    recorder.start(writer, flush_interval_s=3600)
    pg = RecordingProcessGroup(inner, 0, world, backend_name="dtprobe_nccl", recorder=recorder, device_timing=True)
    pg.dtprobe_name = "dp"
    clock = DeviceClock(cuda=cuda, host_ns=host.time_ns, refresh_s=refresh_s)
    assert pg.enable_completion_timing(clock=clock, steady_offset_ns=BOOT_UNIX_NS)
    return host, sim, cuda, inner, recorder, writer, pg


def _shuffle_across_streams(inner, rng):
    """An order of ``inner.infos`` that keeps each stream's works in order and interleaves streams at random."""
    by_stream: dict = {}
    for i, key in enumerate(inner.stream_of_info):
        by_stream.setdefault(key, []).append(i)
    queues = [list(q) for q in by_stream.values()]
    order = []
    while queues:
        q = rng.choice(queues)
        order.append(q.pop(0))
        if not q:
            queues.remove(q)
    return order


def test_steady_clock_workinfo_times_convert_to_unix_exactly():
    offset = BOOT_UNIX_NS
    since_boot = datetime.timedelta(seconds=3_600, microseconds=123_456)
    assert nccl.work_time_unix_ns(since_boot, steady_offset_ns=offset) == BOOT_UNIX_NS + 3_600_123_456_000
    # older torch handed system-clock time points over as naive local datetimes
    when = datetime.datetime(2026, 11, 22, 3, 0, 0, 500_000)
    assert nccl.work_time_unix_ns(when, steady_offset_ns=offset) == int(when.timestamp() * 1e6) * 1000
    assert nccl.work_time_unix_ns(None, steady_offset_ns=offset) is None
    with pytest.raises(TypeError, match="neither a timedelta"):
        nccl.work_time_unix_ns(12.5, steady_offset_ns=offset)


def test_steady_unix_offset_matches_this_machines_clocks():
    offset = nccl.steady_unix_offset_ns()
    # a steady reading taken now, converted, lands between two Unix readings around it
    before = time.time_ns()
    converted = time.monotonic_ns() + offset
    after = time.time_ns()
    assert before - 1 * MS <= converted <= after + 1 * MS
    # and it is not the old bug: a steady time point read as Unix time is decades off
    assert abs(offset) > 365 * 86_400 * 10**9 or time.monotonic_ns() > 365 * 86_400 * 10**9


def test_completions_shuffled_across_peers_are_matched_by_sequence_number_on_the_device_clock():
    rng = random.Random(7)
    plan = [("allreduce", None), ("send", 1), ("recv", 3), ("send", 2), ("allreduce", None), ("send", 1),
            ("recv", 3), ("send", 2), ("allreduce", None), ("recv", 1)]
    durations = [rng.randrange(50, 900) * US for _ in plan]
    host, sim, cuda, inner, recorder, writer, pg = _setup(durations)
    t = torch.ones(256)
    for op, peer in plan:
        cuda.compute.launch(rng.randrange(100, 3_000) * US)     # compute queued before the collective
        host.advance(rng.randrange(5, 60) * US)                  # the host runs ahead of the device
        if op == "allreduce":
            pg.allreduce([t])
        elif op == "send":
            pg.send([t], peer, 0)
        else:
            pg.recv([t], peer, 0)
    assert [r["op"] for r in recorder.pending()] == [op for op, _ in plan]
    inner.deliver(_shuffle_across_streams(inner, rng))
    recorder.stop()
    rows = writer.table("collectives")
    assert len(rows) == len(plan) and recorder.pending() == []
    by_issue = sorted(rows, key=lambda r: r["enqueue_ns"])
    for row, truth, (op, peer) in zip(by_issue, inner.truth, plan):
        assert (row["op"], row.get("peer")) == (op, peer)
        assert row["timing"] == "cuda_event"
        for column, key in (("arrive_ns", "arrive"), ("start_ns", "start"), ("end_ns", "end")):
            assert abs(row[column] - sim.unix_of(truth[key])) <= 5 * US, (op, peer, column)
        assert row["end_ns"] - row["start_ns"] == pytest.approx(truth["end"] - truth["start"], abs=1 * US)
    # per (peer, direction) numbering of the rows is the recorder's own, independent of NCCL's p2p counter
    assert [r["seq"] for r in by_issue if r["op"] == "send" and r["peer"] == 1] == [1, 2]


def test_fifo_order_would_swap_two_peers_whose_completions_arrive_reversed():
    host, sim, cuda, inner, recorder, writer, pg = _setup([900 * US, 40 * US])
    t = torch.ones(8)
    pg.send([t], 1, 0)                # long transfer to peer 1
    pg.send([t], 2, 0)                # short transfer to peer 2, on its own stream: completes first
    inner.deliver([1, 0])
    recorder.stop()
    rows = {r["peer"]: r for r in writer.table("collectives")}
    assert rows[1]["end_ns"] - rows[1]["start_ns"] == 900 * US
    assert rows[2]["end_ns"] - rows[2]["start_ns"] == 40 * US


def test_a_collective_waiting_for_the_previous_one_on_the_nccl_stream_starts_when_that_ends():
    host, sim, cuda, inner, recorder, writer, pg = _setup([5 * MS, 1 * MS])
    t = torch.ones(8)
    pg.allreduce([t])                 # arrives now, runs 5 ms
    pg.allreduce([t])                 # arrives now too, but NCCL's stream is busy until the first ends
    inner.deliver()
    recorder.stop()
    first, second = sorted(writer.table("collectives"), key=lambda r: r["seq"])
    assert abs(second["arrive_ns"] - first["arrive_ns"]) <= 5 * US
    assert abs(second["start_ns"] - first["end_ns"]) <= 1 * US
    assert second["end_ns"] - second["start_ns"] == 1 * MS


def test_a_coalesced_p2p_block_completes_as_one_work_with_each_op_its_own_arrival():
    host, sim, cuda, inner, recorder, writer, pg = _setup([100 * US, 200 * US, 300 * US, 50 * US])
    t = torch.ones(8)
    pg.allreduce([t])                                         # collective seq 1
    pg._start_coalescing(torch.device("cuda"))                # bumps the collective counter (burned)
    pg.send([t], 1, 0)
    cuda.compute.launch(70 * US)
    pg.recv([t], 3, 0)
    pg.send([t], 2, 0)
    pg._end_coalescing(torch.device("cuda"))
    assert [(i.op_type.name, i.seq) for i in inner.infos] == [("ALLREDUCE", 1), ("COALESCED", 1)]
    inner.deliver([1, 0])             # the p2p block is reported first; it still waits for the all-reduce
    recorder.stop()
    rows = sorted(writer.table("collectives"), key=lambda r: r["enqueue_ns"])
    allreduce, block = rows[0], rows[1:]
    assert [r["op"] for r in block] == ["send", "recv", "send"]
    assert len({(r["start_ns"], r["end_ns"]) for r in block}) == 1
    assert block[0]["end_ns"] - block[0]["start_ns"] == 550 * US
    assert block[1]["arrive_ns"] - block[0]["arrive_ns"] == pytest.approx(70 * US, abs=2 * US)
    assert block[0]["start_ns"] >= allreduce["end_ns"] - 1 * US


def test_completions_after_close_are_dropped_and_rows_were_written_once_without_an_end():
    host, sim, cuda, inner, recorder, writer, pg = _setup([100 * US, 100 * US])
    t = torch.ones(8)
    pg.allreduce([t])
    pg.send([t], 1, 0)
    recorder.stop()                   # a hang or an exit: in-flight rows flushed with no end
    inner.deliver()                   # the watchdog reports them later
    recorder.drain()
    rows = writer.table("collectives")
    assert len(rows) == 2 and all(r.get("end_ns") is None for r in rows)


def test_watchdog_progress_tracks_pending_nccl_collectives_with_timing():
    host, sim, cuda, inner, recorder, writer, pg = _setup([100 * US] * 3)
    t = torch.ones(8)
    pg.allreduce([t])
    pg.allreduce([t])
    pg.send([t], 1, 0)
    progress = recorder.progress()["dp"]
    assert (progress["last_issued_seq"], progress["last_completed_seq"]) == (2, 0)
    assert [r["op"] for r in recorder.pending()] == ["allreduce", "allreduce", "send"]
    inner.deliver([0])                # the first all-reduce completed; the second hangs
    assert recorder.progress()["dp"]["last_completed_seq"] == 1
    assert [r["op"] for r in recorder.pending()] == ["allreduce", "send"]
    recorder.stop()


def test_watchdog_progress_tracks_pending_nccl_collectives_without_timing():
    host = HostClock()
    sim = Device(host)
    cuda = StandinCuda(sim)
    inner = StandinNcclGroup(cuda, durations=[2 * MS, 1 * MS])
    recorder, writer = CollectiveRecorder(), ListWriter()
    recorder.start(writer, flush_interval_s=3600)
    pg = RecordingProcessGroup(inner, 0, 2, backend_name="dtprobe_nccl", recorder=recorder, device_timing=True)
    pg.dtprobe_name = "dp"
    poller = nccl.NcclCompletionPoller(recorder, interval_s=3600)   # polled by hand below
    pg.set_nccl_timing(poller)
    t = torch.ones(8)
    pg.allreduce([t])
    pg.allreduce([t])
    assert recorder.progress()["dp"]["last_completed_seq"] == 0
    assert poller.poll() == 0         # the device has not finished either
    host.advance(2 * MS + 1)          # the first one ends at 2 ms, the second at 3 ms
    assert poller.poll() == 1
    assert recorder.progress()["dp"]["last_completed_seq"] == 1
    assert [r["seq"] for r in recorder.pending()] == [2]
    host.advance(1 * MS)
    assert poller.poll() == 1 and recorder.pending() == []
    recorder.stop()
    rows = writer.table("collectives")
    assert len(rows) == 2 and all("end_ns" not in r and r["timing"] == "host" for r in rows)


def test_reference_refresh_bounds_the_error_of_a_drifting_device_clock():
    drift = 50e-6                     # the device oscillator runs 50 ppm fast
    errors = {}
    for refresh_s in (1.0, 3_600.0):
        host = HostClock()
        sim = Device(host, drift=drift)
        cuda = StandinCuda(sim)
        clock = DeviceClock(cuda=cuda, host_ns=host.time_ns, refresh_s=refresh_s)
        worst = 0
        for _ in range(40):           # one event every 0.5 s for 20 s
            host.advance(500 * MS)
            event = clock.mark()
            event.synchronize()
            worst = max(worst, abs(clock.to_unix_ns(event) - sim.unix_of(event.device_ns)))
        errors[refresh_s] = (worst, clock.references_taken)
    refreshed, stale = errors[1.0], errors[3_600.0]
    assert refreshed[1] >= 10 and stale[1] == 1
    assert refreshed[0] <= 1.0e9 * drift + 10 * US        # drift over one refresh interval, plus the bracket
    assert stale[0] >= 19.0e9 * drift                       # 20 s of drift on one reference


def test_reference_bracket_is_the_tightest_of_its_tries():
    host = HostClock()
    sim = Device(host, wait_latency_ns=6 * US)
    cuda = StandinCuda(sim)
    clock = DeviceClock(cuda=cuda, host_ns=host.time_ns)
    event = clock.mark()
    cuda.compute.launch(1 * MS)
    event.synchronize()
    assert abs(clock.to_unix_ns(event) - sim.unix_of(event.device_ns)) <= 3 * US
    assert clock.uncertainty_ns() == 3 * US


def test_elapsed_time_on_an_unfinished_event_raises_like_cuda():
    host = HostClock()
    cuda = StandinCuda(Device(host))
    start, end = cuda.Event(enable_timing=True), cuda.Event(enable_timing=True)
    start.record()
    cuda.compute.launch(1 * MS)
    end.record()
    with pytest.raises(RuntimeError, match="not ready"):
        start.elapsed_time(end)
    end.synchronize()
    assert start.elapsed_time(end) == pytest.approx(1.0)


def test_mfu_from_the_device_name_a_rank_recorded(tmp_path):
    from dtprobe.analysis import RunAnalysis
    from dtprobe.analysis.peaks import peak_flops
    from dtprobe.store import manifest as store_manifest
    from dtprobe.store.writer import RankWriter

    flops_per_token = 6 * 1e9                         # a 1B-parameter model
    store_manifest.create_manifest(tmp_path, run_id="gpu", command=["train.py"],
                                   config={"collect": {}, "model_flops_per_token": flops_per_token,
                                           "precision": {"dtype": "bf16"}}, world_size=2, nnodes=1)
    for rank in range(2):
        store_manifest.write_rank_info(tmp_path, rank, host="n0", node_rank=0, local_rank=rank,
                                       device=f"cuda:{rank}", pid=100 + rank, clock_offset_ns=0,
                                       device_name="NVIDIA H100 80GB HBM3")
        writer = RankWriter(tmp_path, rank)
        for step in range(8):                         # 1 s steps, 40k tokens per rank and step
            start = 1_800_000_000_000_000_000 + step * 10**9
            writer.write("steps", {"step": step, "start_ns": start, "end_ns": start + 10**9, "tokens": 40_000,
                                   "restart": 0, "clock": "device"})
        writer.close()
    saved = json.loads((tmp_path / "ranks" / "rank00000.json").read_text())
    assert saved["device_name"] == "NVIDIA H100 80GB HBM3"
    analysis = RunAnalysis.open(tmp_path)
    assert analysis.info.device_name == "NVIDIA H100 80GB HBM3"
    peak, _ = peak_flops("NVIDIA H100 80GB HBM3", "bf16")
    assert peak is not None and peak > 5e14
    summary = analysis.throughput_summary()
    expected = 2 * 40_000 * flops_per_token / (2 * peak)      # tokens/s x FLOPs per token over two peaks
    assert summary["mfu"] == pytest.approx(expected, rel=1e-9), summary
    assert "H100" in summary["mfu_reason"]


def test_a_cpu_rank_info_has_no_device_name_and_the_run_stays_on_the_cpu_peak(tmp_path):
    from dtprobe.store import manifest as store_manifest
    from dtprobe.store.source import run_info

    store_manifest.create_manifest(tmp_path, run_id="cpu", command=["train.py"], config={"collect": {}},
                                   world_size=1, nnodes=1)
    store_manifest.write_rank_info(tmp_path, 0, host="n0", node_rank=0, local_rank=0, device="cpu", pid=1,
                                   clock_offset_ns=0)
    assert "device_name" not in json.loads((tmp_path / "ranks" / "rank00000.json").read_text())
    assert run_info(store_manifest.read_manifest(tmp_path)).device_name == "cpu"


def test_nccl_rows_without_timing_set_up_are_written_at_issue_with_no_end_time():
    recorder, writer = CollectiveRecorder(), ListWriter()
    recorder.start(writer, flush_interval_s=3600)
    inner = StandinNcclGroup(StandinCuda(Device(HostClock())), durations=[1 * MS])
    pg = RecordingProcessGroup(inner, 0, 2, backend_name="dtprobe_nccl", recorder=recorder, device_timing=True)
    pg.allreduce([torch.ones(4)])
    recorder.stop()
    (row,) = writer.table("collectives")
    assert row["timing"] == "host" and "end_ns" not in row and row["num_bytes"] == 16


def test_batch_isend_irecv_on_a_recording_nccl_group_goes_out_as_one_coalesced_block(monkeypatch):
    import torch.distributed as dist

    from dtprobe.collectors.pg_wrapper import register_backends

    register_backends()               # installs the coalescing batch_isend_irecv
    host, sim, cuda, inner, recorder, writer, pg = _setup([300 * US, 200 * US])
    # registered as new_group would (global rank -> group rank), so P2POp can translate peers
    monkeypatch.setitem(dist.distributed_c10d._world.pg_group_ranks, pg, {r: r for r in range(4)})
    t = torch.ones(16)
    ops = [dist.P2POp(dist.isend, t, group=pg, group_peer=1), dist.P2POp(dist.irecv, t, group=pg, group_peer=3)]
    works = dist.batch_isend_irecv(ops)
    assert len(works) == 1            # one work for the block, as torch gives a plain NCCL group
    assert [(i.op_type.name, i.seq) for i in inner.infos] == [("COALESCED", 1)]
    inner.deliver()
    recorder.stop()
    rows = sorted(writer.table("collectives"), key=lambda r: r["enqueue_ns"])
    assert [(r["op"], r["peer"]) for r in rows] == [("send", 1), ("recv", 3)]    # still one row per op
    assert {r["end_ns"] - r["start_ns"] for r in rows} == {500 * US}


def _device_clock(host, sim):
    cuda = StandinCuda(sim)
    return DeviceClock(cuda=cuda, host_ns=host.time_ns), cuda


@pytest.fixture
def device_steps():
    from dtprobe.collectors import training

    host = HostClock()
    sim = Device(host, drift=20e-6)
    clock, cuda = _device_clock(host, sim)
    training.use_device_clock(clock, cuda)
    yield host, sim, cuda
    training.use_device_clock(None)


def _run_step(cuda, host, *, sync: bool):
    from dtprobe.collectors.training import StepContext

    rows = []
    ctx = StepContext(3, on_enter=lambda step: None, on_exit=lambda c: rows.append(c.row(restart=0)))
    with ctx as s:
        for name, device_ms in (("fwd", 4), ("bwd", 9), ("opt", 2)):
            with s.phase(name):
                cuda.compute.launch(device_ms * MS)     # kernels queued; the host returns at once
                host.advance(50 * US)
        if sync:
            cuda.synchronize()                           # the loop reads its loss
    return rows[0]


def test_step_phases_come_from_device_events_when_the_step_synchronized(device_steps):
    host, sim, cuda = device_steps
    row = _run_step(cuda, host, sync=True)
    assert row["clock"] == "device"
    assert row["fwd_ns"] == pytest.approx(4 * MS, abs=2 * US)
    assert row["bwd_ns"] == pytest.approx(9 * MS, abs=2 * US)
    assert row["opt_ns"] == pytest.approx(2 * MS, abs=2 * US)
    assert row["end_ns"] - row["start_ns"] == pytest.approx(15 * MS, abs=5 * US)
    assert cuda.nvtx.ranges == ["fwd", "bwd", "opt", "step 3"] and cuda.nvtx.stack == []


def test_step_phases_keep_host_times_when_the_device_is_still_running(device_steps):
    host, sim, cuda = device_steps
    row = _run_step(cuda, host, sync=False)
    assert row["clock"] == "host"
    assert row["fwd_ns"] < 1 * MS              # the host only queued the work
    assert cuda.nvtx.ranges == ["fwd", "bwd", "opt", "step 3"]


def test_steps_on_the_host_say_so():
    from dtprobe.collectors.training import StepContext

    rows = []
    with StepContext(1, on_enter=lambda step: None, on_exit=lambda c: rows.append(c.row(restart=0))) as s:
        with s.phase("fwd"):
            pass
    assert rows[0]["clock"] == "host" and rows[0]["fwd_ns"] >= 0


class _Stage:
    """A pipeline stage's action methods as ``PipelineTimer`` wraps them (torch's PipelineStage names)."""

    def __init__(self, cuda, host, stage_index, device_ms):
        self.cuda, self.host, self.stage_index, self.device_ms = cuda, host, stage_index, device_ms

    def forward_one_chunk(self, chunk, *args, **kwargs):
        self.cuda.compute.launch(self.device_ms["F"] * MS)
        self.host.advance(20 * US)

    def backward_one_chunk(self, chunk, *args, **kwargs):
        self.cuda.compute.launch(self.device_ms["B"] * MS)
        self.host.advance(20 * US)

    def backward_weight_one_chunk(self, chunk, *args, **kwargs):
        self.cuda.compute.launch(self.device_ms["W"] * MS)


def test_pipeline_actions_are_written_with_device_times_once_the_device_finished_them():
    from dtprobe.runtime.parallel.pp import PipelineTimer

    host = HostClock()
    sim = Device(host)
    clock, cuda = _device_clock(host, sim)
    written = []
    stage = _Stage(cuda, host, 1, {"F": 3, "B": 5, "W": 1})
    timer = PipelineTimer([stage], lambda table, row: written.append((table, row)), device=(clock, cuda))
    timer.start_step(7)
    for chunk in range(2):
        stage.forward_one_chunk(chunk)
    stage.backward_one_chunk(0, None, True)
    assert written == []                          # still running on the device: held, not waited for
    assert [r["clock"] for r in timer.rows] == ["host"] * 3
    cuda.synchronize()
    timer.start_step(8)                           # next step: the finished actions are written
    rows = [r for t, r in written if t == "pipeline"]
    assert [(r["action"], r["microbatch"], r["step"], r["clock"]) for r in rows] == [
        ("F", 0, 7, "device"), ("F", 1, 7, "device"), ("B", 0, 7, "device")]
    assert [r["end_ns"] - r["start_ns"] for r in rows] == pytest.approx([3 * MS, 3 * MS, 5 * MS], abs=2 * US)
    assert rows[1]["start_ns"] == pytest.approx(rows[0]["end_ns"], abs=2 * US)   # back to back on the stream
    assert cuda.nvtx.ranges == ["F1.0", "F1.1", "B1.0"]
    stage.forward_one_chunk(0)
    timer.flush()                                 # at exit: a still-running action keeps its host times
    assert [r["clock"] for t, r in written][-1] == "host"


def test_a_call_nccl_coalesces_itself_is_matched_on_the_collective_counter():
    host, sim, cuda, inner, recorder, writer, pg = _setup([100 * US, 400 * US, 50 * US])
    t = torch.ones(8)
    pg.allreduce([t])
    pg.allreduce_coalesced([t, t])    # one COALESCED work, numbered like any collective
    pg.send([t], 1, 0)                # p2p seq 1: the same number as the first all-reduce, other counter
    assert [(i.op_type.name, i.seq) for i in inner.infos] == [("ALLREDUCE", 1), ("COALESCED", 2), ("SEND", 1)]
    inner.deliver([2, 0, 1])
    recorder.stop()
    rows = sorted(writer.table("collectives"), key=lambda r: r["enqueue_ns"])
    assert [(r["op"], r["end_ns"] - r["start_ns"]) for r in rows] == [
        ("allreduce", 100 * US), ("allreduce", 400 * US), ("send", 50 * US)]


def test_the_torch_surfaces_the_nccl_path_relies_on_are_those_of_this_torch():
    """What the stand-in imitates is what this torch has: a torch upgrade that moves one fails here."""
    import inspect

    import torch.distributed as dist
    from torch._C._distributed_c10d import WorkInfo

    for name in ("_enable_collectives_timing", "_register_on_completion_hook", "_get_sequence_number_for_group",
                 "_start_coalescing", "_end_coalescing", "_get_backend"):
        assert callable(getattr(dist.ProcessGroup, name, None)), name
    assert {"op_type", "seq", "time_started", "time_finished", "active_duration"} <= set(dir(WorkInfo))
    assert "COALESCED" in OpType.__members__ and {"SEND", "RECV"} <= set(OpType.__members__)
    c10d = dist.distributed_c10d
    for name in ("_coalescing_manager", "_check_p2p_op_list", "_get_default_group", "isend", "irecv"):
        assert callable(getattr(c10d, name, None)), name
    original = getattr(c10d.batch_isend_irecv, "__wrapped__", c10d.batch_isend_irecv)
    # the reason for install_batch_p2p_coalescing: torch coalesces only for the exact ProcessGroup type
    assert "type(group) is ProcessGroup" in inspect.getsource(original)
    assert set(inspect.signature(torch.cuda.Event).parameters) >= {"enable_timing", "blocking", "interprocess"}
    assert {"record", "query", "synchronize", "elapsed_time"} <= set(dir(torch.cuda.Event))
    assert callable(torch.cuda.nvtx.range_push) and callable(torch.cuda.nvtx.range_pop)
