"""A per-step table's rows one rank block at a time, as ``RunStore.aligned_arrow`` gives them restricted to that
block's ranks: the rows of an earlier compaction, then the events lines after it, group members filled in,
clock-aligned and sorted. Read by ``store.compaction``, which so holds one rank block of a table at a time.

A rank block is ``RANK_BLOCK_RANKS`` ranks (a partition's ranks), so every partition file of the block is written
from one batch. A table's sort order starts with ``rank`` (``frames.SORT_KEYS``), so a block's rows sorted are the
whole table's rows of those ranks in the whole table's order.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from dtprobe.store.clock_sync import Basis, ClockModel, align_rows
from dtprobe.store.errors import TraceError
from dtprobe.store.frames import SORT_KEYS, time_columns
from dtprobe.store.groups import GROUPS_SINCE_VERSION, fill_members, missing_groups_error
from dtprobe.store.jsonl import FileCursor, read_new_rows
from dtprobe.store.partitions import PartFile, read_files, row_filter
from dtprobe.store.schema import COMPACT_FILE, EVENTS_FILE, GROUPED_TABLES, RANK_BLOCK_RANKS

_PARSE_THREADS = min(4, os.cpu_count() or 1)
"""Events files of a block parsed side by side (Arrow's JSON parser releases the GIL)."""
_PER_KEY_NULLS = int(pa.__version__.split(".")[0]) >= 25
"""pyarrow 25 takes the null placement per sort key (and deprecates the one for all keys)."""


@dataclass
class RankBlockSource:
    """Where a run's per-step rows come from: its events files and, if it was compacted before, that compaction."""

    run_dir: Path
    model: ClockModel
    """Every rank's clock offsets (the ones the compaction records)."""
    groups: Callable[[bool], pa.Table]
    """The run's ``groups`` rows; called with True to read them again (a group line written since)."""
    schema_version: int
    """The run's (a version-1 run without ``groups`` rows keeps null members, as the reader does)."""
    previous: dict | None = None
    """The marker of the run's earlier compaction (its rows are read, then the events lines after it)."""
    cursors: dict[str, tuple[int, int]] = field(default_factory=dict)
    """Events file (run-relative) -> (bytes, lines) read so far: the marker's ``events`` of what was consumed."""

    def blocks(self, name: str) -> Iterator[tuple[int, pa.Table]]:
        """``(rank block, rows)`` of table ``name`` for every rank block with rows, in rank-block order."""
        files = self._events_files(name)
        old = self._previous_files(name)
        blocks = {rank // RANK_BLOCK_RANKS for rank in files}
        for f in old:
            if f.min_rank is None:  # one file of the whole table (an older layout): it may hold any rank
                blocks |= {int(r) // RANK_BLOCK_RANKS for r in self._previous_ranks(name, f)}
            else:
                blocks |= set(range(f.min_rank // RANK_BLOCK_RANKS, f.max_rank // RANK_BLOCK_RANKS + 1))
        for block in sorted(blocks):
            ranks = frozenset(range(block * RANK_BLOCK_RANKS, (block + 1) * RANK_BLOCK_RANKS))
            parts = [self._previous_rows(name, [f for f in old if f.may_hold(None, ranks)], ranks)]
            parts.append(self._events_rows(name, {r: p for r, p in files.items() if r in ranks}))
            parts = [p for p in parts if p is not None and p.num_rows]
            if parts:
                rows = pa.concat_tables(parts) if len(parts) > 1 else parts[0]
                yield block, sort_rows(rows, SORT_KEYS[name])

    def _events_files(self, name: str) -> dict[int, Path]:
        folder = self.run_dir / Path(EVENTS_FILE.format(table=name, rank=0)).parent
        if not folder.is_dir():
            return {}
        files = {}
        for entry in os.scandir(folder):
            stem = entry.name[4:-6]
            if entry.name.startswith("rank") and entry.name.endswith(".jsonl") and stem.isdigit():
                files[int(stem)] = Path(entry.path)
        return dict(sorted(files.items()))

    def _events_rows(self, name: str, files: dict[int, Path]) -> pa.Table | None:
        """The block's events lines not in the earlier compaction, in rank order, members filled, aligned."""
        consumed = (self.previous or {}).get("events", {})

        def read(rank: int) -> pa.Table | None:
            path = files[rank]
            rel = EVENTS_FILE.format(table=name, rank=rank)
            offset, lines = consumed.get(rel, (0, 0))
            cursor = FileCursor(offset_bytes=int(offset), lines=int(lines))
            rows = read_new_rows(path, cursor, name, rank)
            self.cursors[rel] = (cursor.offset_bytes, cursor.lines)
            if rows is not None and rank not in self.model.ranks:
                raise TraceError(f"rank {rank} has events in '{path}' but no rank info file "
                                 f"'{self.run_dir / 'ranks' / f'rank{rank:05d}.json'}', so its times cannot be "
                                 f"aligned with the other ranks. Restore that file (each rank writes it at attach), "
                                 f"or write it with clock_offset_ns=0 if all ranks ran on one host.")
            return rows

        if len(files) > 1 and _PARSE_THREADS > 1:
            with ThreadPoolExecutor(_PARSE_THREADS, thread_name_prefix="dtprobe-compact") as pool:
                parts = list(pool.map(read, files))
        else:
            parts = [read(rank) for rank in files]
        parts = [p for p in parts if p is not None]
        if not parts:
            return None
        rows = pa.concat_tables(parts) if len(parts) > 1 else parts[0]
        if name in GROUPED_TABLES:
            rows = self._with_members(name, rows)
        return align_rows(rows, time_columns(name), self.model, None, source=f"'{self.run_dir}'")

    def _with_members(self, name: str, rows: pa.Table) -> pa.Table:
        groups = self.groups(False)
        filled, missing = fill_members(rows, groups, name)
        if missing:
            groups = self.groups(True)
            filled, missing = fill_members(rows, groups, name)
        if missing and (self.schema_version >= GROUPS_SINCE_VERSION or groups.num_rows):
            raise missing_groups_error(name, self.run_dir, missing)
        return filled

    def _previous_files(self, name: str) -> list[PartFile]:
        entry = (self.previous or {}).get("tables", {}).get(name)
        if entry is None:
            return []
        if "files" in entry:
            return [PartFile.from_json(f) for f in entry["files"]]
        return [PartFile(path=Path(COMPACT_FILE.format(table=name)).name, rows=int(entry.get("rows", 0)))]

    def _previous_ranks(self, name: str, f: PartFile) -> list[int]:
        rows = read_files(self._tables_dir, [f], name, None, ordered=False)
        return pc.unique(rows.column("rank")).drop_null().to_pylist()

    def _previous_rows(self, name: str, files: list[PartFile], ranks: frozenset[int]) -> pa.Table | None:
        """The earlier compaction's rows of ``ranks`` (its files' order), re-aligned if offsets changed since."""
        if not files:
            return None
        ordered = bool(self.previous["tables"][name].get("ordered", False))
        whole = any(f.min_rank is None for f in files)
        rows = read_files(self._tables_dir, files, name, row_filter(None, ranks) if whole else None,
                          ordered=ordered)
        basis = Basis.from_marker(self.previous["clock_offsets_ns"], self.previous.get("clock_samples"))
        return align_rows(rows, time_columns(name), self.model, basis,
                          source=f"the compacted '{name}' table in {self._tables_dir}")

    @property
    def _tables_dir(self) -> Path:
        return self.run_dir / Path(COMPACT_FILE).parts[0]


def sort_rows(rows: pa.Table, keys: tuple[str, ...]) -> pa.Table:
    """``rows`` stably sorted by ``keys`` ascending, nulls last (the reader's order); unchanged when already so."""
    if rows.num_rows < 2:
        return rows
    if _PER_KEY_NULLS:
        options = pc.SortOptions([(k, "ascending", "at_end") for k in keys])
    else:
        options = pc.SortOptions([(k, "ascending") for k in keys], null_placement="at_end")
    order = pc.sort_indices(rows, options=options)
    if np.array_equal(order.to_numpy(), np.arange(rows.num_rows)):
        return rows
    return rows.take(order)
