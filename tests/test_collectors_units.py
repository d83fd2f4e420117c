"""Collectors in one process, with stand-ins: NVML sampler (fake pynvml), NCCL completion-hook timings (fake
inner group and WorkInfo), recorded Work completion, steps/phases, config errors, the null probe's surface."""

from __future__ import annotations

import datetime
import inspect
import time
import types

import pytest
import torch
from torch._C._distributed_c10d import OpType

from dtprobe.collectors import devices
from dtprobe.collectors.attach import Probe, attach
from dtprobe.collectors.config import CollectConfig
from dtprobe.collectors.null import NullProbe
from dtprobe.collectors.pg_wrapper import CollectiveRecorder, RecordedWork, RecordingProcessGroup
from dtprobe.collectors.training import StepContext
from dtprobe.store.errors import ConfigError


class ListWriter:
    def __init__(self) -> None:
        self.rows: list[tuple[str, dict]] = []

    def write(self, table: str, row: dict) -> None:
        self.rows.append((table, dict(row)))

    def table(self, name: str) -> list[dict]:
        return [r for t, r in self.rows if t == name]


# ---------------------------------------------------------------------------------------------- NVML stand-in

class FakeNvml:
    """Just enough of pynvml: one GPU with known readings, NVLink counters that advance, one XID event."""

    class NVMLError(Exception):
        pass

    NVML_TEMPERATURE_GPU = 0
    NVML_CLOCK_SM = 1
    NVML_PCIE_UTIL_TX_BYTES = 0
    NVML_PCIE_UTIL_RX_BYTES = 1
    NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX = 138
    NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX = 139
    nvmlEventTypeXidCriticalError = 8

    def __init__(self) -> None:
        self.nvlink_kib = 0
        self.pending_xids = [79]
        self.shutdown = False

    def nvmlInit(self): pass
    def nvmlShutdown(self): self.shutdown = True
    def nvmlDeviceGetCount(self): return 1
    def nvmlDeviceGetHandleByIndex(self, i): return ("gpu", i)
    def nvmlDeviceGetUtilizationRates(self, h): return types.SimpleNamespace(gpu=87, memory=40)
    def nvmlDeviceGetMemoryInfo(self, h): return types.SimpleNamespace(used=30 * 2**30, total=80 * 2**30)
    def nvmlDeviceGetPowerUsage(self, h): return 350_500            # mW
    def nvmlDeviceGetEnforcedPowerLimit(self, h): return 400_000    # mW
    def nvmlDeviceGetTemperature(self, h, sensor): return 71
    def nvmlDeviceGetClockInfo(self, h, clock): return 1410
    def nvmlDeviceGetCurrentClocksThrottleReasons(self, h): return 0x4   # SW power cap
    def nvmlDeviceGetPcieThroughput(self, h, counter): return 1000 if counter == 0 else 2000   # KB/s

    def nvmlDeviceGetFieldValues(self, h, ids):
        self.nvlink_kib += 1024
        return [types.SimpleNamespace(nvmlReturn=0, value=types.SimpleNamespace(ullVal=self.nvlink_kib * k))
                for k in (1, 2)]

    def nvmlDeviceGetHandleByUUID(self, uuid):
        if uuid != "GPU-abc":
            raise self.NVMLError("not found")
        return ("gpu", 0)

    def nvmlDeviceGetIndex(self, h): return h[1]

    def nvmlEventSetCreate(self): return "event-set"
    def nvmlDeviceRegisterEvents(self, h, types_, event_set): pass

    def nvmlEventSetWait_v2(self, event_set, timeout_ms):
        if not self.pending_xids:
            raise self.NVMLError("timeout")
        return types.SimpleNamespace(eventData=self.pending_xids.pop(0))


