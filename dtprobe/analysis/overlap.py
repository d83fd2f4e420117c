"""Per-rank communication/computation overlap of GPU kernels; read by trace_metrics and RunAnalysis.

``overlap_frac`` = time(union of communication kernels ∩ union of compute kernels) / time(union of communication
kernels), per rank: the share of communication hidden behind compute (HTA 0.5.0 ``get_comm_comp_overlap``,
whole-microsecond rounding as in ``temporal``). Exposed communication = ``comm_us - overlap_us``.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from dtprobe.analysis.temporal import KERNEL_COLUMNS, _groups, _in_steps, quantized_us, sweep_states
from dtprobe.intervals import merge_intervals
from dtprobe.store.columns import require_columns

OVERLAP_COLUMNS = ["rank", "overlap_frac", "comm_us", "overlap_us", "exposed_comm_us"]
"""Final columns of ``comm_comp_overlap`` (``by_step=True`` inserts ``step`` after ``rank``)."""


def comm_comp_overlap(kernels: pd.DataFrame, *, by_step: bool = False) -> pd.DataFrame:
    """Per rank (or rank and step): share of communication kernel time overlapped by compute kernels.

    Columns: rank, [step,] overlap_frac (0..1; NaN when the rank ran no communication kernel), comm_us,
    overlap_us, exposed_comm_us.
    """
    require_columns(kernels, KERNEL_COLUMNS + (("step",) if by_step else ()), table="kernels")
    keys = ["rank", "step"] if by_step else ["rank"]
    data = _in_steps(kernels) if by_step else kernels
    start, end = quantized_us(data)
    kind = data["kind"].to_numpy(dtype=object, na_value="")
    is_comm, is_comp = kind == "comm", kind == "compute"
    rows = []
    for key, idx in _groups(data, keys):
        s, e = start[idx], end[idx]
        comm = merge_intervals(s[is_comm[idx]], e[is_comm[idx]])
        comp = merge_intervals(s[is_comp[idx]], e[is_comp[idx]])
        state, dur = sweep_states([comm, comp])
        comm_us = int((comm[1] - comm[0]).sum())
        overlap_us = int(dur[state == 3].sum())
        rows.append((*key, comm_us, overlap_us))
    out = pd.DataFrame(rows, columns=keys + ["comm_us", "overlap_us"])
    out["overlap_frac"] = out["overlap_us"] / out["comm_us"].where(out["comm_us"] > 0)
    out["exposed_comm_us"] = out["comm_us"] - out["overlap_us"]
    return out[OVERLAP_COLUMNS[:1] + (["step"] if by_step else []) + OVERLAP_COLUMNS[1:]]
