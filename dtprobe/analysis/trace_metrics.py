"""One call from a loaded Kineto trace folder to its GPU metrics (temporal, overlap, kernel types); read by `dtprobe analyze`.

``analyze_traces(run)`` checks that the analyses apply (GPU events on every rank; a CPU-only gloo trace is
accepted with its collectives and empty GPU metrics) and runs them over every ProfilerStep of the window.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pandas as pd

from dtprobe.analysis.kernel_breakdown import kernel_type_breakdown, top_kernels
from dtprobe.analysis.overlap import comm_comp_overlap
from dtprobe.analysis.temporal import kernels_in_steps, temporal_breakdown
from dtprobe.store.errors import TraceError
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
        """The JSON shape of ``dtprobe analyze --json``: temporal_breakdown, comm_comp_overlap, kernel types."""
        return {
            "steps_analyzed": list(self.steps_analyzed),
            "temporal_breakdown": _records(self.temporal[["rank", "idle_frac", "compute_frac", "non_compute_frac",
                                                          "kernel_time_us"]]),
            "comm_comp_overlap": _records(self.overlap[["rank", "overlap_frac"]]),
            "kernel_type_breakdown": _records(self.kernel_types),
        }


def _records(df: pd.DataFrame) -> list[dict[str, Any]]:
    return [{k: (None if pd.isna(v) else (v.item() if hasattr(v, "item") else v)) for k, v in row.items()}
            for row in df.to_dict("records")]


def check_gpu_coverage(run: KinetoRun) -> bool:
    """True when every rank has GPU events, False for a CPU-only trace with collectives; else TraceError.

    A rank without GPU events next to ranks with them, or a trace with neither GPU events nor collectives,
    cannot be analysed: the error names the files.
    """
    with_gpu = set(int(r) for r in run.kernels["rank"].unique())
    without = [r for r in run.ranks if r not in with_gpu]
    if not without:
        return True
    files = ", ".join(f"rank {r}: {run.file_of(r)}" + (
        " (no distributedInfo: read as a single-process trace)"
        if run.ranks[r].rank_source == "single-process" else "") for r in without)
    if with_gpu:
        raise TraceError(
            f"no GPU events (no event has args.stream) in {files}, while ranks {sorted(with_gpu)} have them. "
            f"Was that rank profiled without ProfilerActivity.CUDA? Re-record it with activities=[CPU, CUDA], or "
            f"remove the file from the folder to analyse the other ranks.")
    if run.collectives.empty:
        raise TraceError(
            f"nothing to analyse in {files}: no GPU events (no event has args.stream) and no collectives "
            f"(NCCL kernels, gloo:* annotations or c10d:: ops). Record GPU activity with "
            f"torch.profiler.profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) in a job that "
            f"runs torch.distributed collectives.")
    return False


def analyze_traces(run: KinetoRun) -> TraceMetrics:
    """Temporal breakdown, comm/comp overlap and kernel-type split of a loaded trace folder, every step kept."""
    has_gpu = check_gpu_coverage(run)
    kernels = kernels_in_steps(run.kernels, run.steps) if has_gpu else run.kernels
    return TraceMetrics(
        ranks=tuple(sorted(run.ranks)), steps_analyzed=tuple(run.steps_found), has_gpu_kernels=has_gpu,
        temporal=temporal_breakdown(kernels), temporal_by_step=temporal_breakdown(kernels, by_step=True),
        overlap=comm_comp_overlap(kernels), overlap_by_step=comm_comp_overlap(kernels, by_step=True),
        kernel_types=kernel_type_breakdown(kernels), top_kernels=top_kernels(kernels),
        num_collectives=len(run.collectives))
