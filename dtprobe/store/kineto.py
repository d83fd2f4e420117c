"""Kineto trace folders -> the run store's tables (``kernels``, ``collectives``, ``steps``) + per-rank metadata.

``KinetoRun`` is a ``source.Source``: read by ``RunAnalysis`` (so by ``dtprobe analyze`` and the dashboard) for
foreign GPU traces (NCCL, ROCm/RCCL) and CPU/gloo traces. Layers, in the order data flows: find files -> stream
and reduce each rank's file to its tables in a worker (``kineto_pool`` runs ``kineto_reduce``: a chunk of the
file in memory at a time) -> spill each rank's tables to disk as it arrives (``kineto_spill``) -> check ranks ->
when an analysis asks, assemble schema-typed DataFrames one rank at a time, ``kernels`` of the profiled steps
only (``kineto_window``), in blocks of whole ranks (``kernel_blocks``) and ``collectives`` in parts of whole
process groups, a group spanning many ranks in windows of whole collectives (``collective_parts``,
``kineto_group_windows``), for the analyses that never need every rank's rows at once.

Timestamps: ``*_ns`` columns are Unix-epoch nanoseconds (trace ``ts`` microseconds x 1000 +
``baseTimeNanoseconds``) on each rank's own clock, exactly as in the file (no cross-rank alignment is applied:
Kineto records none). Usage::

    run = load_trace_dir("traces/dlrm_8rank_v100")
    run.kernels          # rank, name, kind, stream, start_ns, dur_ns, step, correlation, launch_ns
    run.ranks[3].world_size, run.steps_found
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from functools import cached_property, partial
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from dtprobe.store.errors import TraceError
from dtprobe.store.kineto_collective_frame import collective_columns
from dtprobe.store.kineto_events import RankMeta, kernel_kind
from dtprobe.store.kineto_group_windows import Window, plan_windows, row_keys, window_mask, window_ranges
from dtprobe.store.kineto_pool import ProgressFn, ReduceConfig, reduce_files
from dtprobe.store.kineto_spill import (RankSpill, SpilledRank, collective_rows, collective_tables, group_masks,
                                        group_tables, kernel_columns, read_keys, write_keys)
from dtprobe.store.kineto_window import check_gpu_coverage, last_step_ends_us, launched_in_steps
from dtprobe.store.schema import MANIFEST_FILE, SCHEMAS
from dtprobe.store.source import SourceInfo

__all__ = ["CollectiveParts", "KinetoRun", "RankMeta", "find_trace_files", "is_trace_dir", "kernel_kind",
           "load_trace_dir"]

TRACE_SUFFIXES = (".json", ".json.gz")
"""File names read as traces (covers ``*.pt.trace.json`` and ``*.pt.trace.json.gz``)."""

COLLECTIVE_PART_ROWS = 50_000
"""Collectives per part of ``KinetoRun.collective_parts`` (a process group larger than this is a part alone): what the
cross-rank analyses of a trace folder hold at a time, whatever the number of ranks."""

COLLECTIVE_WINDOW_ROWS = 50_000
"""Collectives per window of a part that holds more (``kineto_group_windows``): a group spanning many ranks is read a
slice of its collectives over every member at a time, whatever the number of ranks."""

KERNEL_BLOCK_ROWS = 250_000
"""GPU events per block of ``KinetoRun.kernel_blocks``: what the kernel-level analyses of a trace folder hold at a
time, whatever the number of ranks."""

_KEY_FILES = itertools.count()
"""Numbers the window key files written in a run's spill folder (each ``collective_parts`` call writes its own)."""

_PANDAS_DTYPES = {"int32": "Int32", "int64": "Int64", "float64": "float64", "boolean": "boolean",
                  "string": "string"}

@dataclass(frozen=True, kw_only=True)
class CollectiveParts:
    """A source's ``collectives`` table in parts, each read when called: every row is in one part, all the rows of a
    process group (pg, pg_ranks) are in the same part, in the table's order, with its columns and values. What
    analyses that work group by group (``analysis.collective_groups``) read instead of the whole table, holding one
    part at a time."""

    readers: tuple[Callable[[], pd.DataFrame], ...]
    """One call per part, each giving a fresh frame of its rows."""
    ranks: frozenset[int]
    """The ranks with at least one row in the table."""


