"""ONE rank's trace file -> its reduced tables (``RankTables``): the unit of work ``kineto_pool`` runs in a process
or on a Dask worker and ``kineto.load_trace_dir`` assembles.

Only what the analyses read crosses back to the caller: the GPU events as numpy columns, the distinct event
names, the profiler steps and the rank's collectives; the file's text and decoded events never leave the worker.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from dtprobe.store.kineto_collectives import RankCollectives, collective_rows, rank_collectives
from dtprobe.store.kineto_events import RankMeta, parse_trace_file
from dtprobe.store.kineto_stream import CHUNK_BYTES


@dataclass(kw_only=True)
class RankTables:
    """One rank's reduced tables."""

    meta: RankMeta
    """What the file says about its rank."""
    kernels: dict[str, np.ndarray]
    """GPU events: name_code (int32: index into ``names``); stream, start_ns, dur_ns, correlation, launch_ns,
    step (int64; -1 = none)."""
    names: list[str]
    """Distinct GPU event names, in order of first appearance."""
    name_kinds: list[str]
    """``kernel_kind`` of each of ``names``."""
    steps: list[tuple[int, int, int]]
    """(step, start_ns, end_ns) per ``ProfilerStep#N``."""
    collectives: RankCollectives
    """``collectives`` rows of the rank as columns (``kineto_collectives.rank_collectives``), ``seq`` not yet
    set (``kineto_collective_frame.collective_columns`` numbers them over all ranks)."""


def reduce_trace_file(path: str, *, single_file: bool = False, chunk_bytes: int = CHUNK_BYTES) -> RankTables:
    """Stream one trace file and reduce it to its ``RankTables``; TraceError naming the file when it cannot be
    read. ``single_file``: the file is the only one of its folder (a lone file without ``distributedInfo`` is
    rank 0 of 1)."""
    parsed = parse_trace_file(path, single_file=single_file, chunk_bytes=chunk_bytes)
    return RankTables(meta=parsed.meta, kernels=parsed.kernels, names=parsed.names, name_kinds=parsed.name_kinds,
                      steps=parsed.steps, collectives=rank_collectives(collective_rows(parsed)))
