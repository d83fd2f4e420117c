"""The recorder's blocking-call path and batch encoding: a blocking gloo call (``async_op=False``) is waited by the
group and recorded as a tuple row; the row is in flight (``pending``, watchdog progress, spill) while the call blocks,
stays in flight when the wait fails; ``RankWriter.write_values`` writes the same bytes as ``write`` of the dict rows,
in queue order with dict rows between them."""

from __future__ import annotations

import threading
import time

import orjson
import pytest
import torch
import torch.distributed.distributed_c10d as c10d

from dtprobe.collectors.collective_recorder import ROW_COLUMNS, CollectiveRecorder
from dtprobe.collectors.pg_wrapper import RecordingProcessGroup, _waits_now
from dtprobe.store.writer import RankWriter

from collector_fakes import ListWriter


def _blocking_opts() -> c10d.AllreduceOptions:
    opts = c10d.AllreduceOptions()
    opts.asyncOp = False
    return opts


class GateWork(torch.distributed.Work):
    """A work whose ``wait()`` blocks until ``release`` is set, then returns or raises ``error``."""

    def __init__(self, error: Exception | None = None) -> None:
        super().__init__()
        self.release = threading.Event()
        self.error = error

    def wait(self, timeout=None) -> bool:
        assert self.release.wait(10), "test work never released"
        if self.error is not None:
            raise self.error
        return True

    def get_future(self):
        raise AssertionError("the blocking path takes no future")


class GateInner:
    def __init__(self, work: GateWork) -> None:
        self.work = work

    def allreduce(self, tensors, *args):
        return self.work

    def _set_group_name(self, name):
        pass


def _group(writer, work: GateWork, *, timing: str = "wait") -> tuple[RecordingProcessGroup, CollectiveRecorder]:
    recorder = CollectiveRecorder()
    recorder.start(writer, timing=timing, flush_interval_s=3600, restart=1)
    recorder.step = 4
    pg = RecordingProcessGroup(GateInner(work), 0, 2, backend_name="dtprobe_gloo", recorder=recorder)
    pg.dtprobe_name = "dp"
    return pg, recorder


@pytest.mark.parametrize("args,kwargs,expected", [
    ((), {}, False),                                   # no options: torch's default asyncOp is True
    ((c10d.AllreduceOptions(),), {}, False),
    ((_blocking_opts(),), {}, True),
    ((), {"opts": _blocking_opts()}, True),
    ((torch.distributed.ReduceOp.SUM,), {}, False),    # the ``allreduce(tensors, op)`` overload
])
def test_waits_now_only_when_the_options_say_async_op_is_false(args, kwargs, expected):
    assert _waits_now(args, kwargs) is expected


def test_a_blocking_call_is_in_flight_while_it_blocks_and_spilled_after_a_whole_tick():
    writer, work = ListWriter(), GateWork()
    pg, recorder = _group(writer, work)
    caller = threading.Thread(target=lambda: pg.allreduce([torch.ones(8)], _blocking_opts()))
    caller.start()
    deadline = time.monotonic() + 10
    while not recorder.pending() and time.monotonic() < deadline:
        time.sleep(0.001)
    [pending] = recorder.pending()
    assert {k: pending[k] for k in ("pg", "pg_size", "seq", "op", "num_bytes", "dtype", "step", "restart")} == {
        "pg": "dp", "pg_size": 2, "seq": 1, "op": "allreduce", "num_bytes": 32, "dtype": "float32", "step": 4,
        "restart": 1}
    progress = recorder.progress()["dp"]
    issued = (progress["last_issued_seq"], progress["last_issued_op"], progress["last_issued_step"])
    assert issued == (1, "allreduce", 4)
    assert progress["last_completed_seq"] == 0 and progress["last_issued_ns"] == pending["enqueue_ns"]
    assert recorder.tick() == 0                        # first tick: seen, not yet spilled
    assert recorder.tick() == 1 and recorder.tick() == 0
    [spilled] = writer.table("pending")
    assert spilled == {k: pending[k] for k in ("pg", "seq", "op", "num_bytes", "dtype", "step", "timing",
                                                "enqueue_ns", "restart")}    # the members are in ``groups``
    assert pending["pg_ranks"] == "" and writer.table("groups") == [
        {"pg": "dp", "name": "dp", "pg_ranks": "", "pg_size": 2, "restart": 1}]
    work.release.set()
    caller.join(10)
    recorder.stop()
    [row] = writer.table("collectives")
    assert list(row) == list(ROW_COLUMNS) and row["end_ns"] >= row["enqueue_ns"] == pending["enqueue_ns"]
    assert recorder.progress()["dp"]["last_completed_seq"] == 1 and recorder.pending() == []