@dataclass(frozen=True, kw_only=True, eq=False)
class KinetoRun:
    """Tables and metadata of a folder of Kineto traces, one file per rank. ``kernels``, ``analysed_kernels`` and
    ``collectives`` are built from the spilled ranks the first time they are read, one rank at a time;
    ``kernel_blocks`` gives the analysed kernels without ever holding every rank's. Compared and hashed by
    identity (a per-source cache may key on it)."""

    path: Path
    """The folder (or single file) that was loaded."""
    spill: RankSpill = field(repr=False)
    """Each rank's reduced tables on disk (``kineto_spill``), in rank order."""
    steps: pd.DataFrame
    """One row per (rank, ProfilerStep): rank, step, start_ns, end_ns (other ``steps`` columns null)."""

    @property
    def ranks(self) -> dict[int, RankMeta]:
        """Rank -> its file's metadata (path, world size, backend, process groups, device properties)."""
        return {r.meta.rank: r.meta for r in self.spill.ranks}

    @cached_property
    def kernels(self) -> pd.DataFrame:
        """Every GPU event (kernels, memcpy/memset, stream syncs); ``kind`` in {compute, comm, memory, other}.
        ``name`` and ``kind`` are Categorical (one dictionary of the distinct strings for the whole folder)."""
        return _kernels_frame(self.spill.ranks)

    @cached_property
    def collectives(self) -> pd.DataFrame:
        """Collectives identified on each rank (NCCL kernels, gloo annotations); schema ``collectives``."""
        frame, seq_source = _collectives_frame(self.spill.ranks)
        assert seq_source == self.collective_seq, (seq_source, self.collective_seq)
        return frame

    def collective_parts(self, max_rows: int | None = None, *, window_rows: int | None = None) -> CollectiveParts:
        """``collectives`` in parts of whole process groups (pg, pg_ranks) of at most ``max_rows`` rows
        (``COLLECTIVE_PART_ROWS`` by default; a larger group is a part alone) (``CollectiveParts``): each part is read
        from the spilled ranks that have rows of its groups, so analyses that match collectives across ranks hold a
        few groups' rows over their members, not every rank's. Groups an analysis could take for one (a rank's groups
        of one name, numbered together when ``seq`` is each rank's order; a group named by none and ``world``) share
        a part. A part of more than ``window_rows`` rows (``COLLECTIVE_WINDOW_ROWS`` by default: a group over many
        ranks) is read in windows of whole collectives over every member (``kineto_group_windows``), each a part."""
        parts = _group_parts([r.groups for r in self.spill.ranks], world_ranks=self._world_ranks,
                             max_rows=COLLECTIVE_PART_ROWS if max_rows is None else max_rows)
        window_rows = COLLECTIVE_WINDOW_ROWS if window_rows is None else window_rows
        readers = []
        for part in parts:
            windows = self._windows(part, window_rows) \
                if sum(r.groups.get(key, 0) for r in self.spill.ranks for key in part) > window_rows else None
            if windows is None:
                readers.append(partial(self._group_collectives, part))
                continue
            ranks, files = self._ranks_of(part), []
            rows = np.zeros((len(windows), len(ranks), 2), dtype=np.int64)
            for j, (rank, (table, in_part)) in enumerate(zip(ranks, group_masks(ranks, part))):
                keys = row_keys(table, in_part, windows, seq_source=self.collective_seq, world_ranks=self._world_ranks)
                files.append(rank.collectives_file.with_suffix(f".keys{next(_KEY_FILES)}.npy"))
                write_keys(files[-1], keys)
                rows[:, j] = window_ranges(keys, windows, rank.meta.rank)
                del table, keys
            readers += [partial(self._window_collectives, ranks, files, window=w, rows=rows[i])
                        for i, w in enumerate(windows)]
        return CollectiveParts(readers=tuple(readers),
                               ranks=frozenset(r.meta.rank for r in self.spill.ranks if r.num_collectives))

    def _windows(self, groups: frozenset[tuple[str | None, str | None]], max_rows: int) -> list[Window] | None:
        """``kineto_group_windows.plan_windows`` of the rows of ``groups``, read one rank at a time."""
        return plan_windows(group_tables(self._ranks_of(groups), groups), seq_source=self.collective_seq,
                            world_ranks=self._world_ranks, max_rows=max_rows)

    @property
    def _world_ranks(self) -> str | None:
        # the members of a group the traces name none of, as the analyses spell them (``pg_ranks``)
        return ",".join(str(r) for r in range(self.world_size)) if self.world_size else None

    def _ranks_of(self, groups: frozenset[tuple[str | None, str | None]]) -> list[SpilledRank]:
        return [r for r in self.spill.ranks if r.groups.keys() & groups]

    def _group_collectives(self, groups: frozenset[tuple[str | None, str | None]]) -> pd.DataFrame:
        """The rows of ``collectives`` of ``groups`` (pg, pg_ranks), in the table's order and with its ``seq``."""
        frame, _ = _collectives_frame(self._ranks_of(groups), groups=groups, seq_source=self.collective_seq)
        return frame

    def _window_collectives(self, ranks: list[SpilledRank], files: list[Path], *, window: Window, rows: np.ndarray
                            ) -> pd.DataFrame:
        """The rows of ``collectives`` of ``window`` of a part, each rank's looked for in its ``rows`` [start, stop)
        of its table with the keys in its file of ``files`` (``kineto_group_windows.row_keys``), in the table's
        order and with its ``seq``."""
        tables, seq, no_seq = [], [], []
        for rank, path, (start, stop) in zip(ranks, files, rows.tolist()):
            if stop <= start:
                continue
            keys = read_keys(path, start, stop)
            keep = window_mask(keys, window, rank.meta.rank)
            tables.append(collective_rows(rank, start, stop).filter(keep))
            seq.append(keys["seq"][keep])
            no_seq.append(keys["no_seq"][keep])
        columns, n, _ = collective_columns(tables, seq_source=self.collective_seq,
                                           seq=(np.concatenate(seq or [np.empty(0, np.int64)]),
                                                np.concatenate(no_seq or [np.empty(0, bool)])))
        return _table_order(columns, n)

    @property
    def collective_seq(self) -> str:
        """``trace`` when ``collectives.seq`` is every trace's own per-group ``Seq`` arg, ``order`` when it is each
        rank's order within its window (``kineto_collectives.number_seq``)."""
        group = sum(r.num_group_collectives for r in self.spill.ranks)
        return "trace" if group and sum(r.num_trace_seq for r in self.spill.ranks) == group else "order"

    @property
    def steps_found(self) -> list[int]:
        """Distinct ``ProfilerStep#N`` numbers over all ranks, sorted."""
        return sorted(int(s) for s in self.steps["step"].dropna().unique())

    @property
    def world_size(self) -> int | None:
        """``distributedInfo.world_size`` (the largest any file states), None when no file states one."""
        sizes = [m.world_size for m in self.ranks.values() if m.world_size is not None]
        return max(sizes) if sizes else None

    @property
    def info(self) -> SourceInfo:
        """The folder's facts for analysis (the ``Source`` protocol): each rank on its own clock and cut on its own
        (no cross-rank timing, hangs or mismatches), every ProfilerStep counts, the device from the traces'
        ``deviceProperties`` (``cpu`` without any)."""
        props = [p for m in self.ranks.values() for p in m.device_properties]
        return SourceInfo(kind="kineto_traces", status="trace", world_size=self.world_size,
                          device_name=props[0].get("name") if props else "cpu", clock_aligned=False,
                          collective_seq=self.collective_seq, whole_record=False, warmup_recorded=False)

    @property
    def has_gpu_kernels(self) -> bool:
        """True when every rank has GPU events, False for a CPU-only trace with collectives; TraceError for a
        trace that cannot be analysed (``kineto_window.check_gpu_coverage``)."""
        return check_gpu_coverage({r.meta.rank for r in self.spill.ranks if r.num_kernels},
                                  has_collectives=any(r.num_collectives for r in self.spill.ranks),
                                  ranks=self.ranks)

    @cached_property
    def analysed_kernels(self) -> pd.DataFrame:
        """``kernels`` of the profiled steps, every step included (``kineto_window.kernels_in_steps``), built
        without the events the window leaves out; all of them (none) for a CPU-only trace."""
        if not self.has_gpu_kernels:
            return self.kernels
        last_end_us = last_step_ends_us(self.steps)
        return self.kernels if last_end_us is None else _kernels_frame(self.spill.ranks, window=last_end_us)

    def kernel_blocks(self, max_rows: int | None = None) -> Iterator[pd.DataFrame]:
        """``table("kernels")`` in blocks of whole ranks, in rank order, each of at most ``max_rows`` rows
        (``KERNEL_BLOCK_ROWS`` by default; a larger rank is a block alone): the rows, values and dtypes of the
        whole table (``name`` and ``kind`` categories are the block's), never every rank's at once; for a CPU-only
        trace, the one ``kernels`` frame. TraceError as ``table("kernels")``."""
        if not self.has_gpu_kernels:
            yield self.kernels
            return
        last_end_us = last_step_ends_us(self.steps)
        max_rows = KERNEL_BLOCK_ROWS if max_rows is None else max_rows
        block: list[SpilledRank] = []
        for rank in self.spill.ranks:
            if block and sum(r.num_kernels for r in block) + rank.num_kernels > max_rows:
                yield _kernels_frame(block, window=last_end_us)
                block = []
            block.append(rank)
        if block:
            yield _kernels_frame(block, window=last_end_us)

    def table(self, name: str) -> pd.DataFrame:
        """The table ``name`` with every schema column; tables a trace cannot fill come back empty. ``kernels``
        is ``analysed_kernels``: the events the profiled steps launched (TraceError for a folder whose GPU
        events cannot be analysed); the ``kernels`` attribute keeps every event."""
        if name == "kernels":
            return self.analysed_kernels
        if name in ("collectives", "steps"):
            return getattr(self, name)
        if name not in SCHEMAS:
            raise TraceError(f"unknown table {name!r}; tables: {sorted(SCHEMAS)}")
        return _typed_frame(name, {})

    def file_of(self, rank: int) -> str:
        """The trace file of ``rank``."""
        return self.ranks[rank].path


