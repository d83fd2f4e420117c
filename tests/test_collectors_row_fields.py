"""The ``collectives`` rows of the recording gloo group, field by field and in order, for each way a completion is
seen: the backend's own Work with a done-callback (first work of a (group, op), and every work when a caller takes
futures, as DDP's reducer does), the wrapper with a callback while the callers' wait habit is learned, and the
wrapper stamping at a prompt ``wait()``; plus broadcast, coalesced all_reduce (DDP buckets), all_gather into a
tensor, and send/recv (works without a future)."""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed.distributed_c10d as c10d

from dtprobe.collectors.collective_recorder import CollectiveRecorder
from dtprobe.collectors.pg_wrapper import RecordingProcessGroup
from dtprobe.collectors.recorded_work import RecordedWork, WaitHabit

from collector_fakes import ListWriter

STEP, RESTART = 7, 2
ROW_ORDER = ["pg", "seq", "op", "num_bytes", "dtype", "step", "timing", "enqueue_ns", "restart"]
"""Keys of a row as issued, in the order they reach the events file; ``peer`` follows for p2p, ``end_ns`` last.
The group's members are in its ``groups`` row, written once."""


class FakeWork(torch.distributed.Work):
    """A gloo-like work with a future; ``wait()`` returns at once (the collective is done by then)."""

    def __init__(self) -> None:
        super().__init__()
        self.fut = torch.futures.Future()
        self.done = False

    def wait(self, timeout=None) -> bool:
        return True

    def is_completed(self) -> bool:
        return self.done

    def get_future(self):
        return self.fut


class NoFutureWork(FakeWork):
    def get_future(self):
        raise RuntimeError("Work::getFuture not implemented.")


class FakeInner:
    def __init__(self) -> None:
        self.works: list[FakeWork] = []

    def _work(self, cls=FakeWork):
        work = cls()
        self.works.append(work)
        return work

    def allreduce(self, tensors, *args):
        return self._work()

    def allreduce_coalesced(self, tensors, *args):
        return self._work()

    def broadcast(self, tensors, *args):
        return self._work()

    def _allgather_base(self, output, input, *args):
        return self._work()

    def send(self, tensors, dst, tag):
        return self._work(NoFutureWork)

    def recv(self, tensors, src, tag):
        return self._work(NoFutureWork)

    def _set_group_name(self, name):
        pass


def _group() -> tuple[RecordingProcessGroup, CollectiveRecorder, ListWriter, FakeInner]:
    recorder, writer, inner = CollectiveRecorder(), ListWriter(), FakeInner()
    recorder.start(writer, flush_interval_s=3600, restart=RESTART)
    recorder.step = STEP
    pg = RecordingProcessGroup(inner, 0, 2, backend_name="dtprobe_gloo", recorder=recorder)
    pg.dtprobe_name = "tp"
    return pg, recorder, writer, inner


def _expected(seq: int, op: str, num_bytes: int, dtype: str | None, **extra) -> dict:
    return {"pg": "tp", "seq": seq, "op": op, "num_bytes": num_bytes,
            "dtype": dtype, "step": STEP, "timing": "host", **extra, "restart": RESTART}


def _check(row: dict, expected: dict, *, peer: int | None = None) -> None:
    """``row`` equals ``expected`` apart from its times, which are ordered; keys in the issued order."""
    order = ROW_ORDER + (["peer"] if peer is not None else []) + ["end_ns"]
    assert list(row) == order
    assert {k: v for k, v in row.items() if k not in ("enqueue_ns", "end_ns")} == {
        **expected, **({"peer": peer} if peer is not None else {})}
    assert isinstance(row["enqueue_ns"], int) and isinstance(row["end_ns"], int)
    assert 0 < row["enqueue_ns"] <= row["end_ns"]


CASES = [
    ("allreduce", lambda pg: pg.allreduce([torch.ones(4)]), ("allreduce", 16, "float32")),
    ("broadcast", lambda pg: pg.broadcast([torch.ones(3, dtype=torch.float64)]), ("broadcast", 24, "float64")),
    ("coalesced", lambda pg: pg.allreduce_coalesced([torch.ones(4), torch.ones(6)]), ("allreduce", 40, "float32")),
    ("allgather", lambda pg: pg.all_gather_single(torch.ones(8, dtype=torch.bfloat16),
                                                  torch.ones(4, dtype=torch.bfloat16)), ("allgather", 16, "bfloat16")),
]


@pytest.mark.parametrize("name,issue,fields", CASES, ids=[c[0] for c in CASES])
def test_rows_are_identical_whichever_way_the_completion_is_seen(name, issue, fields):
    pg, recorder, writer, inner = _group()
    num_works = WaitHabit.PROMPT_WAITS + 4      # direct, then learning with a callback, then prompt waits
    for _ in range(num_works):
        work = issue(pg)
        work.wait()
        inner.works[-1].fut.set_result(None)      # a late done-callback must not write a second row
    recorder.stop()
    rows = writer.table("collectives")
    assert [r["seq"] for r in rows] == list(range(1, num_works + 1))
    for seq, row in enumerate(rows, start=1):
        _check(row, _expected(seq, *fields))
    assert recorder.pending() == [] and recorder.progress()["tp"]["last_completed_seq"] == num_works


