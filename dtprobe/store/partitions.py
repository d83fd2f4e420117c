"""The partitioned Parquet layout of a compacted run's per-step tables: written by ``store.compaction``, selected and
read with filters pushed down by ``store.reader`` (a step window or a rank subset reads only its files).

A per-step table (``schema.STEP_TABLES``) is split by step block (``step // STEP_BLOCK_STEPS``; rows outside steps,
``step`` null or negative, in block -1) and rank block (``rank // RANK_BLOCK_RANKS``) into
``tables/<table>/step_block=<K>/rank_block=<R>/part-0.parquet`` (Hive-style folders, so DuckDB, Polars or
``pyarrow.dataset`` read the folder as one partitioned table). Each file keeps the rows in the table's sort order
and is written in row groups of ``ROW_GROUP_ROWS`` rows, whose min/max statistics let a filter skip row groups
inside a file. The compaction marker lists every file with its rows and its step and rank ranges (``PartFile``),
so the reader picks files without opening any.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as ds
import pyarrow.parquet as pq

from dtprobe.store.errors import TraceError
from dtprobe.store.frames import SORT_KEYS, memory_schema
from dtprobe.store.manifest import check_schema_version
from dtprobe.store.schema import PARTITION_FILE, RANK_BLOCK_RANKS, ROW_GROUP_ROWS, STEP_BLOCK_STEPS

PART_FILE = PARTITION_FILE.split("/", 1)[1]
"""A partition's file, relative to ``<run>/tables/``."""
NO_STEP_BLOCK = -1
"""The step block of rows outside steps (``step`` null or negative)."""
_READ_THREADS = min(4, os.cpu_count() or 1)
"""Partition files read side by side."""


@dataclass(frozen=True, kw_only=True)
class PartFile:
    """One compacted Parquet file of a table as the marker lists it."""

    path: str
    """Relative to ``<run>/tables/``."""
    rows: int
    """Rows in the file."""
    min_step: int | None = None
    """Lowest non-null ``step`` in the file (None: only null steps, or a single-file table of an older layout)."""
    max_step: int | None = None
    """Highest non-null ``step`` (None as ``min_step``)."""
    min_rank: int | None = None
    """Lowest rank in the file (None: unknown, the file may hold any rank)."""
    max_rank: int | None = None
    """Highest rank in the file."""
    step_block: int | None = None
    """The file's step block (None for a single-file table)."""

    def to_json(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if v is not None}

    @classmethod
    def from_json(cls, data: dict) -> "PartFile":
        return cls(**{k: data.get(k) for k in cls.__dataclass_fields__})

    def may_hold(self, steps: tuple[int | None, int | None] | None, ranks: frozenset[int] | None) -> bool:
        """False only when no row of this file can be in ``steps`` (inclusive, None = open) and ``ranks``."""
        if steps is not None and self.step_block is not None:
            first, last = steps
            if self.max_step is None:  # rows outside steps only: outside every step range
                return False
            if (first is not None and self.max_step < first) or (last is not None and self.min_step > last):
                return False
        if ranks is not None and self.min_rank is not None:
            if not any(self.min_rank <= r <= self.max_rank for r in ranks):
                return False
        return True


