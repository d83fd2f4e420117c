"""Per-step, per-group summaries of one rank's own collectives: the ``comm_steps`` rows of ``store.schema``.

``CollectiveRecorder.drain`` hands every drained row (a tuple of ``collective_recorder.ROW_COLUMNS``, ``end_ns``
absent while it had no end, or a dict of the same keys) to ``StepSummaries.add``; a step's summary rows are written
once the step ended (``end_step``) and none of its collectives is still in flight, at two drains in a row (a row
moves from in flight to the drain queue in two steps, so one drain may see it in neither: the second sees it
queued). At close, ``rest`` gives what is left. Summaries of what the rank knows alone: counts, bytes, its own first
and last enqueue, last completion, the union of its collectives' spans (``comm_ns``) and the longest one, per group,
and over all groups (``pg`` left out) when the step used two or more; the row over the whole step (that one, or a
one-group step's group row) says ``all_groups``. A checkpoint group's collectives (``schema.is_checkpoint_group``)
run beside the steps: they get their group's row and are in no ``all_groups`` row. Cross-rank figures (lateness,
waits) are the analysis' derived tables, made from the raw rows at compaction and per step by a live reader.
``tests/comm_summary_checks.py`` holds the rows equal to the raw rows' aggregates on recorded runs.
"""

from __future__ import annotations

from typing import Any, Iterable

from dtprobe.intervals import union_of_spans
from dtprobe.store.schema import is_checkpoint_group

ROW_POSITIONS = {"pg": 0, "num_bytes": 3, "step": 5, "enqueue_ns": 7, "end_ns": 9}
"""Positions of the columns read here in a tuple row (``collective_recorder.ROW_COLUMNS``, which asserts them):
numbers, since ``collective_recorder`` imports this module."""
_PG, _BYTES, _STEP, _ENQUEUE, _END = ROW_POSITIONS.values()
_LATE_STEPS = 64
"""Steps back a late completion's row is still given the all-groups row its step was written with."""


class _Group:
    """One (step, group)'s rows so far: counts and bytes, and every completed span for the union."""

    __slots__ = ("rows", "num_bytes", "first_enqueue", "last_enqueue", "spans")

    def __init__(self) -> None:
        self.rows = 0
        self.num_bytes = 0
        self.first_enqueue: int | None = None
        self.last_enqueue: int | None = None
        self.spans: list[tuple[int, int]] = []

    def add(self, num_bytes: Any, enqueue: Any, end: Any) -> None:
        self.rows += 1
        if num_bytes is not None:
            self.num_bytes += int(num_bytes)
        if enqueue is None:
            return
        if self.first_enqueue is None or enqueue < self.first_enqueue:
            self.first_enqueue = enqueue
        if self.last_enqueue is None or enqueue > self.last_enqueue:
            self.last_enqueue = enqueue
        if end is not None:
            self.spans.append((enqueue, max(end, enqueue)))

    def row(self, step: int, restart: int | None, pg: str | None, *, all_groups: bool) -> dict[str, Any]:
        out: dict[str, Any] = {"step": step} if restart is None else {"restart": restart, "step": step}
        if pg is not None:
            out["pg"] = pg
        if all_groups:
            out["all_groups"] = True
        out.update(num_collectives=self.rows, num_completed=len(self.spans), num_bytes=self.num_bytes)
        if self.first_enqueue is not None:
            out.update(first_enqueue_ns=self.first_enqueue, last_enqueue_ns=self.last_enqueue)
        if self.spans:
            out.update(last_end_ns=max(end for _, end in self.spans), comm_ns=union_of_spans(self.spans),
                       longest_ns=max(end - start for start, end in self.spans))
        return out


class StepSummaries:
    """The summaries of one attach of a rank (see the module docstring). Used from the drain (under its lock)."""

    def __init__(self, restart: int | None = 0) -> None:
        self.restart = restart
        """Copied into every row (None: left out, as rows without a restart count name their group without one)."""
        self._steps: dict[int, dict[str | None, _Group]] = {}
        self._ended = -1            # highest step whose ``probe.step`` context exited
        self._ready: set[int] = set()   # steps complete at the previous ``due``
        self._with_total: set[int] = set()   # steps written with an all-groups row: a later row of theirs gets one

    def end_step(self, step: int) -> None:
        """Step ``step`` ended on the training thread (its steps row is written)."""
        if step > self._ended:
            self._ended = step

    def add(self, rows: Iterable[Any]) -> None:
        """Count drained collective rows (tuples of ``ROW_COLUMNS`` or dicts); rows outside steps are left out."""
        steps = self._steps
        for row in rows:
            if type(row) is tuple:
                step = row[_STEP]
                if step is None or step < 0:
                    continue
                pg, num_bytes, enqueue = row[_PG], row[_BYTES], row[_ENQUEUE]
                end = row[_END] if len(row) > _END else None
            else:
                step = row.get("step")
                if step is None or step < 0:
                    continue
                pg, num_bytes, enqueue, end = row.get("pg"), row.get("num_bytes"), row.get("enqueue_ns"), \
                    row.get("end_ns")
            groups = steps.get(step)
            if groups is None:
                groups = steps[step] = {}
            # the group's row and the all-groups row (not a checkpoint group's: it runs beside the steps)
            for key in (pg,) if is_checkpoint_group(pg) else (pg, None):
                group = groups.get(key)
                if group is None:
                    group = groups[key] = _Group()
                group.add(num_bytes, enqueue, end)

    def due(self, in_flight_steps: Iterable[int]) -> list[dict[str, Any]]:
        """Rows of the steps that are over: ended, with no collective of theirs or of an earlier step in flight
        (``in_flight_steps``: the steps of the rows in flight, taken before this drain took its rows), at this
        drain and the previous one. Their aggregates are dropped once returned."""
        in_flight = [s for s in in_flight_steps if s is not None and s >= 0]
        limit = min(in_flight, default=None)
        ready = {s for s in self._steps if s <= self._ended and (limit is None or s < limit)}
        over = ready & self._ready
        self._ready = ready - over    # a step's later row (a late completion) waits for two drains again
        return self._rows(sorted(over))

    def rest(self) -> list[dict[str, Any]]:
        """Rows of every step still held (at close)."""
        self._ready = set()
        return self._rows(sorted(self._steps))

    def _rows(self, steps: list[int]) -> list[dict[str, Any]]:
        out = []
        for step in steps:
            groups = self._steps.pop(step)
            total = groups.pop(None, None)
            with_total = sum(not is_checkpoint_group(pg) for pg in groups) > 1 or step in self._with_total
            out += [group.row(step, self.restart, pg, all_groups=not with_total and not is_checkpoint_group(pg))
                    for pg, group in sorted(groups.items(), key=_by_name)]
            if with_total and total is not None:
                out.append(total.row(step, self.restart, None, all_groups=True))
                self._with_total.add(step)
        if len(self._with_total) > 2 * _LATE_STEPS:     # a late row comes a drain or two after its step's rows
            newest = max(self._with_total)
            self._with_total = {s for s in self._with_total if s > newest - _LATE_STEPS}
        return out


def _by_name(item: tuple[str | None, _Group]) -> str:
    return str(item[0])