def _is_trace_name(name: str) -> bool:
    return name.endswith(TRACE_SUFFIXES)


def find_trace_files(path: str | os.PathLike) -> list[Path]:
    """Trace files of a folder (not recursive), or ``[path]`` for a single file; TraceError if there are none."""
    path = Path(path)
    if path.is_file():
        if not _is_trace_name(path.name):
            raise TraceError(f"{path}: not a trace file name; expected *.json or *.json.gz "
                             f"(torch.profiler writes *.pt.trace.json[.gz]).")
        return [path]
    if not path.is_dir():
        raise TraceError(f"{path}: no such file or folder.")
    files = sorted(p for p in path.iterdir() if p.is_file() and _is_trace_name(p.name))
    if not files:
        nested = sorted({p.parent.name for p in path.glob("*/*") if p.is_file() and _is_trace_name(p.name)})
        hint = f" Sub-folders with traces: {', '.join(nested)}; pass one of them." if nested else ""
        raise TraceError(f"{path}: no trace files (*.json, *.json.gz, *.pt.trace.json.gz) in this folder.{hint}")
    return files


def is_trace_dir(path: str | os.PathLike) -> bool:
    """True for a trace file or a folder holding trace files that is not a dtprobe run (no ``run.json``)."""
    path = Path(path)
    if path.is_file():
        return _is_trace_name(path.name)
    if not path.is_dir() or (path / MANIFEST_FILE).exists():
        return False
    return any(p.is_file() and _is_trace_name(p.name) for p in path.iterdir())


