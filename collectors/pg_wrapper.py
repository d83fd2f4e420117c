"""Recording process-group backends (``dtprobe_gloo``, ``dtprobe_nccl``): one ``collectives`` row per collective.

A ``RecordingProcessGroup`` is a Python ``dist.ProcessGroup`` that forwards every call to a real process group
(gloo, or NCCL on CUDA) and records op, group, logical bytes, dtype, step and times. Being the process group
itself, it sees what a monkeypatch of ``torch.distributed`` misses: DDP's C++ reducer buckets, FSDP2
all-gather/reduce-scatter, DTensor collectives and pipeline send/recv.

Gloo collectives are recorded in C++ when the native recorder is built (``collectors/native_recorder.cpp``,
``native_module``; ``_NativeGlooGroup``): the row is taken at the issue, ``end_ns`` is stamped by a done-callback on
the work's future on the thread that completed it (no GIL), or when ``wait()`` returns for works without a future,
and the rows reach the drain thread below in batches. What follows is the Python path: point-to-point, NCCL, and gloo
without the build (one stderr line says so).

Completion (``end_ns``), gloo: when the work completes. Blocking calls (torch's API with ``async_op=False``, which
waits on the work as soon as it is returned) are waited by the group itself and stamped when that wait returns, on
the caller's thread; the caller gets the completed backend Work. Otherwise, works whose callers wait on them
before they complete (``async_op=True`` then ``wait()``, DTensor and FSDP waits, ``get_future().wait()``) are
wrapped and stamped when the caller's ``wait()``, or that of the future the wrapper handed out, returns, on the
caller's thread; works whose futures are taken and not waited from Python (DDP's C++ reducer, ``then()``) stay the
backend's own Work with a done-callback, run by the gloo thread that finished it (a Python Work handed to the
reducer costs GIL round trips on every ``getFuture`` and destruction); ``_WaitHabit`` picks between the two per
(group, op) and goes back to the callback for callers that wait late. Works without a future (gloo send/recv,
reduce-scatter) are wrapped and timed when ``wait()`` returns. A gloo collective's row is a tuple
(``ROW_COLUMNS``; send/recv and NCCL rows are dicts), encoded by the drain thread in batches. On the caller's
thread a collective costs the Python pass-through, the row and a queue append; ``benchmarks/probe_overhead.py``
measures it per collective against plain gloo (its ``record_cost`` case: one process, no peer, so that the
recording cost is not lost in a 2-rank collective's noise).

On NCCL ``wait()`` does not block the host: NCCL rows are issued and timed on the device by
``collectors.nccl`` (arrival event, NCCL's own start/end, ``timing="cuda_event"``). Rows are written once
the collective completes; collectives still in flight at close (a hang) are written with ``end_ns`` null.
A collective still in flight after one drain tick is also spilled once to the ``pending`` table, so a rank
killed inside it (SIGKILL: no close) still names it.
Rows name their group by ``pg`` only (a key, ``dtprobe.store.groups``); the group's members go to the ``groups``
table once, when the group first records, written to the writer before the row (``CollectiveRecorder.group_key``).
Read by ``dtprobe.store`` (tables ``collectives``, ``pending``, ``groups``) and ``dtprobe.runtime.hang``
(``RECORDER.progress()``, ``RECORDER.pending()``).
"""

from __future__ import annotations

import collections
import functools
import inspect
import itertools
import os
import sys
import threading
import time
import weakref
from types import ModuleType
from typing import Any, Callable

import torch
import torch.distributed as dist

from dtprobe.collectors import native_recorder, nccl, torch_internals
from dtprobe.collectors.comm_summaries import ROW_POSITIONS, StepSummaries
from dtprobe.store.groups import MEMBER_COLUMNS, GroupKeys
from dtprobe.store.schema import SCHEMAS

GLOO_BACKEND = "dtprobe_gloo"
"""Name of the recording gloo backend: ``init_process_group(backend="dtprobe_gloo")``."""
NCCL_BACKEND = "dtprobe_nccl"
"""Name of the recording NCCL backend (CUDA tensors)."""
WORLD_GROUP = "world"
"""``pg`` value for the default group when nothing else names it."""
_PENDING_COLUMNS = tuple(c for c in SCHEMAS["pending"] if c != "rank" and c not in MEMBER_COLUMNS)
ROW_COLUMNS = ("pg", "seq", "op", "num_bytes", "dtype", "step", "timing", "enqueue_ns", "restart", "end_ns")
"""Columns of a row kept as a tuple (a gloo collective, not send/recv), in order; an in-flight row lacks the last
(``end_ns``). Rows kept as dicts (p2p, NCCL) have these keys in this order, with ``peer`` before ``end_ns``. ``pg``
is the group's key in the ``groups`` table (``CollectiveRecorder.group_key``)."""
_PG, _SEQ, _OP, _STEP = (ROW_COLUMNS.index(c) for c in ("pg", "seq", "op", "step"))
assert set(ROW_COLUMNS) <= set(SCHEMAS["collectives"])
assert all(ROW_COLUMNS[i] == c for c, i in ROW_POSITIONS.items())


def row_dict(row: dict[str, Any] | tuple) -> dict[str, Any]:
    """A row as a dict (a tuple row's columns named by ``ROW_COLUMNS``); dict rows are returned as they are."""
    return row if type(row) is dict else dict(zip(ROW_COLUMNS, row))


def _ended(row: dict[str, Any] | tuple, end_ns: int) -> dict[str, Any] | tuple:
    """The finished row: a tuple row extended by ``end_ns``, a dict row with ``end_ns`` set."""
    if type(row) is tuple:
        return row + (end_ns,)
    row["end_ns"] = end_ns
    return row


class _Mirrored:
    """An attribute of ``CollectiveRecorder`` (kept in ``_<name>``) copied to its native recorder's ``native_name``
    when set, as ``to_native(value)``."""

    def __init__(self, native_name: str, to_native: Callable[[Any], Any] = lambda value: value) -> None:
        self.native_name, self.to_native = native_name, to_native

    def __set_name__(self, owner: type, name: str) -> None:
        self.private = f"_{name}"

    def __get__(self, recorder: Any, owner: type) -> Any:
        return self if recorder is None else getattr(recorder, self.private)

    def __set__(self, recorder: Any, value: Any) -> None:
        setattr(recorder, self.private, value)
        if recorder._native is not None:
            self.copy(recorder, recorder._native)

    def copy(self, recorder: Any, native: Any) -> None:
        setattr(native, self.native_name, self.to_native(getattr(recorder, self.private)))


