"""``RunStore``: the incremental, clock-aligned reader of a run directory (a ``source.Source``); used by analysis,
dashboard and CLI.

Reading order for each table: the compacted Parquet files if the run was compacted (``tables/_compacted.json``
lists them, with each partition's step and rank ranges, and records how many bytes of every events file went into
them), then every events line appended after that (``events/<table>/rankNNNNN.jsonl``, tailed by byte offset).
``refresh()`` parses only lines appended since the last call; a torn last line is left for later.
``table(name, steps=..., ranks=...)`` reads only the partition files (and row groups) that can hold those rows.

Clock alignment: rows are kept on their rank's clock; ``table()`` adds the rank's offset to the table's
``schema.TIME_COLUMNS``: interpolated between the rank's ``clock`` samples when it has some (re-measured while
the job ran, ``clock_sync.ClockModel``), else its ``clock_offset_ns`` (from ``ranks/rankNNNNN.json``, re-read on
every refresh). Compacted Parquet holds aligned values and records the offsets and samples it used, so the reader
only shifts them if an offset changed or samples arrived since. A rank with events but no rank info is an error,
never a silent offset of 0.
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Iterator, Sequence

import numpy as np
import orjson
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc

from dtprobe.store.clock_sync import Basis, ClockModel, align_rows
from dtprobe.store.errors import TraceError
from dtprobe.store.file_scan import read_files_at_once
from dtprobe.store.derived import Deriver, marker_entry, read_derived
from dtprobe.store.frames import SORT_KEYS, arrow_to_frame, empty_frame, memory_schema, time_columns
from dtprobe.store.groups import GROUPS_SINCE_VERSION, fill_members, missing_groups_error
from dtprobe.store.jsonl import FileCursor, last_step_in_file, read_new_rows, read_new_rows_batched, tail_cursor
from dtprobe.store.live_derived import LiveDerived
from dtprobe.store.manifest import Manifest, check_schema_version, read_manifest
from dtprobe.store.partitions import NO_STEP_BLOCK, PartFile, block_of, filter_rows, row_filter
from dtprobe.store.schema import COMPACT_FILE, EVENTS_FILE, GROUPED_TABLES, SCHEMAS, STEP_BLOCK_STEPS, STEP_TABLES
from dtprobe.store.source import SourceInfo, run_info

EVENTS_DIR = Path(EVENTS_FILE).parts[0]
TABLES_DIR = Path(COMPACT_FILE).parts[0]
COMPACTED_MARKER = f"{TABLES_DIR}/_compacted.json"
"""Written last by compaction: schema version, offsets used, rows per table, bytes of each events file read."""
COMPACTED_FORMAT = "dtprobe-compacted"
_MERGE_CHUNKS = 16
_PARALLEL_FILES = 8
"""Parse events files on a thread pool when at least this many grew since the last read."""
_PARSE_THREADS = min(8, os.cpu_count() or 1)
_BATCH_BYTES = 4 << 20
"""New bytes over all files of a table up to which a refresh parses them in one call (live tailing)."""
_BATCH_MANY = 16
"""... and up to this many times that when each file grew by ``_BATCH_FILE_BYTES`` or less on average: a live step
of 1,024 ranks is about 20 MB of collectives in 20 KB increments, parsed in one threaded Arrow call instead of 1,024
small ones. Larger increments (a first read) are parsed file by file on the thread pool, which is faster there."""
_BATCH_FILE_BYTES = 64 << 10
"""Mean new bytes per grown file up to which ``_BATCH_MANY`` applies."""


@dataclass
class _Chunk:
    rows: pa.Table
    """Rows with every schema column."""
    basis: Basis | None
    """Clock offsets already added to the time columns (None: raw rank-clock values)."""
    in_order: bool = False
    """Rows already in the table's sort order (compacted files read in order)."""
    span: tuple[int, int] | None = None
    """Lowest and highest step block of the rows when known (``_block_span``)."""
    steps: tuple[int, int] | None = None
    """Lowest and highest ``step`` of the rows when known (rows with a step in one block: ``_append``)."""
    ranks: np.ndarray | None = field(default=None, repr=False, compare=False)
    """The rows' distinct ranks, sorted, once ``_align`` needed them (rows never change: a live window's held
    chunks are aligned again at every read, and finding a long chunk's ranks costs more than the rest)."""


@dataclass
class _TableState:
    chunks: list[_Chunk] = field(default_factory=list)
    cursors: dict[str, FileCursor] = field(default_factory=dict)
    num_rows: int = 0
    frame: pd.DataFrame | None = None
    frame_offsets: tuple | None = None
    """``ClockModel.key`` of the model ``frame`` was aligned with."""
    heads: dict[str, FileCursor] = field(default_factory=dict)
    """Events files opened at their tail (``open(tail_steps=...)``): the part before the cursor, not read yet."""
    unread: list[PartFile] = field(default_factory=list)
    """Compacted files not read yet: a pushed-down ``table(name, steps=..., ranks=...)`` reads from them directly;
    any other use of the table reads them all first."""
    head_files: list[PartFile] = field(default_factory=list)
    """Compacted files of steps before the tail (``open(tail_steps=...)``), read by ``load_head()``."""
    ordered: bool = True
    """The compacted files' rows merge back into sort order by rank (the marker's ``ordered``)."""
    step_blocks: dict[int, int] = field(default_factory=dict)
    """Distinct steps per step block of the compacted files (the marker's ``step_blocks``)."""
    held_files: list[PartFile] = field(default_factory=list)
    """The compacted files whose rows the chunks hold (read by ``_load``)."""
    step_counts: dict[int, int] | None = None
    """Rows per step of the chunks (``RunStore._step_counts``), kept up to date by ``_append``; None: not counted."""