def load_trace_dir(path: str | os.PathLike, *, progress: ProgressFn | None = None,
                   workers: int | None = None, dask_address: str | None = None) -> KinetoRun:
    """Stream every trace file of ``path`` (one per rank), reduce each to its rank's tables, and assemble a
    ``KinetoRun``.

    ``workers`` local processes reduce files in parallel (default: one per CPU, at most one per file; 1: in this
    process); ``dask_address`` runs the reduction on that Dask scheduler's workers instead. Each worker holds one
    file's working set (a chunk of its text, its decoded events, its columns) and this process one rank's reduced
    tables at a time, which it spills to disk (``kineto_spill``): loading peaks at about ``workers`` x one file's
    working set, whatever the number of files. ``kernels`` and ``collectives`` are built when first read, each
    the size of its rows over every rank. Raises TraceError naming the file for
    unreadable, truncated or non-Kineto files, a file without ``distributedInfo.rank``, and two files claiming the
    same rank; ConfigError for a Dask address that does not answer or dask not installed.
    """
    files = find_trace_files(path)
    spill = RankSpill()
    try:
        spilled = reduce_files(files, ReduceConfig(workers=workers, dask_address=dask_address), progress=progress,
                               keep=spill.add)          # in the order of files (spill.ranks: as they arrived)
    except BaseException:
        spill.close()
        raise
    by_rank: dict[int, SpilledRank] = {}
    for item in spilled:
        rank = item.meta.rank
        if rank in by_rank:
            spill.close()
            raise TraceError(
                f"rank {rank} appears in two files: {by_rank[rank].meta.path} and {item.meta.path} "
                f"(distributedInfo.rank). Keep one trace per rank in the folder (e.g. one profiler window).")
        by_rank[rank] = item
    spill.ranks[:] = [by_rank[r] for r in sorted(by_rank)]
    return KinetoRun(path=Path(path), spill=spill, steps=_steps_frame(spill.ranks))