class CollectiveRecorder:
    """Process-wide sink shared by every recording group: the writer, the current step, the timing mode.

    The backends are created by ``torch.distributed`` (not by the probe), so they reach the probe through this
    one module-level object (``RECORDER``). Until ``start`` sets a writer, rows are dropped.

    Rows are queued (a deque append, well under a microsecond) and handed to the writer by a drain thread
    every ``flush_interval_s``, by ``drain()`` and at ``stop()``: the writer's JSON encoding (tuple rows in one
    batch per drain, dict rows one by one) stays off the training thread. Each tick of the drain thread
    (``tick()``) drains the queue, spills to ``pending`` every collective that was already in flight at the
    previous tick (each at most once), and flushes the writer: a completed row reaches the OS within one
    interval, a collective pending for two intervals is on disk, even while the training thread is blocked.
    """

    def __init__(self) -> None:
        self._native: Any = None
        """The native recorder of this recorder's native gloo groups (``native_recorder.cpp``'s ``Recorder``), made
        by the first one (``native``); None until then. Mirrors ``writer``, ``step``, ``timing`` and ``restart``."""
        self._writer: Any = None
        self._step = -1
        self._timing = "wait"
        self._restart = 0
        self.nccl_timing = True
        """Use the NCCL completion hook for device timings when ``TORCH_NCCL_ENABLE_TIMING=1``."""
        self._paused = _PausedFlag()
        self._in_flight: dict[int, dict[str, Any] | tuple] = {}
        self._callbacks: weakref.WeakSet = weakref.WeakSet()   # done-callbacks a work's future still holds
        self._ids = itertools.count()
        self._progress: dict[str, _GroupProgress] = {}   # read by the hang watchdog: see progress()
        self._queue: collections.deque = collections.deque()
        self._drain_lock = threading.Lock()
        self._stop_drain = threading.Event()
        self._drainer: threading.Thread | None = None
        self._flushing: Any = None               # the writer the drain tick flushes in its stead (start)
        self._tick_lock = threading.Lock()
        self._seen_at_tick: set[int] = set()     # in-flight keys at the previous tick
        self._spilled: set[int] = set()          # in-flight keys already written to ``pending``
        self._group_lock = threading.Lock()
        self._group_keys = GroupKeys()
        self._groups: dict[str, dict[str, Any]] = {}   # key -> the group's ``groups`` row (name, members)
        self._summaries = StepSummaries()              # ``comm_steps`` rows in the making (used under _drain_lock)

    writer = _Mirrored("writing", lambda writer: writer is not None)
    """``RankWriter`` (or None: drop rows)."""
    step = _Mirrored("step")
    """Training step current at enqueue; -1 outside ``probe.step``."""
    timing = _Mirrored("enqueue_timing", lambda timing: timing == "enqueue")
    """``"wait"``: rows get ``end_ns`` at completion; ``"enqueue"``: rows are written at once, no end."""
    restart = _Mirrored("restart")
    """torchrun restart count of this worker (``TORCHELASTIC_RESTART_COUNT``), copied into every row."""

    def native(self, module: ModuleType) -> Any:
        """This recorder's native ``Recorder`` (of ``module``, the loaded ``native_recorder``), made at the first
        call with the recorder's state."""
        if self._native is None:
            native = module.Recorder()
            for mirrored in (CollectiveRecorder.writer, CollectiveRecorder.step, CollectiveRecorder.timing,
                             CollectiveRecorder.restart):
                mirrored.copy(self, native)
            self._native = native
        return self._native

    def start(self, writer: Any, *, timing: str = "wait", nccl_timing: bool = True,
              flush_interval_s: float = 1.0, restart: int = 0) -> None:
        """Begin recording into ``writer`` (attach); ``restart`` is the worker's torchrun restart count."""
        self.stop()
        with self._group_lock:
            self.writer = writer
            self.restart = int(restart)
            # Groups met before (an earlier attach of this process): their rows again, for this writer.
            for group in self._groups.values():
                writer.write("groups", {**group, "restart": self.restart})
        self.timing = timing
        self.nccl_timing = nccl_timing
        self.step = -1
        with self._drain_lock:
            self._summaries = StepSummaries(self.restart)
        self._seen_at_tick, self._spilled = set(), set()
        if self._native is not None:
            self._native.reset_ticks()
        self._stop_drain = threading.Event()
        # The drain tick flushes the writer anyway: the writer's own flusher stops meanwhile (one wake-up per
        # interval instead of two on the rank's cores)
        hand_over = getattr(writer, "hand_over_flushing", None)
        self._flushing = writer if hand_over is not None and hand_over(flush_interval_s) else None
        self._drainer = threading.Thread(target=self._drain_loop, args=(self._stop_drain, flush_interval_s),
                                         name="dtprobe-collectives", daemon=True)
        self._drainer.start()

    def stop(self) -> None:
        """Write in-flight rows (end null), drain the queue and stop recording (close). Idempotent."""
        if self._drainer is not None:
            self._stop_drain.set()
            self._drainer.join(timeout=10)
            self._drainer = None
        if self.writer is not None:
            # A work's done-callback runs just after its waiters wake: give just-finished ones a moment.
            deadline = time.monotonic() + 0.2
            while self._num_in_flight() and time.monotonic() < deadline:
                time.sleep(0.005)
            self.flush_in_flight()
            self.drain()
            with self._drain_lock:
                for row in self._summaries.rest():
                    self.writer.write("comm_steps", row)
        self._give_back_flushing()
        self.writer = None
        self.step = -1

    def _give_back_flushing(self) -> None:
        """The writer whose flushing the drain thread took over (``start``) flushes on its own again."""
        writer, self._flushing = self._flushing, None
        if writer is not None:
            writer.take_back_flushing()

    def _num_in_flight(self) -> int:
        return len(self._in_flight) + (self._native.num_in_flight() if self._native is not None else 0)

    def step_ended(self, step: int) -> None:
        """The training thread left step ``step``: its ``comm_steps`` rows are written once its collectives are
        all drained (``comm_summaries``)."""
        with self._drain_lock:
            self._summaries.end_step(step)

    def _in_flight_steps(self) -> list[int]:
        """The steps of the rows in flight now (Python and native)."""
        rows = list(self._in_flight.values())
        steps = [row[_STEP] if type(row) is tuple else row.get("step") for row in rows]
        if self._native is not None and self._native.num_in_flight():
            steps += [row[_STEP] for row in self._native.in_flight()]
        return steps

    def drain(self) -> None:
        """Hand every queued row to the writer now: tuple rows in batches through ``writer.write_values`` when it has
        one (``RankWriter``), else each as a dict through ``writer.write``. The native recorder's rows come first.
        Then the ``comm_steps`` rows of the steps that are over (``comm_summaries.StepSummaries``)."""
        writer = self.writer
        with self._drain_lock:
            in_flight_steps = self._in_flight_steps() if writer is not None else []   # before the rows are taken
            queue = self._queue
            rows = self._native.take() if self._native is not None else []
            while True:
                try:
                    rows.append(queue.popleft())
                except IndexError:
                    break
            if writer is None:
                return
            summaries = self._summaries
            summaries.add(rows)
            write_values = getattr(writer, "write_values", None)
            batch: list[tuple] = []
            for row in rows:
                if type(row) is tuple and write_values is not None:
                    batch.append(row)
                    continue
                if batch:
                    write_values("collectives", ROW_COLUMNS, batch)
                    batch = []
                writer.write("collectives", row_dict(row))
            if batch:
                write_values("collectives", ROW_COLUMNS, batch)
            for summary in summaries.due(in_flight_steps):
                writer.write("comm_steps", summary)

    def tick(self) -> int:
        """One drain-thread tick: drain the queue, spill to ``pending`` the collectives in flight since the previous
        tick and not spilled yet, flush the writer. Returns how many rows were spilled."""
        with self._tick_lock:
            self.drain()
            writer = self.writer
            if writer is None:
                return 0
            in_flight = self._in_flight
            now = set(in_flight)               # a C-level copy under the GIL: safe against concurrent track/untrack
            spill = (now & self._seen_at_tick) - self._spilled
            spilled = [in_flight.get(key) for key in sorted(spill)]   # keys grow with issue order: oldest first
            if self._native is not None:
                spilled += self._native.spill()
            for row in spilled:
                if row is not None:
                    row = row_dict(row)
                    writer.write("pending", {c: row[c] for c in _PENDING_COLUMNS if c in row})
            self._spilled = (self._spilled | spill) & now   # keys never come back once completed
            self._seen_at_tick = now
            # Every table reaches the OS each tick, even while the training thread is blocked (in-memory sinks
            # given to the recorder in tests have no flush).
            flush = getattr(writer, "flush", None)
            if flush is not None:
                flush()
            return sum(row is not None for row in spilled)

    def _drain_loop(self, stop: threading.Event, interval_s: float) -> None:
        try:
            while not stop.wait(interval_s):
                self.tick()
        finally:
            if not stop.is_set():    # ended by an error (threading reports it): the writer's rows still go out
                self._give_back_flushing()

    @property
    def active(self) -> bool:
        return self._writer is not None and not self._paused.on

    def paused(self) -> "_Paused":
        """Context manager: collectives issued by this thread inside it are not recorded (clock sync)."""
        return _Paused(self._paused, self)

    def group_key(self, name: str, pg_ranks: str, pg_size: int) -> str:
        """The ``pg`` key of group (``name``, ``pg_ranks``) in rows. The first time, its ``groups`` row is handed to
        the writer at once, so it precedes every row that names it (the writer flushes ``groups`` first)."""
        with self._group_lock:
            key, new = self._group_keys.key(name, pg_ranks)
            if new:
                group = self._groups[key] = {"pg": key, "name": name, "pg_ranks": pg_ranks, "pg_size": pg_size}
                if self.writer is not None:
                    self.writer.write("groups", {**group, "restart": self.restart})
            return key

    def with_members(self, row: dict[str, Any]) -> dict[str, Any]:
        """``row`` (a dict) with its group's ``pg_ranks`` and ``pg_size`` after ``pg``, as readers show it."""
        group = self._groups.get(row.get("pg"))
        if group is None:
            return row
        out = {"pg": row["pg"], "pg_ranks": group["pg_ranks"], "pg_size": group["pg_size"]}
        out.update(row)
        return out

    def emit(self, row: dict[str, Any] | tuple) -> None:
        """Queue a finished row (a dict, or a tuple of ``ROW_COLUMNS``) for the drain thread."""
        if self.writer is not None:
            self._queue.append(row)

    def track(self, row: dict[str, Any] | tuple) -> int:
        """Register an issued row (a dict, or a tuple of ``ROW_COLUMNS`` but ``end_ns``) as in flight; returns its
        key for ``untrack``."""
        key = next(self._ids)              # next() and dict set/pop are atomic under the GIL: no lock
        self._in_flight[key] = row
        # Progress per group: collectives only (p2p rows, always dicts, have their own numbering).
        if type(row) is tuple:
            pg = row[_PG]
        elif "peer" not in row:
            pg = row["pg"]
        else:
            return key
        p = self._progress.get(pg)
        if p is None:
            p = self.group_progress(pg)
        p.issued = row
        return key

    def untrack(self, key: int) -> bool:
        """Forget an in-flight row; False if it was already written (completed, or flushed at close)."""
        row = self._in_flight.pop(key, None)
        if row is None:
            return False
        if type(row) is tuple:
            pg, seq, op = row[_PG], row[_SEQ], row[_OP]
        elif "peer" not in row:
            pg, seq, op = row["pg"], row["seq"], row["op"]
        else:
            return True
        p = self._progress.get(pg)
        if p is not None and seq > p.completed_seq:
            p.completed_seq, p.completed_op = seq, op
        return True

    def complete(self, key: int, row: dict[str, Any] | tuple, end_ns: int | None) -> None:
        """``untrack(key)`` and, unless it was already written, queue ``row`` finished at ``end_ns`` (None: no end)."""
        if self.untrack(key) and self._writer is not None:     # ``emit``, inline: once per wrapped collective
            self._queue.append(row if end_ns is None else row + (end_ns,) if type(row) is tuple
                               else _ended(row, end_ns))

    def group_progress(self, pg: str) -> "_GroupProgress":
        """Group ``pg``'s progress on this rank (created at its first use; listed by ``progress`` once it issued)."""
        p = self._progress.get(pg)
        if p is None:
            group = self._groups.get(pg)
            p = self._progress.setdefault(pg, _GroupProgress(pg, group["pg_ranks"] if group else ""))
        return p

    def run_blocking(self, row: tuple, progress: "_GroupProgress", call: Callable[..., Any], args: tuple,
                     kwargs: dict[str, Any]) -> Any:
        """``call(*args, **kwargs)`` and wait on the work it returns, with ``row`` (a gloo collective's tuple, no
        ``end_ns``; ``progress`` is its group's) in flight meanwhile; then queue it ended. ``track``, ``untrack``
        and ``emit`` in one call, for torch's blocking API (see ``RecordingProcessGroup._issue``)."""
        key = next(self._ids)              # next() and dict set/pop are atomic under the GIL: no lock
        in_flight = self._in_flight
        in_flight[key] = row
        progress.issued = row
        work = call(*args, **kwargs)
        if work is not None:
            work.wait()                    # raises if the collective failed: the row stays in flight
        end_ns = time.time_ns()
        if in_flight.pop(key, None) is not None:    # else already written at close, without an end
            seq = row[_SEQ]
            if seq > progress.completed_seq:
                progress.completed_seq, progress.completed_op = seq, row[_OP]
            if self._writer is not None:
                self._queue.append(row + (end_ns,))
        return work

    def progress(self) -> dict[str, dict[str, Any]]:
        """Per group name: ``pg_ranks``, ``last_issued_seq``/``_op``/``_step``/``_ns`` and ``last_completed_seq``/
        ``_op`` of this rank's collectives (timing "wait" only); read by ``dtprobe.runtime.hang``'s watchdog."""
        out = {pg: p.as_dict() for pg, p in list(self._progress.items()) if p.issued is not None}
        for pg, seq, op, step, enqueue_ns, completed_seq, completed_op in (
                self._native.progress() if self._native is not None else ()):
            if pg in out and out[pg]["last_issued_seq"] >= seq:
                continue                     # a group recorded in Python too (not made so): the further one
            group = self._groups.get(pg)
            out[pg] = {"pg_ranks": group["pg_ranks"] if group else "", "last_completed_seq": completed_seq,
                       "last_completed_op": completed_op, "last_issued_seq": seq, "last_issued_op": op,
                       "last_issued_step": step, "last_issued_ns": enqueue_ns}
        return out

    def pending(self) -> list[dict[str, Any]]:
        """Rows of collectives issued but not completed yet, oldest first (what a hung rank waits on), each with its
        group's ``pg_ranks`` and ``pg_size``."""
        rows = [row_dict(r) for r in list(self._in_flight.values())]
        if self._native is not None:
            rows = sorted(rows + [row_dict(r) for r in self._native.in_flight()], key=lambda r: r["enqueue_ns"])
        return [self.with_members(dict(r)) for r in rows]

    def flush_in_flight(self) -> int:
        """Write every in-flight row with ``end_ns`` null (at close: a hang or a crash); returns how many."""
        rows = []
        for key in list(self._in_flight):
            row = self._in_flight.pop(key, None)
            if row is not None:
                rows.append(row)
        for row in rows:
            self.emit(row)
        return len(rows) + (self._native.flush_in_flight() if self._native is not None else 0)

    def on_done(self, future: Any, callback: "_FutureDone | _WorkDone") -> None:
        """``future.add_done_callback(callback)``, the callback known to ``settle_callbacks``."""
        callback.future = future
        self._callbacks.add(callback)
        future.add_done_callback(callback)

    def settle_callbacks(self, timeout_s: float = 5.0) -> bool:
        """Wait (sleeping, so without the GIL) until no future of a finished work still holds one of our
        done-callbacks; False if some still did after ``timeout_s``. Called at interpreter exit.

        The callbacks run on the gloo worker thread that finished the work, after the waiter was woken, and that
        thread takes the GIL again to release the callback once it returned. A thread that needs the GIL once the
        interpreter is finalizing is ended by CPython (``pthread_exit``), whose unwinding through torch's C++
        frames aborts the process ("terminate called without an active exception", exit -6) after its work was
        done. A callback is released when its object is freed, which empties its entry here; callbacks of works
        still in flight (a hung collective) are not waited for."""
        deadline = time.monotonic() + timeout_s
        while True:
            busy = any(cb.future.done() for cb in list(self._callbacks))
            if not busy:
                return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.005)


