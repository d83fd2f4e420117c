"""What a killed rank leaves: the recorder's spill of in-flight collectives to ``pending`` (each once, only after a
tick), the writers' flush bound, ``lifecycle`` rows, and (2 real ranks, CPU + gloo) a rank SIGKILLed or SIGTERMed
while blocked in an all_reduce its peer never issues."""

from __future__ import annotations

import inspect
import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from dtprobe.collectors.attach import Probe
from dtprobe.collectors.config import CollectConfig
from dtprobe.collectors.null import NullProbe
from dtprobe.collectors.collective_recorder import CollectiveRecorder
from dtprobe.collectors.pg_wrapper import RecordingProcessGroup
from dtprobe.collectors.recorded_work import RecordedWork
from dtprobe.store import RunStore
from dtprobe.store.schema import SCHEMAS
from dtprobe.store.writer import RankWriter

KEY = ["rank", "restart", "pg", "pg_ranks", "seq", "peer", "op"]
"""A collective's identity across ``pending`` and ``collectives`` (schema.py)."""


class SinkWriter:
    """In-memory writer: rows per table, and how often it was flushed."""

    def __init__(self) -> None:
        self.rows: list[tuple[str, dict]] = []
        self.flushes = 0

    def write(self, table: str, row: dict) -> None:
        self.rows.append((table, dict(row)))

    def flush(self) -> None:
        self.flushes += 1

    def table(self, name: str) -> list[dict]:
        return [r for t, r in self.rows if t == name]


class FakeWork:
    def __init__(self) -> None:
        self.fut = torch.futures.Future()

    def get_future(self):
        return self.fut

    def wait(self, timeout=None):
        return True


class FakeInner:
    def allreduce(self, tensors, *args):
        return FakeWork()

    def _set_group_name(self, name):
        pass


def _row(seq: int, **extra) -> dict:
    return {"op": "allreduce", "pg": "dp", "seq": seq, "step": 7,
            "num_bytes": 16, "dtype": "float32", "timing": "host", "enqueue_ns": time.time_ns(), "restart": 1,
            **extra}


def _manual_recorder(writer) -> CollectiveRecorder:
    """A started recorder whose drain thread never ticks on its own: the test calls ``tick()``."""
    recorder = CollectiveRecorder()
    recorder.start(writer, flush_interval_s=3600, restart=1)
    return recorder


# ---------------------------------------------------------------------------------------------- spill (unit)

def test_in_flight_collective_is_spilled_once_and_only_after_a_whole_tick():
    writer = SinkWriter()
    recorder = _manual_recorder(writer)
    work = RecordedWork(FakeWork(), _row(4), recorder)
    assert recorder.tick() == 0 and writer.table("pending") == []      # first seen: not a whole tick yet
    assert recorder.tick() == 1                                          # in flight at two ticks: spilled
    assert recorder.tick() == 0 and recorder.tick() == 0                 # ... once
    (row,) = writer.table("pending")
    assert row == _row(4, enqueue_ns=row["enqueue_ns"])                 # the collective as issued, no end
    assert set(row) <= set(SCHEMAS["pending"]) and "end_ns" not in row
    work.wait()                                                          # completes: collectives row as usual
    recorder.tick()
    assert [(r["seq"], "end_ns" in r) for r in writer.table("collectives")] == [(4, True)]
    recorder.stop()
    assert len(writer.table("pending")) == 1 and len(writer.table("collectives")) == 1


def test_collective_completed_between_ticks_never_reaches_pending():
    writer = SinkWriter()
    recorder = _manual_recorder(writer)
    for seq in range(1, 6):                   # healthy collectives: issued and done within a tick
        recorder.tick()
        RecordedWork(FakeWork(), _row(seq), recorder).wait()
    recorder.tick()
    recorder.tick()
    recorder.stop()
    assert writer.table("pending") == [] and [r["seq"] for r in writer.table("collectives")] == [1, 2, 3, 4, 5]