def test_a_blocking_call_whose_wait_fails_raises_and_is_written_at_close_without_an_end():
    writer, work = ListWriter(), GateWork(RuntimeError("Connection closed by peer"))
    work.release.set()
    pg, recorder = _group(writer, work)
    with pytest.raises(RuntimeError, match="closed by peer"):
        pg.allreduce([torch.ones(2)], _blocking_opts())
    assert [r["seq"] for r in recorder.pending()] == [1]
    assert recorder.progress()["dp"]["last_completed_seq"] == 0     # the watchdog still sees it waiting
    recorder.stop()
    [row] = writer.table("collectives")
    assert "end_ns" not in row and row["op"] == "allreduce"


def test_a_blocking_call_under_enqueue_timing_is_written_at_once_and_not_waited():
    writer, work = ListWriter(), GateWork()                 # never released: waiting on it would hang
    pg, recorder = _group(writer, work, timing="enqueue")
    assert pg.allreduce([torch.ones(2)], _blocking_opts()) is work
    recorder.stop()
    [row] = writer.table("collectives")
    assert "end_ns" not in row and row["seq"] == 1


def _dict_rows() -> list[dict]:
    base = {"pg": "tp", "seq": 1, "op": "allreduce", "num_bytes": 1024,
            "dtype": "float32", "step": 3, "timing": "host", "enqueue_ns": 1_795_000_000_000_000_000, "restart": 0,
            "end_ns": 1_795_000_000_000_050_000}
    return [base, {**base, "seq": 2, "dtype": None, "op": "barrier", "num_bytes": 0},
            {k: v for k, v in {**base, "seq": 3, "pg": "p\u00e9 \"q\""}.items() if k != "end_ns"}]


def test_write_values_writes_the_bytes_write_writes_for_the_same_rows(tmp_path):
    rows = _dict_rows()
    by_dict = RankWriter(tmp_path / "dict", 5)
    for row in rows:
        by_dict.write("collectives", row)
    by_dict.close()
    by_values = RankWriter(tmp_path / "values", 5)
    by_values.write_values("collectives", ROW_COLUMNS, [tuple(r.values()) for r in rows])   # the last one short
    by_values.close()
    path = "events/collectives/rank00005.jsonl"
    written = (tmp_path / "values" / path).read_bytes()
    assert written == (tmp_path / "dict" / path).read_bytes()
    assert [orjson.loads(line) for line in written.splitlines()] == [{"rank": 5, **r} for r in rows]


def test_write_values_refuses_columns_the_table_does_not_have(tmp_path):
    writer = RankWriter(tmp_path, 0)
    with pytest.raises(AssertionError, match="unknown columns for collectives: \\['bogus'\\]"):
        writer.write_values("collectives", ("pg", "bogus"), [("tp", 1)])
    writer.close()


def test_the_drain_keeps_queue_order_across_tuple_batches_and_dict_rows(tmp_path):
    writer = RankWriter(tmp_path, 0)
    recorder = CollectiveRecorder()
    recorder.writer = writer                               # no drain thread: drained by hand
    first, barrier, last = _dict_rows()
    recorder.emit(tuple(first.values()))
    recorder.emit({**barrier, "peer": 1})                  # a dict row (async path, p2p) between tuples
    recorder.emit(tuple(last.values()))
    recorder.emit(tuple({**first, "seq": 4}.values()))
    recorder.drain()
    writer.close()
    lines = (tmp_path / "events/collectives/rank00000.jsonl").read_bytes().splitlines()
    assert [orjson.loads(line)["seq"] for line in lines] == [1, 2, 3, 4]
    assert orjson.loads(lines[1])["peer"] == 1 and "end_ns" not in orjson.loads(lines[2])
