"""NCCL side of the recording process group (``dtprobe_nccl``): builds the group and times its collectives on the
device; rows go to the ``collectives`` table through the recorder (read by ``dtprobe.store`` and the hang watchdog).

``make_nccl`` builds a ProcessGroupNCCL as ``init_process_group("nccl")`` would, hands it to the recording wrapper
(``collectors.pg_wrapper``, which registers the backend) and, when collectives are recorded, switches on NCCL's
collective timing (``torch_internals.enable_collectives_timing``: no ``TORCH_NCCL_ENABLE_TIMING`` needed) and its
completion hook. Per recorded collective (``NcclCompletionMatcher.issue``):

- **arrival**: a CUDA event recorded on the caller's current stream just before the call. ProcessGroupNCCL makes
  its stream wait on the caller's, so the event marks when the device reached the collective: ``arrive_ns``.
- **start / end**: NCCL's own start and end events, reported by the completion hook as ``WorkInfo``. A completion
  is paired with its row by the backend's work sequence number (``WorkInfo.seq``: the group's collective counter,
  read right after the call, or its p2p counter, which the matcher keeps), never by arrival order: the watchdog
  reports p2p completions of different peers (different streams) in any order. NCCL's start event waits for the
  caller's stream and for the previous work on the same NCCL stream (the group's collective stream, or the p2p
  stream of one peer), so ``start_ns = max(arrive_ns, end of the previous work on that stream)`` and ``end_ns =
  start_ns + active_duration``, all on the device clock resolved to Unix time (``collectors.cuda_clock``).
  Without an arrival event ``end_ns`` is the watchdog's detection time (``time_finished``, a steady-clock
  reading converted to Unix time: an upper bound) and ``start_ns = end_ns - active_duration``. Rows get
  ``timing="cuda_event"``.
- **pending**: every row is tracked from issue to completion, so the hang watchdog (``RECORDER.progress()``) and
  the ``pending`` spill see it; a completion after the recorder closed is dropped (the row was written at close).

With ``nccl_timing`` off, ``NcclCompletionPoller`` tracks rows and polls their works' ``is_completed()`` (a
CUDA event query) from a background thread: rows leave the pending set when done, without times.

Not seen: collectives that do not go through a process group. NCCL calls captured inside a CUDA graph are
recorded once at capture (never enqueued to the watchdog, so they stay pending) and not at each replay;
symmetric-memory async tensor parallelism (``torch.distributed._symmetric_memory``) moves data with its own
kernels and never calls the group. Their time shows up in kernel traces (``profile_steps``), not in
``collectives``.
"""

from __future__ import annotations

import datetime
import threading
import time
import warnings
from typing import Any, Callable

import torch
import torch.distributed as dist

from dtprobe.collectors import torch_internals
from dtprobe.collectors.cuda_clock import DeviceClock, clock_for

_P2P_TYPES = frozenset({"SEND", "RECV", "RECVANYSOURCE"})
_COALESCED = "COALESCED"


