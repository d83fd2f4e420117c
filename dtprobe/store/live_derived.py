"""Derived per-step tables of a run read from its events (not compacted, e.g. while it runs): the frames a caller's
``store.derived.Deriver`` computes from the rows, kept per unit of steps (a step block, or the steps of a block that
one refresh added) and recomputed only from the first step whose rows changed since; read by
``RunStore.derived_table`` (the facade's lateness, exposure, bandwidth, ...).

Events are append-only, so a step's rows changed exactly when its number of rows of some input table did. A
refresh of a live run adds the newest step or two (and may complete the one before): the deriver is restored to its
state before the unit holding the first changed step (a copy kept before each of the newest ``KEPT_UNITS`` units and
the newest ``KEPT_STATES`` blocks) and fed the steps from that unit's first on, one unit per step block, in block
order as at compaction; older units' frames are reused. A refresh then costs its new rows, not the rows of the
newest block. A change further back (or a new clock model, or another deriver key) derives every block again, one
unit per block.

A unit's frames equal the same steps' frames of its whole block whenever the deriver's ``invalid_reason`` is None
for the units: the deriver checks that no collective has rows in two of them (two units of one block are two
``derive`` calls of that block). When the units of a block make it invalid, every block is derived again whole and
the block is the unit from then on, so what is given is what deriving whole blocks gives. The frames are those
compaction writes (kept as Arrow tables, read back as ``derived.read_derived`` reads its files), and they are given
only while the deriver's ``invalid_reason`` is None.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np
import orjson
import pandas as pd
import pyarrow as pa

from dtprobe.store.derived import Deriver, blocks_frame, block_in_steps
from dtprobe.store.partitions import block_of

KEPT_STATES = 2
"""Newest step blocks before which the deriver's state is kept: a change there re-derives from that block on."""
KEPT_UNITS = 2
"""Newest units before which the deriver's state is kept: a change there re-derives from that unit on."""

StepCounts = Callable[[str], dict[int, int]]
"""Rows per step (``NO_STEP_BLOCK``: outside steps, ``step`` null or negative) of an input table."""
BlockRows = Callable[[str, int, int | None], pd.DataFrame]
"""An input table's rows of one step block from a step on (None: the whole block), as ``RunStore.table`` gives
them (clock-aligned, in sort order)."""


@dataclass
class _Unit:
    """Steps ``first``..``last`` of step ``block`` derived in one ``derive`` call."""

    block: int
    first: int
    last: int
    frames: dict[str, pa.Table]
    """Derived table -> its frame of these steps."""
    state: Deriver | None = None
    """A copy of the deriver before this unit (kept for the newest units and blocks only)."""


@dataclass
class _Derivation:
    """One deriver's frames of every unit, and what they were derived from."""

    key: bytes
    """The deriver's ``key`` as JSON."""
    clock: tuple
    """``ClockModel.key`` of the rows derived."""
    deriver: Deriver
    """Fed every unit in order so far."""
    whole_blocks: bool = False
    """Units are whole step blocks (set once units of a block made the deriver's ``invalid_reason`` say so)."""
    counts: dict[int, tuple[int, ...]] = field(default_factory=dict)
    """Step -> its rows of each input table when derived."""
    units: list[_Unit] = field(default_factory=list)
    """In step order."""
    reason: str | None = None
    """``deriver.invalid_reason()`` after the last unit."""


