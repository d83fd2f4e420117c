"""Derived per-step tables of a compacted run: frames a caller's ``Deriver`` computes from each step block's rows at
compaction (the analysis' per-step lateness and exposure), written under ``tables/derived/`` by
``store.compaction`` and read back by ``RunStore.derived_table``.

The store knows nothing of what a deriver computes (it may not import the analysis): it hands the deriver one step
block at a time (``STEP_BLOCK_STEPS`` steps of every input table, as ``RunStore.table`` gives them), writes the
frames it returns, one file per derived table and step block, and records in the marker the deriver's ``key``
(what the frames depend on: its version, options) or why they were not kept (``Deriver.invalid_reason``: the
whole run's computation would differ from the blocks', e.g. a collective whose rows lie in two step blocks). A
reader compares that key with its own and reads the frames only while the compacted tables are all there is.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Iterable, Iterator, Protocol, Sequence

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from dtprobe.store.errors import TraceError
from dtprobe.store.frames import arrow_to_frame, memory_schema
from dtprobe.store.partitions import PartFile, block_of, read_compacted_file, read_files
from dtprobe.store.schema import COMPACT_FILE, DERIVED_FILE, STEP_BLOCK_STEPS

DERIVED_DIR = DERIVED_FILE.split("/")[1]
"""The derived tables' folder under ``<run>/tables/``."""


class Deriver(Protocol):
    """Computes derived per-step frames from one step block's rows (see the module docstring)."""

    key: dict
    """JSON-able: what the derived frames depend on (the deriver's version, options); stored in the marker."""
    inputs: tuple[str, ...]
    """Tables read per step block (rows with ``step`` in the block; block -1: the rows outside steps, ``step``
    null or negative, handed over first)."""

    def derive(self, step_block: int, frames: dict[str, pd.DataFrame]) -> dict[str, pd.DataFrame]:
        """The derived frames of one step block from its rows of every input table."""

    def invalid_reason(self) -> str | None:
        """After every block: None when the blocks' frames together equal the whole run's, else why not."""


def write_derived(deriver: Deriver, tables_dir: Path, blocks: Iterable[tuple[int, dict[str, pa.Table]]]) -> dict:
    """Run ``deriver`` over ``blocks``, ``(step block, {input table: its rows in the block})`` in block order (the
    clock-aligned rows compaction writes, in the tables' sort order: ``block_inputs``), and write its frames under
    ``tables_dir/derived/``; returns the marker's ``derived`` entry: ``{"key", "tables": {name: {"rows", "files":
    [{"path", "rows", "step_block"}]}}}``, or ``{"key", "skipped": reason}`` (no files kept) when the deriver says
    its frames would differ from the whole run's."""
    entry: dict = {"key": deriver.key, "tables": {}}
    for block, rows in blocks:
        frames = {name: arrow_to_frame(rows[name], name) for name in deriver.inputs}
        for derived, frame in deriver.derive(block, frames).items():
            table = entry["tables"].setdefault(derived, {"rows": 0, "files": []})
            if frame.empty:
                continue
            rel = DERIVED_FILE.split("/", 1)[1].format(table=derived, step_block=block)
            (tables_dir / rel).parent.mkdir(parents=True, exist_ok=True)
            pq.write_table(pa.Table.from_pandas(frame, preserve_index=False), tables_dir / rel, compression="zstd")
            table["rows"] += len(frame)
            table["files"].append({"path": rel, "rows": len(frame), "step_block": block})
    reason = deriver.invalid_reason()
    if reason is not None:
        shutil.rmtree(tables_dir / DERIVED_DIR, ignore_errors=True)
        return {"key": deriver.key, "skipped": reason}
    return entry


def block_inputs(tables_dir: Path, entries: dict[str, dict], inputs: Iterable[str]
                 ) -> Iterator[tuple[int, dict[str, pa.Table]]]:
    """Every step block's rows of the compacted tables ``inputs`` (``entries``: the marker's ``tables``), block -1
    (rows outside steps) first: a partitioned table's files of the block (in rank-block order, so in sort order),
    one step block in memory at a time; a one-file table is read whole and split. A table without rows gives an
    empty table in every block."""
    files: dict[str, dict[int, list[PartFile]]] = {}
    whole: dict[str, tuple[pa.Table, np.ndarray, dict[int, tuple[int, int]]]] = {}
    for name in inputs:
        entry = entries.get(name)
        if entry is not None and "files" in entry:
            by_block: dict[int, list[PartFile]] = {}
            for f in map(PartFile.from_json, entry["files"]):
                by_block.setdefault(f.step_block, []).append(f)
            files[name] = {b: sorted(fs, key=lambda f: f.min_rank) for b, fs in by_block.items()}
        elif entry is not None:
            rows = read_compacted_file(tables_dir, Path(COMPACT_FILE).name.format(table=name), name)
            whole[name] = (rows, *_block_spans(rows))
        else:
            whole[name] = (memory_schema(name).empty_table(), np.empty(0, dtype=np.int64), {})
    blocks = {b for by_block in files.values() for b in by_block} | {b for *_, spans in whole.values() for b in spans}
    for block in sorted(blocks):
        rows = {}
        for name in inputs:
            if name in files:
                parts = files[name].get(block, [])
                rows[name] = read_files(tables_dir, parts, name, None, ordered=False)
            else:
                table, order, spans = whole[name]
                begin, end = spans.get(block, (0, 0))
                rows[name] = table.take(pa.array(order[begin:end]))
        yield block, rows


