"""Training events: the ``probe.step(n)`` context and its phases; writes one ``steps`` row per step and rank."""

from __future__ import annotations

import time
from typing import Any, Callable

from dtprobe.store.errors import ConfigError

PHASES = ("data", "fwd", "bwd", "opt")
"""Phase names with a ``<name>_ns`` column in the ``steps`` table."""
_RECORDABLE = ("loss", "tokens", "lr")


class _Phase:
    __slots__ = ("_step", "_name", "_t0")

    def __init__(self, step: "StepContext", name: str) -> None:
        self._step = step
        self._name = name

    def __enter__(self) -> None:
        self._t0 = time.perf_counter_ns()

    def __exit__(self, *exc: object) -> None:
        durations = self._step.phase_ns
        durations[self._name] = durations.get(self._name, 0) + time.perf_counter_ns() - self._t0


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
        """The ``steps`` row of this step."""
        row: dict[str, Any] = {"step": self.step, "start_ns": self.start_ns, "end_ns": self.end_ns,
                               "restart": restart}
        for name, ns in self.phase_ns.items():
            row[f"{name}_ns"] = ns
        row.update(self.values)
        return row

    def __enter__(self) -> "StepContext":
        self.start_ns = time.time_ns()
        self._on_enter(self.step)
        return self

    def __exit__(self, *exc: object) -> None:
        self.end_ns = time.time_ns()
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