class RunStore:
    """A run directory opened for reading. Build with ``RunStore.open(path)``. Safe to share between threads."""

    def __init__(self, path: Path, manifest: Manifest) -> None:
        self._path = path
        self._manifest = manifest
        self._states: dict[str, _TableState] = {}
        self._compacted = _read_compacted_marker(path)
        self._lock = threading.RLock()
        self._tail_from_step: int | None = None
        self._clock: tuple[tuple, int, ClockModel] | None = None   # (rank offsets, clock rows, model)
        self._live_derived = LiveDerived()
        self._whole: bool | None = None   # compaction_is_whole() since the last open/refresh

    @classmethod
    def open(cls, path: str | os.PathLike, *, tables: Iterable[str] | None = None,
             tail_steps: int | None = None) -> "RunStore":
        """Open a run; reads every table now (or only ``tables``; others load on first ``table()`` call).

        ``tail_steps``: read only the end of the per-step tables (``STEP_TABLES``): in each rank's events file,
        the lines after the last line of a step older than the newest ``tail_steps`` steps (rows outside steps,
        ``step`` null or -1, are skipped there); of a run compacted in partitions (version 3), only the partition
        files holding those steps. Opening a run for a recent-steps view then costs the window, not the run's
        length; ``load_head()`` reads the rest later.
        Raises TraceError for a directory that is not a dtprobe run, a newer schema, or damaged files.
        """
        path = Path(path)
        store = cls(path, read_manifest(path))
        if tail_steps is not None:
            if tail_steps < 1:
                raise ValueError(f"tail_steps must be at least 1, got {tail_steps}")
            if store._compacted is None:
                last = _last_step_on_disk(path)
            else:  # a version-3 compaction's marker knows its steps; one file per table is read whole
                compacted = store._compacted_last_step()
                last = None if compacted is None else max(compacted, _last_step_on_disk(path) or compacted)
            if last is not None and last >= tail_steps:
                store._tail_from_step = last - tail_steps + 1
        for name in SCHEMAS if tables is None else tables:
            store._load(_check_table_name(name))
        return store

    def list_tables(self) -> None:
        """Give every table its state without reading compacted files: their files are listed (read on the first
        ``table()`` call that needs them), events lines not in the compaction are read. ``num_rows()`` and
        ``refresh()`` then cover every table, as after a full ``open``; a lazy ``open(tables=())`` plus this is
        what ``resolve.open_source`` uses, so an analysis reads only the compacted tables it asks for."""
        with self._lock:
            for name in SCHEMAS:
                self._state(name)

    @property
    def is_partial(self) -> bool:
        """True while some per-step rows before the tail read by ``open(tail_steps=...)`` are not loaded."""
        with self._lock:
            return any(state.heads or state.head_files for state in self._states.values()) \
                or self._tail_from_step is not None and any(name not in self._states for name in STEP_TABLES)

    @property
    def tail_from_step(self) -> int | None:
        """The oldest step whose rows a partial store is sure to hold (None when it holds everything)."""
        return self._tail_from_step if self.is_partial else None

    def load_head(self) -> int:
        """Read the parts of the events files that ``open(tail_steps=...)`` skipped; afterwards the store holds
        every row. Returns the number of rows added."""
        with self._lock:
            added = 0
            for name, state in self._states.items():
                chunks, heads = [], list(state.heads.items())
                for rel, head in heads:
                    rows = read_new_rows(self._path / rel, FileCursor(), name, int(Path(rel).name[4:-6]),
                                         end=head.offset_bytes)
                    if rows is not None:
                        chunks.append(rows)
                added += self._append(state, self._with_members(name, chunks))
                for rel, _ in heads:  # only once their rows are in: a read that raised leaves them to read again
                    del state.heads[rel]
                if state.head_files:
                    added += self._read_files(name, state, state.head_files)
                    state.head_files = []
            self._tail_from_step = None
            return added

    @property
    def path(self) -> Path:
        """The run directory."""
        return self._path

    @property
    def manifest(self) -> Manifest:
        """The manifest as of the last ``open``/``refresh``."""
        return self._manifest

    @property
    def info(self) -> SourceInfo:
        """The run's facts for analysis (the ``Source`` protocol) as of the last ``open``/``refresh``."""
        return run_info(self._manifest)

    @property
    def is_compacted(self) -> bool:
        """True if ``tables/_compacted.json`` existed when the store was opened."""
        return self._compacted is not None

    def table(self, name: str, *, min_step: int | None = None, steps: tuple[int | None, int | None] | None = None,
              ranks: Iterable[int] | None = None) -> pd.DataFrame:
        """All rows of table ``name`` so far: every schema column, schema dtypes, clock-aligned, sorted.

        ``steps=(first, last)``: only rows with ``first <= step <= last`` (inclusive; None leaves that end open;
        rows outside steps, ``step`` null, are left out); ``min_step=m`` is ``steps=(m, None)``. ``ranks``: only
        those ranks' rows. Tables without a ``step`` column ignore ``steps``. The filters are pushed down: of a
        compacted run only the partition files (and row groups) that can hold such rows are read, and not kept
        (a table already read whole is filtered in memory); the events lines appended after compaction are
        filtered the same way. A window of a long run costs the window, not the run.
        A table the run never wrote is an empty frame with the schema columns.
        """
        _check_table_name(name)
        if min_step is not None:
            if steps is not None:
                raise ValueError("give either min_step or steps, not both")
            steps = (min_step, None)
        if steps is not None and "step" not in SCHEMAS[name]:
            steps = None
        with self._lock:
            if steps is not None or ranks is not None:
                rows = self._selected(name, steps, None if ranks is None else frozenset(int(r) for r in ranks))
                return arrow_to_frame(rows, name) if rows.num_rows else empty_frame(name)
            state = self._state(name)
            model = self.clock_model()
            if state.frame is None or state.frame_offsets != model.key:   # rows changed since (frame reset)
                state = self._load(name)
                state.frame = self._build_frame(name, state, model)
                state.frame_offsets = model.key
                self._release_compacted(name, state)
            return state.frame.copy(deep=False)

    def arrow(self, name: str, *, columns: Iterable[str] | None = None, filter: pc.Expression | None = None,
              steps: tuple[int | None, int | None] | None = None, ranks: Iterable[int] | None = None,
              ordered: bool = True) -> pa.Table:
        """The rows of table ``name`` that pass ``filter`` (an Arrow expression over any of its columns, on
        clock-aligned values), with only ``columns`` (every schema column when None), as one Arrow table in the
        table's sort order (``ordered=False``: in no given order, not sorted: for a caller that aggregates them);
        ``steps`` and ``ranks`` as in ``table()``. Of the compacted files not held only those
        columns are read, with the filter pushed down (row groups whose statistics rule it out are skipped, e.g.
        ``pc.field("end_ns").is_null()`` of a run whose collectives all finished reads no rows), and nothing is
        kept: a question about a few rows of a long run costs those rows, not the run."""
        _check_table_name(name)
        if steps is not None and "step" not in SCHEMAS[name]:
            steps = None
        wanted = list(SCHEMAS[name]) if columns is None else list(columns)
        unknown = [c for c in wanted if c not in SCHEMAS[name]]
        if unknown:
            raise TraceError(f"table {name!r} has no columns {unknown}; its columns are {list(SCHEMAS[name])}.")
        keys = SORT_KEYS.get(name, ("rank",))
        rank_set = None if ranks is None else frozenset(int(r) for r in ranks)
        with self._lock:
            state = self._state(name)
            model = self.clock_model()
            basis = self._compacted_basis() if self._compacted is not None else None
            held = [c for c in state.chunks if c.rows.num_rows]
            files = [f for f in state.unread + state.head_files if f.may_hold(steps, rank_set)]
            aligned = basis is not None and basis.matches(model)
            # rows already in sort order: compacted files only, read back in their order (``rank`` merges them),
            # or one chunk held that was read so; else the sort keys are read too
            in_order = (not held and aligned and (state.ordered or len(files) <= 1)) or (
                not files and len(held) == 1 and held[0].in_order and held[0].basis is not None
                and held[0].basis.matches(model))
            in_order = in_order or not ordered
            need = [c for c in SCHEMAS[name] if c in wanted or c == "rank" or (c in keys and not in_order)]
            rows_expr = row_filter(steps, rank_set)
            # (chunk, filter still to apply): the filter may name any column, so it is applied to the aligned
            # rows before only ``need`` is kept, unless it was pushed down to the files
            chunks = [(_in_steps(c, rows_expr, steps, rank_set), filter) for c in held]
            if files:   # stored values are the aligned ones unless offsets changed since: only then filter later
                later = filter is not None and not aligned
                pushed = rows_expr if later or filter is None else (
                    filter if rows_expr is None else rows_expr & filter)
                chunks.insert(0, (_Chunk(read_files_at_once(self._path / TABLES_DIR, files, name, pushed,
                                                            ordered=state.ordered, columns=None if later else need),
                                         basis),
                                  filter if later else None))
            parts = [filter_rows(_align(c, name, model, self._path), expr).select(need)
                     for c, expr in chunks if c.rows.num_rows]
            parts = [p for p in parts if p.num_rows]
            if not parts:
                return memory_schema(name).empty_table().select(wanted)
            rows = pa.concat_tables(parts)
            return (rows if in_order else _sort(rows, keys)).select(wanted)

    def derived_table(self, name: str, key: dict, *, steps: tuple[int | None, int | None] | None = None,
                      deriver: Callable[[], Deriver] | None = None,
                      order: Sequence[str] | None = None) -> pd.DataFrame | None:
        """The derived per-step table ``name`` written at compaction (``store.derived``), when the marker records
        it under the same ``key`` and the compacted tables are still all of the run (no events line appended
        since, the same clock offsets, the whole run opened); else None: compute it from the rows. Sorted by the
        columns ``order`` when given (``derived.blocks_frame``: in Arrow, cheaper than in pandas).
        Of a run not compacted, with ``deriver`` (makes a fresh ``Deriver`` of ``key``): the frames ``deriver``
        computes from the events rows per step block, kept, and recomputed only for the blocks whose rows
        changed since (``live_derived``); None when the store is partial (``open(tail_steps=...)``) or the
        deriver finds its blocks' frames would differ from the whole run's."""
        with self._lock:
            if self._compacted is None:
                if deriver is None or self._tail_from_step is not None:
                    return None
                return self._live_derived.table(name, key, deriver, clock=self.clock_model().key,
                                                counts=self._step_counts, rows=self._block_rows, steps=steps,
                                                order=order)
            derived = marker_entry(self._compacted)
            if (derived.get("key") != key or name not in derived.get("tables", {}) or self._tail_from_step is not None
                    or not self.compaction_is_whole()):
                return None
            return read_derived(self._path / TABLES_DIR, derived, name, steps, order)

    def derived_key(self) -> dict | None:
        """The key the compaction's derived tables were written under (``derived_table`` reads them only under the
        same key); None when the run is not compacted or its compaction wrote none."""
        with self._lock:
            return marker_entry(self._compacted).get("key")

    @contextmanager
    def step_rows(self) -> Iterator["StepRows"]:
        """The rows the store holds, by step and by step block, with the store's lock held until the block ends: no
        ``refresh()`` or ``load_head()`` runs in between, so counts and rows read inside are of one moment (what an
        incremental derivation needs: it derives the steps whose counts changed from those steps' rows)."""
        with self._lock:
            rows = StepRows(self)
            try:
                yield rows
            finally:
                rows._active = False

    def compaction_is_whole(self) -> bool:
        """True while the run is compacted, no events file differs from what the compaction consumed and the clock
        offsets are those it used (then every table equals its compacted files). Checked (every events file's
        size) once per ``open`` and ``refresh``: the store's view of the run changes only then."""
        with self._lock:
            if self._whole is None:
                self._whole = self._compaction_is_whole()
            return self._whole

    def _compaction_is_whole(self) -> bool:
        if self._compacted is None:
            return False
        consumed = self._compacted["events"]
        offsets = {str(r): o for r, o in self._manifest.clock_offsets_ns.items()}
        if offsets != self._compacted["clock_offsets_ns"]:
            return False
        for name in SCHEMAS:
            for path in _events_files(self._path, name).values():
                rel = _events_rel(name, path)
                if path.stat().st_size != (consumed.get(rel) or [0])[0]:
                    return False
        return True

    def last_step(self, name: str = "steps") -> int | None:
        """Highest ``step`` recorded so far in table ``name`` (None when it has no rows with a step)."""
        with self._lock:
            state = self._counted(_check_table_name(name))
            highs = [pc.max(c.rows.column("step")).as_py() for c in state.chunks if c.rows.num_rows]
            highs += [f.max_step for f in state.unread + state.head_files]
            highs = [h for h in highs if h is not None]
            return max(highs) if highs else None

    def num_steps(self, name: str = "steps") -> int:
        """Distinct ``step`` values recorded so far in table ``name``. In a partial store (``is_partial``) the
        steps before the tail are counted as the lines of the longest skipped head (one line per step per rank;
        a step re-run after a restart counts twice there)."""
        with self._lock:
            state = self._counted(_check_table_name(name))
            cols = [c.rows.column("step") for c in state.chunks if c.rows.num_rows]
            head = max((h.line_count(self._path / rel) for rel, h in state.heads.items()), default=0)
            # compacted files not held: their step blocks' counts from the marker, and the held rows' steps
            # outside those blocks (a block is never partly held: its files are read together)
            blocks = {f.step_block for f in state.unread + state.head_files} - {None, NO_STEP_BLOCK}
            head += sum(state.step_blocks.get(b, 0) for b in blocks)
            if not cols:
                return head
            held = pc.unique(pa.chunked_array([a for c in cols for a in c.chunks], type=pa.int64()))
            held = held.drop_null().to_numpy()
            return head + int(np.count_nonzero(~np.isin(block_of(held), list(blocks))))

    def tables(self) -> list[str]:
        """Names of the tables that have at least one row (or, for tables not loaded yet, a data file)."""
        with self._lock:
            present = []
            for name in SCHEMAS:
                state = self._states.get(name)
                if state is not None:
                    if state.num_rows or state.unread or state.head_files:
                        present.append(name)
                elif name in self._compacted_tables() or any(
                        p.stat().st_size for p in _events_files(self._path, name).values()):
                    present.append(name)
            return present

    def num_rows(self) -> dict[str, int]:
        """Rows so far of every loaded table (cheap: no frame is built; compacted files not read yet count their
        rows from the marker); changes exactly when a table does."""
        with self._lock:
            return {name: state.num_rows + sum(f.rows for f in state.unread + state.head_files)
                    for name, state in self._states.items()}

    def refresh(self) -> dict[str, int]:
        """Re-read the manifest and rank infos and parse lines appended since the last read.

        Returns ``{table: number of new rows}`` for the loaded tables that got new rows.
        """
        with self._lock:
            self._manifest = read_manifest(self._path)
            self._whole = None
            new = {}
            for name, state in self._states.items():
                n = self._tail(name, state)
                if n:
                    new[name] = n
            return new

    def aligned_arrow(self, name: str) -> pa.Table:
        """All rows of ``name`` as one clock-aligned, sorted Arrow table (what compaction writes)."""
        with self._lock:
            state = self._load(_check_table_name(name))
            return self._aligned(name, state, self.clock_model())

    def clock_model(self) -> ClockModel:
        """Every rank's clock offset as of the last read: rank info constants and ``clock`` samples."""
        with self._lock:
            clock = self._load("clock")
            constants = self._manifest.clock_offsets_ns
            key = tuple(sorted(constants.items()))
            if self._clock is None or self._clock[:2] != (key, clock.num_rows):
                self._clock = (key, clock.num_rows, ClockModel.build(constants, _rows_of(clock, "clock")))
            return self._clock[2]

    def cursors(self) -> dict[str, tuple[int, int]]:
        """Events file (relative path) -> (bytes, lines) consumed so far, for every loaded table."""
        with self._lock:
            return {rel: (c.offset_bytes, c.line_count(self._path / rel)) for s in self._states.values()
                    for rel, c in s.cursors.items()}

    # ------------------------------------------------------------------------------------------------ internals

    def _load(self, name: str) -> _TableState:
        """The table's state holding every row (but the head a tail-opened store skipped)."""
        state = self._state(name)
        if state.unread:
            self._read_files(name, state, state.unread)
            state.held_files, state.unread = state.held_files + state.unread, []
        return state

    def _release_compacted(self, name: str, state: _TableState) -> None:
        """Once a frame holds them, drop the Arrow copy of a finished run's compacted rows of a per-step table (as
        large as the frame: GBs at 1,024 ranks): its files go back to ``unread``, counted from the marker and read
        again only if something needs the Arrow rows (``aligned_arrow``) or new rows arrive. A running run's are
        kept: its refreshes rebuild the frame from them."""
        if (name not in STEP_TABLES or self._manifest.status == "running" or len(state.chunks) != 1
                or state.chunks[0].basis is None or not state.held_files
                or any(f.step_block is None for f in state.held_files)):
            return
        state.num_rows -= state.chunks[0].rows.num_rows
        state.chunks, state.unread, state.held_files = [], state.held_files, []
        state.step_counts = None

    def _counted(self, name: str) -> _TableState:
        """The table's state for counting steps: compacted files not held are counted from the marker, unless
        some file has no step ranges (one file per table): then it is read."""
        state = self._state(name)
        if any(f.step_block is None for f in state.unread):
            return self._load(name)
        return state

    def _state(self, name: str) -> _TableState:
        """The table's state; a compacted table's files are listed (``unread``), not read yet."""
        state = self._states.get(name)
        if state is None:
            if name in GROUPED_TABLES:
                self._load("groups")   # first, so that every refresh reads it before the rows naming its groups
            state = _TableState()
            if self._compacted is not None:
                self._list_compacted(name, state)
            self._tail(name, state)
            self._states[name] = state
        return state

    def _compacted_tables(self) -> dict:
        return (self._compacted or {}).get("tables", {})

    def _compacted_last_step(self) -> int | None:
        """Newest step of the compacted ``steps`` table from the marker's file ranges (None without them)."""
        entry = self._compacted_tables().get("steps")
        if entry is None or "files" not in entry:
            return None
        highs = [f["max_step"] for f in entry["files"] if f.get("max_step") is not None]
        return max(highs) if highs else None

    def _list_compacted(self, name: str, state: _TableState) -> None:
        marker = self._compacted
        folder = f"{EVENTS_DIR}/{name}/"     # the marker's paths are POSIX, relative to the run
        for rel, (offset, lines) in marker["events"].items():
            if rel.startswith(folder):
                state.cursors[rel] = FileCursor(offset_bytes=int(offset), lines=int(lines))
        entry = marker["tables"].get(name)
        if entry is None:
            return
        if "files" in entry:
            files = [PartFile.from_json(f) for f in entry["files"]]
            state.ordered = bool(entry.get("ordered", False))
            state.step_blocks = {int(b): int(n) for b, n in entry.get("step_blocks", {}).items()}
            if self._tail_from_step is not None and name in STEP_TABLES:
                tail = (self._tail_from_step, None)
                state.head_files = [f for f in files if not f.may_hold(tail, None)]
                files = [f for f in files if f.may_hold(tail, None)]
        else:  # one file per table: versions 1 and 2, and the tables outside STEP_TABLES
            files = [PartFile(path=Path(COMPACT_FILE.format(table=name)).name, rows=int(entry.get("rows", 0)))]
        state.unread = files

    def _read_files(self, name: str, state: _TableState, files: list[PartFile]) -> int:
        """Read compacted ``files`` whole into the state's chunks, before the events rows (which came after them);
        returns the rows added."""
        rows = self._read_compacted(name, state, files, None)
        state.chunks.insert(0, _Chunk(rows, self._compacted_basis(), in_order=state.ordered or len(files) == 1))
        state.num_rows += rows.num_rows
        state.frame = None
        state.step_counts = None
        return rows.num_rows

    def _read_compacted(self, name: str, state: _TableState, files: list[PartFile],
                        expr: pc.Expression | None) -> pa.Table:
        rows = read_files_at_once(self._path / TABLES_DIR, files, name, expr, ordered=state.ordered)
        basis = self._compacted_basis()
        missing = sorted(set(pc.unique(rows.column("rank")).to_pylist()) - set(basis.constants)
                         - set(basis.samples) - {None})
        if missing:
            raise TraceError(f"'{self._path / TABLES_DIR}' has '{name}' rows of ranks {missing}, but "
                             f"{COMPACTED_MARKER} records no clock offset for them. Delete "
                             f"{self._path / TABLES_DIR} and run `dtprobe compact {self._path}` again.")
        return rows

    def _compacted_basis(self) -> Basis:
        return Basis.from_marker(self._compacted["clock_offsets_ns"], self._compacted.get("clock_samples"))

    def _selected(self, name: str, steps: tuple[int | None, int | None] | None,
                  ranks: frozenset[int] | None) -> pa.Table:
        """Clock-aligned, sorted rows of ``name`` in ``steps`` and ``ranks``: the rows held, filtered, and the rows
        of the compacted files not held that can match, read with the filter pushed down."""
        state = self._state(name)
        expr = row_filter(steps, ranks)
        chunks = [_in_steps(c, expr, steps, ranks) for c in state.chunks]
        files = [f for f in state.unread + state.head_files if f.may_hold(steps, ranks)]
        if files:  # compacted rows first, as in a state that holds them
            chunks.insert(0, _Chunk(self._read_compacted(name, state, files, expr), self._compacted_basis(),
                                    in_order=state.ordered or len(files) == 1))
        return self._aligned_chunks(name, chunks, self.clock_model())

    def _step_counts(self, name: str) -> dict[int, int]:
        """Rows per step (``NO_STEP_BLOCK``: outside steps, ``step`` null or negative) of a not compacted table
        (counted once, then only the rows each refresh adds)."""
        state = self._load(name)
        if state.step_counts is None:
            state.step_counts = _count_steps([c.rows for c in state.chunks])
        return state.step_counts

    def _block_rows(self, name: str, block: int, first_step: int | None = None) -> pd.DataFrame:
        """A not compacted table's rows of step block ``block`` (-1: outside steps) as ``table()`` gives them; from
        step ``first_step`` on when given (a refresh's new steps of the block)."""
        if block == NO_STEP_BLOCK:
            expr = pc.field("step").is_null() | (pc.field("step") < 0)
        else:
            low = block * STEP_BLOCK_STEPS if first_step is None else max(first_step, block * STEP_BLOCK_STEPS)
            expr = row_filter((low, (block + 1) * STEP_BLOCK_STEPS - 1), None)
        chunks = []
        for c in self._load(name).chunks:
            low, high = c.span if c.span is not None else _block_span(c.rows)
            if not low <= block <= high:
                continue
            if low == high == block and (first_step is None or block == NO_STEP_BLOCK):
                chunks.append(c)   # wholly in the block (a live run's first read, its newest lines): as is
                continue
            if low == high == block and c.steps is not None:
                if c.steps[1] < first_step:
                    continue       # the block's steps before first_step only: not read
                if c.steps[0] >= first_step:
                    chunks.append(c)
                    continue
            chunks.append(_Chunk(filter_rows(c.rows, expr), c.basis, c.in_order))
        rows = self._aligned_chunks(name, chunks, self.clock_model())
        return arrow_to_frame(rows, name) if rows.num_rows else empty_frame(name)

    def _tail(self, name: str, state: _TableState) -> int:
        known = self._manifest.clock_offsets_ns
        grown = []
        for rank, path in _events_files(self._path, name).items():
            rel = _events_rel(name, path)
            cursor = state.cursors.get(rel)
            if cursor is None:
                cursor = state.cursors[rel] = FileCursor()
                if self._tail_from_step is not None and name in STEP_TABLES:
                    head = tail_cursor(path, self._tail_from_step)
                    if head.offset_bytes:
                        cursor.offset_bytes, cursor.lines, cursor.head_bytes = (head.offset_bytes, head.lines,
                                                                               head.head_bytes)
                        state.heads[rel] = head
            size = path.stat().st_size
            if size == cursor.offset_bytes:
                continue  # nothing appended (a file shorter than its cursor is reported by read_new_rows)
            grown.append((rank, path, cursor, size))
        before = [(c, c.offset_bytes, c.lines) for _, _, c, _ in grown]
        new_bytes = sum(size - c.offset_bytes for _, _, c, size in grown)
        if 1 < len(grown) and (new_bytes <= _BATCH_BYTES or new_bytes <= min(_BATCH_MANY * _BATCH_BYTES,
                                                                             _BATCH_FILE_BYTES * len(grown))) \
                and all(rank in known for rank, *_ in grown):
            rows = read_new_rows_batched([(path, cursor, rank) for rank, path, cursor, _ in grown], name)
            if rows is not None:  # else read file by file below, which names any damage exactly
                return self._append(state, self._with_members(name, [rows], undo=before))
        results: list[pa.Table | None | TraceError] = [None] * len(grown)

        def read(i: int) -> None:
            rank, path, cursor, size = grown[i]
            try:
                if rank not in known and size > cursor.offset_bytes:
                    raise TraceError(
                        f"rank {rank} has events in '{path}' but no rank info file "
                        f"'{self._path / 'ranks' / f'rank{rank:05d}.json'}', so its clock offset is unknown and "
                        f"its times cannot be aligned with the other ranks. Each rank writes that file at attach "
                        f"(dtprobe.store.manifest.write_rank_info) before any event; restore it, or write it "
                        f"with clock_offset_ns=0 if all ranks ran on one host.")
                results[i] = read_new_rows(path, cursor, name, rank)
            except TraceError as exc:
                results[i] = exc

        if len(grown) >= _PARALLEL_FILES and _PARSE_THREADS > 1:
            # Arrow's JSON parser releases the GIL: parse many ranks' files side by side (first read of a long run)
            with ThreadPoolExecutor(_PARSE_THREADS, thread_name_prefix="dtprobe-parse") as pool:
                list(pool.map(read, range(len(grown))))
        else:
            for i in range(len(grown)):
                read(i)
        # keep the rows of every file whose cursor advanced, even if another file failed; then report the first error
        num_new = self._append(state, self._with_members(
            name, [r for r in results if isinstance(r, pa.Table)], undo=before))
        errors = [r for r in results if isinstance(r, TraceError)]
        if errors:
            raise errors[0]
        return num_new

    def _with_members(self, name: str, chunks: list[pa.Table], *,
                      undo: list[tuple[FileCursor, int, int]] = ()) -> list[pa.Table]:
        """New rows of ``name`` with their groups' members filled in (grouped tables; others as they are).

        A rank hands a group's row to the OS before any row naming it, but this reader may have read ``groups``
        just before that: an unknown group re-reads ``groups`` once. Rows whose group is still unknown, in a
        version-2 run or one that has ``groups`` rows (a version-1 run appended to by a newer dtprobe), are damage:
        TraceError, and the cursors go back to ``undo`` so the next read reports it again. In a version-1 run
        without groups such rows keep null members, as version 1 read them."""
        if name not in GROUPED_TABLES or not chunks:
            return chunks
        groups_state = self._load("groups")
        groups = _rows_of(groups_state, "groups")
        # one fill of all new rows: a refresh of 1,024 ranks' files filled file by file paid a fill's fixed cost
        # (the groups' keys and codes) 1,024 times
        rows = pa.concat_tables(chunks) if len(chunks) > 1 else chunks[0]
        rows_filled, missing = fill_members(rows, groups, name)
        if missing:
            self._tail("groups", groups_state)
            groups = _rows_of(groups_state, "groups")
            rows_filled, missing = fill_members(rows, groups, name)
        if missing and (self._manifest.schema_version >= GROUPS_SINCE_VERSION or groups.num_rows):
            for cursor, offset, lines in undo:
                cursor.offset_bytes, cursor.lines = offset, lines
            raise missing_groups_error(name, self._path, missing)
        return [rows_filled]

    @staticmethod
    def _append(state: _TableState, new_chunks: list[pa.Table]) -> int:
        if not new_chunks:
            return 0
        rows = pa.concat_tables(new_chunks)
        # a chunk per step block: a live refresh derives its newest block from that block's chunks alone
        # (``_block_rows``), not by filtering a first read that holds every block
        # (and its new steps from their chunks alone: each chunk's steps are known); a part of many Arrow chunks
        # (one per rank's file, from a read file by file) is made contiguous once, so that every later filter or
        # sort of it does not pay a per-chunk cost per rank
        state.chunks.extend(_Chunk(part if part.column(0).num_chunks <= _MERGE_CHUNKS else part.combine_chunks(),
                                   None, span=None if block is None else (block, block),
                                   steps=None if block is None or block == NO_STEP_BLOCK else _step_span(part))
                            for block, part in _by_block(rows))
        state.num_rows += rows.num_rows
        state.frame = None
        if state.step_counts is not None:
            for step, n in _count_steps([rows]).items():
                state.step_counts[step] = state.step_counts.get(step, 0) + n
        raw: dict[tuple[int, int] | None, list[_Chunk]] = {}
        for c in state.chunks:
            if c.basis is None:
                raw.setdefault(c.span, []).append(c)
        if sum(map(len, raw.values())) - len(raw) > _MERGE_CHUNKS:   # many appends: one chunk per block again
            state.chunks = [c for c in state.chunks if c.basis is not None] + [
                parts[0] if len(parts) == 1 else
                _Chunk(pa.concat_tables([c.rows for c in parts]).combine_chunks(), None, span=span,
                       steps=_merged_steps([c.steps for c in parts]))
                for span, parts in sorted(raw.items(), key=lambda item: item[0] or (NO_STEP_BLOCK, NO_STEP_BLOCK))]
        return rows.num_rows

    def _build_frame(self, name: str, state: _TableState, model: ClockModel) -> pd.DataFrame:
        if not state.num_rows:
            return empty_frame(name)
        return arrow_to_frame(self._aligned(name, state, model), name)

    def _aligned(self, name: str, state: _TableState, model: ClockModel) -> pa.Table:
        if not state.num_rows:
            return memory_schema(name).empty_table()
        return self._aligned_chunks(name, state.chunks, model)

    def _aligned_chunks(self, name: str, chunks: list[_Chunk], model: ClockModel) -> pa.Table:
        chunks = [c for c in chunks if c.rows.num_rows]
        if not chunks:
            return memory_schema(name).empty_table()
        aligned = pa.concat_tables([_align(c, name, model, self._path) for c in chunks])
        basis = chunks[0].basis
        if len(chunks) == 1 and chunks[0].in_order and basis is not None and basis.matches(model):
            return aligned  # compacted rows, read back in their sort order
        return _sort(aligned, SORT_KEYS.get(name, ("rank",)))


