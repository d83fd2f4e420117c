"""GPU kernel breakdown: exclusive time per kernel-type combination, and each rank's top kernels per type.

Read by trace_metrics and RunAnalysis. Equal to HTA 0.5.0 ``get_gpu_kernel_breakdown(include_memory_kernels=True)``:
the time the GPU ran only compute, only communication, compute overlapping communication, ... summed over ranks
(types: COMPUTATION, COMMUNICATION, MEMORY; ``other`` events such as stream syncs are left out), and per rank and
type the kernels covering ``duration_ratio`` of the time, at most ``num_kernels``, the rest grouped as ``others``.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from dtprobe.analysis.temporal import KERNEL_COLUMNS, _groups, quantized_us, sweep_states
from dtprobe.intervals import merge_intervals
from dtprobe.store.columns import require_columns

KERNEL_TYPES = {"compute": "COMPUTATION", "comm": "COMMUNICATION", "memory": "MEMORY"}
"""``kernels.kind`` -> HTA's kernel type label, in HTA's bit order (labels combine in this order)."""

TYPE_COLUMNS = ["kernel_type", "sum_us", "frac"]
TOP_COLUMNS = ["rank", "kernel_type", "name", "sum_us", "max_us", "min_us", "mean_us", "std_us", "count"]


def _label(state: int) -> str:
    names = [label for bit, label in enumerate(KERNEL_TYPES.values()) if state & (1 << bit)]
    return " overlapping ".join(names)


def kernel_type_breakdown(kernels: pd.DataFrame) -> pd.DataFrame:
    """Exclusive GPU time of each kernel-type combination over all ranks.

    Columns: kernel_type (``COMPUTATION``, ``COMMUNICATION``, ``MEMORY``, ``COMPUTATION overlapping
    COMMUNICATION`` ...), sum_us, frac (share of the total, 0..1); largest first.
    """
    return kernel_type_table(kernel_type_sums(kernels))


def kernel_type_sums(kernels: pd.DataFrame) -> dict[int, int]:
    """Exclusive microseconds per kernel-type combination (a bitmask of ``KERNEL_TYPES``) summed over the ranks
    of ``kernels``: sums of disjoint sets of ranks add up (``kernel_type_table`` turns them into the breakdown)."""
    require_columns(kernels, KERNEL_COLUMNS, table="kernels")
    start, end = quantized_us(kernels)
    kind = kernels["kind"].to_numpy(dtype=object, na_value="")
    totals: dict[int, int] = {}
    for _, idx in _groups(kernels, ["rank"]):
        sets = [merge_intervals(start[idx][kind[idx] == k], end[idx][kind[idx] == k]) for k in KERNEL_TYPES]
        state, dur = sweep_states(sets)
        live = state > 0
        sums = pd.Series(dur[live]).groupby(state[live]).sum()
        for s, d in sums.items():
            totals[int(s)] = totals.get(int(s), 0) + int(d)
    return totals


def kernel_type_table(totals: dict[int, int]) -> pd.DataFrame:
    """``kernel_type_breakdown`` of ``kernel_type_sums``. Columns: TYPE_COLUMNS."""
    out = pd.DataFrame({"kernel_type": [_label(s) for s in totals], "sum_us": list(totals.values())},
                       columns=["kernel_type", "sum_us"]).astype({"sum_us": "int64"})
    out = out.sort_values(["sum_us", "kernel_type"], ascending=[False, True], ignore_index=True)
    total = out["sum_us"].sum()
    out["frac"] = out["sum_us"] / total if total > 0 else np.nan
    return out[TYPE_COLUMNS]


def top_kernels(kernels: pd.DataFrame, *, num_kernels: int = 10, duration_ratio: float = 0.8) -> pd.DataFrame:
    """Per rank and kernel type, the kernels taking the most GPU time (HTA ``_aggr_gpu_kernel_time``).

    When a (rank, type) has more than ``num_kernels`` distinct kernels, those past the ``duration_ratio``
    quantile of cumulative time or past the first ``num_kernels`` become one ``others`` row.
    Columns: rank, kernel_type, name, sum_us, max_us, min_us, mean_us, std_us, count.
    """
    require_columns(kernels, KERNEL_COLUMNS + ("name",), table="kernels")
    start, end = quantized_us(kernels)
    # names as integer codes numbered in name order (grouping by them is grouping by name, without a string
    # column of every kernel); a group's few names are looked up after its aggregation
    name_code, names = pd.factorize(kernels["name"], sort=True)
    kind_code, kinds = pd.factorize(kernels["kind"])
    type_code = np.append(pd.Index(kinds).map(KERNEL_TYPES).to_numpy(dtype=object, na_value=None), None)
    data = pd.DataFrame({"rank": kernels["rank"].to_numpy(dtype=np.int64), "name": name_code,
                         "kernel_type": type_code[kind_code], "dur": end - start})
    data = data[data["kernel_type"].notna() & (name_code >= 0)]
    names = np.asarray(names, dtype=object)
    # one aggregation over every (rank, type, name), in key order: each (rank, type) block is what aggregating
    # that group alone gives
    every = data.groupby(["rank", "kernel_type", "name"], sort=True)["dur"].agg(
        ["sum", "max", "min", "mean", "std", "count"]).reset_index()
    every["name"] = names[every["name"].to_numpy()]
    frames = []
    for (rank, ktype), block in every.groupby(["rank", "kernel_type"], sort=True):
        agg = block.drop(columns=["rank", "kernel_type"]).reset_index(drop=True)
        agg = agg.sort_values("sum", ascending=False, ignore_index=True).fillna({"std": 0.0})
        if len(agg) > num_kernels:
            cumsum = agg["sum"].cumsum()
            past = (cumsum > cumsum.quantile(duration_ratio)) | (agg.index >= num_kernels)
            agg.loc[past, "name"] = "others"
            agg = (agg.groupby("name")
                   .agg(sum=("sum", "sum"), max=("sum", "max"), min=("sum", "min"), mean=("sum", "mean"),
                        std=("sum", "std"), count=("count", "sum"))
                   .reset_index().fillna({"std": 0.0}).sort_values("sum", ascending=False, ignore_index=True))
        agg.insert(0, "kernel_type", ktype)
        agg.insert(0, "rank", rank)
        frames.append(agg)
    if not frames:
        return pd.DataFrame(columns=TOP_COLUMNS)
    out = pd.concat(frames, ignore_index=True).rename(columns={
        "sum": "sum_us", "max": "max_us", "min": "min_us", "mean": "mean_us", "std": "std_us"})
    return out[TOP_COLUMNS]
