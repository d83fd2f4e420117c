"""The recording process group in one process (its NCCL timing: tests/test_cuda_standins.py): gloo works timed at
their future or at wait, each collective written once (also when the watchdog flushed it early), in-flight
collectives written at stop without an end time, a paused recorder forwarding untouched."""

from __future__ import annotations

import time

import torch

from dtprobe.collectors.collective_recorder import CollectiveRecorder
from dtprobe.collectors.pg_wrapper import RecordingProcessGroup
from dtprobe.collectors.recorded_work import RecordedWork

from collector_fakes import ListWriter


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