def test_a_group_row_is_written_once_before_the_first_row_that_names_it():
    pg, recorder, writer, _ = _group()
    for _ in range(3):
        pg.allreduce([torch.ones(2)]).wait()
    pg.send([torch.ones(5)], 1, 0).wait()
    recorder.stop()
    tables = [table for table, _ in writer.rows]
    # at close, after every row: the step's summary (its one group's row; see test_comm_summaries)
    assert tables == ["groups"] + ["collectives"] * 4 + ["comm_steps"]
    assert [r.get("pg") for r in writer.table("comm_steps")] == ["tp"]
    # The fake group is not registered with torch.distributed: its members are unknown (""), as in the rows before.
    assert writer.table("groups") == [{"pg": "tp", "name": "tp", "pg_ranks": "", "pg_size": 2, "restart": RESTART}]
    assert {r["pg"] for r in writer.table("collectives")} == {"tp"}


def test_rows_of_a_caller_that_takes_futures_are_identical_to_those_of_a_waiting_caller():
    pg, recorder, writer, inner = _group()
    for _ in range(3):                            # DDP's reducer: takes each work's future, never waits on it
        work = pg.allreduce_coalesced([torch.ones(4), torch.ones(6)])
        work.get_future()
        inner.works[-1].fut.set_result(None)
    recorder.stop()
    rows = writer.table("collectives")
    assert [type(w) for w in inner.works] == [FakeWork] * 3
    for seq, row in enumerate(rows, start=1):
        _check(row, _expected(seq, "allreduce", 40, "float32"))


def test_send_and_recv_rows_carry_the_peer_and_their_own_numbering():
    pg, recorder, writer, _ = _group()
    pg.allreduce([torch.ones(2)]).wait()
    for _ in range(2):
        send = pg.send([torch.ones(5)], 1, 0)
        recv = pg.recv([torch.ones(5, dtype=torch.float16)], 1, 0)
        assert isinstance(send, RecordedWork) and isinstance(recv, RecordedWork)
        send.wait()
        recv.wait()
    recorder.stop()
    rows = [r for r in writer.table("collectives") if r["op"] in ("send", "recv")]
    expected = [("send", 1, 20, "float32"), ("recv", 1, 10, "float16"), ("send", 2, 20, "float32"),
                ("recv", 2, 10, "float16")]
    for row, (op, seq, num_bytes, dtype) in zip(rows, expected, strict=True):
        _check(row, _expected(seq, op, num_bytes, dtype), peer=1)


def test_a_work_waited_late_brings_the_done_callback_back_for_its_group_and_op():
    pg, recorder, writer, inner = _group()
    habit = pg._habits
    for _ in range(WaitHabit.PROMPT_WAITS + 1):       # the first work, then prompt waits
        pg.allreduce([torch.ones(4)]).wait()
        inner.works[-1].fut.set_result(None)
    assert not habit["allreduce"].needs_callback
    late = pg.allreduce([torch.ones(4)])
    inner.works[-1].done = True                        # completed ...
    time.sleep(2 * WaitHabit.PROMPT_WAIT_NS / 1e9)    # ... well before the caller waits
    late.wait()
    assert habit["allreduce"].needs_callback
    recorder.stop()
    rows = writer.table("collectives")
    assert [r["seq"] for r in rows] == list(range(1, WaitHabit.PROMPT_WAITS + 3))
    assert rows[-1]["end_ns"] - rows[-1]["enqueue_ns"] >= 2 * WaitHabit.PROMPT_WAIT_NS   # an upper bound


def _blocking(options_type):
    """Options of a blocking call, as torch's ``dist.*`` functions build them with ``async_op=False``."""
    opts = options_type()
    opts.asyncOp = False
    return opts


class WaitStampingWork(FakeWork):
    """Records when it was waited (``waited_ns``)."""

    waited_ns = None

    def wait(self, timeout=None) -> bool:
        self.waited_ns = time.time_ns()
        return True


class WaitStampingInner(FakeInner):
    def _work(self, cls=FakeWork):
        return super()._work(WaitStampingWork)


BLOCKING_CASES = [
    ("allreduce", lambda pg: pg.allreduce([torch.ones(4)], _blocking(c10d.AllreduceOptions)),
     ("allreduce", 16, "float32")),
    ("broadcast", lambda pg: pg.broadcast([torch.ones(3, dtype=torch.float64)],
                                          _blocking(c10d.BroadcastOptions)),
     ("broadcast", 24, "float64")),
    ("coalesced", lambda pg: pg.allreduce_coalesced([torch.ones(4), torch.ones(6)],
                                                    _blocking(c10d.AllreduceCoalescedOptions)),
     ("allreduce", 40, "float32")),
    ("allgather", lambda pg: pg._allgather_base(torch.ones(8, dtype=torch.bfloat16),
                                                torch.ones(4, dtype=torch.bfloat16), _blocking(c10d.AllgatherOptions)),
     ("allgather", 16, "bfloat16")),
]


@pytest.mark.parametrize("name,issue,fields", BLOCKING_CASES, ids=[c[0] for c in BLOCKING_CASES])
def test_rows_of_blocking_calls_are_identical_to_those_of_waited_works(name, issue, fields):
    pg, recorder, writer, _ = _group()
    pg._inner = inner = WaitStampingInner()
    for _ in range(3):
        work = issue(pg)
        assert work is inner.works[-1] and work.waited_ns is not None   # the backend's own Work, waited by the group
        work.fut.set_result(None)                   # no done-callback was added: no second row
    recorder.stop()
    rows = writer.table("collectives")
    assert [r["seq"] for r in rows] == [1, 2, 3]
    for seq, (row, work) in enumerate(zip(rows, inner.works, strict=True), start=1):
        _check(row, _expected(seq, *fields))
        assert row["enqueue_ns"] <= work.waited_ns <= row["end_ns"]
    assert recorder.pending() == [] and recorder.progress()["tp"]["last_completed_seq"] == 3
