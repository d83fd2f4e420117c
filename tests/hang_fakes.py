"""A c10d store and a probe that record what the hang watchdog does, for the watchdog tests (tests/test_hang*.py)."""

from __future__ import annotations

from typing import Any


class FakeStore:
    """An in-memory c10d store: values are kept as bytes, as a TCPStore returns them."""

    def __init__(self) -> None:
        self.data: dict[str, bytes] = {}

    def set(self, key: str, value: Any) -> None:
        self.data[key] = value if isinstance(value, bytes) else str(value).encode()

    def get(self, key: str) -> bytes:
        return self.data[key]

    def check(self, keys: list[str]) -> bool:
        return all(k in self.data for k in keys)


class FakeProbe:
    """Records, in order, what the watchdog does to its probe: ``("fault", kind, row)``, ``("flush", in_flight)``,
    ``("close", status, reason)`` in ``log``. Probes given one ``timeline`` list also append ``(rank, name)`` to it
    (``name`` as in ``names()``), so a test can order what several ranks did."""

    def __init__(self, *, rank: int = 0, current_step: int = 11, world_size: int = 0,
                 timeline: list[tuple[int, str]] | None = None) -> None:
        self.rank = rank
        self.current_step = current_step
        self.world_size = world_size
        """0: unknown (the watchdog then waits for the peers named in its report)."""
        self.log: list[tuple] = []
        self._timeline = timeline

    def fault(self, kind: str, **row: Any) -> None:
        self._record("fault", kind, row)

    def flush(self, *, in_flight: bool = False) -> None:
        self._record("flush", in_flight)

    def close(self, status: str = "finished", reason: str | None = None) -> None:
        self._record("close", status, reason)

    def faults(self) -> list[tuple[str, dict[str, Any]]]:
        """The ``(kind, row)`` of every ``fault`` call, in order."""
        return [(e[1], e[2]) for e in self.log if e[0] == "fault"]

    def names(self) -> list[str]:
        """The log as names: a fault's kind, else ``"flush"`` or ``"close"``."""
        return [_name(e) for e in self.log]

    def _record(self, *entry: Any) -> None:
        self.log.append(entry)
        if self._timeline is not None:
            self._timeline.append((self.rank, _name(entry)))


def _name(entry: tuple) -> str:
    return entry[1] if entry[0] == "fault" else entry[0]