class _GroupProgress:
    """One group's progress on this rank: the last issued row (kept as is; its fields are read only when the
    watchdog asks; None until the group issues) and the highest completed collective."""

    __slots__ = ("pg", "pg_ranks", "issued", "completed_seq", "completed_op")

    def __init__(self, pg: str, pg_ranks: str) -> None:
        self.pg = pg
        self.pg_ranks = pg_ranks
        self.issued: dict[str, Any] | tuple | None = None
        self.completed_seq = 0
        self.completed_op: str | None = None

    def as_dict(self) -> dict[str, Any]:
        issued = row_dict(self.issued)
        return {"pg_ranks": self.pg_ranks, "last_completed_seq": self.completed_seq,
                "last_completed_op": self.completed_op, "last_issued_seq": issued["seq"],
                "last_issued_op": issued["op"], "last_issued_step": issued["step"],
                "last_issued_ns": issued["enqueue_ns"]}


class _PausedFlag(threading.local):
    """Per thread: recording paused (``CollectiveRecorder.paused``). A class default, so reading it on the hot path is
    a plain attribute lookup, not a caught AttributeError."""

    on = False


class _Paused:
    def __init__(self, local: threading.local, recorder: CollectiveRecorder) -> None:
        self._local = local
        self._recorder = recorder

    def __enter__(self) -> None:
        self._prev = getattr(self._local, "on", False)
        self._local.on = True
        self._native = self._recorder._native      # its native recorder pauses per thread too
        if self._native is not None:
            self._native.set_paused(True)

    def __exit__(self, *exc: object) -> None:
        self._local.on = self._prev
        if self._native is not None:
            self._native.set_paused(False)


RECORDER = CollectiveRecorder()
"""The recorder every ``RecordingProcessGroup`` writes through; ``dtprobe.collectors.attach`` configures it."""


_DTYPE_NAMES: dict[torch.dtype, str] = {}


def dtype_name(dtype: torch.dtype) -> str:
    name = _DTYPE_NAMES.get(dtype)
    if name is None:
        name = _DTYPE_NAMES[dtype] = str(dtype).removeprefix("torch.")
    return name


def _nbytes(t: torch.Tensor) -> int:
    return t.nbytes                      # numel * element size (of the view, not of its storage)