def _typed_frame(table: str, columns: dict[str, Any], *, length: int = 0) -> pd.DataFrame:
    """A frame with every schema column of ``table`` in its pandas (nullable) dtype; missing -> null."""
    data = {}
    for col, dtype in SCHEMAS[table].items():
        pd_dtype = _PANDAS_DTYPES[dtype]
        if isinstance(columns.get(col), pd.Categorical):     # a string column kept dictionary-encoded
            data[col] = columns[col]
        elif col in columns:
            values = columns[col]             # already of its dtype: taken as it is (coercing again costs a pass)
            if isinstance(values, pd.api.extensions.ExtensionArray) and values.dtype == pd_dtype:
                data[col] = values
            elif isinstance(values, np.ndarray) and values.dtype.kind == "i" and pd_dtype in ("Int32", "Int64"):
                data[col] = pd.arrays.IntegerArray(values.astype(pd_dtype.lower(), copy=False),
                                                   np.zeros(len(values), dtype=bool))
            else:
                data[col] = pd.array(values, dtype=pd_dtype, copy=False)
        elif pd_dtype in ("Int32", "Int64"):           # all null, built from its parts
            data[col] = pd.arrays.IntegerArray(np.zeros(length, dtype=pd_dtype.lower()), np.ones(length, dtype=bool))
        else:
            data[col] = pd.array([None] * length, dtype=pd_dtype)
    return pd.DataFrame(data, copy=False)     # the columns are this frame's alone: no second copy of each


def _masked(values: np.ndarray, null_below: int = 0) -> pd.api.extensions.ExtensionArray:
    """int64 array -> nullable Int64 with values < ``null_below`` as null."""
    return pd.arrays.IntegerArray(values.astype(np.int64), values < null_below)


def _dictionary(codes: np.ndarray, values: list[str]) -> pd.Categorical:
    """``values[codes]`` as a Categorical whose categories are the distinct values, sorted: a column of kernel
    names (long C++ template names, a few hundred distinct ones repeated on every event) then costs one small integer
    code per event instead of a string per event, and sorting or grouping by it orders as the strings do."""
    distinct = sorted(set(values))
    position = {v: i for i, v in enumerate(distinct)}
    remap = np.asarray([position[v] for v in values], dtype=np.int32)
    return pd.Categorical.from_codes(remap[codes] if len(codes) else codes.astype(np.int32),
                                     categories=pd.Index(distinct, dtype=object))


_KERNEL_INTS = ("stream", "start_ns", "dur_ns", "step", "correlation", "launch_ns")


def _kernels_frame(ranks: list[SpilledRank], *, window: pd.Series | None = None) -> pd.DataFrame:
    """The ``kernels`` table of the spilled ``ranks``, read one rank at a time into columns of the final length;
    with ``window`` (``kineto_window.last_step_ends_us``) only the events ``launched_in_steps``."""
    keep = [_in_window(r, window) for r in ranks] if window is not None else [None] * len(ranks)
    sizes = [r.num_kernels if k is None else int(k.sum()) for r, k in zip(ranks, keep)]
    n = sum(sizes)
    out = {col: np.empty(n, np.int64) for col in _KERNEL_INTS}
    rank_col = np.empty(n, np.int32)
    codes = np.empty(n, np.int32)
    at, first_name = 0, 0
    for r, k, size in zip(ranks, keep, sizes):
        if r.num_kernels:
            cols = kernel_columns(r, ["name_code", *_KERNEL_INTS])
            for col, values in cols.items():
                target = codes if col == "name_code" else out[col]
                target[at:at + size] = values if k is None else values[k]
            codes[at:at + size] += first_name        # each rank's names, in turn
            del cols
        rank_col[at:at + size] = r.meta.rank
        at += size
        first_name += len(r.names)
    columns = {
        "rank": rank_col, "name": _dictionary(codes, [name for r in ranks for name in r.names]),
        "kind": _dictionary(codes, [kind for r in ranks for kind in r.name_kinds]), "stream": out["stream"],
        "start_ns": out["start_ns"], "dur_ns": out["dur_ns"], "step": out["step"],
        "correlation": _masked(out["correlation"]), "launch_ns": _masked(out["launch_ns"]),
    }
    return _typed_frame("kernels", columns, length=n)