class StepRows:
    """A ``RunStore``'s rows by step and by step block, given by ``RunStore.step_rows()`` and used inside its ``with``
    block (the store's lock held): ``counts`` says which steps changed since a caller last looked, ``block`` reads
    the rows of those steps. Covers the rows the store holds: a compacted table's files are read whole first; a store
    opened with ``tail_steps`` holds no rows of the skipped head until ``load_head()``."""

    def __init__(self, store: RunStore) -> None:
        self._store = store
        self._active = True
        """Inside the ``with`` block (cleared under the lock when it ends)."""

    def counts(self, name: str) -> dict[int, int]:
        """Rows per ``step`` of table ``name`` (key ``NO_STEP_BLOCK``, -1: rows outside steps, ``step`` null or
        negative; {} for a table without a ``step`` column). Kept up to date by each refresh (counted once, then
        only the rows it adds); the dict returned is the caller's."""
        with self._store._lock:
            self._check_active()
            return dict(self._store._step_counts(_check_table_name(name)))

    def block(self, name: str, block: int, *, first_step: int | None = None) -> pd.DataFrame:
        """Rows of table ``name`` in step block ``block`` (``partitions.block_of``: steps ``block * STEP_BLOCK_STEPS``
        on; ``NO_STEP_BLOCK``: rows outside steps) as ``RunStore.table()`` gives them (every schema column,
        clock-aligned, sorted); only those of steps from ``first_step`` on when given. Only the chunks of that block
        are read."""
        with self._store._lock:
            self._check_active()
            return self._store._block_rows(_check_table_name(name), block, first_step)

    def _check_active(self) -> None:
        if not self._active:
            raise RuntimeError("StepRows used after its `with store.step_rows()` block ended; read inside it")


