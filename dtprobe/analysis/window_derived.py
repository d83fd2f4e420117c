"""Derived per-step frames of a step window of a live run (``window.StepWindow.derived_table``): what
``derived_tables`` computes, kept per unit of steps and recomputed only from the first step whose rows changed, so
that a refresh of a running run's window costs the steps it added, not the window.

A unit is the steps of one step block that one refresh added (the first analysis of a window: one unit per step
block it spans). Events are append-only, so a step's rows changed exactly when its number of rows of some input
table did; the units from the one holding the first changed step on are derived again, and the units that slid
out of the window are dropped. Every frame has a ``step`` column (``groups`` and ``suspects`` are kept per step:
``derived_tables.derive_steps``), so the window's frame is its units' frames cut at its first step.

That cut equals the frame computed from the window's rows when each step's frames depend on the step's rows only:
no collective has rows in two steps, every group has one arrival clock in every step, and the window's collective
numbering never restarts (``arrivals.unique_seq`` leaves it as it is). ``derived_tables.StepFacts`` records this
per unit; when it fails, ``table`` gives None and the facade computes from the window's rows.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Protocol, Sequence

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc

from dtprobe.analysis.derived_tables import ARRIVAL_COLUMNS, StepFacts, derive_steps, deriver
from dtprobe.store.derived import blocks_frame
from dtprobe.store.partitions import block_of

INPUTS = deriver().inputs
"""The tables the frames are computed from (``derived_tables.LatenessExposure.inputs``)."""
GROUP_COLUMNS = ("pg", "pg_ranks")
"""The text columns naming a group, dictionary-encoded in the units' frames (``_coded``)."""

StepCounts = Callable[[str], dict[int, int]]
"""Rows per step of an input table (steps below 0: rows outside steps): ``RunStore.step_rows()``'s ``counts``."""


class BlockRows(Protocol):
    """An input table's rows of one step block, from ``first_step`` on (None: the whole block), as the store gives
    them: ``RunStore.step_rows()``'s ``block``."""

    def __call__(self, name: str, block: int, *, first_step: int | None = None) -> pd.DataFrame: ...


@dataclass
class _Unit:
    """Steps ``first``..``last`` of step ``block`` derived together."""

    block: int
    first: int
    last: int
    counts: dict[int, tuple[int, ...]]
    """Step -> its rows of each input table when derived."""
    frames: dict[str, pa.Table]
    facts: StepFacts


