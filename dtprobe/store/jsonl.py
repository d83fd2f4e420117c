"""Incremental parsing of one append-only events file into an Arrow table; used by ``RunStore`` to tail by offset.

Only complete lines (ending in ``\\n``) are consumed: a torn last line, left by a rank killed mid-write or
still being written, stays unread and is parsed on a later call once complete. A bad line before the last
complete one is damage, and raises ``TraceError`` naming the file and the 1-based line number.
"""

from __future__ import annotations

import io
import re
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import orjson
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.json as pajson

from dtprobe.store.errors import TraceError
from dtprobe.store.frames import arrow_schema

_BLOCK_BYTES = 4 << 20
"""Arrow JSON block size; a line longer than this falls back to the (slower) line-by-line parser."""
_READ_BYTES = 64 << 20
"""Bytes read from an events file per parse (bounds memory on the first read of a long run)."""


_SCAN_BYTES = 1 << 20
"""Bytes read per step when scanning an events file backwards for its tail."""
_PROBE_BYTES = 64 << 10
"""Bytes read per probe when bisecting an events file for its tail."""
_TAIL_SLACK_STEPS = 2
"""Steps a row of an events file may lag the rows written before it (a collective's row is written when it
completes, a step row when its step ends): ``tail_cursor`` looks for the tail's start this far behind the first
line it finds of a later step."""
_STEP_KEY = re.compile(rb'"step":\s*(-?\d+)')
"""The ``step`` key of a row (a string value cannot hold it: its quotes would be escaped)."""


@dataclass
class FileCursor:
    """How far one events file has been consumed."""

    offset_bytes: int = 0
    """Bytes consumed; always just after a newline."""
    lines: int = 0
    """Complete lines consumed after the first ``head_bytes`` (for error messages: ``line_count``)."""
    head_bytes: int = 0
    """A head of the file (a line boundary) whose lines ``lines`` does not count: a tail open skips it unread, and
    its newlines are counted only when a line number is asked for (``line_count``)."""
    _head_lines: int | None = field(default=None, repr=False, compare=False)

    def line_count(self, path: Path) -> int:
        """Complete lines consumed, the head's included (``path``: the file; its head is counted once)."""
        if not self.head_bytes:
            return self.lines
        if self._head_lines is None:
            with open(path, "rb") as f:
                self._head_lines = _count_lines(f, self.head_bytes)
        return self._head_lines + self.lines


def read_new_rows(path: Path, cursor: FileCursor, table: str, rank: int, *, end: int | None = None
                  ) -> pa.Table | None:
    """Parse the complete lines of ``path`` after ``cursor`` (up to byte ``end``, a line boundary, if given) and
    advance it; None if there are none.

    Reads at most ``_READ_BYTES`` at a time (plus whatever completes a longer line), so memory stays bounded on
    a first read of a long run. Every returned row has ``rank`` equal to the file's rank (filled in where the
    line had none). On error the cursor is left where it was.
    """
    offset, lines, parts = cursor.offset_bytes, cursor.lines, []
    with open(path, "rb") as f:
        size = f.seek(0, io.SEEK_END)
        if size < offset:
            raise TraceError(
                f"'{path}' is {size} bytes, shorter than the {offset} bytes already read: it was "
                f"truncated or replaced, but events files are append-only. Restore it, or if the run was "
                f"compacted, delete tables/ and run `dtprobe compact` again.")
        if end is not None:
            size = min(size, end)
        f.seek(offset)
        data = b""
        while offset + len(data) < size:
            data += f.read(min(_READ_BYTES, size - offset - len(data)))
            end = data.rfind(b"\n")
            if end < 0:
                continue  # a line longer than one read (or a torn last line): read on
            block, data = data[: end + 1], data[end + 1:]
            try:
                rows = parse_lines(block, table, path=path, first_line=lines + 1)
                parts.append(_check_rank(rows, rank, path, first_line=lines + 1))
            except TraceError:
                if not cursor.head_bytes:
                    raise
                # the error names the line within the lines read after an uncounted head: the same read with
                # the head counted raises it with the file's own line number
                first = cursor.line_count(path) - cursor.lines + lines + 1
                _check_rank(parse_lines(block, table, path=path, first_line=first), rank, path, first_line=first)
                raise
            offset += end + 1
            lines += block.count(b"\n")
    cursor.offset_bytes, cursor.lines = offset, lines
    rows = pa.concat_tables(parts) if len(parts) > 1 else (parts[0] if parts else None)
    return rows if rows is not None and rows.num_rows else None


