"""Training events: the ``probe.step(n)`` context and its phases; writes one ``steps`` row per step and rank.

On CUDA (``use_device_clock``, set by attach) a step and each of its phases are also marked with CUDA events on the
compute stream and NVTX ranges (``step <n>``, and the phase name inside it, as Nsight Systems shows them). When the
row is written at the step's exit, the events are resolved to Unix time if the device has finished them (a loop that
reads its loss, ``s.record(loss=loss)``, has synchronized): the row then has device times and ``clock="device"``.
The host never waits for the device here; a step whose work is still running, or whose phases were also timed by
someone else (``phase_ns`` added to directly), keeps its host times with ``clock="host"``.
"""

from __future__ import annotations

import time
from typing import Any, Callable

from dtprobe.collectors.cuda_clock import DeviceClock, DeviceSpan
from dtprobe.store.errors import ConfigError

PHASES = ("data", "fwd", "bwd", "opt")
"""Phase names with a ``<name>_ns`` column in the ``steps`` table."""
_RECORDABLE = ("loss", "tokens", "lr")


_DEVICE: tuple[DeviceClock, Any] | None = None


def use_device_clock(clock: DeviceClock | None, cuda: Any = None) -> None:
    """Time later steps and phases with CUDA events resolved by ``clock`` (None: host only); ``cuda`` is the
    ``torch.cuda`` module (tests pass a stand-in)."""
    global _DEVICE
    if clock is None:
        _DEVICE = None
        return
    if cuda is None:
        import torch
        cuda = torch.cuda
    _DEVICE = (clock, cuda)


def device_clock() -> tuple[DeviceClock, Any] | None:
    """The ``(clock, cuda)`` set by ``use_device_clock`` (pipeline actions use it too), or None on the host."""
    return _DEVICE


class _Phase:
    __slots__ = ("_step", "_name", "_t0", "_span")

    def __init__(self, step: "StepContext", name: str) -> None:
        self._step = step
        self._name = name
        self._span: DeviceSpan | None = None

    def __enter__(self) -> None:
        device = self._step._device
        if device is not None:
            self._span = DeviceSpan(device[0], device[1], self._name)
            self._span.begin()
        self._t0 = time.perf_counter_ns()

    def __exit__(self, *exc: object) -> None:
        durations = self._step.phase_ns
        durations[self._name] = durations.get(self._name, 0) + time.perf_counter_ns() - self._t0
        if self._span is not None:
            self._span.end()
            self._step._spans.append((self._name, self._span))


class StepContext:
    """One training step: ``with probe.step(n) as s:``; ``s.phase("fwd")`` times a phase (repeated phases add
    up, e.g. forward over gradient-accumulation micro-batches); ``s.record(loss=, tokens=, lr=)``.

    On exit the ``steps`` row is written (also when the body raised: a crashed step keeps its partial timing).
    """

    def __init__(self, step: int, *, on_enter: Callable[[int], None], on_exit: Callable[["StepContext"], None]) -> None:
        self.step = int(step)
        """The training step number."""
        self.phase_ns: dict[str, int] = {}
        """Accumulated duration per phase (ns)."""
        self.values: dict[str, Any] = {}
        """Values given to ``record``."""
        self.start_ns: int | None = None
        self.end_ns: int | None = None
        self._on_enter = on_enter
        self._on_exit = on_exit
        self._device = _DEVICE
        self._span: DeviceSpan | None = None
        self._spans: list[tuple[str, DeviceSpan]] = []

    def phase(self, name: str) -> _Phase:
        """Context manager timing phase ``name`` (one of data, fwd, bwd, opt)."""
        if name not in PHASES:
            raise ConfigError(f"probe step phase {name!r} is not one of {list(PHASES)}; the steps table has a "
                              f"column per phase. Time other work outside the phases, or use one of these names.")
        return _Phase(self, name)

    def record(self, **values: Any) -> None:
        """Store ``loss`` (this rank's mean), ``tokens`` (this rank's tokens this step) and/or ``lr``."""
        unknown = set(values) - set(_RECORDABLE)
        if unknown:
            raise ConfigError(f"probe step record() got {sorted(unknown)}; it accepts {list(_RECORDABLE)}. "
                              f"Write other values with probe.record(table, row).")
        for key, value in values.items():
            if value is None:
                continue
            if key == "tokens":
                value = int(value)
            else:
                value = float(value.item() if hasattr(value, "item") else value)
            self.values[key] = value

    def row(self, *, restart: int) -> dict[str, Any]:
        """The ``steps`` row of this step (device times when they are resolvable now, see the module doc)."""
        timed = self._device_times()
        start_ns, end_ns, phase_ns = timed if timed is not None else (self.start_ns, self.end_ns, self.phase_ns)
        row: dict[str, Any] = {"step": self.step, "start_ns": start_ns, "end_ns": end_ns, "restart": restart,
                               "clock": "host" if timed is None else "device"}
        for name, ns in phase_ns.items():
            row[f"{name}_ns"] = ns
        row.update(self.values)
        return row

    def _device_times(self) -> tuple[int, int, dict[str, int]] | None:
        if self._span is None or not self._span.done() or {n for n, _ in self._spans} != set(self.phase_ns):
            return None
        resolved = self._span.resolve()
        if resolved is None:
            return None
        phase_ns: dict[str, int] = {}
        for name, span in self._spans:
            times = span.resolve()
            if times is None:
                return None
            phase_ns[name] = phase_ns.get(name, 0) + times[1] - times[0]
        return resolved[0], resolved[1], phase_ns

    def __enter__(self) -> "StepContext":
        self.start_ns = time.time_ns()
        if self._device is not None:
            self._span = DeviceSpan(self._device[0], self._device[1], f"step {self.step}")
            self._span.begin()
        self._on_enter(self.step)
        return self

    def __exit__(self, *exc: object) -> None:
        self.end_ns = time.time_ns()
        if self._span is not None:
            self._span.end()
        self._on_exit(self)

    def __int__(self) -> int:
        return self.step

    def __index__(self) -> int:
        return self.step


class NullStepContext:
    """A step that records nothing (``enabled=False``)."""

    def __init__(self, step: int) -> None:
        self.step = int(step)

    def phase(self, name: str) -> "NullStepContext":
        return self

    def record(self, **values: Any) -> None:
        pass

    def __enter__(self) -> "NullStepContext":
        return self

    def __exit__(self, *exc: object) -> None:
        pass

    def __int__(self) -> int:
        return self.step

    def __index__(self) -> int:
        return self.step