def _flat(tensors: Any) -> list[torch.Tensor]:
    """Tensors from a tensor, a list of tensors, or a list of lists of tensors."""
    if isinstance(tensors, torch.Tensor):
        return [tensors]
    out: list[torch.Tensor] = []
    for t in tensors:
        if isinstance(t, torch.Tensor):
            out.append(t)
        else:
            out.extend(t)
    return out


def _sum_bytes(tensors: Any) -> tuple[int, str | None]:
    if type(tensors) is list and len(tensors) == 1 and isinstance(tensors[0], torch.Tensor):   # the usual case
        t = tensors[0]
        return t.nbytes, dtype_name(t.dtype)
    flat = _flat(tensors)
    return sum(_nbytes(t) for t in flat), (dtype_name(flat[0].dtype) if flat else None)


def _waits_now(args: tuple, kwargs: dict) -> bool:
    """True if the call's options (first extra argument, or ``opts=``) say ``asyncOp`` is False: torch's blocking
    API (``dist.all_reduce(t)`` and the like, ``async_op=False``) then waits on the work as soon as it is returned.
    C++ callers (DDP's reducer, functional collectives) and calls without options keep the default, True."""
    opts = args[0] if args else kwargs.get("opts")
    return getattr(opts, "asyncOp", True) is False


def _failed(future: Any) -> bool:
    """True if a work's future finished with an error (a peer died, the group was aborted): that is no
    completion, so the row stays in flight and is written at close with ``end_ns`` null, like a hang's."""
    try:
        future.value()
    except Exception:  # noqa: BLE001 - any backend error means the collective never completed
        return True
    return False


class _FutureDone:
    """Done-callback of a work's future: stamps ``end_ns`` and writes the row (unless flushed at close or the
    work failed). Registered through ``CollectiveRecorder.on_done``, which sets ``future``."""

    __slots__ = ("recorder", "key", "row", "future", "__weakref__")

    def __init__(self, recorder: CollectiveRecorder, key: int, row: dict[str, Any]) -> None:
        self.recorder, self.key, self.row = recorder, key, row
        self.future: Any = None

    def __call__(self, future: Any) -> None:
        if not _failed(future):
            self.recorder.complete(self.key, self.row, time.time_ns())


class _WorkDone:
    """Done-callback of a ``RecordedWork``'s future: its ``_complete`` (an object, not a bound method, so that
    ``CollectiveRecorder.settle_callbacks`` sees when the future lets go of it)."""

    __slots__ = ("work", "future", "__weakref__")

    def __init__(self, work: "RecordedWork") -> None:
        self.work = work
        self.future: Any = None

    def __call__(self, future: Any) -> None:
        self.work._complete(future)


class _WaitHabit:
    """How callers of one (group, op) use its works, learned from the works themselves; decides how ``end_ns`` is
    taken for the next ones.

    A done-callback on the work's future stamps the exact completion, but runs Python on the gloo thread that
    finished the work: a GIL hand-over between two threads for every collective, the bulk of the recording cost
    of a small collective. A caller that waits before the work completes (``dist.all_reduce`` without
    ``async_op``, a DTensor or FSDP wait right after the issue, ``get_future().wait()``; or within
    ``PROMPT_WAIT_NS`` of it) sees the completion itself: its ``wait()`` returns then, on its own thread, so the
    wrapper stamps ``end_ns`` there, with no callback. A future handed out by the wrapper is the backend's own
    future with an unwrap function (``RecordedWork._future_waited``), which torch runs on the caller's thread when
    that future's ``wait()`` or ``value()`` returns.

    The first work of a (group, op) goes back as the backend's own Work with the callback; the next ones are
    wrapped, with the callback until ``PROMPT_WAITS`` of them in a row were waited promptly. A work found completed
    well before its ``wait()`` starts, a future waited more than ``PROMPT_WAIT_NS`` after it was taken, a work
    dropped unwaited, or a future released without a wait through it (DDP's reducer takes futures in C++;
    ``then()``, ``wait_all``) brings the callback back, so a caller that overlaps the collective with other work
    gets exact completion times. The works that reveal the change are stamped at their wait, an upper bound of
    their completion: one work for a caller that waits each work before issuing the next, every work issued
    without the callback before the first late wait for one that waits a batch at the end.
    """

    PROMPT_WAITS = 4
    """Works waited before completion, in a row, after which a (group, op) goes without the done-callback."""
    PROMPT_WAIT_NS = 50_000
    """A wait that starts this soon after the backend handed the work back counts as prompt even if the work
    already completed (a descheduled caller, a tiny collective): its end is stamped at most this late after the
    issue returned, within a thread wake-up. Counted from the issue's return, not from ``enqueue_ns``: a caller
    descheduled inside the backend's call (a busy machine) has not waited late. A future's wait counts as prompt
    if the future was taken so (or before the work completed) and its ``wait()`` returned within this of that."""

    __slots__ = ("issued", "prompt", "future_taken")

    def __init__(self) -> None:
        self.issued = False
        """A work of this (group, op) was issued: the first one goes back as the backend's own Work."""
        self.prompt = 0
        """Works of this (group, op) waited promptly, in a row."""
        self.future_taken = False
        """A future taken from a work was released without being waited through it (DDP's reducer, ``then()``
        users): the group hands back the backend's own Work with the done-callback, as a Python Work costs those
        C++ callers GIL round trips."""

    @property
    def needs_callback(self) -> bool:
        return self.prompt < self.PROMPT_WAITS

    def waited(self, prompt: bool) -> None:
        """Count one wait: prompt ones in a row, a late one starts the count again."""
        if not prompt:
            self.prompt = 0
        elif self.prompt < self.PROMPT_WAITS:
            self.prompt += 1


_set_future_unwrap = torch_internals.set_future_unwrap
"""torch's futures take an unwrap function (run when a Python ``wait()``/``value()`` returns; None: this torch has
none): a wrapped work's future is then stamped at its wait (``RecordedWork._future_waited``)."""


