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


def last_step_ends_us(steps: pd.DataFrame) -> pd.Series | None:
    """Per rank, the end of its last ProfilerStep in whole microseconds; None when the folder has fewer than two
    distinct steps (then every event is kept)."""
    if steps.empty or steps["step"].nunique() < 2:
        return None
    return steps.groupby("rank")["end_ns"].max().astype("int64") // 1000


def launched_in_steps(rank: np.ndarray, launch_ns: np.ndarray, has_launch: np.ndarray,
                      last_end_us: pd.Series) -> np.ndarray:
    """Which events to keep (``kernels_in_steps``): launched at or before the end of their rank's last step, or of
    a rank with no step; ``launch_ns`` is read only where ``has_launch``."""
    at = np.searchsorted(last_end_us.index.to_numpy(dtype=np.int64), rank)
    at_clipped = np.minimum(at, len(last_end_us) - 1)
    has_limit = (at < len(last_end_us)) & (last_end_us.index.to_numpy(dtype=np.int64)[at_clipped] == rank)
    limit = last_end_us.to_numpy(dtype=np.int64)[at_clipped]
    launch_us = -((-np.where(has_launch, launch_ns, 0)) // 1000)
    return (has_launch & (launch_us <= limit)) | ~has_limit


def kernels_in_steps(kernels: pd.DataFrame, steps: pd.DataFrame) -> pd.DataFrame:
    """The GPU events of the profiled steps, every step included (HTA with ``include_last_profiler_step=True``).

    With two or more distinct ProfilerSteps, keep events whose launching host call started at or before the
    end of the rank's last step (drops warm-up/teardown work after the window and events with no known
    launch); with fewer, keep everything. A rank with no ProfilerStep keeps all its events.
    """
    require_columns(kernels, KERNEL_WINDOW_COLUMNS, table="kernels")
    last_end_us = last_step_ends_us(steps)
    if last_end_us is None:
        return kernels
    keep = launched_in_steps(kernels["rank"].to_numpy(dtype=np.int64),
                             kernels["launch_ns"].to_numpy(dtype=np.int64, na_value=0),
                             kernels["launch_ns"].notna().to_numpy(dtype=bool), last_end_us)
    return kernels if keep.all() else kernels[keep]


def check_gpu_coverage(ranks_with_gpu: set[int], *, has_collectives: bool, ranks: Mapping[int, RankMeta]) -> bool:
    """True when every rank has GPU events, False for a CPU-only trace with collectives; else TraceError.

    A rank without GPU events next to ranks with them, or a trace with neither GPU events nor collectives,
    cannot be analysed: the error names the files.
    """
    with_gpu = set(ranks_with_gpu)
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
    if not has_collectives:
        raise TraceError(
            f"nothing to analyse in {files}: no GPU events (no event has args.stream) and no collectives "
            f"(NCCL kernels, gloo:* annotations or c10d:: ops). Record GPU activity with "
            f"torch.profiler.profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) in a job that "
            f"runs torch.distributed collectives.")
    return False