def write_partitions(rows: pa.Table, tables_dir: Path, name: str,
                     metadata: dict[str, str]) -> tuple[list[PartFile], bool]:
    """Write the sorted table ``rows`` of ``name`` as partition files under ``tables_dir``.

    Returns the files (in rank-block, step-block order) and whether each rank's rows lie in step-block order in
    the sorted table (``ordered``): then the rows of any set of these files are put back in sort order by taking
    each rank's stretch of every file in file order (``interleave``), no sort needed. False when e.g. a restart
    re-ran older steps, or a rank wrote rows outside steps between steps: the reader sorts then."""
    rows = rows.replace_schema_metadata(metadata)
    step = rows.column("step").to_numpy(zero_copy_only=False)
    step = np.where(np.isnan(step), -1, step).astype(np.int64) if step.dtype.kind == "f" else step.astype(np.int64)
    step_block = block_of(step)
    rank = rows.column("rank").to_numpy(zero_copy_only=False).astype(np.int64)
    rank_block = rank // RANK_BLOCK_RANKS
    by_rank = rank * (1 << 24) + (step_block - NO_STEP_BLOCK)
    ordered = SORT_KEYS[name][0] == "rank" and bool(np.all(by_rank[1:] >= by_rank[:-1]))
    key = rank_block * (1 << 24) + (step_block - NO_STEP_BLOCK)
    order = np.argsort(key, kind="stable")
    keys_sorted = key[order]
    starts = np.flatnonzero(np.r_[True, keys_sorted[1:] != keys_sorted[:-1]])
    bounds = np.r_[starts, len(key)]
    files = []
    for begin, end in zip(bounds[:-1], bounds[1:]):
        part = rows.take(pa.array(order[begin:end]))
        sb = int(step_block[order[begin]])
        rb = int(rank_block[order[begin]])
        rel = PART_FILE.format(table=name, step_block=sb, rank_block=rb)
        (tables_dir / rel).parent.mkdir(parents=True, exist_ok=True)
        pq.write_table(part, tables_dir / rel, compression="zstd", row_group_size=ROW_GROUP_ROWS)
        steps = pc.min_max(part.column("step"))
        ranks = pc.min_max(part.column("rank"))
        files.append(PartFile(path=rel, rows=part.num_rows, min_step=steps["min"].as_py(),
                              max_step=steps["max"].as_py(), min_rank=ranks["min"].as_py(),
                              max_rank=ranks["max"].as_py(), step_block=sb))
    return files, ordered


