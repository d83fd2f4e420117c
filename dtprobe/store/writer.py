"""Per-rank append-only JSONL writers for the run store; written by collectors, read by ``store.reader``."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Any

import msgspec
import orjson

from dtprobe.store.schema import EVENTS_FILE, FLUSH_FIRST, SCHEMAS

_COLUMN_SETS = {table: frozenset(columns) for table, columns in SCHEMAS.items()}
"""Each table's column names, built once: ``write`` checks every row against them."""
_ROW_TYPES: dict[tuple[str, tuple[str, ...]], type] = {}
"""``write_values``: per (table, columns), checked once, the struct its tuples are encoded through."""
_ENCODER = msgspec.json.Encoder()


def _row_struct(columns: tuple[str, ...]) -> type:
    """A struct of ``rank`` and ``columns`` that encodes as the JSON object ``write`` writes for the same dict: keys in
    this order, values as given; a value not given (a short tuple) is left out, i.e. null to the reader."""
    fields = [("rank", Any)] + [(c, Any, msgspec.UNSET) for c in columns]
    return msgspec.defstruct("Row_" + "_".join(columns), fields, omit_defaults=True)


class RankWriter:
    """Appends rows to ``<run>/events/<table>/rankNNNNN.jsonl``, one file per table, for one rank.

    Rows are buffered and reach the OS (``write(2)``; no fsync: the page cache survives a killed process) at
    ``flush``/``close`` and every ``flush_interval_s``: with ``autoflush`` from a background thread, so a rank
    blocked in a collective or a long step still gets its rows out and a killed rank loses at most the rows of
    its last ``flush_interval_s`` (a thread that flushes anyway, the collective recorder's, may take that over:
    ``hand_over_flushing``); without it, from the caller's thread on the next ``write``. Each flush writes
    whole lines with one ``write`` call per table, so a rank killed mid-write leaves at most one torn last line,
    which the reader skips; ``schema.FLUSH_FIRST`` tables (``groups``) go first, so a row that names a group never
    reaches the OS before the group's row. Thread-safe.
    """

    def __init__(self, run_dir: str | os.PathLike, rank: int, *, flush_interval_s: float = 1.0,
                 autoflush: bool = False) -> None:
        self.run_dir = Path(run_dir)
        self.rank = rank
        self._rank_prefix = orjson.dumps({"rank": rank})[:-1] + b","
        self._rank_only = orjson.dumps({"rank": rank}) + b"\n"
        self.flush_interval_s = flush_interval_s
        self._buffers: dict[str, list[bytes]] = {table: [] for table in FLUSH_FIRST}   # flushed in this order
        self._files: dict[str, Any] = {}
        self._lock = threading.Lock()
        self._last_flush = time.monotonic()
        self._closed = False
        self._autoflush = autoflush
        self._stop_flusher = threading.Event()
        self._flusher: threading.Thread | None = None
        self._handed_over = False
        if autoflush:
            self._start_flusher()

    def write(self, table: str, row: dict[str, Any]) -> None:
        """Queue one row of ``table``; ``rank`` is filled in. Unknown tables or columns are programmer errors."""
        columns = _COLUMN_SETS.get(table)
        assert columns is not None, f"unknown table {table!r}"
        assert row.keys() <= columns, f"unknown columns for {table}: {sorted(set(row) - columns)}"
        # The bytes of dumping {"rank": rank, **row}, without building that dict for every row.
        if not row:
            line = self._rank_only
        elif "rank" in row:
            line = orjson.dumps({"rank": self.rank, **row}) + b"\n"
        else:
            line = self._rank_prefix + orjson.dumps(row)[1:] + b"\n"
        self._queue_lines(table, line)

    def write_values(self, table: str, columns: tuple[str, ...], rows: list[tuple]) -> None:
        """Queue rows of ``table`` given as tuples of values named by ``columns`` (a row may stop short: its last
        columns are then absent, i.e. null). Same lines as ``write`` of each row as a dict; the columns are checked
        once for the batch."""
        row_type = _ROW_TYPES.get((table, columns))
        if row_type is None:
            known = _COLUMN_SETS.get(table)
            assert known is not None, f"unknown table {table!r}"
            assert "rank" not in columns and set(columns) <= known, \
                f"unknown columns for {table}: {sorted(set(columns) - known)}"
            row_type = _ROW_TYPES[(table, columns)] = _row_struct(columns)
        rank = self.rank
        self._queue_lines(table, _ENCODER.encode_lines([row_type(rank, *values) for values in rows]))

    def _queue_lines(self, table: str, lines: bytes) -> None:
        """Buffer whole lines of ``table`` (dropped once closed); without the background flusher, flush when due."""
        with self._lock:
            if self._closed:
                return
            self._buffers.setdefault(table, []).append(lines)
            if not self._autoflush and time.monotonic() - self._last_flush >= self.flush_interval_s:
                self._flush_locked()

    def flush(self) -> None:
        """Write every buffered row to the OS now (no fsync: the page cache survives a killed process)."""
        with self._lock:
            if not self._closed:
                self._flush_locked()

    def hand_over_flushing(self, interval_s: float) -> bool:
        """Stop the background flusher because the caller's own thread calls ``flush`` every ``interval_s`` from
        now on (the collective recorder's drain tick, which flushes anyway): one thread waking per interval, not
        two. True when handed over; False (nothing changes) without ``autoflush``, once closed, or when
        ``interval_s`` is longer than ``flush_interval_s`` (the loss bound would grow). Undone by
        ``take_back_flushing``."""
        with self._lock:
            if not self._autoflush or self._closed or self._handed_over or interval_s > self.flush_interval_s:
                return False
            self._handed_over = True
        self._stop_background_flusher()
        return True

    def take_back_flushing(self) -> None:
        """The caller stops flushing (``hand_over_flushing``): the background flusher runs again, unless closed."""
        with self._lock:
            if not self._handed_over:
                return
            self._handed_over = False
            if self._closed:
                return
        self._start_flusher()

    def close(self) -> None:
        """Stop the background flusher, flush and close all files; later writes are dropped. Idempotent."""
        self._stop_background_flusher()
        with self._lock:
            if self._closed:
                return
            self._flush_locked()
            for f in self._files.values():
                f.close()
            self._files.clear()
            self._closed = True

    def _start_flusher(self) -> None:
        self._stop_flusher = threading.Event()
        self._flusher = threading.Thread(target=self._flush_loop, args=(self._stop_flusher,),
                                         name=f"dtprobe-writer-{self.rank}", daemon=True)
        self._flusher.start()

    def _stop_background_flusher(self) -> None:
        self._stop_flusher.set()
        flusher, self._flusher = self._flusher, None
        if flusher is not None and flusher is not threading.current_thread():
            flusher.join(timeout=10)

    def _flush_loop(self, stop: threading.Event) -> None:
        while not stop.wait(self.flush_interval_s) and not self._closed:
            self.flush()

    def _flush_locked(self) -> None:
        self._last_flush = time.monotonic()
        for table, lines in self._buffers.items():
            if not lines:
                continue
            f = self._files.get(table)
            if f is None:
                path = self.run_dir / EVENTS_FILE.format(table=table, rank=self.rank)
                path.parent.mkdir(parents=True, exist_ok=True)
                f = self._files[table] = _open_for_append(path)
            f.write(b"".join(lines))
            lines.clear()


def _open_for_append(path: Path) -> Any:
    """Open ``path`` for appending whole lines, first cutting a torn last line left by a killed predecessor.

    A rank restarted by torchrun appends to the file its previous incarnation was killed writing; without the
    cut, the torn fragment and the next line would fuse into one corrupt line in the middle of the file.
    """
    f = open(path, "ab", buffering=0)
    size = f.seek(0, os.SEEK_END)
    if size:
        with open(path, "rb") as r:
            end = size
            while end > 0:
                start = max(0, end - 65536)
                r.seek(start)
                chunk = r.read(end - start)
                nl = chunk.rfind(b"\n")
                if nl >= 0:
                    end = start + nl + 1
                    break
                end = start
        if end != size:
            f.truncate(end)
    return f


class NullWriter:
    """A writer that drops everything: used when telemetry is off, so callers never branch on ``enabled``."""

    rank = -1

    def write(self, table: str, row: dict[str, Any]) -> None:
        pass

    def flush(self) -> None:
        pass

    def close(self) -> None:
        pass