def read_new_rows_batched(files: list[tuple[Path, FileCursor, int]], table: str) -> pa.Table | None:
    """Parse the small increments of several events files of one table in one Arrow call and advance their
    cursors; None (nothing advanced) when that is not possible cleanly (a shrunk file, a line Arrow refuses, a
    row count or rank that does not match), so the caller reads those files one by one and reports exactly.

    A live refresh appends a few lines to every rank's file; one parse of all of them costs a fraction of one
    parse per file.
    """
    blocks, counts = [], []
    for path, cursor, _ in files:
        with open(path, "rb") as f:
            size = f.seek(0, io.SEEK_END)
            if size < cursor.offset_bytes:
                return None
            f.seek(cursor.offset_bytes)
            data = f.read(size - cursor.offset_bytes)
        block = data[: data.rfind(b"\n") + 1]
        blocks.append(block)
        counts.append(block.count(b"\n"))
    if not sum(counts):
        return None
    try:
        rows = _read_json(b"".join(blocks), arrow_schema(table))
    except pa.ArrowException:
        return None
    if rows.num_rows != sum(counts):  # blank lines: let the exact per-file path count them
        return None
    expected = pa.array(np.repeat(np.array([rank for _, _, rank in files], dtype=np.int32), counts), pa.int32())
    ranks = pc.coalesce(rows.column("rank"), expected)
    if not pc.all(pc.equal(ranks, expected)).as_py():
        return None
    rows = rows.set_column(rows.schema.get_field_index("rank"), "rank", ranks)
    for (_, cursor, _), block, count in zip(files, blocks, counts):
        cursor.offset_bytes += len(block)
        cursor.lines += count
    return rows


def parse_lines(block: bytes, table: str, *, path: Path, first_line: int) -> pa.Table:
    """Parse newline-terminated JSON lines of ``table`` into an Arrow table with the table's full schema.

    Fast path: Arrow's JSON reader. If it refuses the block, the slow path parses line by line to name the
    first bad line (or builds the table itself when Arrow only refused an over-long line).
    """
    schema = arrow_schema(table)
    try:
        return _read_json(block, schema)
    except pa.ArrowException:
        return _parse_lines_slow(block, table, schema, path=path, first_line=first_line)


def _read_json(block: bytes, schema: pa.Schema) -> pa.Table:
    """Arrow's JSON reader over newline-terminated lines with the table's schema (ArrowException if it refuses)."""
    return pajson.read_json(
        io.BytesIO(block),
        read_options=pajson.ReadOptions(block_size=_BLOCK_BYTES, use_threads=len(block) > _BLOCK_BYTES),
        parse_options=pajson.ParseOptions(explicit_schema=schema, unexpected_field_behavior="ignore"),
    )


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
        for key, value in row.items():
            if value is not None and not _ACCEPTS[str(schema.field(key).type)](value):
                raise TraceError(f"'{path}' line {n} does not match the '{table}' table schema: column "
                                 f"'{key}' is {value!r}, expected {schema.field(key).type}. "
                                 f"{fix.format(n=n, path=path)}")
        rows.append(row)
    return pa.Table.from_pylist(rows, schema=schema)


def _is_int(v: object) -> bool:
    return (isinstance(v, int) and not isinstance(v, bool)) or (isinstance(v, float) and v.is_integer())


_ACCEPTS = {
    "int32": lambda v: _is_int(v) and -2**31 <= v < 2**31,
    "int64": lambda v: _is_int(v) and -2**63 <= v < 2**63,
    "double": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
    "bool": lambda v: isinstance(v, bool),
    "string": lambda v: isinstance(v, str),
}
"""Arrow type name -> does a parsed JSON value fit losslessly (integral floats count as ints)."""


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