class LiveDerived:
    """A run store's derived frames computed from its rows, per deriver key (one per ``RunStore``; not
    thread-safe: the store calls it under its lock)."""

    def __init__(self) -> None:
        self._derivations: dict[bytes, _Derivation] = {}
        self.num_derived = 0
        """Units derived so far (``derive`` calls; tests: a refresh derives only what changed)."""
        self.num_rows_derived = 0
        """Input rows handed to ``derive`` so far (tests: a refresh derives only its new steps' rows)."""

    def table(self, name: str, key: dict, new_deriver: Callable[[], Deriver], *, clock: tuple,
              counts: StepCounts, rows: BlockRows, steps: tuple[int | None, int | None] | None = None,
              order: Sequence[str] | None = None) -> pd.DataFrame | None:
        """The derived table ``name`` of the rows as they are now (its units' frames in step order, only those of
        ``steps`` when given, sorted by ``order`` when given, as ``derived.read_derived`` gives them), None when
        the deriver says its units' frames would differ from the whole run's. ``new_deriver`` makes a fresh
        deriver of ``key``; ``clock`` is the rows' clock model key; ``counts`` and ``rows`` read the input tables
        by step."""
        d = self._current(key, new_deriver, clock, counts, rows)
        if d.reason is not None:
            return None
        parts = [u.frames[name] for u in d.units if name in u.frames and block_in_steps(u.block, steps)]
        return blocks_frame(parts, steps, order)

    def _current(self, key: dict, new_deriver: Callable[[], Deriver], clock: tuple, counts: StepCounts,
                 rows: BlockRows) -> _Derivation:
        """The derivation of ``key`` brought up to the rows now held."""
        key_json = orjson.dumps(key, option=orjson.OPT_SORT_KEYS)
        d = self._derivations.get(key_json)
        if d is None or d.clock != clock:
            d = self._derivations[key_json] = _Derivation(key_json, clock, new_deriver())
        per_table = [counts(t) for t in d.deriver.inputs]
        now = {s: tuple(c.get(s, 0) for c in per_table) for s in sorted(set().union(*per_table))}
        changed = [s for s in sorted(set(now) | set(d.counts)) if d.counts.get(s) != now.get(s)]
        if not changed:
            return d
        d = self._derivations[key_json] = self._restored(d, changed[0], new_deriver)
        self._derive(d, now, rows)
        if d.reason is not None and not d.whole_blocks and _split_block(d.units):
            # units of one block may be what the deriver objects to (a collective across two of them): whole blocks
            d = self._derivations[key_json] = _Derivation(key_json, clock, new_deriver(), whole_blocks=True)
            self._derive(d, now, rows)
        return d

    def _restored(self, d: _Derivation, step: int, new_deriver: Callable[[], Deriver]) -> _Derivation:
        """``d`` with its units from the one holding ``step`` on dropped (of whole blocks: from ``step``'s block on)
        and the deriver as it was before them: from the nearest earlier unit whose state was kept, or a fresh
        derivation when there is none."""
        block = int(block_of(np.array([step]))[0])
        first = next((i for i, u in enumerate(d.units)
                      if (u.block >= block if d.whole_blocks else u.last >= step)), len(d.units))
        if first == len(d.units):
            return d          # new steps only: the deriver has seen every unit before them
        while first >= 0 and d.units[first].state is None:
            first -= 1
        if first < 0:         # a change before the kept states: every block again
            return _Derivation(d.key, d.clock, new_deriver(), whole_blocks=d.whole_blocks)
        d.deriver = copy.deepcopy(d.units[first].state)
        dropped_from = d.units[first].first
        del d.units[first:]
        d.counts = {s: n for s, n in d.counts.items() if s < dropped_from}
        return d

    def _derive(self, d: _Derivation, now: dict[int, tuple[int, ...]], rows: BlockRows) -> None:
        """Derive every step of ``now`` after ``d``'s units, one unit per step block; keep the deriver's state
        before the newest units and blocks."""
        done = d.units[-1].last if d.units else None
        todo = [s for s in now if done is None or s > done]
        if not todo:
            d.reason = d.deriver.invalid_reason()
            return
        blocks = block_of(np.array(todo)).tolist()
        newest_blocks = set(sorted(set(blocks) | {u.block for u in d.units})[-KEPT_STATES:])
        for block in sorted(set(blocks)):
            steps = [s for s, b in zip(todo, blocks) if b == block]
            whole = not any(u.block == block for u in d.units)
            d.units.append(_Unit(block, steps[0], steps[-1], {},
                                 copy.deepcopy(d.deriver) if block in newest_blocks else None))
            inputs = {t: rows(t, block, None if whole else steps[0]) for t in d.deriver.inputs}
            frames = d.deriver.derive(block, inputs)
            d.units[-1].frames = {t: pa.Table.from_pandas(f, preserve_index=False)
                                  for t, f in frames.items() if not f.empty}
            for s in steps:
                d.counts[s] = now[s]
            self.num_derived += 1
            self.num_rows_derived += sum(len(f) for f in inputs.values())
        # states before the newest units and the newest blocks' first units only (each is a copy of the deriver)
        keep = {id(u) for u in d.units[-KEPT_UNITS:]}
        firsts = {}
        for u in d.units:
            firsts.setdefault(u.block, u)
        keep |= {id(firsts[b]) for b in newest_blocks if b in firsts}
        for u in d.units:
            if id(u) not in keep:
                u.state = None
        d.reason = d.deriver.invalid_reason()


def _split_block(units: list[_Unit]) -> bool:
    """Some step block is derived in more than one unit."""
    blocks = [u.block for u in units]
    return len(blocks) != len(set(blocks))