def _rows_of(state: _TableState, name: str) -> pa.Table:
    """Every row of table ``name`` a state holds, as read (not clock-aligned: for tables without time columns)."""
    rows = [c.rows for c in state.chunks if c.rows.num_rows]
    return pa.concat_tables(rows) if rows else memory_schema(name).empty_table()


def _by_block(rows: pa.Table) -> list[tuple[int | None, pa.Table]]:
    """``rows`` split by step block (``partitions.block_of``; -1: outside steps), each block's rows in their order
    in ``rows``, blocks ascending; rows of a table without steps are one part of block None."""
    if "step" not in rows.column_names or not rows.num_rows:
        return [(None, rows)]
    blocks = block_of(pc.fill_null(rows.column("step"), -1).to_numpy())
    if blocks.min() == blocks.max():
        return [(int(blocks[0]), rows)]
    order = np.argsort(blocks, kind="stable")
    ordered, sorted_blocks = rows.take(pa.array(order)), blocks[order]
    starts = np.flatnonzero(np.diff(sorted_blocks)) + 1
    bounds = [0, *starts.tolist(), len(order)]
    return [(int(sorted_blocks[a]), ordered.slice(a, b - a)) for a, b in zip(bounds, bounds[1:])]


def _block_span(rows: pa.Table) -> tuple[int, int]:
    """The lowest and highest step block of some rows (``partitions.block_of``; -1: outside steps)."""
    if not rows.num_rows:
        return NO_STEP_BLOCK, NO_STEP_BLOCK - 1    # no block
    low_high = pc.min_max(pc.fill_null(rows.column("step"), -1))
    return tuple(block_of(np.array([low_high["min"].as_py(), low_high["max"].as_py()])).tolist())


