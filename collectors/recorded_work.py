"""The ``Work`` a recording process group (``pg_wrapper``) hands back for a gloo collective or a send/recv, and how
the collective's completion time (``end_ns``) is taken from it.

Completion (``end_ns``), gloo: when the work completes. Blocking calls (torch's API with ``async_op=False``, which
waits on the work as soon as it is returned) are waited by the group itself and stamped when that wait returns, on
the caller's thread; the caller gets the completed backend Work. Otherwise, works whose callers wait on them before
they complete (``async_op=True`` then ``wait()``, DTensor and FSDP waits, ``get_future().wait()``) are wrapped and
stamped when the caller's ``wait()``, or that of the future the wrapper handed out, returns, on the caller's thread;
works whose futures are taken and not waited from Python (DDP's C++ reducer, ``then()``) stay the backend's own Work
with a done-callback, run by the gloo thread that finished it (a Python Work handed to the reducer costs GIL round
trips on every ``getFuture`` and destruction); ``WaitHabit`` picks between the two per (group, op) and goes back to
the callback for callers that wait late. Works without a future (gloo send/recv, reduce-scatter) are wrapped and
timed when ``wait()`` returns. A gloo collective's row is a tuple (``collective_recorder.ROW_COLUMNS``; send/recv
and NCCL rows are dicts), encoded by the drain thread in batches. On the caller's thread a collective costs the
Python pass-through, the row and a queue append; ``benchmarks/probe_overhead.py`` measures it per collective against
plain gloo (its ``record_cost`` case: one process, no peer, so that the recording cost is not lost in a 2-rank
collective's noise).

Read by ``pg_wrapper.RecordingProcessGroup`` (``wrap_work``, ``WaitHabit``, ``FutureDone``).
"""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist

from dtprobe.collectors import torch_internals
from dtprobe.collectors.collective_recorder import CollectiveRecorder


def _failed(future: Any) -> bool:
    """True if a work's future finished with an error (a peer died, the group was aborted): that is no
    completion, so the row stays in flight and is written at close with ``end_ns`` null, like a hang's."""
    try:
        future.value()
    except Exception:  # noqa: BLE001 - any backend error means the collective never completed
        return True
    return False


class FutureDone:
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


class WaitHabit:
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
    callers wait on them (see ``WaitHabit``); ``habit`` is updated with how this work was used.
    """

    # One per wrapped collective: slots make it cheaper to build than an instance dict (torch's Work takes no
    # attributes of its own either).
    __slots__ = ("_inner", "_row", "_recorder", "_key", "_habit", "_handed_ns", "_future", "_callback", "_waiter",
                 "_taken_ns")

    def __init__(self, inner: dist.Work, row: dict[str, Any] | tuple, recorder: CollectiveRecorder, *,
                 habit: WaitHabit | None = None, future: Any = None) -> None:
        super().__init__()
        wrap_work(inner, row, recorder, habit, future, self)

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
            if (self._row is not None and time.time_ns() - self._handed_ns > WaitHabit.PROMPT_WAIT_NS
                    and self._inner.is_completed()):   # the clock first: cheaper than asking the backend
                habit.prompt = 0            # completed well before the wait: only a callback sees when
            elif habit.prompt < WaitHabit.PROMPT_WAITS:
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
            prompt = now - self._handed_ns <= WaitHabit.PROMPT_WAIT_NS or not self._inner.is_completed()
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
        habit.waited(taken_ns is not None and now - taken_ns <= WaitHabit.PROMPT_WAIT_NS)
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
                self._recorder.on_done(self._inner.get_future(), FutureDone(self._recorder, self._key, row))
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
            self._recorder.on_done(future, FutureDone(self._recorder, self._key, row))
            return
        self._recorder.complete(self._key, row, None)


class _IssuedWork(RecordedWork):
    """The ``RecordedWork`` of the group's hot path (``RecordingProcessGroup._issue``): built by torch's own Work
    constructor (no Python ``__init__`` frame, no ``super()`` call, no keyword arguments), then filled by
    ``wrap_work``."""

    __slots__ = ()
    __init__ = dist.Work.__init__


def wrap_work(inner: dist.Work, row: tuple | dict[str, Any], recorder: CollectiveRecorder,
              habit: WaitHabit | None = None, future: Any = None, work: RecordedWork | None = None) -> RecordedWork:
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
