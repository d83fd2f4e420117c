"""The kernels a Kineto trace folder's analyses count: its profiled steps' GPU events, after checking that every
rank has some; read by ``KinetoRun.table("kernels")`` (and so by every kernel-level analysis of a trace folder).

A profiler window is cut on each rank on its own and ends with work launched after the last ProfilerStep
(warm-up of the next window, teardown): the filter keeps what the steps launched, every step included (Holistic
Trace Analysis with ``include_last_profiler_step=True``).
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import pandas as pd

from dtprobe.store.columns import require_columns
from dtprobe.store.errors import TraceError
from dtprobe.store.kineto_events import RankMeta

KERNEL_WINDOW_COLUMNS = ("rank", "kind", "start_ns", "dur_ns", "launch_ns")
"""Columns of the ``kernels`` table the window filter reads."""


def kernels_in_steps(kernels: pd.DataFrame, steps: pd.DataFrame) -> pd.DataFrame:
    """The GPU events of the profiled steps, every step included (HTA with ``include_last_profiler_step=True``).

    With two or more distinct ProfilerSteps, keep events whose launching host call started at or before the
    end of the rank's last step (drops warm-up/teardown work after the window and events with no known
    launch); with fewer, keep everything. A rank with no ProfilerStep keeps all its events.
    """
    require_columns(kernels, KERNEL_WINDOW_COLUMNS, table="kernels")
    if steps.empty or steps["step"].nunique() < 2:
        return kernels
    last_end_us = (steps.groupby("rank")["end_ns"].max().astype("int64") // 1000)
    rank = kernels["rank"].to_numpy(dtype=np.int64)
    at = np.searchsorted(last_end_us.index.to_numpy(dtype=np.int64), rank)
    at_clipped = np.minimum(at, len(last_end_us) - 1)
    has_limit = (at < len(last_end_us)) & (last_end_us.index.to_numpy(dtype=np.int64)[at_clipped] == rank)
    limit = last_end_us.to_numpy(dtype=np.int64)[at_clipped]
    has_launch = kernels["launch_ns"].notna().to_numpy(dtype=bool)
    launch_us = -((-kernels["launch_ns"].to_numpy(dtype=np.int64, na_value=0)) // 1000)
    keep = (has_launch & (launch_us <= limit)) | ~has_limit
    return kernels if keep.all() else kernels[keep]


def check_gpu_coverage(kernels: pd.DataFrame, collectives: pd.DataFrame, ranks: Mapping[int, RankMeta]) -> bool:
    """True when every rank has GPU events, False for a CPU-only trace with collectives; else TraceError.

    A rank without GPU events next to ranks with them, or a trace with neither GPU events nor collectives,
    cannot be analysed: the error names the files.
    """
    with_gpu = set(int(r) for r in kernels["rank"].unique())
    without = [r for r in ranks if r not in with_gpu]
    if not without:
        return True
    files = ", ".join(f"rank {r}: {ranks[r].path}" + (
        " (no distributedInfo: read as a single-process trace)"
        if ranks[r].rank_source == "single-process" else "") for r in without)
    if with_gpu:
        raise TraceError(
            f"no GPU events (no event has args.stream) in {files}, while ranks {sorted(with_gpu)} have them. "
            f"Was that rank profiled without ProfilerActivity.CUDA? Re-record it with activities=[CPU, CUDA], or "
            f"remove the file from the folder to analyse the other ranks.")
    if collectives.empty:
        raise TraceError(
            f"nothing to analyse in {files}: no GPU events (no event has args.stream) and no collectives "
            f"(NCCL kernels, gloo:* annotations or c10d:: ops). Record GPU activity with "
            f"torch.profiler.profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) in a job that "
            f"runs torch.distributed collectives.")
    return False


def analysed_kernels(kernels: pd.DataFrame, steps: pd.DataFrame, collectives: pd.DataFrame,
                     ranks: Mapping[int, RankMeta]) -> pd.DataFrame:
    """The ``kernels`` table of a trace folder as analyses see it: the profiled steps' events when every rank has
    GPU events, all of them (none) for a CPU-only trace; TraceError for a trace that cannot be analysed."""
    return kernels_in_steps(kernels, steps) if check_gpu_coverage(kernels, collectives, ranks) else kernels