def _count_steps(parts: list[pa.Table]) -> dict[int, int]:
    """Rows per ``step`` of ``parts`` (``NO_STEP_BLOCK``: step null or negative); {} for a table without steps."""
    steps = [p.column("step") for p in parts if p.num_rows and "step" in p.column_names]
    if not steps:
        return {}
    step = pc.fill_null(pa.chunked_array([a for c in steps for a in c.chunks], type=pa.int64()), -1).to_numpy()
    step = np.where(step < 0, NO_STEP_BLOCK, step)
    if step.max() > 16 * len(step) + (1 << 20):     # sparse step numbers: count the distinct ones
        values, count = np.unique(step, return_counts=True)
        return dict(zip(values.tolist(), count.tolist()))
    count = np.bincount(step - NO_STEP_BLOCK)
    present = np.flatnonzero(count)
    return dict(zip((present + NO_STEP_BLOCK).tolist(), count[present].tolist()))


def _step_span(rows: pa.Table) -> tuple[int, int]:
    """The lowest and highest ``step`` of rows that all have one (a step block's)."""
    low_high = pc.min_max(rows.column("step"))
    return int(low_high["min"].as_py()), int(low_high["max"].as_py())


def _merged_steps(spans: list[tuple[int, int] | None]) -> tuple[int, int] | None:
    """The step span of chunks merged into one (None when some chunk's is unknown)."""
    if any(s is None for s in spans):
        return None
    return min(s[0] for s in spans), max(s[1] for s in spans)


