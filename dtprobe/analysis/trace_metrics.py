"""The kernel-level metrics of a source in one record (temporal, overlap, kernel types, per rank and per step);
read by ``RunAnalysis.trace_metrics``, the HTA comparison benchmark and its tests. ``kernel_breakdowns`` gives the
per-rank temporal breakdown, overlap and kernel-type split the findings document reports, built one rank at a
time from a source that yields its kernels so (a Kineto trace folder: blocks of whole ranks): memory of one
block's kernels, not of all.

``analyze_traces(run)`` checks that the analyses apply to a Kineto trace folder (GPU events on every rank; a
CPU-only gloo trace is accepted with its collectives and empty GPU metrics) and runs them over every ProfilerStep
of the window.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import pandas as pd

from dtprobe.analysis.findings import jsonable
from dtprobe.analysis.kernel_breakdown import kernel_type_breakdown, kernel_type_sums, kernel_type_table, top_kernels
from dtprobe.analysis.overlap import comm_comp_overlap
from dtprobe.analysis.temporal import temporal_breakdown
from dtprobe.store.kineto import KinetoRun


@dataclass(frozen=True, kw_only=True)
class TraceMetrics:
    """GPU metrics of a Kineto trace folder. Frames are empty for a CPU-only trace (``has_gpu_kernels`` False)."""

    ranks: tuple[int, ...]
    """Ranks loaded, sorted."""
    steps_analyzed: tuple[int, ...]
    """ProfilerStep numbers whose kernels are analysed (all of them, the last included); empty when the trace
    has no ProfilerStep, in which case the whole trace is analysed."""
    has_gpu_kernels: bool
    """False for CPU-only traces (e.g. gloo): only collectives are available."""
    temporal: pd.DataFrame
    """``temporal.temporal_breakdown`` per rank over all steps analysed."""
    temporal_by_step: pd.DataFrame
    """The same per (rank, step)."""
    overlap: pd.DataFrame
    """``overlap.comm_comp_overlap`` per rank."""
    overlap_by_step: pd.DataFrame
    """The same per (rank, step)."""
    kernel_types: pd.DataFrame
    """``kernel_breakdown.kernel_type_breakdown`` over all ranks."""
    top_kernels: pd.DataFrame
    """``kernel_breakdown.top_kernels`` per rank and kernel type."""
    num_collectives: int
    """Collectives identified (NCCL kernels or gloo annotations) over all ranks."""

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON values: steps analysed and the per-rank records the findings document's ``metrics`` holds
        (temporal_breakdown, comm_comp_overlap, kernel_type_breakdown), converted by ``findings.jsonable``."""
        return jsonable({
            "steps_analyzed": list(self.steps_analyzed),
            "temporal_breakdown": self.temporal[["rank", "idle_frac", "compute_frac", "non_compute_frac",
                                                 "kernel_time_us"]],
            "comm_comp_overlap": self.overlap[["rank", "overlap_frac"]],
            "kernel_type_breakdown": self.kernel_types,
        })


def kernel_metrics(kernels: pd.DataFrame, collectives: pd.DataFrame, *, steps_analyzed: Iterable[int],
                   ranks: Iterable[int] | None = None, has_gpu_kernels: bool | None = None) -> TraceMetrics:
    """Temporal breakdown, comm/comp overlap and kernel-type split of a source's ``kernels`` table (for a trace
    folder: those of its profiled steps, every step kept). ``ranks`` default to those with kernels or
    collectives, ``has_gpu_kernels`` to whether there are kernels."""
    if ranks is None:
        ranks = set(kernels["rank"].dropna().astype(int)) | set(collectives["rank"].dropna().astype(int))
    return TraceMetrics(
        ranks=tuple(sorted(int(r) for r in ranks)), steps_analyzed=tuple(steps_analyzed),
        has_gpu_kernels=not kernels.empty if has_gpu_kernels is None else has_gpu_kernels,
        temporal=temporal_breakdown(kernels), temporal_by_step=temporal_breakdown(kernels, by_step=True),
        overlap=comm_comp_overlap(kernels), overlap_by_step=comm_comp_overlap(kernels, by_step=True),
        kernel_types=kernel_type_breakdown(kernels), top_kernels=top_kernels(kernels),
        num_collectives=len(collectives))


def analyze_traces(run: KinetoRun) -> TraceMetrics:
    """Temporal breakdown, comm/comp overlap and kernel-type split of a loaded trace folder, every step kept;
    TraceError for a folder whose GPU events cannot be analysed (``KinetoRun.has_gpu_kernels``)."""
    has_gpu = run.has_gpu_kernels
    return kernel_metrics(run.table("kernels"), run.collectives, steps_analyzed=run.steps_found, ranks=run.ranks,
                          has_gpu_kernels=has_gpu)


@dataclass(frozen=True, kw_only=True)
class KernelBreakdowns:
    """The kernel-level frames the findings document reports, each equal to its function on the whole table."""

    temporal: pd.DataFrame
    """``temporal.temporal_breakdown``."""
    overlap: pd.DataFrame
    """``overlap.comm_comp_overlap``."""
    kernel_types: pd.DataFrame
    """``kernel_breakdown.kernel_type_breakdown``."""


_BY_SOURCE: "weakref.WeakKeyDictionary[Any, KernelBreakdowns]" = weakref.WeakKeyDictionary()
"""Breakdowns of the sources that yield kernels in blocks, computed once per source and dropped with it."""


class _OfTable:
    """The breakdowns of ``table("kernels")``, each computed when first read."""

    def __init__(self, table: Callable[[str], pd.DataFrame]) -> None:
        self._table = table

    @cached_property
    def temporal(self) -> pd.DataFrame:
        return temporal_breakdown(self._table("kernels"))

    @cached_property
    def overlap(self) -> pd.DataFrame:
        return comm_comp_overlap(self._table("kernels"))

    @cached_property
    def kernel_types(self) -> pd.DataFrame:
        return kernel_type_breakdown(self._table("kernels"))


def kernel_breakdowns(source: Any, table: Callable[[str], pd.DataFrame]) -> KernelBreakdowns | _OfTable:
    """Temporal breakdown, comm/comp overlap and kernel-type split of ``source``'s kernels: from each of its
    ``kernel_blocks()`` (frames of whole ranks) in turn when it has that method (``KinetoRun``: one block in memory
    at a time; computed once per source), else from ``table("kernels")``."""
    blocks = getattr(source, "kernel_blocks", None)
    if blocks is None:
        return _OfTable(table)
    if source in _BY_SOURCE:
        return _BY_SOURCE[source]
    temporal, overlap, totals = [], [], {}
    empty = None
    for kernels in blocks():
        if kernels.empty:
            empty = kernels
            continue
        temporal.append(temporal_breakdown(kernels))
        overlap.append(comm_comp_overlap(kernels))
        for state, us in kernel_type_sums(kernels).items():
            totals[state] = totals.get(state, 0) + us
    if not temporal:      # no rank with kernels: the empty frames of the empty table
        kernels = empty if empty is not None else table("kernels")
        out = KernelBreakdowns(temporal=temporal_breakdown(kernels), overlap=comm_comp_overlap(kernels),
                               kernel_types=kernel_type_breakdown(kernels))
    else:
        out = KernelBreakdowns(temporal=pd.concat(temporal, ignore_index=True),
                               overlap=pd.concat(overlap, ignore_index=True), kernel_types=kernel_type_table(totals))
    _BY_SOURCE[source] = out
    return out
