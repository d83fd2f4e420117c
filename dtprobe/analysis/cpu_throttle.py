"""CPU time withheld from each rank by its cgroup's quota, per step: the host sampler's cumulative
``cpu_throttled_ns`` (``devices`` rows, ``collectors.devices.CpuThrottle``) read at each step's start and end.

A rank whose container hits its CPU limit is frozen for the rest of every quota period: it computes slower, in
bursts, for a reason outside the job. The kernel counts that time; the straggler detector reads it beside the
rank's lateness (``stragglers.straggler_scores``' CPU-throttle view), as it reads NVML's throttle reasons for a GPU.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

THROTTLE_COLUMNS = ["rank", "step", "cpu_throttled_frac"]
"""``cpu_throttled_frac``: the time the rank's cgroup was throttled during the step, summed over the cgroup's CPUs,
over the step's wall time (0 when never throttled; above 1 only for a cgroup throttled on several CPUs at once)."""


def cpu_throttled_per_step(devices: pd.DataFrame, steps: pd.DataFrame) -> pd.DataFrame:
    """Per (rank, step) inside the span the rank's samples cover: ``cpu_throttled_frac``. The counter between two
    samples is interpolated linearly (samples come every ``device_interval_s``, steps are shorter), so a window of
    steps gets the throttled share of the samples it spans. A counter that drops started again (a restarted
    process counts from 0). Empty when no sample carries the counter (no cgroup CPU controller, an older run).
    Columns: ``THROTTLE_COLUMNS``."""
    empty = pd.DataFrame({"rank": pd.Series([], dtype="int64"), "step": pd.Series([], dtype="int64"),
                          "cpu_throttled_frac": pd.Series([], dtype="float64")})
    if devices is None or devices.empty or "cpu_throttled_ns" not in devices.columns or steps.empty:
        return empty
    d = devices[["rank", "time_ns", "cpu_throttled_ns"]].dropna()
    s = steps[["rank", "step", "start_ns", "end_ns"]].dropna()
    if d.empty or s.empty:
        return empty
    d = d.sort_values(["rank", "time_ns"], kind="stable")
    rows_of = s.groupby(s["rank"].to_numpy(dtype="int64")).indices     # each rank's steps located once
    out = []
    for rank, g in d.groupby("rank", sort=False):
        t = g["time_ns"].to_numpy(dtype="int64")
        c = g["cpu_throttled_ns"].to_numpy(dtype="float64")
        if len(t) < 2:
            continue
        inc = np.diff(c)
        inc = np.where(inc < 0, c[1:], inc)                     # a drop: a new process, counting from 0
        cum = np.concatenate([[0.0], np.cumsum(inc)])
        if int(rank) not in rows_of:
            continue
        mine = s.iloc[rows_of[int(rank)]]
        start = mine["start_ns"].to_numpy(dtype="int64")
        end = mine["end_ns"].to_numpy(dtype="int64")
        inside = (start >= t[0]) & (end <= t[-1]) & (end > start)
        if not inside.any():
            continue
        start, end = start[inside], end[inside]
        withheld = np.interp(end, t, cum) - np.interp(start, t, cum)
        out.append(pd.DataFrame({"rank": int(rank), "step": mine["step"].to_numpy(dtype="int64")[inside],
                                 "cpu_throttled_frac": withheld / (end - start)}))
    if not out:
        return empty
    return pd.concat(out, ignore_index=True).drop_duplicates(["rank", "step"], keep="last")[THROTTLE_COLUMNS]