def block_of(step: np.ndarray) -> np.ndarray:
    """The step block of each step (``NO_STEP_BLOCK`` for negative steps)."""
    return np.where(step >= 0, step // STEP_BLOCK_STEPS, NO_STEP_BLOCK)


def interleave(parts: list[pa.Table]) -> pa.Table | None:
    """Rows of partition files read in file order (each sorted, rank first), merged into one rank-sorted table by
    taking each rank's stretch of every part in part order: the table's sort order when its files are ``ordered``
    (see ``write_partitions``). None when no part has rows."""
    parts = [p for p in parts if p.num_rows]
    if len(parts) < 2:
        return parts[0] if parts else None
    segments = []
    for i, part in enumerate(parts):
        rank = part.column("rank").to_numpy(zero_copy_only=False)
        starts = np.flatnonzero(np.r_[True, rank[1:] != rank[:-1]])
        ends = np.r_[starts[1:], len(rank)]
        segments.extend((int(rank[s]), i, int(s), int(e)) for s, e in zip(starts, ends))
    segments.sort(key=lambda seg: (seg[0], seg[1]))
    # zero-copy slices, then one contiguous copy: cheaper than a take of every row
    return pa.concat_tables([parts[i].slice(s, e - s) for _, i, s, e in segments]).combine_chunks()


def row_filter(steps: tuple[int | None, int | None] | None, ranks: frozenset[int] | None) -> pc.Expression | None:
    """The filter of rows with ``step`` in ``steps`` (inclusive; None = open end) and ``rank`` in ``ranks``."""
    expr = None
    if steps is not None:
        first, last = steps
        parts = [pc.field("step").is_valid()]
        if first is not None:
            parts.append(pc.field("step") >= first)
        if last is not None:
            parts.append(pc.field("step") <= last)
        for p in parts:
            expr = p if expr is None else expr & p
    if ranks is not None:
        cond = pc.field("rank").isin(pa.array(sorted(ranks), type=pa.int32()))
        expr = cond if expr is None else expr & cond
    return expr


def filter_rows(rows: pa.Table, expr: pc.Expression | None) -> pa.Table:
    """``rows`` (an in-memory table) filtered by ``expr`` (None keeps all)."""
    return rows if expr is None or not rows.num_rows else rows.filter(expr)


def read_files(tables_dir: Path, files: Iterable[PartFile], name: str, expr: pc.Expression | None, *,
               ordered: bool, columns: list[str] | None = None) -> pa.Table:
    """The rows of ``files`` that pass ``expr`` with exactly the schema's columns (or ``columns``, which must
    hold ``rank`` when ``ordered``) and types; row groups whose statistics rule the filter out are not read.
    ``ordered`` (the marker's flag): merged back into sort order (``interleave``), else concatenated in file
    order. TraceError names a damaged file and the fix."""
    files = list(files)
    empty = _selected_schema(name, columns).empty_table()
    if len(files) > 1 and _READ_THREADS > 1:  # Arrow releases the GIL while it decodes: files side by side
        with ThreadPoolExecutor(min(_READ_THREADS, len(files)), thread_name_prefix="dtprobe-parquet") as pool:
            tables = list(pool.map(lambda f: read_compacted_file(tables_dir, f.path, name, expr, columns=columns),
                                   files))
    else:
        tables = [read_compacted_file(tables_dir, f.path, name, expr, columns=columns) for f in files]
    if ordered:
        merged = interleave(tables)
        return merged if merged is not None else empty
    tables = [t for t in tables if t.num_rows]
    return pa.concat_tables(tables) if tables else empty


def _selected_schema(name: str, columns: list[str] | None) -> pa.Schema:
    schema = memory_schema(name)
    return schema if columns is None else pa.schema([schema.field(c) for c in columns])


def read_compacted_file(tables_dir: Path, rel: str, name: str, expr: pc.Expression | None = None, *,
                        columns: list[str] | None = None) -> pa.Table:
    """Read the compacted Parquet file ``tables_dir / rel`` of table ``name`` (rows passing ``expr``, which may
    name columns not read) with exactly the columns (or only ``columns``) and types of ``frames.memory_schema``
    (TraceError otherwise)."""
    schema = memory_schema(name)
    path = tables_dir / rel
    rebuild = f"Delete {tables_dir} and run `dtprobe compact {tables_dir.parent}` to rebuild it from the events files."
    if not path.is_file():
        raise TraceError(f"'{path}', listed in {tables_dir / '_compacted.json'}, is missing: the run was compacted "
                         f"again since it was opened (open it again), or the file was deleted. {rebuild}")
    try:
        file_schema = pq.read_schema(path)
    except (OSError, pa.ArrowException) as exc:
        raise TraceError(f"'{path}' is not a readable Parquet file ({exc}). {rebuild}") from None
    missing = [c for c in schema.names if c not in file_schema.names]
    meta = file_schema.metadata or {}
    ours = b"dtprobe.schema_version" in meta
    if ours:
        check_schema_version(int(meta[b"dtprobe.schema_version"]), path)
    if missing and not ours:
        raise TraceError(f"'{path}' lacks the columns {missing} of the '{name}' table; it was written by an "
                         f"older dtprobe or another tool. {rebuild}")
    wanted = schema.names if columns is None else list(columns)
    try:
        # dictionary columns decoded as such (also from files that hold them as plain strings): never a copy of
        # the value per row
        fields = [schema.field(c) if pa.types.is_dictionary(schema.field(c).type) or c in missing
                  else file_schema.field(c) for c in schema.names]
        # Columns added to the schema (same version) after this file was written are read as nulls (also in a
        # filter naming them)
        data = ds.dataset(path, format="parquet", schema=pa.schema(fields))
        filter_after = expr is not None and any(c in missing for c in ("step", "rank"))
        table = data.to_table(columns=[c for c in schema.names if c in wanted or filter_after],
                              filter=None if filter_after else expr)
        if filter_after:
            table = filter_rows(table.select(schema.names).cast(schema), expr)
        return table.select(wanted).cast(_selected_schema(name, columns))
    except (OSError, pa.ArrowException) as exc:
        raise TraceError(f"'{path}' cannot be read as the '{name}' table ({exc}). {rebuild}") from None