def _in_window(rank: SpilledRank, last_end_us: pd.Series) -> np.ndarray:
    """Which of ``rank``'s events the profiled steps launched (``kineto_window.launched_in_steps``)."""
    launch_ns = kernel_columns(rank, ["launch_ns"])["launch_ns"] if rank.num_kernels else np.empty(0, np.int64)
    return launched_in_steps(np.full(len(launch_ns), rank.meta.rank, np.int64), launch_ns, launch_ns >= 0,
                             last_end_us)


def _steps_frame(ranks: list[SpilledRank]) -> pd.DataFrame:
    rows = [(p.meta.rank, s, lo, hi) for p in ranks for s, lo, hi in p.steps]
    columns = {"rank": [r[0] for r in rows], "step": [r[1] for r in rows], "start_ns": [r[2] for r in rows],
               "end_ns": [r[3] for r in rows]}
    return _typed_frame("steps", columns, length=len(rows))


def _group_parts(rank_groups: list[dict[tuple[str | None, str | None], int]], *, world_ranks: str | None,
                 max_rows: int) -> list[frozenset[tuple[str | None, str | None]]]:
    """The (pg, pg_ranks) pairs of every rank (with their rows) put in parts, sorted, each of at most ``max_rows``
    rows unless one set of pairs that must stay together is larger: pairs of one rank with the same ``pg`` (each
    rank's collectives of a name are numbered together), and pairs that read the same once nulls are filled
    (``world`` and the world's ranks, or "")."""
    parent: dict = {}

    def root(key):
        while parent.setdefault(key, key) != key:
            key = parent[key]
        return key

    def join(a, b) -> None:
        parent[root(a)] = root(b)

    for rank_at, groups in enumerate(rank_groups):
        for pg, pg_ranks in groups:
            key = (pg, pg_ranks)
            root(key)
            join(key, ("name", pg, rank_at))
            join(key, ("filled", pg or "world", pg_ranks or world_ranks))
            join(key, ("filled", pg or "", pg_ranks or ""))
    together: dict = {}
    for key in list(parent):
        if len(key) == 2:
            together.setdefault(root(key), set()).add(key)
    rows = {}
    for groups in rank_groups:
        for key, n in groups.items():
            rows[key] = rows.get(key, 0) + n
    parts, part, part_rows = [], set(), 0
    def first(keys: set) -> tuple:            # parts in the order of their groups, nulls last
        return min(((g is None, g or ""), (r is None, r or "")) for g, r in keys)

    for keys in sorted(together.values(), key=first):
        size = sum(rows[k] for k in keys)
        if part and part_rows + size > max_rows:
            parts.append(frozenset(part))
            part, part_rows = set(), 0
        part |= keys
        part_rows += size
    return parts + [frozenset(part)] if part else parts


def _collectives_frame(ranks: list[SpilledRank], *, groups: frozenset[tuple[str | None, str | None]] | None = None,
                       seq_source: str | None = None) -> tuple[pd.DataFrame, str]:
    """The ``collectives`` table (only the rows of ``groups``, (pg, pg_ranks) pairs, when given, ``seq`` from
    ``seq_source``) and where its ``seq`` came from (``kineto_collectives.number_seq``)."""
    tables = collective_tables(ranks) if groups is None else group_tables(ranks, groups)
    columns, n, seq_source = collective_columns(list(tables), seq_source=seq_source)
    return _table_order(columns, n), seq_source


def _table_order(columns: dict[str, Any], n: int) -> pd.DataFrame:
    """``collective_columns``' columns as the ``collectives`` frame, in its row order."""
    keys = []                      # sorted by rank, enqueue_ns, seq (nulls last, ties in row order), each column
    for col in ("seq", "enqueue_ns", "rank"):      # reordered in turn: no second copy of the whole table
        values = pd.array(columns[col])
        keys += [values.to_numpy(dtype=np.int64, na_value=0), values.isna()]
    order = np.lexsort(keys)
    for col in list(columns):
        columns[col] = columns[col].take(order)
    return _typed_frame("collectives", columns, length=n)