def test_spill_covers_collectives_and_p2p_oldest_first_and_each_tick_flushes():
    writer = SinkWriter()
    recorder = _manual_recorder(writer)
    pg = RecordingProcessGroup(FakeInner(), 0, 2, backend_name="dtprobe_gloo", recorder=recorder)
    pg.dtprobe_name = "pp"
    first = pg.allreduce([torch.ones(4)])                                # on the future path
    recv = RecordedWork(FakeWork(), _row(1, op="recv", peer=1, pg="pp"), recorder)
    recorder.tick()
    late = RecordedWork(FakeWork(), _row(9), recorder)                   # issued after the first tick
    flushes = writer.flushes
    assert recorder.tick() == 2 and writer.flushes == flushes + 1
    assert [(r["op"], r["seq"], r.get("peer")) for r in writer.table("pending")] == [
        ("allreduce", 1, None), ("recv", 1, 1)]
    assert writer.table("pending")[0]["restart"] == 1                    # the recorder's restart, on every row
    assert recorder.tick() == 1 and writer.table("pending")[-1]["seq"] == 9
    first.fut.set_result(None)
    recorder.stop()                           # close: the still-open ones go to collectives with end null
    closed = {(r["op"], r["seq"]): "end_ns" in r for r in writer.table("collectives")}
    assert closed == {("allreduce", 1): True, ("recv", 1): False, ("allreduce", 9): False}
    assert len(writer.table("pending")) == 3
    del recv, late


def test_recorded_rows_carry_the_restart_given_at_start():
    writer = SinkWriter()
    recorder = CollectiveRecorder()
    recorder.start(writer, flush_interval_s=3600, restart=3)
    pg = RecordingProcessGroup(FakeInner(), 0, 2, backend_name="dtprobe_gloo", recorder=recorder)
    pg.allreduce([torch.ones(2)]).fut.set_result(None)
    recorder.stop()
    (row,) = writer.table("collectives")
    assert row["restart"] == 3 and set(row) <= set(SCHEMAS["collectives"])


# ---------------------------------------------------------------------------------------------- flush bound