def test_nvml_sampler_writes_known_readings_when_nvml_is_present(monkeypatch):
    clock = iter([100.0, 102.0, 104.0, 106.0])
    monkeypatch.setattr(devices.time, "monotonic", lambda: next(clock))
    fake, writer = FakeNvml(), ListWriter()
    sampler = devices.DeviceSampler(writer, interval_s=60, gpu_index=0, nvml=fake, step_fn=lambda: 7)
    assert sampler.source == "nvml"
    sampler.sample_once()
    sampler.sample_once()
    rows = writer.table("devices")
    xid_rows = [r for r in rows if "xid" in r]
    first, second = [r for r in rows if "xid" not in r]
    assert [r["xid"] for r in xid_rows] == [79]
    assert first["source"] == "nvml" and first["gpu"] == 0 and first["step"] == 7
    assert (first["util_frac"], first["mem_util_frac"]) == (0.87, 0.40)
    assert (first["mem_used_bytes"], first["mem_total_bytes"]) == (30 * 2**30, 80 * 2**30)
    assert (first["power_w"], first["power_limit_w"], first["temp_c"], first["sm_clock_mhz"]) == (
        350.5, 400.0, 71.0, 1410.0)
    assert first["throttle_reasons"] == 0x4
    assert (first["pcie_tx_bytes_per_s"], first["pcie_rx_bytes_per_s"]) == (1000 * 1024.0, 2000 * 1024.0)
    assert "nvlink_tx_bytes_per_s" not in first                    # a rate needs two counter readings
    # counters advanced 1024 KiB (tx) and 2048 KiB (rx) in 2 s
    assert (second["nvlink_tx_bytes_per_s"], second["nvlink_rx_bytes_per_s"]) == (512 * 1024.0, 1024 * 1024.0)
    assert first["rss_bytes"] > 0 and "cpu_frac" in first           # the process's host metrics ride along


def test_nvml_reader_is_found_by_cuda_uuid_not_by_the_visible_index():
    reader = devices.open_nvml(5, FakeNvml(), uuid="abc")      # CUDA index 5 under CUDA_VISIBLE_DEVICES
    assert reader is not None and reader.index == 0
    assert devices.open_nvml(5, FakeNvml(), uuid="zzz") is None    # unknown uuid, no NVML index 5


def test_nvml_sampler_samples_at_start_and_close_and_shuts_nvml_down():
    fake, writer = FakeNvml(), ListWriter()
    sampler = devices.DeviceSampler(writer, interval_s=60, gpu_index=0, nvml=fake)
    sampler.start()
    sampler.close()
    assert len([r for r in writer.table("devices") if "xid" not in r]) == 2 and fake.shutdown


def test_device_sampler_falls_back_to_host_metrics_when_nvml_library_is_missing():
    writer = ListWriter()
    sampler = devices.DeviceSampler(writer, interval_s=0.05, gpu_index=0)   # the real pynvml: no library here
    assert sampler.source == "host"
    sampler.start()
    time.sleep(0.3)
    sampler.close()
    rows = writer.table("devices")
    assert len(rows) >= 3 and {r["source"] for r in rows} == {"host"}
    assert all(r["rss_bytes"] > 0 and 0 <= r["cpu_frac"] <= 1 and "gpu" not in r for r in rows)


# ---------------------------------------------------------------------------------------------- collectives

class FakeWork(torch.distributed.Work):
    def __init__(self) -> None:
        super().__init__()
        self.fut = torch.futures.Future()
        self.waited = 0

    def wait(self, timeout=None) -> bool:
        self.waited += 1
        return True

    def get_future(self):
        return self.fut


class FakeInner:
    """A stand-in for the inner ProcessGroupNCCL holder: returns works and keeps the completion hook."""

    def __init__(self) -> None:
        self.hook = None
        self.calls: list[str] = []

    def allreduce(self, tensors, *args):
        self.calls.append("allreduce")
        return FakeWork()

    def send(self, tensors, dst, tag):
        self.calls.append("send")
        return FakeWork()

    def _set_group_name(self, name):
        pass

    def _register_on_completion_hook(self, hook):
        self.hook = hook