def steady_unix_offset_ns(*, tries: int = 5) -> int:
    """Unix time minus steady-clock time, in ns (``std::chrono::steady_clock`` is ``CLOCK_MONOTONIC`` on Linux,
    which ``time.monotonic_ns`` reads): the steady reading bracketed by two Unix readings, tightest of ``tries``."""
    best: tuple[int, int] | None = None
    for _ in range(tries):
        before = time.time_ns()
        steady = time.monotonic_ns()
        after = time.time_ns()
        if best is None or after - before < best[1]:
            best = ((before + after) // 2 - steady, after - before)
    assert best is not None
    return best[0]


def work_time_unix_ns(value: Any, *, steady_offset_ns: int) -> int | None:
    """A ``WorkInfo`` time point as Unix ns. torch 2.13: a steady-clock time point, which pybind11 hands over as a
    ``timedelta`` since the steady clock's epoch (boot): add ``steady_offset_ns``. Older torch: a system-clock
    time point, a naive ``datetime`` in local time (what ``timestamp()`` assumes). None if unknown."""
    if value is None:
        return None
    if isinstance(value, datetime.timedelta):
        return duration_ns(value) + steady_offset_ns
    if isinstance(value, datetime.datetime):
        return int(round(value.timestamp() * 1e6)) * 1000
    raise TypeError(f"WorkInfo time {value!r} is neither a timedelta (steady clock) nor a datetime (system clock)")


def duration_ns(value: datetime.timedelta) -> int:
    """A ``timedelta`` as integer ns (exact: days, seconds and microseconds are integers)."""
    return (value.days * 86_400 + value.seconds) * 1_000_000_000 + value.microseconds * 1_000


def _op_type_name(info: Any) -> str:
    return str(getattr(info, "op_type", "")).rsplit(".", 1)[-1].upper()


class _Expected:
    __slots__ = ("key", "row", "arrival", "order", "prev")

    def __init__(self, key: int, row: dict[str, Any], arrival: Any, order: int, prev: int | None) -> None:
        self.key, self.row, self.arrival, self.order = key, row, arrival, order
        self.prev = prev
        """Issue order of the previous work on the same NCCL stream (None: the first)."""


class NcclCompletionMatcher:
    """Issues one group's recorded collectives and pairs NCCL's completion ``WorkInfo`` with them by sequence number.

    ``inner`` is the ProcessGroup holding the ProcessGroupNCCL (its collective counter is read after each call);
    ``clock`` resolves arrival events (None: no arrival, end from the watchdog's detection time);
    ``steady_offset_ns`` converts ``WorkInfo`` steady-clock times (default: measured now).
    """

    def __init__(self, recorder: Any, inner: Any, *, clock: DeviceClock | None = None,
                 steady_offset_ns: int | None = None) -> None:
        self._recorder = recorder
        self._inner = inner
        self._clock = clock
        self.steady_offset_ns = steady_unix_offset_ns() if steady_offset_ns is None else steady_offset_ns
        """Unix minus steady clock (ns) used to convert ``WorkInfo`` times."""
        self._lock = threading.Lock()
        self._expected: dict[tuple[str, int], list[_Expected]] = {}
        self._p2p_seq = 0                 # mirrors ProcessGroupNCCL's seqP2P_
        self._coalescing = False
        self._coalesced_p2p = False       # a p2p op already bumped the p2p counter in this coalescing block
        self._order = 0
        self._last_issued: dict[Any, int] = {}    # NCCL stream -> issue order of its last work
        self._ends: dict[int, int] = {}           # work (issue order of its first op) -> device end (ns)
        self._unresolved: set[int] = set()        # works issued and not completed yet
        self._waiting: dict[int, tuple[list[_Expected], Any]] = {}   # unresolved work -> its successor's completion

    # ---- issue (caller's thread) ----
    def issue(self, row: dict[str, Any], call: Callable[[], Any], *, peer: int | None) -> Any:
        """Mark the arrival, run ``call`` (the real collective) and expect its completion."""
        arrival = self._clock.mark() if self._clock is not None else None
        work = call()
        if peer is None:
            kind, seq, stream = "coll", torch_internals.collective_seq(self._inner), "coll"
        else:
            kind, seq, stream = "p2p", self._next_p2p_seq(), ("p2p", peer)
        if self._coalescing:              # one COALESCED work for the block, on the group's device stream
            kind, stream = f"coalesced-{kind}", "coll"
        key = self._recorder.track(row)
        with self._lock:
            self._order += 1
            group = self._expected.setdefault((kind, seq), [])
            if group:                     # same work (a coalescing block): same predecessor
                prev = group[0].prev
            else:
                prev = self._last_issued.get(stream)
                self._last_issued[stream] = self._order
                self._unresolved.add(self._order)
            group.append(_Expected(key, row, arrival, self._order, prev))
        return work

    def _next_p2p_seq(self) -> int:
        # ProcessGroupNCCL bumps its p2p counter once per send/recv, and once per coalescing block (at its first
        # p2p op); the block's one work carries that number.
        if not self._coalescing:
            self._p2p_seq += 1
        elif not self._coalesced_p2p:
            self._p2p_seq += 1
            self._coalesced_p2p = True
        return self._p2p_seq

    def start_coalescing(self) -> None:
        """The group entered a coalescing block (``_start_coalescing``): its ops complete as one work."""
        self._coalescing, self._coalesced_p2p = True, False

    def end_coalescing(self) -> None:
        self._coalescing, self._coalesced_p2p = False, False

    # ---- completion (NCCL's hook thread) ----
    def on_completion(self, info: Any) -> None:
        """Completion hook: pair ``info`` with its rows by (kind, seq), time them and write them."""
        op_type = _op_type_name(info)
        seq = int(getattr(info, "seq"))
        with self._lock:
            if op_type == _COALESCED:
                # A block issued through _start/_end_coalescing (p2p or collectives: whichever was issued first
                # when both counters give this number), else one call NCCL coalesces itself (allreduce_coalesced,
                # an uneven all-gather), numbered on the collective counter.
                candidates = [k for k in (("coalesced-p2p", seq), ("coalesced-coll", seq)) if k in self._expected]
                candidates.sort(key=lambda k: self._expected[k][0].order)
                group = self._expected.pop(candidates[0] if candidates else ("coll", seq), None)
            else:
                group = self._expected.pop(("p2p" if op_type in _P2P_TYPES else "coll", seq), None)
        if not group:
            return                # issued before recording started, while paused, or not recorded
        self._complete(group, info)

    def _complete(self, group: list[_Expected], info: Any) -> None:
        active_ns = duration_ns(info.active_duration) if info.active_duration is not None else None
        finished_ns = work_time_unix_ns(getattr(info, "time_finished", None), steady_offset_ns=self.steady_offset_ns)
        clock = self._clock
        arrivals = [clock.to_unix_ns(e.arrival) for e in group if e.arrival is not None] if clock else []
        work_id, prev = group[0].order, group[0].prev
        if active_ns is None:
            start_ns, end_ns = None, finished_ns
        elif len(arrivals) == len(group):
            # NCCL's start event waits for the caller's stream (every op's arrival, for a coalesced block) and
            # for the previous work on its own stream: a completion reported before that one's waits for it.
            with self._lock:
                if prev is not None and prev not in self._ends and prev in self._unresolved:
                    self._waiting[prev] = (group, info)
                    return
                prev_end = self._ends.pop(prev, None) if prev is not None else None
            start_ns = max(arrivals) if prev_end is None else max(max(arrivals), prev_end)
            end_ns = start_ns + active_ns
        elif finished_ns is not None:
            start_ns, end_ns = finished_ns - active_ns, finished_ns
        else:
            start_ns = end_ns = None
        for i, expected in enumerate(group):
            if not self._recorder.untrack(expected.key):
                continue          # written at close (recorder stopped) or already completed
            row = expected.row
            if arrivals:
                row["arrive_ns"] = arrivals[i]
            row["start_ns"], row["end_ns"], row["timing"] = start_ns, end_ns, "cuda_event"
            self._recorder.emit(row)
        with self._lock:
            self._unresolved.discard(work_id)
            if end_ns is not None and arrivals:   # a successor on this stream may start at this end
                self._ends[work_id] = end_ns
            successor = self._waiting.pop(work_id, None)
        if successor is not None:
            self._complete(*successor)


class NcclCompletionPoller:
    """Without NCCL timing: tracks each recorded collective until its work reports ``is_completed()`` (a CUDA event
    query, polled every ``interval_s`` by one background thread), then writes its row without times."""

    def __init__(self, recorder: Any, *, interval_s: float = 0.05) -> None:
        self._recorder = recorder
        self._interval_s = interval_s
        self._works: list[tuple[int, dict[str, Any], Any]] = []
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def issue(self, row: dict[str, Any], call: Callable[[], Any], *, peer: int | None) -> Any:
        work = call()
        key = self._recorder.track(row)
        if work is None:                   # completed synchronously (no async work to poll)
            if self._recorder.untrack(key):
                self._recorder.emit(row)
            return work
        with self._lock:
            self._works.append((key, row, work))
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="dtprobe-nccl-poll", daemon=True)
                self._thread.start()
        return work

    def start_coalescing(self) -> None:
        pass

    def end_coalescing(self) -> None:
        pass

    def poll(self) -> int:
        """Write the rows whose works completed; returns how many."""
        with self._lock:
            works, self._works = self._works, []
        still, done = [], 0
        for key, row, work in works:
            try:
                completed = work.is_completed()
            except RuntimeError:           # the group was aborted: never completes
                continue
            if not completed:
                still.append((key, row, work))
            elif self._recorder.untrack(key):
                self._recorder.emit(row)
                done += 1
        with self._lock:
            self._works = still + self._works
        return done

    def _loop(self) -> None:
        while True:
            time.sleep(self._interval_s)
            self.poll()


