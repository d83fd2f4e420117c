"""CUDA events on the Unix clock: marks on a stream, resolved to host nanoseconds; read by ``collectors.nccl``
(collective arrival), ``collectors.training`` (step phases) and ``dtprobe.runtime.parallel.pp`` (pipeline actions).

A CUDA event carries a device timestamp that only ``elapsed_time`` between two events exposes. ``DeviceClock``
keeps a *reference* event whose host time is known: recorded on a private, idle stream between two host clock
reads and waited for, so the device reached it inside that bracket (its midpoint is the reference host time, the
half-width its error; the tightest of a few tries is kept). An event then resolves to
``reference_ns + reference.elapsed_time(event)``. The device and host oscillators drift apart (tens of ppm), so the
reference is re-taken when it is older than ``refresh_s``: a resolution is off by at most drift x refresh interval
plus the bracket's half-width. Resolution waits for nothing: callers resolve events that are known to be complete
(a collective whose completion was reported, a phase whose stream was synchronized), off the training thread
where they can.

The ``cuda`` parameter is the ``torch.cuda`` module (``Event``, ``Stream``, ``current_stream``, ``nvtx``); tests
pass a stand-in with the same surface.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Callable


class DeviceClock:
    """Resolves CUDA events recorded on ``device`` to Unix nanoseconds through a periodically re-taken reference."""

    def __init__(self, *, device: Any = None, cuda: Any = None, host_ns: Callable[[], int] = time.time_ns,
                 refresh_s: float = 30.0, tries: int = 5) -> None:
        if cuda is None:
            import torch
            cuda = torch.cuda
        self._cuda = cuda
        self._device = device
        self._host_ns = host_ns
        self.refresh_ns = int(refresh_s * 1e9)
        """A reference older than this (host clock) is re-taken before the next resolution."""
        self._tries = tries
        self._lock = threading.Lock()
        self._stream: Any = None
        self._reference: tuple[Any, int, int] | None = None    # (event, host ns, bracket half-width ns)
        self.references_taken = 0
        """How many references were taken (the first one and each refresh)."""

    def mark(self, stream: Any = None) -> Any:
        """A timing event recorded now on ``stream`` (default: the current stream): when the device reaches it."""
        event = self._cuda.Event(enable_timing=True)
        event.record(self._cuda.current_stream(self._device) if stream is None else stream)
        return event

    def to_unix_ns(self, event: Any) -> int:
        """Unix time (ns) at which the device reached ``event`` (which must have completed)."""
        ref_event, ref_ns, _ = self.reference()
        return ref_ns + round(ref_event.elapsed_time(event) * 1e6)

    def uncertainty_ns(self) -> int:
        """Half-width of the current reference's host bracket (0 before any reference)."""
        return 0 if self._reference is None else self._reference[2]

    def reference(self) -> tuple[Any, int, int]:
        """The current (event, host ns, half-width ns) reference, re-taken when older than ``refresh_ns``."""
        with self._lock:
            ref = self._reference
            if ref is None or self._host_ns() - ref[1] > self.refresh_ns:
                ref = self._reference = self._take_reference()
            return ref

    def _take_reference(self) -> tuple[Any, int, int]:
        if self._stream is None:
            self._stream = self._cuda.Stream(self._device)   # private: nothing queued ahead of the reference
        best: tuple[Any, int, int] | None = None
        for _ in range(self._tries):
            event = self._cuda.Event(enable_timing=True)
            before = self._host_ns()
            event.record(self._stream)
            event.synchronize()
            after = self._host_ns()
            half = (after - before) // 2
            if best is None or half < best[2]:
                best = (event, before + half, half)
        assert best is not None
        self.references_taken += 1
        return best


_CLOCKS: dict[Any, DeviceClock] = {}


def clock_for(device: Any) -> DeviceClock:
    """The process's ``DeviceClock`` of ``device`` (one reference stream per device, shared by every user)."""
    clock = _CLOCKS.get(device)
    if clock is None:
        clock = _CLOCKS.setdefault(device, DeviceClock(device=device))
    return clock


class DeviceSpan:
    """Start and end events around a block of GPU work on the current stream, with an NVTX range; resolved later.

    ``begin()`` records the start event and pushes the range, ``end()`` records the end event and pops it;
    ``resolve()`` (once the end event completed: ``query()`` True, or after a synchronization) gives
    ``(start_ns, end_ns)`` on the Unix clock, or None while the work is still running.
    """

    __slots__ = ("_clock", "_cuda", "_name", "_start", "_end")

    def __init__(self, clock: DeviceClock, cuda: Any, name: str) -> None:
        self._clock, self._cuda, self._name = clock, cuda, name
        self._start: Any = None
        self._end: Any = None

    def begin(self) -> None:
        self._cuda.nvtx.range_push(self._name)
        self._start = self._clock.mark()

    def end(self) -> None:
        self._end = self._clock.mark()
        self._cuda.nvtx.range_pop()

    def done(self) -> bool:
        return self._end is not None and bool(self._end.query())

    def resolve(self) -> tuple[int, int] | None:
        if not self.done():
            return None
        return self._clock.to_unix_ns(self._start), self._clock.to_unix_ns(self._end)