def _work_info(op_type, *, finished: datetime.datetime, active_us: int):
    return types.SimpleNamespace(op_type=op_type, seq=0, time_started=finished - datetime.timedelta(seconds=1),
                                 time_finished=finished, active_duration=datetime.timedelta(microseconds=active_us))


def _nccl_group(recorder: CollectiveRecorder, inner: FakeInner) -> RecordingProcessGroup:
    pg = RecordingProcessGroup(inner, 0, 2, backend_name="dtprobe_nccl", recorder=recorder, device_timing=True)
    pg.dtprobe_name = "tp"
    return pg


def test_nccl_completion_hook_fills_device_start_and_end_in_issue_order():
    recorder, writer, inner = CollectiveRecorder(), ListWriter(), FakeInner()
    recorder.start(writer)
    pg = _nccl_group(recorder, inner)
    assert pg.enable_completion_timing() and inner.hook is not None
    pg.allreduce([torch.ones(4)])
    pg.send([torch.ones(2, dtype=torch.bfloat16)], 1, 0)
    pg.allreduce([torch.ones(8)])
    assert [r["op"] for r in recorder.pending()] == ["allreduce", "send", "allreduce"]
    t1 = datetime.datetime(2026, 11, 22, 3, 0, 0, 500_000)
    t2 = t1 + datetime.timedelta(milliseconds=5)
    t3 = t1 + datetime.timedelta(milliseconds=7)
    inner.hook(_work_info(OpType.ALLREDUCE, finished=t1, active_us=150))
    inner.hook(_work_info(OpType.ALLREDUCE, finished=t2, active_us=300))
    inner.hook(_work_info(OpType.SEND, finished=t3, active_us=20))
    recorder.stop()
    rows = {(r["op"], r["seq"]): r for r in writer.table("collectives")}
    ns = lambda d: int(d.timestamp() * 1e6) * 1000      # noqa: E731
    first, second, send = rows["allreduce", 1], rows["allreduce", 2], rows["send", 1]
    assert (first["num_bytes"], first["end_ns"], first["start_ns"]) == (16, ns(t1), ns(t1) - 150_000)
    assert (second["num_bytes"], second["end_ns"], second["start_ns"]) == (32, ns(t2), ns(t2) - 300_000)
    assert (send["num_bytes"], send["dtype"], send["peer"], send["end_ns"]) == (4, "bfloat16", 1, ns(t3))
    assert {r["timing"] for r in rows.values()} == {"cuda_event"} and {r["pg"] for r in rows.values()} == {"tp"}


def test_nccl_without_timing_writes_rows_at_enqueue_with_no_end_time():
    recorder, writer, inner = CollectiveRecorder(), ListWriter(), FakeInner()
    recorder.start(writer)
    pg = _nccl_group(recorder, inner)            # completion timing not enabled
    pg.allreduce([torch.ones(4)])
    recorder.stop()
    (row,) = writer.table("collectives")
    assert row["timing"] == "host" and "end_ns" not in row and row["enqueue_ns"] > 0


class NoFutureWork(FakeWork):
    def get_future(self):
        raise RuntimeError("Work::getFuture not implemented.")


def test_gloo_group_keeps_the_backend_work_and_stamps_end_when_its_future_completes():
    recorder, writer, inner = CollectiveRecorder(), ListWriter(), FakeInner()
    recorder.start(writer)
    pg = RecordingProcessGroup(inner, 0, 2, backend_name="dtprobe_gloo", recorder=recorder)
    work = pg.allreduce([torch.ones(3, dtype=torch.float64)])
    assert type(work) is FakeWork                       # no wrapper handed back to C++ callers (DDP)
    assert [r["op"] for r in recorder.pending()] == ["allreduce"]
    time.sleep(0.01)
    work.fut.set_result(None)                           # the gloo thread finishes the work
    recorder.stop()
    (row,) = writer.table("collectives")
    assert (row["op"], row["seq"], row["num_bytes"], row["dtype"]) == ("allreduce", 1, 24, "float64")
    assert row["end_ns"] - row["enqueue_ns"] >= 10_000_000 and recorder.pending() == []