def _align(chunk: _Chunk, name: str, model: ClockModel, run_dir: Path) -> pa.Table:
    """``chunk``'s rows with every time column on rank 0's clock under ``model`` (raw rows: plus the rank's offset
    at each time; compacted rows: plus what changed since their basis, ``clock_sync.Basis.shifts``)."""
    rows = chunk.rows
    cols = [c for c in time_columns(name) if c in rows.column_names]   # ``arrow()`` reads only some columns
    if not cols or not rows.num_rows:
        return rows
    if chunk.ranks is None:
        chunk.ranks = np.unique(rows.column("rank").to_numpy(zero_copy_only=False))
    present = chunk.ranks
    known = model.ranks
    missing = [int(r) for r in present if int(r) not in known]
    if missing:
        raise TraceError(f"ranks {missing} have '{name}' rows but no rank info file in {run_dir / 'ranks'}, so "
                         f"their clock offsets are unknown. Restore ranks/rankNNNNN.json for them.")
    basis = chunk.basis
    if basis is not None and basis.matches(model):
        return rows
    if basis is None and not any(int(r) in model.samples for r in present):
        deltas = {int(r): model.constants[int(r)] for r in present}     # constants only: one shift per rank
        if not any(deltas.values()):
            return rows
        lookup = np.zeros(int(present.max()) + 1, dtype=np.int64)
        for r, d in deltas.items():
            lookup[r] = d
        shift = pa.array(lookup[rows.column("rank").to_numpy(zero_copy_only=False)], type=pa.int64())
        for col in cols:
            i = rows.schema.get_field_index(col)
            rows = rows.set_column(i, col, pc.add(rows.column(col), shift))
        return rows
    return align_rows(rows, tuple(cols), model, basis,
                      source=f"the compacted '{name}' table in {run_dir / TABLES_DIR}")