def _block_spans(rows: pa.Table) -> tuple[np.ndarray, dict[int, tuple[int, int]]]:
    """Row positions of ``rows`` grouped by step block (stable), and each block's span in them."""
    step = rows.column("step").to_numpy(zero_copy_only=False) if rows.num_rows else np.empty(0)
    block = block_of(np.where(pd.isna(step), -1, step).astype(np.int64))
    order = np.argsort(block, kind="stable")
    found, first, count = np.unique(block[order], return_index=True, return_counts=True)
    return order, {int(b): (int(f), int(f + n)) for b, f, n in zip(found, first, count)}


def marker_entry(marker: dict | None) -> dict:
    """The compaction marker's ``derived`` entry (``key``, ``tables``, or why none was kept); {} when it has none."""
    return (marker or {}).get("derived") or {}


def read_derived(tables_dir: Path, entry: dict, name: str, steps: tuple[int | None, int | None] | None = None,
                 order: Sequence[str] | None = None) -> pd.DataFrame:
    """The derived table ``name`` of a marker's ``derived`` entry: its step blocks' frames concatenated in block
    order (only the blocks that can hold ``steps``, then filtered to them), sorted by ``order`` when given
    (``blocks_frame``); an empty frame without columns when it has no rows. TraceError names a damaged or missing
    file and the fix."""
    files = [f for f in entry["tables"][name]["files"] if block_in_steps(f["step_block"], steps)]
    parts = []
    for f in files:
        path = tables_dir / f["path"]
        try:
            # to be sorted, text columns are read as dictionaries (as Parquet stores them): a sort moves codes, not
            # a group's member list per row; they are plain text again in the frame
            parts.append(pq.read_table(path, read_dictionary=None if not order else [
                field.name for field in pq.read_schema(path)
                if pa.types.is_large_string(field.type) or pa.types.is_string(field.type)]))
        except (OSError, pa.ArrowException) as exc:
            raise TraceError(f"'{path}', a derived table listed in {tables_dir / '_compacted.json'}, cannot be "
                             f"read ({exc}). Delete {tables_dir} and run `dtprobe compact {tables_dir.parent}` "
                             f"to rebuild it.") from None
    return blocks_frame(parts, steps, order)


def block_in_steps(step_block: int, steps: tuple[int | None, int | None] | None) -> bool:
    """Whether step block ``step_block`` can hold rows of ``steps`` (inclusive, None ends open; None: all)."""
    if steps is None:
        return True
    first, last = steps
    return ((first is None or (step_block + 1) * STEP_BLOCK_STEPS > first)
            and (last is None or step_block * STEP_BLOCK_STEPS <= last))


def blocks_frame(parts: list[pa.Table], steps: tuple[int | None, int | None] | None = None,
                 order: Sequence[str] | None = None) -> pd.DataFrame:
    """A derived table's step blocks' frames (``parts``, in block order) as one frame, filtered to ``steps`` and,
    with ``order``, sorted by those columns (ascending, stable, nulls last: as pandas' ``sort_values(order,
    kind="stable", na_position="last")``); an empty frame without columns when no block has rows (compacted files
    and ``live_derived`` alike). Dictionary columns come out as plain ones."""
    if not parts:
        return pd.DataFrame()
    # a block's frame types a column by its own values (step_ns is float in the block whose last step has no
    # steps row, int elsewhere): promoted as the whole run's frame would type it
    table = pa.concat_tables(parts, promote_options="permissive").unify_dictionaries()
    if steps is not None:
        first, last = steps
        keep = pc.is_valid(table.column("step"))
        if first is not None:
            keep = pc.and_(keep, pc.greater_equal(table.column("step"), first))
        if last is not None:
            keep = pc.and_(keep, pc.less_equal(table.column("step"), last))
        table = table.filter(keep)
    if order:
        table = table.take(_sort_indices(table, order))
    return _plain(table).to_pandas()


def _sort_indices(table: pa.Table, order: Sequence[str]) -> pa.Array:
    """The stable ascending sort of ``table`` by ``order`` (nulls last); a dictionary column by its values, through
    each code's rank among the (unified) dictionary's values."""
    keys = {}
    for name in order:
        column = table.column(name)
        if pa.types.is_dictionary(column.type):
            column = column.combine_chunks()
            ranks = pc.rank(column.dictionary, sort_keys="ascending", tiebreaker="first")
            column = pc.take(ranks, column.indices)
        keys[name] = column
    return pc.sort_indices(pa.table(keys), sort_keys=[(name, "ascending") for name in order])


def _plain(table: pa.Table) -> pa.Table:
    """``table`` with every dictionary column decoded to its value type."""
    if not any(pa.types.is_dictionary(field.type) for field in table.schema):
        return table
    # a take from the dictionary by the codes decodes faster than a cast
    columns = [_decoded(c.combine_chunks()) if pa.types.is_dictionary(c.type) else c for c in table.columns]
    return pa.Table.from_arrays(columns, schema=pa.schema(
        [f.with_type(f.type.value_type) if pa.types.is_dictionary(f.type) else f for f in table.schema],
        metadata=table.schema.metadata))


def _decoded(column: pa.DictionaryArray) -> pa.Array:
    return column.dictionary.take(column.indices)