def test_gloo_group_wraps_works_without_future_and_times_them_at_wait():
    recorder, writer, inner = CollectiveRecorder(), ListWriter(), FakeInner()
    inner.send = lambda tensors, dst, tag: NoFutureWork()
    recorder.start(writer)
    pg = RecordingProcessGroup(inner, 0, 2, backend_name="dtprobe_gloo", recorder=recorder)
    work = pg.send([torch.ones(5)], 1, 0)
    assert isinstance(work, RecordedWork) and writer.table("collectives") == []
    work.wait()
    recorder.stop()
    (row,) = writer.table("collectives")
    assert (row["op"], row["peer"], row["seq"], row["num_bytes"]) == ("send", 1, 1, 20)
    assert row["end_ns"] >= row["enqueue_ns"]


def test_recorded_work_writes_one_row_when_future_completes_then_wait_returns():
    recorder, writer = CollectiveRecorder(), ListWriter()
    recorder.start(writer)
    inner = FakeWork()
    work = RecordedWork(inner, {"op": "allreduce", "pg": "world", "pg_ranks": "0,1", "seq": 1, "step": 3,
                                "enqueue_ns": time.time_ns()}, recorder)
    fut = work.get_future()
    assert len(recorder.pending()) == 1
    fut.set_result([torch.ones(1)])              # the backend completes the work: the done-callback fires
    assert work.wait() and inner.waited == 1
    recorder.stop()
    (row,) = writer.table("collectives")
    assert row["end_ns"] >= row["enqueue_ns"] and recorder.pending() == []


def test_a_work_whose_future_fails_is_not_a_completion_and_is_written_at_stop_without_end_time():
    recorder, writer, inner = CollectiveRecorder(), ListWriter(), FakeInner()
    recorder.start(writer)
    pg = RecordingProcessGroup(inner, 0, 2, backend_name="dtprobe_gloo", recorder=recorder)
    work = pg.allreduce([torch.ones(3)])
    work.fut.set_exception(RuntimeError("Connection closed by peer"))  # the peer died: gloo fails the work
    wrapped = RecordedWork(FakeWork(), {"op": "allreduce", "pg": "world", "pg_ranks": "0,1", "seq": 2, "step": 5,
                                        "enqueue_ns": time.time_ns()}, recorder)
    wrapped.get_future().set_exception(RuntimeError("Connection closed by peer"))
    assert [r["seq"] for r in recorder.pending()] == [1, 2] and writer.table("collectives") == []
    assert recorder.progress()["world"]["last_completed_seq"] == 0  # the watchdog still sees them waiting
    recorder.stop()
    rows = writer.table("collectives")
    assert [r["seq"] for r in rows] == [1, 2] and all("end_ns" not in r for r in rows)


def test_collectives_in_flight_at_stop_are_written_without_end_time():
    recorder, writer = CollectiveRecorder(), ListWriter()
    recorder.start(writer)
    work = RecordedWork(FakeWork(), {"op": "barrier", "pg": "world", "pg_ranks": "0,1", "seq": 9, "step": 2,
                                     "enqueue_ns": time.time_ns()}, recorder)
    assert [r["seq"] for r in recorder.pending()] == [9]
    recorder.stop()                               # a hung rank closing: the row says what it waited on
    (row,) = writer.table("collectives")
    assert row["seq"] == 9 and "end_ns" not in row
    del work


def test_recording_group_forwards_untouched_when_recorder_is_paused():
    recorder, writer, inner = CollectiveRecorder(), ListWriter(), FakeInner()
    recorder.start(writer)
    pg = RecordingProcessGroup(inner, 0, 2, backend_name="dtprobe_gloo", recorder=recorder)
    with recorder.paused():
        work = pg.allreduce([torch.ones(2)])
    recorder.stop()
    assert isinstance(work, FakeWork) and inner.calls == ["allreduce"] and writer.table("collectives") == []