class RecordedWork(dist.Work):
    """Wraps a real ``Work``: writes the row when ``wait()`` returns, when a future it handed out returns from its
    Python ``wait()``/``value()`` (a work with a ``habit``: ``_future_waited``) or, if a done-callback was added
    (``future``, while the habit is learned; a future taken from a work without a habit), when the work completes;
    first wins.

    Used for works without a future (gloo send/recv, reduce-scatter; timed at ``wait()``) and for gloo works whose
    callers wait on them (see ``_WaitHabit``); ``habit`` is updated with how this work was used.
    """

    # One per wrapped collective: slots make it cheaper to build than an instance dict (torch's Work takes no
    # attributes of its own either).
    __slots__ = ("_inner", "_row", "_recorder", "_key", "_habit", "_handed_ns", "_future", "_callback", "_waiter",
                 "_taken_ns")

    def __init__(self, inner: dist.Work, row: dict[str, Any] | tuple, recorder: CollectiveRecorder, *,
                 habit: _WaitHabit | None = None, future: Any = None) -> None:
        super().__init__()
        _wrap(inner, row, recorder, habit, future, self)

    def _complete(self, future: Any = None) -> None:
        row = self._row
        if row is None or (future is not None and _failed(future)):
            return
        self._row = None
        self._recorder.complete(self._key, row, time.time_ns())

    def wait(self, timeout: Any = None) -> bool:
        habit = self._habit
        if habit is not None:
            self._habit = None
            if (self._row is not None and time.time_ns() - self._handed_ns > _WaitHabit.PROMPT_WAIT_NS
                    and self._inner.is_completed()):   # the clock first: cheaper than asking the backend
                habit.prompt = 0            # completed well before the wait: only a callback sees when
            elif habit.prompt < _WaitHabit.PROMPT_WAITS:
                habit.prompt += 1
        ok = self._inner.wait() if timeout is None else self._inner.wait(timeout)
        row = self._row
        if row is not None:
            self._row = None
            self._recorder.complete(self._key, row, time.time_ns())
        return ok

    def get_future(self) -> torch.futures.Future:
        habit = self._habit
        if habit is not None and _set_future_unwrap is not None:
            # The future's Python wait() stamps the end (``_future_waited``); released unwaited, the work's
            # ``__del__`` brings the callback back. Not kept here: this work is the future's unwrap function, and
            # a cycle through a C++ future is never collected.
            self._habit = None
            now = time.time_ns()
            prompt = now - self._handed_ns <= _WaitHabit.PROMPT_WAIT_NS or not self._inner.is_completed()
            self._taken_ns = now if prompt else None
            self._waiter = habit
        if self._waiter is not None:         # also a second get_future before the first future's wait
            fut = self._inner.get_future()
            _set_future_unwrap(fut, self._future_waited)
            return fut
        if self._future is None:
            if habit is not None:            # a torch without unwrap functions: as a C++ caller
                self._habit = None
                habit.future_taken, habit.prompt = True, 0
            fut = self._inner.get_future()
            self._recorder.on_done(fut, _WorkDone(self))    # the done-callback stamps the completion
            self._future = fut
        return self._future

    def _future_waited(self, value: Any) -> None:
        """Unwrap function of the futures this work handed out while its habit was learned or known: torch calls it
        on the caller's thread each time such a future's ``wait()`` or ``value()`` returns (never when the work
        failed). The first call stamps ``end_ns`` (unless a done-callback wrote the row) and tells the habit
        whether the wait was prompt."""
        habit = self._waiter
        if habit is None:                   # called before: a later wait() or value()
            return
        self._waiter = None
        now = time.time_ns()
        taken_ns = self._taken_ns
        habit.waited(taken_ns is not None and now - taken_ns <= _WaitHabit.PROMPT_WAIT_NS)
        row = self._row
        if row is not None:
            self._row = None
            self._recorder.complete(self._key, row, now)

    def is_completed(self) -> bool:
        return self._inner.is_completed()

    def is_success(self) -> bool:
        return self._inner.is_success()

    def exception(self) -> Any:
        return self._inner.exception()

    def source_rank(self) -> int:
        return self._inner.source_rank()

    def result(self) -> list[torch.Tensor]:
        return self._inner.result()

    def synchronize(self) -> None:
        self._inner.synchronize()

    def __del__(self) -> None:
        try:
            habit, waiter, row = self._habit, self._waiter, self._row
        except AttributeError:              # built, but never filled
            return
        if waiter is not None:
            # Its futures were released without a Python wait (DDP's reducer takes them in C++; then(), wait_all):
            # the callback comes back for its (group, op) and, unless one holds the row, for this work (its end is
            # then the completion, or now if the work completed before: an upper bound).
            waiter.future_taken, waiter.prompt = True, 0
            if row is not None and not self._callback:
                self._row = None
                self._recorder.on_done(self._inner.get_future(), _FutureDone(self._recorder, self._key, row))
            return
        # Never waited and no future taken (fire-and-forget). A work that has a future gets its end from a
        # done-callback (added now if it was not), and its (group, op) gets the callback back; a work without
        # one is written without an end time.
        if habit is not None:
            habit.prompt = 0
        if row is None or self._future is not None:
            return
        self._row = None
        if habit is not None:
            future = self._inner.get_future()
            self._recorder.on_done(future, _FutureDone(self._recorder, self._key, row))
            return
        self._recorder.complete(self._key, row, None)


class _IssuedWork(RecordedWork):
    """The ``RecordedWork`` of the group's hot path (``RecordingProcessGroup._issue``): built by torch's own Work
    constructor (no Python ``__init__`` frame, no ``super()`` call, no keyword arguments), then filled by
    ``_wrap``."""

    __slots__ = ()
    __init__ = dist.Work.__init__


def _wrap(inner: dist.Work, row: tuple | dict[str, Any], recorder: CollectiveRecorder,
          habit: _WaitHabit | None = None, future: Any = None, work: RecordedWork | None = None) -> RecordedWork:
    """``RecordedWork(inner, row, recorder, habit=habit, future=future)``, built the cheap way (an
    ``_IssuedWork``); or, given ``work`` (``RecordedWork.__init__``), its fields filled and ``row`` tracked."""
    if work is None:
        work = _IssuedWork()
    work._inner = inner
    work._row = row
    work._recorder = recorder
    work._key = recorder.track(row)
    work._habit = habit
    if habit is not None:
        work._handed_ns = time.time_ns()     # the backend handed the work back (``PROMPT_WAIT_NS``)
    work._future = None
    work._waiter = None      # while a future taken from it has not returned from a Python wait: the habit to update
    work._callback = future is not None
    if future is not None:                   # exact completion time while the caller's habit is being learned
        recorder.on_done(future, _WorkDone(work))
    return work


_SPLIT_DEVICE_TYPES_ARG = 5
"""Position of ``device_types`` in ``ProcessGroup.split_group(ranks, timeout, opts, group_name, group_desc,
device_types)``, counted from ``ranks``."""


def split_each_backend_once(inner: dist.ProcessGroup, ranks: Any, *args: Any, **kwargs: Any) -> Any:
    """``inner.split_group(ranks, ...)`` that splits each backend of ``inner`` once.

    torch 2.13's ``ProcessGroup::splitGroup`` splits once per device type, and a gloo group serves "cpu" and "cuda"
    with one ``ProcessGroupGloo``: that backend is split twice, both children rendezvous under the same store
    prefix (the group name), and the second is thrown away. The two rendezvous can cross, so that a rank's kept
    child is connected to its peer's discarded one: the first collective on the sub-group then waits for a recv
    that never comes, until gloo's timeout. So the split is asked for one device type per backend
    (``device_types``), and the other device types are mapped to the same child backend, as in the parent. A
    caller that names ``device_types`` gets exactly what it asked for."""
    if len(args) >= _SPLIT_DEVICE_TYPES_ARG or "device_types" in kwargs:
        return inner.split_group(ranks, *args, **kwargs)
    first: list[tuple[Any, torch.device]] = []          # (parent backend, the device type that splits it)
    shared: list[tuple[torch.device, torch.device]] = []  # (device type, the one whose child backend it shares)
    # cpu first: it must stay in the filter (torch checks that the filter holds the default backend's device type,
    # which for a gloo group that also serves cuda is cpu)
    for device in sorted(inner._device_types, key=lambda d: d.type != "cpu"):
        backend = inner._get_backend(device)
        owner = next((d for b, d in first if b is backend), None)
        if owner is None:
            first.append((backend, device))
        else:
            shared.append((device, owner))
    if not shared:
        return inner.split_group(ranks, *args, **kwargs)
    sub = inner.split_group(ranks, *args, device_types=[d for _, d in first], **kwargs)
    if sub is not None:
        for device, owner in shared:
            child = sub._get_backend(owner)
            backend_type = getattr(dist.ProcessGroup.BackendType, child.name().upper(),
                                   dist.ProcessGroup.BackendType.CUSTOM)
            sub._register_backend(device, backend_type, child)
    return sub


