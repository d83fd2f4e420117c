"""Incremental parsing of one append-only events file into an Arrow table; used by ``RunStore`` to tail by offset.

Only complete lines (ending in ``\\n``) are consumed: a torn last line, left by a rank killed mid-write or
still being written, stays unread and is parsed on a later call once complete. A bad line before the last
complete one is damage, and raises ``TraceError`` naming the file and the 1-based line number.
"""

from __future__ import annotations

import io
from dataclasses import dataclass
from pathlib import Path

import orjson
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.json as pajson

from dtprobe.store.errors import TraceError
from dtprobe.store.frames import arrow_schema

_BLOCK_BYTES = 8 << 20


@dataclass
class FileCursor:
    """How far one events file has been consumed."""

    offset_bytes: int = 0
    """Bytes consumed; always just after a newline."""
    lines: int = 0
    """Complete lines consumed (for error messages)."""


def read_new_rows(path: Path, cursor: FileCursor, table: str, rank: int) -> pa.Table | None:
    """Parse the complete lines of ``path`` after ``cursor`` and advance it; None if there are none.

    Every returned row has ``rank`` equal to the file's rank (filled in where the line had none).
    """
    with open(path, "rb") as f:
        size = f.seek(0, io.SEEK_END)
        if size < cursor.offset_bytes:
            raise TraceError(
                f"'{path}' is {size} bytes, shorter than the {cursor.offset_bytes} bytes already read: it was "
                f"truncated or replaced, but events files are append-only. Restore it, or if the run was "
                f"compacted, delete tables/ and run `dtprobe compact` again.")
        if size == cursor.offset_bytes:
            return None
        f.seek(cursor.offset_bytes)
        data = f.read(size - cursor.offset_bytes)
    end = data.rfind(b"\n")
    if end < 0:
        return None  # only a torn / in-progress line so far
    block = data[: end + 1]
    rows = parse_lines(block, table, path=path, first_line=cursor.lines + 1)
    rows = _check_rank(rows, rank, path, first_line=cursor.lines + 1)
    cursor.offset_bytes += end + 1
    cursor.lines += block.count(b"\n")
    return rows if rows.num_rows else None


def parse_lines(block: bytes, table: str, *, path: Path, first_line: int) -> pa.Table:
    """Parse newline-terminated JSON lines of ``table`` into an Arrow table with the table's full schema.

    Fast path: Arrow's JSON reader. If it refuses the block, the slow path parses line by line to name the
    first bad line (or builds the table itself when Arrow only refused an over-long line).
    """
    schema = arrow_schema(table)
    try:
        return pajson.read_json(
            io.BytesIO(block),
            read_options=pajson.ReadOptions(block_size=max(_BLOCK_BYTES, 1 << 20), use_threads=False),
            parse_options=pajson.ParseOptions(explicit_schema=schema, unexpected_field_behavior="ignore"),
        )
    except pa.ArrowException:
        return _parse_lines_slow(block, table, schema, path=path, first_line=first_line)


def _parse_lines_slow(block: bytes, table: str, schema: pa.Schema, *, path: Path, first_line: int) -> pa.Table:
    rows = []
    fix = ("Only the last line of an events file may be incomplete (a rank killed mid-write); a bad line "
           "before it means the file was damaged or written by something other than dtprobe's RankWriter. "
           "Fix: delete or repair that line (e.g. `sed -i '{n}d' '{path}'`) and read the run again.")
    for i, line in enumerate(block.split(b"\n")[:-1]):
        n = first_line + i
        if not line.strip():
            continue
        try:
            row = orjson.loads(line)
        except orjson.JSONDecodeError as exc:
            raise TraceError(f"'{path}' line {n} is not valid JSON ({exc}). {fix.format(n=n, path=path)}") from None
        if not isinstance(row, dict):
            raise TraceError(f"'{path}' line {n} is a JSON {type(row).__name__}, not an object. "
                             f"{fix.format(n=n, path=path)}")
        row = {k: v for k, v in row.items() if k in schema.names}
        try:
            pa.Table.from_pylist([row], schema=schema)
        except (pa.ArrowException, TypeError, ValueError, OverflowError) as exc:
            raise TraceError(f"'{path}' line {n} does not match the '{table}' table schema ({exc}); "
                             f"expected types: {dict(zip(schema.names, map(str, schema.types)))}. "
                             f"{fix.format(n=n, path=path)}") from None
        rows.append(row)
    return pa.Table.from_pylist(rows, schema=schema)


def _check_rank(rows: pa.Table, rank: int, path: Path, *, first_line: int) -> pa.Table:
    col = rows.column("rank")
    if col.null_count:
        rows = rows.set_column(rows.schema.get_field_index("rank"), "rank",
                               pc.fill_null(col, pa.scalar(rank, pa.int32())))
        col = rows.column("rank")
    if rows.num_rows:
        lo, hi = pc.min_max(col).values()
        if lo.as_py() != rank or hi.as_py() != rank:
            bad = pc.index(pc.not_equal(col, pa.scalar(rank, pa.int32())), True).as_py()
            raise TraceError(f"'{path}' line {first_line + bad} has rank {col[bad].as_py()}, but the file "
                             f"belongs to rank {rank}. Each rank must write only its own events file.")
    return rows