# ---------------------------------------------------------------------------------------------- steps

def test_step_phases_accumulate_over_micro_batches(monkeypatch):
    from dtprobe.collectors import training

    ticks = iter([0, 30, 30, 40, 40, 70, 70, 80])       # fwd 0-30, bwd 30-40, fwd 40-70, bwd 70-80 (ms)
    monkeypatch.setattr(training.time, "perf_counter_ns", lambda: next(ticks) * 1_000_000)
    written = []
    with StepContext(5, on_enter=lambda s: None, on_exit=written.append) as s:
        for _ in range(2):
            with s.phase("fwd"):
                pass
            with s.phase("bwd"):
                pass
        s.record(loss=torch.tensor(2.5), tokens=torch.tensor(128), lr=1e-3)
    row = written[0].row(restart=1)
    assert row["step"] == 5 and row["restart"] == 1
    assert (row["fwd_ns"], row["bwd_ns"]) == (60_000_000, 20_000_000)
    assert row["start_ns"] <= row["end_ns"]
    assert (row["loss"], row["tokens"], row["lr"]) == (2.5, 128, 1e-3) and "data_ns" not in row


@pytest.mark.parametrize("call,match", [
    (lambda s: s.phase("forward"), "not one of"),
    (lambda s: s.record(accuracy=0.5), "accuracy"),
])
def test_step_context_rejects_unknown_names(call, match):
    s = StepContext(0, on_enter=lambda s: None, on_exit=lambda s: None)
    with pytest.raises(ConfigError, match=match):
        call(s)


# ---------------------------------------------------------------------------------------------- config / API

@pytest.mark.parametrize("kwargs,match", [
    ({"profile_steps": (11, 10)}, "profile_steps"),
    ({"profile_steps": (10,)}, "profile_steps"),
    ({"device_interval_s": 0}, "device_interval_s"),
    ({"collective_timing": "always"}, "collective_timing"),
    ({"clock_rounds": 0}, "clock_rounds"),
])
def test_collect_config_rejects_bad_values_naming_the_key(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        CollectConfig(**kwargs)


def test_attach_rejects_unknown_options_before_touching_torch_distributed():
    with pytest.raises(ConfigError, match="profile_step"):
        attach("unused", profile_step=(1, 2))
    assert not torch.distributed.is_initialized()


def test_null_probe_offers_every_public_probe_method_and_attribute():
    public = {n for n, _ in inspect.getmembers(Probe) if not n.startswith("_")}
    assert public <= {n for n in dir(NullProbe(rank=0)) if not n.startswith("_")}
    probe = NullProbe(rank=1)
    with probe.step(3) as s:
        with s.phase("fwd"):
            pass
        s.record(loss=1.0)
    probe.fault("crash", injected=True)
    probe.close()
    assert not probe.is_leader and int(s) == 3


def test_in_flight_rows_flushed_early_by_the_watchdog_are_written_once():
    recorder, writer = CollectiveRecorder(), ListWriter()
    recorder.start(writer)
    inner = FakeWork()
    work = RecordedWork(inner, {"op": "allreduce", "pg": "dp", "pg_ranks": "0,1", "seq": 4, "step": 3,
                                "enqueue_ns": time.time_ns()}, recorder)
    fut = work.get_future()
    assert recorder.flush_in_flight() == 1        # the watchdog gives up: the pending row goes out first ...
    recorder.drain()
    assert [(r["seq"], "end_ns" in r) for r in writer.table("collectives")] == [(4, False)]
    fut.set_result([torch.ones(1)])               # ... a late completion does not write a second row ...
    recorder.stop()                               # ... and neither does the close
    assert [(r["seq"], "end_ns" in r) for r in writer.table("collectives")] == [(4, False)]
    assert recorder.pending() == []