def _lines(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def _wait_for_lines(path: Path, count: int, *, timeout_s: float) -> float:
    """Seconds until ``path`` holds ``count`` lines (polling), or ``inf``."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        if len(_lines(path)) >= count:
            return time.monotonic() - t0
        time.sleep(0.005)
    return float("inf")


def test_autoflush_writer_gets_a_lone_row_to_the_os_without_another_write(tmp_path):
    auto = RankWriter(tmp_path / "auto", 0, flush_interval_s=0.05, autoflush=True)
    lazy = RankWriter(tmp_path / "lazy", 0, flush_interval_s=0.05)
    for w in (auto, lazy):
        w.write("steps", {"step": 1})
    waited = _wait_for_lines(tmp_path / "auto" / "events" / "steps" / "rank00000.jsonl", 1, timeout_s=5)
    assert waited < 5                          # a generous ceiling: the machine may be loaded
    time.sleep(0.2)                            # the caller-flushed writer waits for its next write ...
    assert _lines(tmp_path / "lazy" / "events" / "steps" / "rank00000.jsonl") == []
    auto.close()
    lazy.close()                               # ... or its close
    assert _lines(tmp_path / "lazy" / "events" / "steps" / "rank00000.jsonl") == [{"rank": 0, "step": 1}]
    auto.close()                               # idempotent, and no file is reopened after close
    auto.flush()


def test_drain_thread_gets_completed_and_pending_rows_to_disk_while_the_caller_is_blocked(tmp_path):
    interval = 0.05
    writer = RankWriter(tmp_path, 0, flush_interval_s=interval, autoflush=True)
    recorder = CollectiveRecorder()
    recorder.start(writer, flush_interval_s=interval, restart=0)
    try:
        done = RecordedWork(FakeWork(), _row(1), recorder)
        done.wait()
        stuck = RecordedWork(FakeWork(), _row(2), recorder)   # never completes: the caller "hangs" here
        coll = tmp_path / "events" / "collectives" / "rank00000.jsonl"
        pend = tmp_path / "events" / "pending" / "rank00000.jsonl"
        assert _wait_for_lines(coll, 1, timeout_s=5) < 5      # no drain(), flush() or stop() called
        assert _wait_for_lines(pend, 1, timeout_s=5) < 5
        time.sleep(5 * interval)
        assert [r["seq"] for r in _lines(pend)] == [2] and [r["seq"] for r in _lines(coll)] == [1]
    finally:
        recorder.stop()
        writer.close()
    assert [(r["seq"], "end_ns" in r) for r in _lines(coll)] == [(1, True), (2, False)]
    del stuck


def test_the_drain_thread_flushes_the_writer_in_its_stead_and_gives_the_flushing_back(tmp_path, monkeypatch):
    interval = 0.05
    writer = RankWriter(tmp_path, 0, flush_interval_s=interval, autoflush=True)
    steps = tmp_path / "events" / "steps" / "rank00000.jsonl"
    recorder = CollectiveRecorder()
    assert not writer.hand_over_flushing(2 * interval)        # a longer interval would loosen the loss bound
    recorder.start(writer, flush_interval_s=interval, restart=0)
    try:
        assert writer._flusher is None and recorder._drainer.is_alive()   # one thread wakes per interval
        writer.write("steps", {"step": 1})                     # a training-thread row, no collective
        assert _wait_for_lines(steps, 1, timeout_s=5) < 5      # the drain tick got it out
    finally:
        recorder.stop()
    assert writer._flusher is not None and writer._flusher.is_alive()
    writer.write("steps", {"step": 2})                         # after stop: the writer's own flusher again
    assert _wait_for_lines(steps, 2, timeout_s=5) < 5

    # a drain thread that dies of an error gives the flushing back too
    def broken_tick() -> int:
        raise RuntimeError("broken tick")

    monkeypatch.setattr(threading, "excepthook", lambda args: None)    # the error is the point: not printed
    recorder.start(writer, flush_interval_s=interval, restart=0)
    try:
        assert writer._flusher is None
        monkeypatch.setattr(recorder, "tick", broken_tick)
        recorder._drainer.join(timeout=5)
        assert not recorder._drainer.is_alive()
        writer.write("steps", {"step": 3})
        assert _wait_for_lines(steps, 3, timeout_s=5) < 5
    finally:
        recorder.stop()
        writer.close()
    assert not writer.hand_over_flushing(interval)             # closed: nothing to hand over
    assert [r["step"] for r in _lines(steps)] == [1, 2, 3]


# ---------------------------------------------------------------------------------------------- API

def test_close_takes_a_reason_on_the_probe_and_the_null_probe():
    for cls in (Probe, NullProbe):
        params = inspect.signature(cls.close).parameters
        assert params["reason"].kind is inspect.Parameter.KEYWORD_ONLY and params["reason"].default is None
    NullProbe(rank=0).close(status="crashed", reason="watchdog")


def test_default_flush_interval_is_the_documented_bound():
    cfg = CollectConfig()
    assert cfg.flush_interval_s == 0.1 and cfg.close_on_sigterm is True


# ---------------------------------------------------------------------------------------------- real ranks

WORKER = textwrap.dedent("""
    import os, sys, time, signal
    import torch, torch.distributed as dist
    import dtprobe

    run_dir, mode = sys.argv[1], sys.argv[2]
    rank = int(os.environ["RANK"])
    def user_handler(signum, frame):
        print("user handler", flush=True)
        sys.exit(7)
    if mode == "handler-before-attach":
        signal.signal(signal.SIGTERM, user_handler)
    probe = dtprobe.attach(run_dir, timeout_s=60, devices=False)
    if mode == "handler-after-attach":
        signal.signal(signal.SIGTERM, user_handler)
    dist.barrier()                                    # both attached
    if rank == 0:
        with probe.step(3):
            print("issuing", flush=True)
            dist.all_reduce(torch.ones(5))            # rank 1 never issues it: blocks in gloo (C++, GIL released)
        print("all_reduce returned", flush=True)
    else:
        print("issuing", flush=True)
        time.sleep(120)
""")


@pytest.fixture
def start_ranks(tmp_path, free_port, child_env) -> Callable[..., tuple[Path, list[subprocess.Popen]]]:
    """``start_ranks(mode, restart=R)``: the 2 ranks of ``WORKER`` started as torchrun would start attempt ``R``
    (the test stops them with ``_stop``); returns the run directory and the processes."""
    def start(mode: str, *, restart: int) -> tuple[Path, list[subprocess.Popen]]:
        script = tmp_path / "worker.py"
        script.write_text(WORKER)
        run = tmp_path / "run"
        port = free_port()
        procs = []
        for rank in range(2):
            env = child_env(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2",
                            LOCAL_RANK=str(rank), TORCHELASTIC_RESTART_COUNT=str(restart))
            procs.append(subprocess.Popen([sys.executable, str(script), str(run), mode], env=env,
                                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
        return run, procs
    return start


def _await_line(proc: subprocess.Popen, text: str, *, timeout_s: float) -> None:
    """Read ``proc``'s stdout until a line equals ``text`` (readline blocks: the outer deadline is a kill)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if line.strip() == text:
            return
        if line == "" and proc.poll() is not None:
            raise AssertionError(f"worker exited {proc.returncode} before {text!r}: {proc.stderr.read()[-3000:]}")
    raise AssertionError(f"no {text!r} from the worker within {timeout_s} s")


def _stop(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.wait(timeout=30)
        p.stdout.close()
        p.stderr.close()


def _table(run: Path, name: str):
    df = RunStore.open(run).table(name)
    return df[df["rank"] == 0]


def _never_completed(run: Path):
    """Rank 0's pending rows with no ``collectives`` row of the same collective."""
    pending, coll = _table(run, "pending"), _table(run, "collectives")
    merged = pending.merge(coll[KEY].assign(done=True), on=KEY, how="left")
    return merged[merged["done"].isna()]


@pytest.mark.multiproc
@pytest.mark.exclusive
def test_rank_killed_inside_an_all_reduce_leaves_a_pending_row_naming_it_and_no_close(start_ranks):
    run, procs = start_ranks("block", restart=2)
    try:
        _await_line(procs[0], "issuing", timeout_s=120)
        time.sleep(1.0)                       # well past the bound (2 x flush_interval_s = 0.2 s)
        procs[0].send_signal(signal.SIGKILL)
        assert procs[0].wait(timeout=30) == -signal.SIGKILL
    finally:
        _stop(procs)
    lost = _never_completed(run)
    assert len(lost) == 1, lost
    row = lost.iloc[0]
    assert (row["op"], row["pg"], row["pg_ranks"], row["seq"], row["step"], row["restart"], row["num_bytes"]) == (
        "allreduce", "world", "0,1", 2, 3, 2, 20)         # seq 1 is the barrier
    life = _table(run, "lifecycle")
    assert life["event"].tolist() == ["attach"] and life["restart"].tolist() == [2]
    assert life["pid"].tolist() == [procs[0].pid]
    coll = _table(run, "collectives")
    assert coll["restart"].tolist() == [2] * len(coll) and not (coll["op"] == "allreduce").any()


@pytest.mark.multiproc
@pytest.mark.exclusive
def test_rank_sigtermed_inside_an_all_reduce_closes_its_probe_then_dies_of_sigterm(start_ranks):
    run, procs = start_ranks("block", restart=0)
    try:
        _await_line(procs[0], "issuing", timeout_s=120)
        time.sleep(0.5)
        procs[0].send_signal(signal.SIGTERM)
        assert procs[0].wait(timeout=30) == -signal.SIGTERM   # the main thread never left gloo's wait
        out = procs[0].stdout.read()
    finally:
        _stop(procs)
    assert "all_reduce returned" not in out
    life = _table(run, "lifecycle")
    assert life["event"].tolist() == ["attach", "close"]
    close = life.iloc[1]
    assert (close["status"], close["reason"], close["step"], close["pid"]) == ("crashed", "SIGTERM", 3, procs[0].pid)
    coll = _table(run, "collectives")
    open_rows = coll[coll["end_ns"].isna()]
    assert open_rows[["op", "seq", "step"]].values.tolist() == [["allreduce", 2, 3]]
    assert _never_completed(run).empty        # the close wrote it: pending (if spilled) now has its pair
    assert RunStore.open(run).manifest.status == "crashed"


@pytest.mark.multiproc
@pytest.mark.exclusive
@pytest.mark.parametrize("mode,close_reason", [
    ("handler-before-attach", "SIGTERM"),   # chained: the probe closes first, then the user's handler runs
    ("handler-after-attach", "exit"),       # replaced: the user's handler alone; the probe closes at exit
])
def test_sigterm_leaves_the_decision_to_a_user_handler(start_ranks, mode, close_reason):
    run, procs = start_ranks(mode, restart=0)
    try:
        _await_line(procs[1], "issuing", timeout_s=120)      # rank 1 sleeps in Python: its handler can run
        time.sleep(0.5)
        procs[1].send_signal(signal.SIGTERM)
        assert procs[1].wait(timeout=30) == 7                 # the user's handler decided: sys.exit(7)
        out = procs[1].stdout.read()
    finally:
        _stop(procs)
    assert "user handler" in out
    life = RunStore.open(run).table("lifecycle")
    life = life[life["rank"] == 1]
    assert life["event"].tolist() == ["attach", "close"] and life["reason"].tolist()[1] == close_reason


FORKING_WORKER = textwrap.dedent("""
    import os, sys, time
    import dtprobe

    probe = dtprobe.attach(sys.argv[1], devices=False)      # plain python: a 1-rank group
    child = os.fork()                                        # like a fork-started DataLoader worker
    if child == 0:
        time.sleep(120)
        os._exit(0)
    print(child, flush=True)
    time.sleep(120)
""")


def _zombie_exit_status(pid: int, *, timeout_s: float) -> int:
    """The raw wait status of ``pid`` once it is a zombie (exited, not yet reaped by its parent): stat field 52."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        if fields[0] == "Z":
            return int(fields[-1])
        time.sleep(0.05)
    raise AssertionError(f"process {pid} still running after {timeout_s} s")


@pytest.mark.multiproc
@pytest.mark.exclusive
def test_sigterm_to_a_forked_child_neither_closes_nor_kills_the_parent(tmp_path, child_env):
    script = tmp_path / "worker.py"
    script.write_text(FORKING_WORKER)
    env = child_env()
    proc = subprocess.Popen([sys.executable, str(script), str(tmp_path / "run")], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    child = None
    try:
        child = int(proc.stdout.readline())
        os.kill(child, signal.SIGTERM)
        assert _zombie_exit_status(child, timeout_s=30) == signal.SIGTERM    # killed by it, default action
        time.sleep(1.0)                                  # the parent's watcher would have acted by now
        assert proc.poll() is None                       # the parent lives on ...
        life = RunStore.open(tmp_path / "run").table("lifecycle")
        assert life["event"].tolist() == ["attach"]      # ... with its probe open
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == -signal.SIGTERM
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
        if child is not None and Path(f"/proc/{child}").exists():
            os.kill(child, signal.SIGKILL)
        proc.stdout.close()
        proc.stderr.close()
    life = RunStore.open(tmp_path / "run").table("lifecycle")
    assert life["event"].tolist() == ["attach", "close"] and life["reason"].tolist()[1] == "SIGTERM"
