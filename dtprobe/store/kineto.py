"""Kineto trace folders -> the run store's tables (``kernels``, ``collectives``, ``steps``) + per-rank metadata.

``KinetoRun`` is a ``source.Source``: read by ``RunAnalysis`` (so by ``dtprobe analyze`` and the dashboard) for
foreign GPU traces (NCCL, ROCm/RCCL) and CPU/gloo traces. Layers, in the order data flows: find files -> stream
and reduce each rank's file to its tables in a worker (``kineto_pool`` runs ``kineto_reduce``: a chunk of the
file in memory at a time) -> check ranks -> assemble schema-typed DataFrames -> keep the kernels of the profiled
steps (``kineto_window``).

Timestamps: ``*_ns`` columns are Unix-epoch nanoseconds (trace ``ts`` microseconds x 1000 +
``baseTimeNanoseconds``) on each rank's own clock, exactly as in the file (no cross-rank alignment is applied:
Kineto records none). Usage::

    run = load_trace_dir("traces/dlrm_8rank_v100")
    run.kernels          # rank, name, kind, stream, start_ns, dur_ns, step, correlation, launch_ns
    run.ranks[3].world_size, run.steps_found
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from dtprobe.store.errors import TraceError
from dtprobe.store.kineto_collectives import collective_columns
from dtprobe.store.kineto_events import RankMeta, kernel_kind
from dtprobe.store.kineto_pool import ProgressFn, ReduceConfig, reduce_files
from dtprobe.store.kineto_reduce import RankTables
from dtprobe.store.kineto_window import analysed_kernels, check_gpu_coverage
from dtprobe.store.schema import MANIFEST_FILE, SCHEMAS
from dtprobe.store.source import SourceInfo

__all__ = ["KinetoRun", "RankMeta", "find_trace_files", "is_trace_dir", "kernel_kind", "load_trace_dir"]

TRACE_SUFFIXES = (".json", ".json.gz")
"""File names read as traces (covers ``*.pt.trace.json`` and ``*.pt.trace.json.gz``)."""

_PANDAS_DTYPES = {"int32": "Int32", "int64": "Int64", "float64": "float64", "boolean": "boolean",
                  "string": "string"}

@dataclass(frozen=True, kw_only=True)
class KinetoRun:
    """Tables and metadata of a folder of Kineto traces, one file per rank."""

    path: Path
    """The folder (or single file) that was loaded."""
    ranks: dict[int, RankMeta]
    """Rank -> its file's metadata (path, world size, backend, process groups, device properties)."""
    kernels: pd.DataFrame
    """Every GPU event (kernels, memcpy/memset, stream syncs); ``kind`` in {compute, comm, memory, other}.
    ``name`` and ``kind`` are Categorical (one dictionary of the distinct strings for the whole folder)."""
    collectives: pd.DataFrame
    """Collectives identified on each rank (NCCL kernels, gloo annotations); schema ``collectives``."""
    steps: pd.DataFrame
    """One row per (rank, ProfilerStep): rank, step, start_ns, end_ns (other ``steps`` columns null)."""
    collective_seq: str = "order"
    """``trace`` when ``collectives.seq`` is every trace's own per-group ``Seq`` arg, ``order`` when it is each
    rank's order within its window (``kineto_collectives.number_seq``)."""

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
        return check_gpu_coverage(self.kernels, self.collectives, self.ranks)

    @cached_property
    def analysed_kernels(self) -> pd.DataFrame:
        """``kernels`` of the profiled steps, every step included (``kineto_window.analysed_kernels``)."""
        return analysed_kernels(self.kernels, self.steps, self.collectives, self.ranks)

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
    process); ``dask_address`` runs the reduction on that Dask scheduler's workers instead. Each worker holds a
    chunk of one file at a time, so peak memory is bounded by the number of workers, not by the number or size of
    the files; the tables assembled here are a small fraction of the JSON. Raises TraceError naming the file for
    unreadable, truncated or non-Kineto files, a file without ``distributedInfo.rank``, and two files claiming the
    same rank; ConfigError for a Dask address that does not answer or dask not installed.
    """
    files = find_trace_files(path)
    reduced = reduce_files(files, ReduceConfig(workers=workers, dask_address=dask_address), progress=progress)
    by_rank: dict[int, RankTables] = {}
    for item in reduced:
        rank = item.meta.rank
        if rank in by_rank:
            raise TraceError(
                f"rank {rank} appears in two files: {by_rank[rank].meta.path} and {item.meta.path} "
                f"(distributedInfo.rank). Keep one trace per rank in the folder (e.g. one profiler window).")
        by_rank[rank] = item
    ordered = [by_rank[r] for r in sorted(by_rank)]
    del reduced, by_rank
    collectives, seq_source = _collectives_frame(ordered)
    return KinetoRun(
        path=Path(path), ranks={p.meta.rank: p.meta for p in ordered},
        kernels=_kernels_frame(ordered), collectives=collectives, steps=_steps_frame(ordered),
        collective_seq=seq_source)


def _typed_frame(table: str, columns: dict[str, Any], *, length: int = 0) -> pd.DataFrame:
    """A frame with every schema column of ``table`` in its pandas (nullable) dtype; missing -> null."""
    data = {}
    for col, dtype in SCHEMAS[table].items():
        pd_dtype = _PANDAS_DTYPES[dtype]
        if isinstance(columns.get(col), pd.Categorical):     # a string column kept dictionary-encoded
            data[col] = columns[col]
        elif col in columns:
            data[col] = pd.array(columns[col], dtype=pd_dtype, copy=False)
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


def _kernels_frame(ranks: list[RankTables]) -> pd.DataFrame:
    n = sum(len(p.kernels["name_code"]) for p in ranks)

    def cat(key: str) -> np.ndarray:
        parts = [p.kernels[key] for p in ranks]
        return np.concatenate(parts) if parts else np.empty(0, np.int64)

    rank_col = np.concatenate([np.full(len(p.kernels["name_code"]), p.meta.rank, np.int32) for p in ranks]) \
        if ranks else np.empty(0, np.int32)
    first = np.cumsum([0] + [len(p.names) for p in ranks[:-1]], dtype=np.int32)    # each rank's names, in turn
    codes = np.concatenate([p.kernels["name_code"] + f for p, f in zip(ranks, first)]) if ranks \
        else np.empty(0, np.int32)
    columns = {
        "rank": rank_col, "name": _dictionary(codes, [name for p in ranks for name in p.names]),
        "kind": _dictionary(codes, [kind for p in ranks for kind in p.name_kinds]), "stream": cat("stream"),
        "start_ns": cat("start_ns"), "dur_ns": cat("dur_ns"), "step": cat("step"),
        "correlation": _masked(cat("correlation")), "launch_ns": _masked(cat("launch_ns")),
    }
    return _typed_frame("kernels", columns, length=n)


def _steps_frame(ranks: list[RankTables]) -> pd.DataFrame:
    rows = [(p.meta.rank, s, lo, hi) for p in ranks for s, lo, hi in p.steps]
    columns = {"rank": [r[0] for r in rows], "step": [r[1] for r in rows], "start_ns": [r[2] for r in rows],
               "end_ns": [r[3] for r in rows]}
    return _typed_frame("steps", columns, length=len(rows))


def _collectives_frame(ranks: list[RankTables]) -> tuple[pd.DataFrame, str]:
    """The ``collectives`` table and where its ``seq`` came from (``kineto_collectives.number_seq``)."""
    columns, n, seq_source = collective_columns([p.collectives for p in ranks])
    frame = _typed_frame("collectives", columns, length=n)
    return frame.sort_values(["rank", "enqueue_ns", "seq"], kind="stable", na_position="last",
                             ignore_index=True), seq_source