@dataclass
class WindowFrames:
    """The derived frames of one store's step windows, as the window slides (not thread-safe: call it under the
    store's lock)."""

    clock: tuple | None = None
    """The rows' clock model key when derived (another one derives every unit again)."""
    units: list[_Unit] = field(default_factory=list)
    """In step order."""
    codes: dict[tuple[str, str], int] = field(default_factory=dict)
    """(pg, pg_ranks) -> group code of the units' facts."""
    num_derived: int = 0
    """Units derived so far (tests: a refresh derives only what changed)."""
    num_rows_derived: int = 0
    """Input rows handed to ``derive_steps`` so far."""
    _judged: tuple[str | None] | None = None
    """(``invalid_reason()``,) of the units as they are, None when they changed since."""

    def table(self, name: str, *, first_step: int, clock: tuple, counts: StepCounts, rows: BlockRows,
              steps: tuple[int | None, int | None] | None = None,
              order: Sequence[str] | None = None) -> pd.DataFrame | None:
        """The derived table ``name`` of the rows from ``first_step`` on as they are now (only those of ``steps``
        when given, sorted by ``order`` when given, as ``derived.read_derived`` gives them), or None when it may
        differ from the one computed from those rows (module docstring). ``clock``: the rows' clock model key;
        ``counts`` and ``rows`` read the input tables by step."""
        self._update(first_step, clock, counts, rows)
        if self.invalid_reason() is not None:
            return None
        low, high = (None, None) if steps is None else steps
        cut = (first_step if low is None else max(low, first_step), high)
        return blocks_frame([u.frames[name] for u in self.units if name in u.frames], cut, order)

    def invalid_reason(self) -> str | None:
        """Why the units' frames may differ from those of the window's rows (None: they are equal); judged once per
        change of the units."""
        if self._judged is None:
            self._judged = (_invalid_reason([u.facts for u in self.units]),)
        return self._judged[0]

    def _update(self, first_step: int, clock: tuple, counts: StepCounts, rows: BlockRows) -> None:
        """Bring the units up to the rows held now, from ``first_step`` on."""
        if clock != self.clock or (self.units and self.units[0].first > first_step):
            self.clock, self.units, self.codes, self._judged = clock, [], {}, None
        if self.units and self.units[0].last < first_step:      # slid out of the window
            self.units, self._judged = [u for u in self.units if u.last >= first_step], None
        per_table = [counts(t) for t in INPUTS]
        now = {s: tuple(c.get(s, 0) for c in per_table)
               for s in sorted(set().union(*per_table)) if s >= first_step}
        held = {s: n for u in self.units for s, n in u.counts.items() if s >= first_step}
        changed = [s for s in sorted(set(now) | set(held)) if held.get(s) != now.get(s)]
        if not changed:
            return
        kept = [u for u in self.units if u.last < changed[0]]
        start = changed[0] if len(kept) == len(self.units) else max(first_step, min(changed[0],
                                                                                   self.units[len(kept)].first))
        self.units, self._judged = kept, None
        todo = [s for s in now if s >= start]
        blocks = block_of(np.array(todo, dtype=np.int64)).tolist()
        for block in sorted(set(blocks)):
            steps = [s for s, b in zip(todo, blocks) if b == block]
            inputs = {t: rows(t, block, first_step=steps[0]) for t in INPUTS}
            frames, facts = derive_steps(inputs, self.codes)
            self.units.append(_Unit(block, steps[0], steps[-1], {s: now[s] for s in steps},
                                    {t: _coded(f) for t, f in frames.items() if not f.empty}, facts))
            self.num_derived += 1
            self.num_rows_derived += sum(len(f) for f in inputs.values())


def _coded(frame: pd.DataFrame) -> pa.Table:
    """A unit's frame as Arrow with its group columns (``pg``, ``pg_ranks``) dictionary-encoded: the window's frame
    is sorted on them (``blocks_frame``), where a long member list then moves as a code."""
    table = pa.Table.from_pandas(frame, preserve_index=False)
    for name in GROUP_COLUMNS:
        i = table.schema.get_field_index(name)
        if i >= 0 and (pa.types.is_string(table.schema.field(i).type)
                       or pa.types.is_large_string(table.schema.field(i).type)):
            table = table.set_column(i, name, pc.dictionary_encode(table.column(i)))
    return table


def _invalid_reason(facts: list[StepFacts]) -> str | None:
    """``WindowFrames.invalid_reason`` of units with these facts, in step order."""
    reason = next((f.reason for f in facts if f.reason is not None), None)
    if reason is not None or not facts:
        return reason
    clocks = np.unique(np.concatenate([f.clocks for f in facts]))
    if (np.diff(clocks // 2) == 0).any():
        return "a group has device arrivals in some steps only"
    if len(facts) < 2:
        return None
    keys = np.sort(np.concatenate([f.keys for f in facts]))
    if (keys[1:] == keys[:-1]).any():
        return "a collective has rows in two refreshes' steps (ranks were at different steps in it)"
    # unique_seq of the window: each (rank, group)'s arrivals in a unit come after those of the last unit before it
    # that has any, with a higher seq (within a unit its own reason says so)
    spans = np.concatenate([f.arrivals[ARRIVAL_COLUMNS].to_numpy(dtype=np.int64) for f in facts])
    unit = np.repeat(np.arange(len(facts)), [len(f.arrivals) for f in facts])
    spans = spans[np.lexsort((unit, spans[:, 0]))]
    pair, t_first, seq_first, t_last, seq_last = spans.T
    same = pair[1:] == pair[:-1]
    if (same & ~((t_first[1:] > t_last[:-1]) & (seq_first[1:] > seq_last[:-1]))).any():
        return "a collective numbering goes back between two refreshes' steps (a torchrun restart)"
    return None
