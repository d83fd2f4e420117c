"""The process-wide sink of the recording process groups (``pg_wrapper``): ``CollectiveRecorder`` and its one
instance ``RECORDER``, through which every recorded collective reaches the run's writer.

A group hands each collective's row to the recorder at the issue (``track``) and at completion (``complete``); a
drain thread writes them in batches, so the training thread pays a queue append. Rows are written once the
collective completes; collectives still in flight at close (a hang) are written with ``end_ns`` null. A collective
still in flight after one drain tick is also spilled once to the ``pending`` table, so a rank killed inside it
(SIGKILL: no close) still names it. Rows name their group by ``pg`` only (a key, ``dtprobe.store.groups``); the
group's members go to the ``groups`` table once, when the group first records, written to the writer before the
row (``CollectiveRecorder.group_key``). Each rank's per-step summaries (``comm_steps``) are made from the drained
rows (``comm_summaries``). No torch here: the rows are plain tuples and dicts.

Read by ``pg_wrapper`` and ``recorded_work`` (which fill it), ``collectors.attach`` (which starts and stops it),
``dtprobe.store`` (tables ``collectives``, ``pending``, ``groups``, ``comm_steps``) and ``dtprobe.runtime.hang``
(``RECORDER.progress()``, ``RECORDER.pending()``).
"""

from __future__ import annotations

import collections
import itertools
import threading
import time
import weakref
from types import ModuleType
from typing import Any, Callable

from dtprobe.collectors.comm_summaries import ROW_POSITIONS, StepSummaries
from dtprobe.store.groups import MEMBER_COLUMNS, GroupKeys
from dtprobe.store.schema import SCHEMAS

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
        self._progress: dict[str, GroupProgress] = {}   # read by the hang watchdog: see progress()
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

    def group_progress(self, pg: str) -> "GroupProgress":
        """Group ``pg``'s progress on this rank (created at its first use; listed by ``progress`` once it issued)."""
        p = self._progress.get(pg)
        if p is None:
            group = self._groups.get(pg)
            p = self._progress.setdefault(pg, GroupProgress(pg, group["pg_ranks"] if group else ""))
        return p

    def run_blocking(self, row: tuple, progress: "GroupProgress", call: Callable[..., Any], args: tuple,
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

    def on_done(self, future: Any, callback: Any) -> None:
        """``future.add_done_callback(callback)`` (a ``recorded_work`` done-callback object), the callback known to
        ``settle_callbacks``."""
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


class GroupProgress:
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