class UntimedNccl:
    """A recording group on NCCL before timing is set up (or in tests): rows are written at issue, no end time."""

    def __init__(self, recorder: Any) -> None:
        self._recorder = recorder

    def issue(self, row: dict[str, Any], call: Callable[[], Any], *, peer: int | None) -> Any:
        work = call()
        self._recorder.emit(row)
        return work

    def start_coalescing(self) -> None:
        pass

    def end_coalescing(self) -> None:
        pass


def enable_completion_timing(inner: Any, recorder: Any, *, clock: DeviceClock | None = None,
                             steady_offset_ns: int | None = None) -> NcclCompletionMatcher | None:
    """Switch on ``inner``'s collective timing and take completions from its hook; None (with a warning) if
    this torch lacks either surface."""
    try:
        matcher = NcclCompletionMatcher(recorder, inner, clock=clock, steady_offset_ns=steady_offset_ns)
        torch_internals.enable_collectives_timing(inner)
        torch_internals.register_completion_hook(inner, matcher.on_completion)
    except (RuntimeError, AttributeError) as exc:
        warnings.warn(f"dtprobe: NCCL completion timing unavailable ({exc}); collectives get no times.",
                      stacklevel=3)
        return None
    return matcher


def make_nccl(opts: Any, backend_options: Any = None, *, wrap: Callable[..., Any], recorder: Any) -> Any:
    """Creator for ``dtprobe_nccl``: a ProcessGroupNCCL built as ``init_process_group("nccl")`` would
    (``pg_options`` of type ``ProcessGroupNCCL.Options`` are honoured; split from the default group's communicator
    when that group is bound to a device, as torch splits its own), held by a plain ProcessGroup so the completion
    hook can be registered on it; ``wrap(inner, rank, size)`` makes the recording group around it."""
    store, rank, size = opts.store, opts.group_rank, opts.group_size
    options = backend_options if backend_options is not None else dist.ProcessGroupNCCL.Options()
    if backend_options is None:
        options.is_high_priority_stream = False
    options._timeout = opts.timeout
    options.global_ranks_in_group = list(opts.global_ranks_in_group)
    options.group_name = opts.group_id
    torch_internals.split_from_bound_default(options, options.global_ranks_in_group)
    backend = dist.ProcessGroupNCCL(store, rank, size, options)
    backend._set_sequence_number_for_group()
    inner = dist.ProcessGroup(store, rank, size)
    inner._register_backend(torch.device("cuda"), dist.ProcessGroup.BackendType.NCCL, backend)
    inner._set_default_backend(dist.ProcessGroup.BackendType.NCCL)
    pg = wrap(inner, rank, size)
    time_rows(pg, recorder, device_timing=recorder.nccl_timing)
    return pg


def time_rows(pg: Any, recorder: Any, *, device_timing: bool) -> None:
    """How a recording NCCL group times its rows: NCCL's own timing and completion hook, resolved on this rank's
    device clock (``clock_for``: the one clock steps share), or, with ``device_timing`` off, completions polled."""
    if device_timing:
        pg.enable_completion_timing(clock=clock_for(torch.cuda.current_device()))
    else:
        pg.set_nccl_timing(NcclCompletionPoller(recorder))