def tail_cursor(path: Path, first_step: int) -> FileCursor:
    """The cursor just after the last complete line of ``path`` whose ``step`` is in ``[0, first_step)``, so that
    reading from it gives the newest steps; the start of the file if no such line exists. A rank's lines follow
    its steps, a row at most ``_TAIL_SLACK_STEPS`` behind the rows written before it, so the file is bisected by
    byte offset for the first line of step ``first_step + _TAIL_SLACK_STEPS`` or later and scanned backwards from
    there: it costs a few reads and the last steps before the tail, not the tail; the part skipped is not read
    (``FileCursor.head_bytes``: its lines are counted only when an error names a line)."""
    bound = first_step + _TAIL_SLACK_STEPS
    with open(path, "rb") as f:
        size = f.seek(0, io.SEEK_END)
        lo, hi = 0, size            # the first step-bearing line starting at or after ``hi`` has a step >= bound
        if _ahead(f, 0, bound):
            return FileCursor()
        while hi - lo > _PROBE_BYTES:
            mid = (lo + hi) // 2
            if _ahead(f, mid, bound):
                hi = mid
            else:
                lo = mid
        offset = _last_line_before(f, _line_end_at(f, hi, size), first_step)
        return FileCursor() if offset is None else FileCursor(offset_bytes=offset, head_bytes=offset)


def _ahead(f, offset: int, bound: int) -> bool:
    """True when the first complete line starting at or after byte ``offset`` that has a ``step`` of 0 or more has
    one of ``bound`` or more, or there is no such line."""
    pos = offset - 1 if offset > 0 else 0
    f.seek(pos)
    data, skip = b"", offset > 0    # from ``offset - 1``: a line that starts at ``offset`` is not skipped
    while True:
        block = f.read(_PROBE_BYTES)
        if not block:
            return True             # no step-bearing line after the offset (a torn last line is not a line)
        data += block
        if skip:
            cut = data.find(b"\n")
            if cut < 0:
                continue
            data, skip = data[cut + 1:], False
        end = data.rfind(b"\n") + 1
        for match in _STEP_KEY.finditer(data, 0, end):
            if int(match.group(1)) >= 0:
                return int(match.group(1)) >= bound
        data = data[end:]


def _line_end_at(f, offset: int, size: int) -> int:
    """The first line boundary at or after byte ``offset`` (``size`` if none)."""
    if offset == 0:
        return 0
    f.seek(offset - 1)
    pos = offset - 1
    while pos < size:
        block = f.read(_PROBE_BYTES)
        cut = block.find(b"\n")
        if cut >= 0:
            return pos + cut + 1
        pos += len(block)
    return size


def _last_line_before(f, end: int, first_step: int) -> int | None:
    """The offset just after the last complete line before byte ``end`` (a line boundary, or the file's size when
    its last line may be torn) whose ``step`` is in ``[0, first_step)``; None if none. Scans backwards."""
    pos, carry, newest = end, b"", True
    while pos > 0:
        n = min(_SCAN_BYTES, pos)
        pos -= n
        f.seek(pos)
        chunk = f.read(n) + carry
        cut = chunk.find(b"\n") + 1 if pos > 0 else 0  # bytes before it continue a line that starts earlier
        carry, body, start = chunk[:cut], chunk[cut:], pos + cut
        if newest:  # a torn last line is not a line yet
            body = body[: body.rfind(b"\n") + 1]
            newest = False
        line_end = len(body)
        while line_end > 0:
            begin = body.rfind(b"\n", 0, line_end - 1) + 1
            match = _STEP_KEY.search(body, begin, line_end)
            if match is not None and 0 <= int(match.group(1)) < first_step:
                return start + line_end
            line_end = begin
    return None


def last_step_in_file(path: Path) -> int | None:
    """``step`` of the newest complete line of ``path`` that has one (None if none in its last megabyte)."""
    with open(path, "rb") as f:
        size = f.seek(0, io.SEEK_END)
        f.seek(max(0, size - _SCAN_BYTES))
        data = f.read()
    data = data[: data.rfind(b"\n") + 1]
    matches = _STEP_KEY.findall(data)
    return int(matches[-1]) if matches else None


def _count_lines(f, offset: int) -> int:
    f.seek(0)
    lines, left = 0, offset
    while left > 0:
        block = f.read(min(16 << 20, left))
        if not block:
            break
        lines += block.count(b"\n")
        left -= len(block)
    return lines
