"""Per-rank (and per-step) GPU temporal breakdown: idle / compute / non-compute time; read by RunAnalysis and
trace_metrics.

Semantics equal Holistic Trace Analysis 0.5.0 ``get_temporal_breakdown`` so results can be checked against it:
- every GPU event counts (kernels, memcpy, memset, stream syncs), intervals merged over all streams;
- ``kernel_time_us`` = first GPU event start -> last merged end; ``idle`` = kernel_time - union(all events);
  ``compute`` = union(compute kernels); ``non_compute`` = the rest (communication and memory not hidden by compute);
- times in whole microseconds, starts rounded up and ends down (HTA rounds ns-resolution ``ts`` this way,
  pytorch/pytorch#122425: float timestamps otherwise make back-to-back kernels overlap).
Unlike HTA, every ProfilerStep is analysed (HTA drops the last of two or more, its issue #76): a Kineto source
yields the kernels of its profiled steps (``dtprobe.store.kineto_window``), so these functions take the
``kernels`` table as the source gives it.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from dtprobe.intervals import covered, merge_intervals
from dtprobe.store.columns import require_columns

KERNEL_COLUMNS = ("rank", "kind", "start_ns", "dur_ns")
"""Columns of the ``kernels`` table these analyses need (``step``/``launch_ns`` for step selection)."""

TEMPORAL_COLUMNS = [
    "rank", "idle_frac", "compute_frac", "non_compute_frac", "kernel_time_us", "idle_us", "compute_us",
    "non_compute_us", "num_kernels",
]
"""Final columns of ``temporal_breakdown`` (``by_step=True`` inserts ``step`` after ``rank``)."""


def quantized_us(kernels: pd.DataFrame) -> tuple[np.ndarray, np.ndarray]:
    """(start_us, end_us) int64: start rounded up, end (start + dur) rounded down to whole microseconds."""
    start = kernels["start_ns"].to_numpy(dtype=np.int64, na_value=0)
    end = start + kernels["dur_ns"].to_numpy(dtype=np.int64, na_value=0)
    return -((-start) // 1000), end // 1000


def sweep_states(groups: list[tuple[np.ndarray, np.ndarray]]) -> tuple[np.ndarray, np.ndarray]:
    """Exclusive time per combination of interval sets: set ``i`` contributes bit ``1 << i``.

    Returns (state, duration) over the elementary segments between consecutive boundaries; ``state`` is the
    bitmask of sets covering the segment (each set must already be merged).
    """
    times, deltas = [], []
    for i, (s, e) in enumerate(groups):
        bit = 1 << i
        times += [s, e]
        deltas += [np.full(len(s), bit, np.int64), np.full(len(e), -bit, np.int64)]
    if not times:
        return np.empty(0, np.int64), np.empty(0, np.int64)
    t = np.concatenate(times)
    d = np.concatenate(deltas)
    order = np.argsort(t, kind="stable")
    t, d = t[order], d[order]
    state = np.cumsum(d)
    return state[:-1], np.diff(t)


def _breakdown_one(start: np.ndarray, end: np.ndarray, is_compute: np.ndarray) -> tuple[int, int, int, int]:
    ms, me = merge_intervals(start, end)
    kernel_time = int(me[-1] - ms[0])
    idle = kernel_time - covered(ms, me)
    compute = covered(*merge_intervals(start[is_compute], end[is_compute]))
    return kernel_time, idle, compute, kernel_time - compute - idle


def temporal_breakdown(kernels: pd.DataFrame, *, by_step: bool = False) -> pd.DataFrame:
    """Per rank (or per rank and step, ``by_step``): idle, compute and non-compute share of the GPU span.

    Columns: rank, [step,] idle_frac, compute_frac, non_compute_frac (0..1 of kernel_time_us), kernel_time_us,
    idle_us, compute_us, non_compute_us, num_kernels. Ranks (steps) without GPU events are absent; with
    ``by_step`` kernels launched outside any ProfilerStep (step -1) are left out.
    """
    require_columns(kernels, KERNEL_COLUMNS + (("step",) if by_step else ()), table="kernels")
    keys = ["rank", "step"] if by_step else ["rank"]
    columns = TEMPORAL_COLUMNS[:1] + (["step"] if by_step else []) + TEMPORAL_COLUMNS[1:]
    data = _in_steps(kernels) if by_step else kernels
    start, end = quantized_us(data)
    is_compute = (data["kind"] == "compute").to_numpy(dtype=bool, na_value=False)
    rows = []
    for key, idx in _groups(data, keys):
        kt, idle, comp, non = _breakdown_one(start[idx], end[idx], is_compute[idx])
        rows.append((*key, kt, idle, comp, non, len(idx)))
    out = pd.DataFrame(rows, columns=keys + ["kernel_time_us", "idle_us", "compute_us", "non_compute_us",
                                             "num_kernels"])
    span = out["kernel_time_us"].where(out["kernel_time_us"] > 0)
    for part in ("idle", "compute", "non_compute"):
        out[f"{part}_frac"] = out[f"{part}_us"] / span
    return out[columns]


def _in_steps(kernels: pd.DataFrame) -> pd.DataFrame:
    """The rows of kernels launched inside a ProfilerStep (step >= 0), with only the columns the per-step
    breakdowns read: no copy of the long kernel names."""
    keep = kernels["step"].ge(0).to_numpy(dtype=bool, na_value=False)
    return kernels.loc[keep, list(dict.fromkeys(KERNEL_COLUMNS + ("step",)))]


def _groups(data: pd.DataFrame, keys: list[str]) -> list[tuple[tuple, np.ndarray]]:
    """(key tuple, positional indices) per group, sorted by key."""
    if data.empty:
        return []
    codes = data[keys].astype("int64")
    groups = codes.groupby(keys, sort=True).indices
    return [((k,) if not isinstance(k, tuple) else k, idx) for k, idx in groups.items()]