class RecordingProcessGroup(dist.ProcessGroup):
    """A process group that records each collective, then runs it on ``inner`` (a real ProcessGroup).

    ``pg`` in the rows is ``dtprobe_name`` when set (``probe.new_group(..., name=)``, mesh axes), ``"world"``
    for the default group, else ``"g<torch group name>"``. ``seq`` counts collectives on this group (1-based);
    send/recv are numbered apart, per (peer, direction): the k-th send to rank B has seq k, and so does B's
    k-th recv from this rank (same seq = same message). Never reorders or delays a collective: the row is
    built before the call and the call is forwarded as is, on the caller's thread.

    Made as a ``_NativeGlooGroup`` (collectives recorded in C++) when ``inner`` runs gloo on every device, the
    native recorder is built (``native_module``) and ``native`` is left on; else every call is recorded here.
    """

    def __new__(cls, inner: Any, rank: int, size: int, *, backend_name: str,
                recorder: CollectiveRecorder | None = None, device_timing: bool = False,
                native: bool = True) -> "RecordingProcessGroup":
        if (cls is RecordingProcessGroup and native and not device_timing and _runs_gloo(inner)
                and native_module() is not None):
            cls = _NativeGlooGroup
        return super().__new__(cls)

    def __init__(self, inner: dist.ProcessGroup, rank: int, size: int, *, backend_name: str,
                 recorder: CollectiveRecorder | None = None, device_timing: bool = False,
                 native: bool = True) -> None:
        super().__init__(rank, size)
        self._inner = inner
        self._rank = rank
        self._size = size
        self._backend_name = backend_name
        self._recorder = recorder or RECORDER
        self._device_timing = device_timing
        """True on NCCL: host ``wait()`` is not completion; rows come from the completion hook (or lack an end)."""
        self._group_name = ""
        self._group_desc = ""
        self.dtprobe_name: str | None = None
        """Recording name of this group (axis name); set by ``probe.new_group`` / ``probe.name_mesh``."""
        self._ranks_str: str | None = None
        self._fallback_name = ""
        self._key: str | None = None
        """``pg`` of this group's rows (``CollectiveRecorder.group_key``), for the name in ``_key_name``."""
        self._key_name: str | None = None
        self._seq = itertools.count(1)     # next() is atomic under the GIL: no lock on the hot path
        self._p2p_seq: dict[tuple[int, str], Any] = {}
        self._no_future_ops: set[str] = set()
        self._habits: dict[str, _WaitHabit] = {}    # per op: how its callers wait (see _WaitHabit)
        self._progress: _GroupProgress | None = None
        """The recorder's progress of the group whose key the last blocking call had (``run_blocking``)."""
        self._nccl: Any = nccl.UntimedNccl(self._recorder) if device_timing else None
        """NCCL only: issues and times the recorded collectives (``collectors.nccl``)."""

    # ---- identity (DeviceMesh, FSDP2 and DTensor need the group name) ----
    def size(self) -> int:
        return self._size

    def rank(self) -> int:
        return self._rank

    def getBackendName(self) -> str:
        return self._backend_name

    def _get_backend_name(self) -> str:
        return self._backend_name

    @property
    def group_name(self) -> str:
        return self._group_name

    def _set_group_name(self, name: str) -> None:
        self._group_name = name
        self._inner._set_group_name(name)

    @property
    def group_desc(self) -> str:
        return self._group_desc

    def _set_group_desc(self, desc: str) -> None:
        self._group_desc = desc
        self._inner._set_group_desc(desc)
        if self.dtprobe_name is None and desc.startswith("mesh_") and desc != "mesh_default":
            self.dtprobe_name = desc[len("mesh_"):]    # a DeviceMesh axis group (desc "mesh_<axis>"): its axis name

    @property
    def inner(self) -> dist.ProcessGroup:
        """The real process group every call is forwarded to."""
        return self._inner

    def _get_backend(self, device: Any) -> Any:
        return self._inner._get_backend(device)

    @property
    def _device_types(self) -> list:
        return self._inner._device_types

    @property
    def bound_device_id(self) -> Any:
        return self._inner.bound_device_id

    @bound_device_id.setter
    def bound_device_id(self, device: Any) -> None:
        self._inner.bound_device_id = device

    def set_timeout(self, timeout: Any) -> None:
        self._inner.set_timeout(timeout)

    def _get_sequence_number_for_group(self) -> int:
        return self._inner._get_sequence_number_for_group()

    def _set_sequence_number_for_group(self) -> None:
        self._inner._set_sequence_number_for_group()

    def abort(self) -> None:
        self._inner.abort()

    def shutdown(self) -> None:
        self._inner.shutdown()

    def monitored_barrier(self, *args: Any, **kwargs: Any) -> Any:
        return self._inner.monitored_barrier(*args, **kwargs)

    def get_group_store(self) -> Any:
        return self._inner.get_group_store()

    def split_group(self, ranks: Any, *args: Any, **kwargs: Any) -> Any:
        """The inner group's ``split_group`` (``dist.split_group``; a DeviceMesh of a group bound to a device),
        wrapped as a recording group like this one: the sub-group's collectives are recorded too. None for a rank
        outside ``ranks``."""
        sub = split_each_backend_once(self._inner, ranks, *args, **kwargs)
        if sub is None:
            return None
        wrapper = RecordingProcessGroup(sub, sub.rank(), sub.size(), backend_name=self._backend_name,
                                        recorder=self._recorder, device_timing=self._device_timing)
        wrapper._group_name = sub.group_name     # already set on the inner group by the split
        try:                                     # its members, known before torch registers it (if it does)
            parent = dist.get_process_group_ranks(self)
            wrapper._ranks_str = ",".join(str(parent[r]) for r in sorted(ranks))
            wrapper._fallback_name = f"g{sub.group_name}"
        except (RuntimeError, ValueError, KeyError, IndexError):
            pass                                 # resolved from torch's registry at its first collective
        if self._device_timing:
            nccl.time_rows(wrapper, self._recorder, device_timing=self._recorder.nccl_timing)
        return wrapper

    # ---- naming ----
    def _pg_key(self) -> str:
        """This group's key for the rows, resolved (and its ``groups`` row written) at the first recorded collective,
        and again if ``dtprobe_name`` changes; ``_issue`` reads the cached ``_key`` itself."""
        ranks = self._ranks_str
        if ranks is None:
            try:
                ranks = ",".join(str(r) for r in dist.get_process_group_ranks(self))
                is_world = dist.distributed_c10d._get_default_group() is self
            except (RuntimeError, ValueError, KeyError):   # not registered yet: no members known, nothing cached
                return self._recorder.group_key(self.dtprobe_name or f"g{self._group_name}", "", self._size)
            self._ranks_str = ranks
            self._fallback_name = WORLD_GROUP if is_world else f"g{self._group_name}"
        name = self.dtprobe_name
        self._key = self._recorder.group_key(name or self._fallback_name, ranks, self._size)
        self._key_name = name
        return self._key

    # ---- recording core ----
    def _issue(self, op: str, num_bytes: int, dtype: str | None, call: Callable[..., dist.Work], args: tuple,
               kwargs: dict[str, Any], peer: int | None = None, waits_now: bool = False) -> dist.Work:
        """Record ``call(*args, **kwargs)`` (the inner group's method and the caller's arguments, forwarded as
        given) as collective ``op``, or as a send/recv to ``peer``."""
        recorder = self._recorder            # callers checked recorder.active
        pg = self._key
        if pg is None or self.dtprobe_name is not self._key_name:
            pg = self._pg_key()
        if peer is None:
            seq = next(self._seq)
        else:
            counter = self._p2p_seq.get((peer, op))
            if counter is None:
                counter = self._p2p_seq.setdefault((peer, op), itertools.count(1))
            seq = next(counter)
        row: dict[str, Any] | tuple = (pg, seq, op, int(num_bytes), dtype, recorder._step, "host", time.time_ns(),
                                       recorder._restart)        # ROW_COLUMNS but end_ns
        if peer is None and not self._device_timing:     # a gloo collective: the row stays a tuple
            if waits_now and recorder._timing != "enqueue":
                # torch's blocking API (async_op=False) waits on the work as soon as it is returned: wait here, on
                # the caller's thread, stamp the end and hand back the completed backend Work (its wait() returns
                # at once). No Python Work, no done-callback on the gloo thread.
                progress = self._progress
                if progress is None or progress.pg != pg:
                    progress = self._progress = recorder.group_progress(pg)
                return recorder.run_blocking(row, progress, call, args, kwargs)
        else:                                            # p2p and NCCL rows are dicts, with ``peer`` for p2p
            row = row_dict(row)
            if peer is not None:
                row["peer"] = peer
            if self._device_timing:            # NCCL: timed on the device by collectors/nccl.py
                return self._nccl.issue(row, functools.partial(call, *args, **kwargs), peer=peer)
        work = call(*args, **kwargs)
        if work is None or recorder._timing == "enqueue":
            recorder.emit(row)
            return work
        habit = self._habits.get(op)
        if habit is not None and habit.prompt >= _WaitHabit.PROMPT_WAITS and not habit.future_taken:
            # Its callers wait before completion: the wrapper's wait(), or its future's, stamps end_ns on the
            # caller's thread.
            return _wrap(work, row, recorder, habit)
        if op in self._no_future_ops:
            return _wrap(work, row, recorder)
        if habit is None:
            habit = self._habits[op] = _WaitHabit()
        try:
            future = work.get_future()
        except RuntimeError:               # gloo p2p and reduce-scatter works have no future
            self._no_future_ops.add(op)
            return _wrap(work, row, recorder)
        if habit.future_taken or not habit.issued:
            habit.issued = True
            # The caller keeps the backend's own Work: a Python Work handed to C++ (DDP's reducer) costs GIL
            # round trips on every getFuture and destruction. The callback runs where the backend completes the
            # work (a gloo worker thread), so end_ns is the completion time.
            recorder.on_done(future, _FutureDone(recorder, recorder.track(row), row))
            return work
        return _wrap(work, row, recorder, habit, future)

    def _global_peer(self, group_peer: int) -> int:
        try:
            return dist.get_global_rank(self, group_peer)
        except (RuntimeError, ValueError, KeyError):
            return group_peer

    # ---- collectives (Python API names and C++ trampoline names) ----
    def allreduce(self, tensors: Any, *args: Any, **kwargs: Any) -> dist.Work:
        if not self._recorder.active:
            return self._inner.allreduce(tensors, *args, **kwargs)
        n, dt = _sum_bytes(tensors)
        return self._issue("allreduce", n, dt, self._inner.allreduce, (tensors, *args), kwargs,
                           waits_now=_waits_now(args, kwargs))

    def allreduce_coalesced(self, tensors: Any, *args: Any, **kwargs: Any) -> dist.Work:
        if not self._recorder.active:
            return self._inner.allreduce_coalesced(tensors, *args, **kwargs)
        n, dt = _sum_bytes(tensors)
        return self._issue("allreduce", n, dt,
                           self._inner.allreduce_coalesced, (tensors, *args), kwargs,
                           waits_now=_waits_now(args, kwargs))

    def broadcast(self, tensors: Any, *args: Any, **kwargs: Any) -> dist.Work:
        if not self._recorder.active:
            return self._inner.broadcast(tensors, *args, **kwargs)
        n, dt = _sum_bytes(tensors)
        return self._issue("broadcast", n, dt, self._inner.broadcast, (tensors, *args), kwargs,
                           waits_now=_waits_now(args, kwargs))

    def reduce(self, tensors: Any, *args: Any, **kwargs: Any) -> dist.Work:
        if not self._recorder.active:
            return self._inner.reduce(tensors, *args, **kwargs)
        n, dt = _sum_bytes(tensors)
        return self._issue("reduce", n, dt, self._inner.reduce, (tensors, *args), kwargs,
                           waits_now=_waits_now(args, kwargs))

    def allgather(self, outputs: Any, inputs: Any, *args: Any, **kwargs: Any) -> dist.Work:
        if not self._recorder.active:
            return self._inner.allgather(outputs, inputs, *args, **kwargs)
        n, dt = _sum_bytes(outputs)
        return self._issue("allgather", n, dt, self._inner.allgather, (outputs, inputs, *args), kwargs,
                           waits_now=_waits_now(args, kwargs))

    def allgather_coalesced(self, outputs: Any, inputs: Any, *args: Any, **kwargs: Any) -> dist.Work:
        if not self._recorder.active:
            return self._inner.allgather_coalesced(outputs, inputs, *args, **kwargs)
        n, dt = _sum_bytes(outputs)
        return self._issue("allgather", n, dt,
                           self._inner.allgather_coalesced, (outputs, inputs, *args), kwargs,
                           waits_now=_waits_now(args, kwargs))

    def _allgather_base(self, output: torch.Tensor, input: torch.Tensor, *args: Any, **kwargs: Any) -> dist.Work:
        if not self._recorder.active:
            return self._inner._allgather_base(output, input, *args, **kwargs)
        return self._issue("allgather", _nbytes(output), dtype_name(output.dtype),
                           self._inner._allgather_base, (output, input, *args), kwargs,
                           waits_now=_waits_now(args, kwargs))

    def all_gather_single(self, output: torch.Tensor, input: torch.Tensor, *args: Any, **kwargs: Any) -> dist.Work:
        if not self._recorder.active:
            return self._inner._allgather_base(output, input, *args, **kwargs)
        return self._issue("allgather", _nbytes(output), dtype_name(output.dtype),
                           self._inner._allgather_base, (output, input, *args), kwargs,
                           waits_now=_waits_now(args, kwargs))

    def all_gather_single_coalesced(self, outputs: Any, inputs: Any, *args: Any, **kwargs: Any) -> dist.Work:
        if not self._recorder.active:
            return self._inner.allgather_into_tensor_coalesced(outputs, inputs, *args, **kwargs)
        n, dt = _sum_bytes(outputs)
        return self._issue("allgather", n, dt,
                           self._inner.allgather_into_tensor_coalesced, (outputs, inputs, *args), kwargs,
                           waits_now=_waits_now(args, kwargs))

    allgather_into_tensor_coalesced = all_gather_single_coalesced

    def reduce_scatter(self, outputs: Any, inputs: Any, *args: Any, **kwargs: Any) -> dist.Work:
        if not self._recorder.active:
            return self._inner.reduce_scatter(outputs, inputs, *args, **kwargs)
        n, dt = _sum_bytes(inputs)
        return self._issue("reduce_scatter", n, dt,
                           self._inner.reduce_scatter, (outputs, inputs, *args), kwargs,
                           waits_now=_waits_now(args, kwargs))

    def _reduce_scatter_base(self, output: torch.Tensor, input: torch.Tensor, *args: Any, **kwargs: Any) -> dist.Work:
        if not self._recorder.active:
            return self._inner._reduce_scatter_base(output, input, *args, **kwargs)
        return self._issue("reduce_scatter", _nbytes(input), dtype_name(input.dtype),
                           self._inner._reduce_scatter_base, (output, input, *args), kwargs,
                           waits_now=_waits_now(args, kwargs))

    def reduce_scatter_single(self, output: torch.Tensor, input: torch.Tensor, *args: Any, **kwargs: Any) -> dist.Work:
        if not self._recorder.active:
            return self._inner._reduce_scatter_base(output, input, *args, **kwargs)
        return self._issue("reduce_scatter", _nbytes(input), dtype_name(input.dtype),
                           self._inner._reduce_scatter_base, (output, input, *args), kwargs,
                           waits_now=_waits_now(args, kwargs))

    def reduce_scatter_single_coalesced(self, outputs: Any, inputs: Any, *args: Any, **kwargs: Any) -> dist.Work:
        if not self._recorder.active:
            return self._inner.reduce_scatter_tensor_coalesced(outputs, inputs, *args, **kwargs)
        n, dt = _sum_bytes(inputs)
        return self._issue("reduce_scatter", n, dt,
                           self._inner.reduce_scatter_tensor_coalesced, (outputs, inputs, *args), kwargs,
                           waits_now=_waits_now(args, kwargs))

    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced

    def alltoall_base(self, output: torch.Tensor, input: torch.Tensor, *args: Any, **kwargs: Any) -> dist.Work:
        if not self._recorder.active:
            return self._inner.alltoall_base(output, input, *args, **kwargs)
        return self._issue("alltoall", _nbytes(input), dtype_name(input.dtype),
                           self._inner.alltoall_base, (output, input, *args), kwargs,
                           waits_now=_waits_now(args, kwargs))

    all_to_all_single = alltoall_base

    def alltoall(self, outputs: Any, inputs: Any, *args: Any, **kwargs: Any) -> dist.Work:
        if not self._recorder.active:
            return self._inner.alltoall(outputs, inputs, *args, **kwargs)
        n, dt = _sum_bytes(inputs)
        return self._issue("alltoall", n, dt, self._inner.alltoall, (outputs, inputs, *args), kwargs,
                           waits_now=_waits_now(args, kwargs))

    def gather(self, outputs: Any, inputs: Any, *args: Any, **kwargs: Any) -> dist.Work:
        if not self._recorder.active:
            return self._inner.gather(outputs, inputs, *args, **kwargs)
        n, dt = _sum_bytes(inputs)    # logical: every member's input, gathered at the root
        return self._issue("gather", n * self._size, dt,
                           self._inner.gather, (outputs, inputs, *args), kwargs,
                           waits_now=_waits_now(args, kwargs))

    def scatter(self, outputs: Any, inputs: Any, *args: Any, **kwargs: Any) -> dist.Work:
        if not self._recorder.active:
            return self._inner.scatter(outputs, inputs, *args, **kwargs)
        n, dt = _sum_bytes(outputs)   # logical: every member's output, scattered from the root
        return self._issue("scatter", n * self._size, dt,
                           self._inner.scatter, (outputs, inputs, *args), kwargs,
                           waits_now=_waits_now(args, kwargs))

    def barrier(self, *args: Any, **kwargs: Any) -> dist.Work:
        if not self._recorder.active:
            return self._inner.barrier(*args, **kwargs)
        return self._issue("barrier", 0, None, self._inner.barrier, args, kwargs,
                           waits_now=_waits_now(args, kwargs))

    def send(self, tensors: Any, dst: int, tag: int = 0) -> dist.Work:
        if not self._recorder.active:
            return self._inner.send(tensors, dst, tag)
        n, dt = _sum_bytes(tensors)
        return self._issue("send", n, dt, self._inner.send, (tensors, dst, tag), {}, peer=self._global_peer(dst))

    def recv(self, tensors: Any, src: int, tag: int = 0) -> dist.Work:
        if not self._recorder.active:
            return self._inner.recv(tensors, src, tag)
        n, dt = _sum_bytes(tensors)
        return self._issue("recv", n, dt, self._inner.recv, (tensors, src, tag), {}, peer=self._global_peer(src))

    def recv_anysource(self, tensors: Any, tag: int = 0) -> dist.Work:
        if not self._recorder.active:
            return self._inner.recv_anysource(tensors, tag)
        n, dt = _sum_bytes(tensors)
        return self._issue("recv", n, dt, self._inner.recv_anysource, (tensors, tag), {}, peer=-1)

    # ---- NCCL timing and coalescing (collectors/nccl.py) ----
    def enable_completion_timing(self, **kwargs: Any) -> bool:
        """Time collectives on the device through the inner NCCL group's timing and completion hook
        (``nccl.enable_completion_timing`` keywords: ``clock``, ``steady_offset_ns``); False if unavailable."""
        matcher = nccl.enable_completion_timing(self._inner, self._recorder, **kwargs)
        if matcher is not None:
            self._nccl = matcher
        return matcher is not None

    def set_nccl_timing(self, timing: Any) -> None:
        """Use ``timing`` (an object with ``issue``/``start_coalescing``/``end_coalescing``) for NCCL rows."""
        self._nccl = timing

    def _start_coalescing(self, device: Any) -> None:
        if self._nccl is not None:
            self._nccl.start_coalescing()
        self._inner._start_coalescing(device)

    def _end_coalescing(self, device: Any) -> Any:
        try:
            return self._inner._end_coalescing(device)
        finally:
            if self._nccl is not None:
                self._nccl.end_coalescing()