def _sort(rows: pa.Table, keys: tuple[str, ...]) -> pa.Table:
    """Stable sort by ``keys`` ascending, nulls last."""
    if rows.num_rows < 2:
        return rows
    try:  # pyarrow >= 25: null placement per key
        order = pc.sort_indices(rows, options=pc.SortOptions([(k, "ascending", "at_end") for k in keys]))
    except (TypeError, ValueError, pa.ArrowException):
        order = pc.sort_indices(rows, options=pc.SortOptions([(k, "ascending") for k in keys],
                                                             null_placement="at_end"))
    return rows.take(order)


def _in_steps(chunk: _Chunk, expr: pc.Expression | None, steps: tuple[int | None, int | None] | None,
              ranks: frozenset[int] | None) -> _Chunk:
    """``chunk``'s rows that pass ``expr`` (``row_filter(steps, ranks)``): the chunk itself when its known step
    span lies inside ``steps`` and no rank is selected (a live window's held blocks: no filter to run), or when
    there is no filter."""
    if expr is None:
        return chunk
    if ranks is None and chunk.steps is not None:
        first, last = steps
        if (first is None or chunk.steps[0] >= first) and (last is None or chunk.steps[1] <= last):
            return chunk
    return _Chunk(filter_rows(chunk.rows, expr), chunk.basis, chunk.in_order)


