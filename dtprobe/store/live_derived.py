"""Derived per-step tables of a run read from its events (not compacted, e.g. while it runs): the frames a caller's
``store.derived.Deriver`` computes from each step block's rows, kept per block and recomputed only for the blocks
whose rows changed since; read by ``RunStore.derived_table`` (the facade's lateness, exposure, bandwidth, ...).

Events are append-only, so a block's rows changed exactly when its number of rows of some input table did. A
refresh of a live run adds rows to its newest block or two: the deriver is restored to its state before the first
changed block (a copy kept for the newest ``KEPT_STATES`` blocks) and fed that block and the ones after it, in
block order as at compaction; older blocks' frames are reused. A change further back (or a new clock model, or
another deriver key) derives every block again. The frames are those compaction writes (kept as Arrow tables,
read back as ``derived.read_derived`` reads its files), and they are given only while the deriver's
``invalid_reason`` is None.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Callable

import orjson
import pandas as pd
import pyarrow as pa

from dtprobe.store.derived import Deriver, blocks_frame, block_in_steps

KEPT_STATES = 2
"""Newest step blocks before which the deriver's state is kept: a change there re-derives from that block on."""

BlockCounts = Callable[[str], dict[int, int]]
"""Rows per step block (-1: outside steps) of an input table."""
BlockRows = Callable[[str, int], pd.DataFrame]
"""An input table's rows of one step block, as ``RunStore.table`` gives them (clock-aligned, in sort order)."""


@dataclass
class _Derivation:
    """One deriver's frames of every block, and what they were derived from."""

    key: bytes
    """The deriver's ``key`` as JSON."""
    clock: tuple
    """``ClockModel.key`` of the rows derived."""
    deriver: Deriver
    """Fed every block in order so far."""
    counts: dict[int, tuple[int, ...]] = field(default_factory=dict)
    """Step block -> its rows of each input table when derived."""
    frames: dict[int, dict[str, pa.Table]] = field(default_factory=dict)
    """Step block -> derived table -> its frame of that block."""
    states: dict[int, Deriver] = field(default_factory=dict)
    """Step block -> a copy of the deriver before that block (the newest ``KEPT_STATES`` blocks)."""
    reason: str | None = None
    """``deriver.invalid_reason()`` after the last block."""


class LiveDerived:
    """A run store's derived frames computed from its rows, per deriver key (one per ``RunStore``; not
    thread-safe: the store calls it under its lock)."""

    def __init__(self) -> None:
        self._derivations: dict[bytes, _Derivation] = {}
        self.num_derived = 0
        """Blocks derived so far (tests: a refresh derives only the changed blocks)."""

    def table(self, name: str, key: dict, new_deriver: Callable[[], Deriver], *, clock: tuple,
              counts: BlockCounts, rows: BlockRows,
              steps: tuple[int | None, int | None] | None = None) -> pd.DataFrame | None:
        """The derived table ``name`` of the rows as they are now (its blocks' frames in block order, only those
        of ``steps`` when given, as ``derived.read_derived`` gives them), None when the deriver says its blocks'
        frames would differ from the whole run's. ``new_deriver`` makes a fresh deriver of ``key``; ``clock`` is
        the rows' clock model key; ``counts`` and ``rows`` read the input tables by step block."""
        d = self._current(key, new_deriver, clock, counts, rows)
        if d.reason is not None:
            return None
        parts = [frames[name] for block, frames in sorted(d.frames.items())
                 if name in frames and block_in_steps(block, steps)]
        return blocks_frame(parts, steps)

    def _current(self, key: dict, new_deriver: Callable[[], Deriver], clock: tuple, counts: BlockCounts,
                 rows: BlockRows) -> _Derivation:
        """The derivation of ``key`` brought up to the rows now held."""
        key_json = orjson.dumps(key, option=orjson.OPT_SORT_KEYS)
        d = self._derivations.get(key_json)
        if d is None or d.clock != clock:
            d = self._derivations[key_json] = _Derivation(key_json, clock, new_deriver())
        inputs = d.deriver.inputs
        per_table = [counts(t) for t in inputs]
        now = {b: tuple(c.get(b, 0) for c in per_table) for b in sorted(set().union(*per_table))}
        changed = [b for b, n in now.items() if d.counts.get(b) != n]
        if not changed:
            return d
        first = changed[0]
        if d.counts and first > max(d.counts):
            pass          # new blocks only: the deriver has seen every block before them
        elif first in d.states:
            d.deriver = copy.deepcopy(d.states[first])
        elif d.counts:    # a change before the kept states: every block again
            d = self._derivations[key_json] = _Derivation(key_json, clock, new_deriver())
            first = min(now)
        blocks = [b for b in now if b >= first]
        newest = set(list(now)[-KEPT_STATES:])
        d.states = {b: s for b, s in d.states.items() if b < first and b in newest}
        for block in blocks:
            if block in newest:
                d.states[block] = copy.deepcopy(d.deriver)
            frames = d.deriver.derive(block, {t: rows(t, block) for t in inputs})
            d.frames[block] = {t: pa.Table.from_pandas(f, preserve_index=False)
                               for t, f in frames.items() if not f.empty}
            d.counts[block] = now[block]
            self.num_derived += 1
        d.reason = d.deriver.invalid_reason()
        return d