def _runs_gloo(inner: Any) -> bool:
    """True if ``inner`` is a process group whose every device runs a gloo backend."""
    gloo = getattr(dist, "ProcessGroupGloo", None)
    if gloo is None or not isinstance(inner, dist.ProcessGroup):
        return False
    try:
        devices = inner._device_types
        return bool(devices) and all(isinstance(inner._get_backend(device), gloo) for device in devices)
    except (RuntimeError, AttributeError):
        return False


_NATIVE_COLLECTIVES = (
    "allreduce", "allreduce_coalesced", "broadcast", "reduce", "allgather", "allgather_coalesced", "_allgather_base",
    "all_gather_single", "all_gather_single_coalesced", "allgather_into_tensor_coalesced", "reduce_scatter",
    "_reduce_scatter_base", "reduce_scatter_single", "reduce_scatter_single_coalesced",
    "reduce_scatter_tensor_coalesced", "alltoall_base", "all_to_all_single", "alltoall", "gather", "scatter",
    "barrier")
"""The collectives a ``_NativeGlooGroup`` leaves to the C++ process group (and so to its native backend)."""

_native: tuple[ModuleType | None] | None = None


def native_module() -> ModuleType | None:
    """The native recorder (``native_recorder.load``), loaded at the first recording gloo group; None records in
    Python: when it is not built, one stderr line says so and how to build it. ``DTPROBE_NATIVE_RECORDER=0`` keeps
    recording in Python, silently."""
    global _native
    if _native is None:
        module = None
        if os.environ.get("DTPROBE_NATIVE_RECORDER", "1") != "0":
            module, why = native_recorder.load()
            if module is None:
                print(f"dtprobe: collectives are recorded in Python, at a higher cost per collective, because the "
                      f"native recorder is not usable: {why}. Build it with `{native_recorder.BUILD_COMMAND}`.",
                      file=sys.stderr, flush=True)
        _native = (module,)
    return _native[0]