def _events_files(run_dir: Path, name: str) -> dict[int, Path]:
    folder = run_dir / EVENTS_DIR / name
    try:
        entries = list(os.scandir(folder))
    except FileNotFoundError:
        return {}
    files = {}
    paths = _EVENTS_PATHS
    if len(paths) > _EVENTS_PATHS_MAX:
        paths.clear()
    for e in entries:
        stem = e.name[4:-6]
        if e.name.startswith("rank") and e.name.endswith(".jsonl") and stem.isdigit() and e.is_file():
            path = paths.get(e.path)
            if path is None:
                path = paths[e.path] = Path(e.path)
            files[int(stem)] = path
    return dict(sorted(files.items()))


_EVENTS_PATHS: dict[str, Path] = {}
"""``_events_files``' Path of each file path met: a live refresh lists a table's files of every rank, and making
thousands of Paths again each time costs more than the listing."""
_EVENTS_PATHS_MAX = 200_000


def _events_rel(name: str, path: Path) -> str:
    """The run-relative POSIX path of an events file of table ``name`` (``_events_files``' paths), the key of its
    cursor and of the marker's ``events``; built from the name (a run has thousands of these files)."""
    return f"{EVENTS_DIR}/{name}/{path.name}"


def _last_step_on_disk(run_dir: Path) -> int | None:
    """Newest step in the steps table's events files (their last complete lines), None without any."""
    steps = [last_step_in_file(path) for path in _events_files(run_dir, "steps").values()]
    steps = [s for s in steps if s is not None]
    return max(steps) if steps else None


def _read_compacted_marker(run_dir: Path) -> dict | None:
    path = run_dir / COMPACTED_MARKER
    tables_dir = run_dir / TABLES_DIR
    if not path.is_file():
        if tables_dir.is_dir() and (any(tables_dir.glob("*.parquet")) or any(tables_dir.glob("*/step_block=*"))):
            raise TraceError(f"'{tables_dir}' holds Parquet files but no {path.name}, so it is unknown which "
                             f"events they cover (an interrupted or foreign compaction). Delete {tables_dir} and "
                             f"run `dtprobe compact {run_dir}` to rebuild it from the events files.")
        return None
    try:
        marker = orjson.loads(path.read_bytes())
    except (orjson.JSONDecodeError, OSError) as exc:
        raise TraceError(f"'{path}' is not readable JSON ({exc}). Delete {tables_dir} and run "
                         f"`dtprobe compact {run_dir}` again.") from None
    keys = ("format", "schema_version", "tables", "events", "clock_offsets_ns")
    missing = [k for k in keys if not isinstance(marker, dict) or k not in marker]
    if missing or marker.get("format") != COMPACTED_FORMAT:
        raise TraceError(f"'{path}' is not a dtprobe compaction marker (missing {missing or ['format']}). Delete "
                         f"{tables_dir} and run `dtprobe compact {run_dir}` again.")
    check_schema_version(marker["schema_version"], path)
    return marker


def _check_table_name(name: str) -> str:
    if name not in SCHEMAS:
        raise TraceError(f"unknown table {name!r}; the run store has {sorted(SCHEMAS)}.")
    return name