def _native_pg_key(group_ref: "weakref.ref[RecordingProcessGroup]") -> tuple[str, bool]:
    """A native backend's question for its group's ``pg`` key: the key, and whether it stays (``_pg_key``)."""
    group = group_ref()
    if group is None:                    # the group is gone while its backend is still used
        return WORLD_GROUP, False
    key = group._pg_key()
    return key, group._key is not None


class _NativeGlooGroup(RecordingProcessGroup):
    """A recording gloo group whose collectives are recorded in C++ (``native_recorder.cpp``).

    A ``RecordingBackend`` around each of the inner group's backends is registered, for the same devices, on this
    group and on ``_direct``, a plain C++ process group. A Python caller's collective (``dist.all_reduce``, FSDP,
    DTensor's waits) is ``_direct``'s own method (instance attributes): no Python frame, and not torch's trampoline
    for Python subclasses, which takes the GIL around the call. A C++ caller (DDP's reducer, functional collectives
    resolving this group by name) goes through that trampoline, finds no Python override and reaches the same
    backend. Rows go to the recorder's native ``Recorder`` and are drained with the Python ones. Point-to-point calls
    stay on the Python path (their per-peer numbering and global peer rank)."""

    def __init__(self, inner: dist.ProcessGroup, rank: int, size: int, *, backend_name: str,
                 recorder: CollectiveRecorder | None = None, device_timing: bool = False,
                 native: bool = True) -> None:
        super().__init__(inner, rank, size, backend_name=backend_name, recorder=recorder)
        module = native_module()
        recorder_native = self._recorder.native(module)
        resolve_key = functools.partial(_native_pg_key, weakref.ref(self))   # no cycle through C++
        self._direct = dist.ProcessGroup(rank, size)
        backends: dict[int, Any] = {}
        for device in inner._device_types:
            backend = inner._get_backend(device)
            wrapped = backends.get(id(backend))
            if wrapped is None:
                wrapped = backends[id(backend)] = module.RecordingBackend(backend, recorder_native, resolve_key)
            for group in (self, self._direct):
                group._register_backend(device, dist.ProcessGroup.BackendType.CUSTOM, wrapped)
        for group in (self, self._direct):
            group._set_default_backend(dist.ProcessGroup.BackendType.CUSTOM)
        self._native_backends = tuple(backends.values())
        for name in _NATIVE_COLLECTIVES:
            setattr(self, name, getattr(self._direct, name))

    def _set_group_name(self, name: str) -> None:
        super()._set_group_name(name)
        self._direct._set_group_name(name)

    @property
    def dtprobe_name(self) -> str | None:
        """Recording name of this group (axis name); a new one is asked for by the next collective's row."""
        return self.__dict__.get("_dtprobe_name")

    @dtprobe_name.setter
    def dtprobe_name(self, name: str | None) -> None:
        self._dtprobe_name = name
        for backend in self.__dict__.get("_native_backends", ()):
            backend.reset_key()


for _name in _NATIVE_COLLECTIVES:     # C++ callers: the class's own entry (a C++ method), so no Python override
    setattr(_NativeGlooGroup, _name, inspect.getattr_static(dist.ProcessGroup, _name))


# ---- backend registration ----

def _make_gloo(opts: Any, backend_options: Any = None) -> RecordingProcessGroup:
    """Creator for ``dtprobe_gloo`` (extended API: ``opts`` is torch's ``_DistributedBackendOptions``)."""
    store, rank, size = opts.store, opts.group_rank, opts.group_size
    backend = dist.ProcessGroupGloo(store, rank, size, opts.timeout)
    backend.options.global_ranks_in_group = list(opts.global_ranks_in_group)
    backend.options.group_name = opts.group_id
    backend._set_sequence_number_for_group()
    inner = dist.ProcessGroup(store, rank, size)
    inner._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.GLOO, backend)
    inner._set_default_backend(dist.ProcessGroup.BackendType.GLOO)
    return RecordingProcessGroup(inner, rank, size, backend_name=GLOO_BACKEND)


def register_backends() -> None:
    """Register ``dtprobe_gloo`` (cpu) and, when NCCL is built in, ``dtprobe_nccl`` (cuda). Idempotent.

    Both wrap a Python ``ProcessGroup``, so one backend serves one device type: use ``dtprobe_nccl`` on CUDA
    (``"cpu:dtprobe_gloo,cuda:dtprobe_nccl"`` is not supported: torch keeps only the first Python group).
    """
    plugins = dist.Backend._plugins
    if GLOO_BACKEND.upper() not in plugins:
        dist.Backend.register_backend(GLOO_BACKEND, _make_gloo, extended_api=True, devices=["cpu"])
    if dist.is_nccl_available() and NCCL_BACKEND.upper() not in plugins:
        make = functools.partial(nccl.make_nccl, recorder=RECORDER, wrap=functools.partial(
            RecordingProcessGroup, backend_name=NCCL_BACKEND, device_timing=True))
        dist.Backend.register_backend(NCCL_BACKEND, make, extended_api=True, devices=["cuda"])
    torch_internals.install_batch_p2p_coalescing(lambda group: isinstance(group, RecordingProcessGroup))
