"""CPU time each rank lost, per step, from two cumulative counters the host sampler keeps (``devices`` rows,
``collectors.devices``), read at each step's start and end:

- ``cpu_throttled_ns`` (``CpuThrottle``): time the rank's cgroup was held back by its CPU quota. A rank whose
  container hits its CPU limit is frozen for the rest of every quota period: it computes slower, in bursts, for a
  reason outside the job. The straggler detector reads it beside the rank's lateness (``straggler_scores``'
  CPU-throttle view), as it reads NVML's throttle reasons for a GPU.
- ``cpu_wait_ns`` (``RunQueueWait``): time the rank's main thread was runnable but waited for a CPU: taken by
  another process or thread on its core, or withheld by its quota (the kernel counts both). The straggler finding
  reports it as evidence and names a shared core as the reason when it explains the rank's lateness and the quota
  does not.
- ``cpu_time_ns`` (``HostReader``): the CPU time the rank's process used (all its threads). A rank late by its own
  compute uses more CPU per step than its peers; one that is late while using no more was off the CPU (asleep,
  blocked in I/O or a lock): the straggler finding of a run on CPU tells which.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

THROTTLE_COLUMNS = ["rank", "step", "cpu_throttled_frac"]
"""``cpu_throttled_frac``: the time the rank's cgroup was throttled during the step, summed over the cgroup's CPUs,
over the step's wall time (0 when never throttled; above 1 only for a cgroup throttled on several CPUs at once)."""
WAIT_COLUMNS = ["rank", "step", "cpu_wait_frac"]
"""``cpu_wait_frac``: the time the rank's main thread waited for a CPU during the step, over the step's wall time
(0..1)."""
BUSY_COLUMNS = ["rank", "step", "cpu_busy_frac"]
"""``cpu_busy_frac``: the CPU time the rank's process used during the step (all its threads) over the step's wall
time: cores' worth, above 1 for a process computing on several cores at once."""


SAMPLE_COLUMNS = ["rank", "time_ns", "cpu_throttled_ns", "cpu_wait_ns", "cpu_time_ns"]
"""The ``devices`` columns the per-step shares below read (the host sampler's cumulative counters)."""


def cpu_throttled_per_step(devices: pd.DataFrame, steps: pd.DataFrame) -> pd.DataFrame:
    """Per (rank, step) inside the span the rank's samples cover: ``cpu_throttled_frac`` (``counter_per_step`` of
    ``cpu_throttled_ns``). Empty when no sample carries the counter (no cgroup CPU controller, an older run).
    Columns: ``THROTTLE_COLUMNS``."""
    return counter_per_step(devices, steps, "cpu_throttled_ns", "cpu_throttled_frac")


def cpu_wait_per_step(devices: pd.DataFrame, steps: pd.DataFrame) -> pd.DataFrame:
    """Per (rank, step) inside the span the rank's samples cover: ``cpu_wait_frac`` (``counter_per_step`` of
    ``cpu_wait_ns``). Empty when no sample carries the counter (no schedstat, an older run). Columns:
    ``WAIT_COLUMNS``."""
    return counter_per_step(devices, steps, "cpu_wait_ns", "cpu_wait_frac")


def cpu_busy_per_step(devices: pd.DataFrame, steps: pd.DataFrame) -> pd.DataFrame:
    """Per (rank, step) inside the span the rank's samples cover: ``cpu_busy_frac`` (``counter_per_step`` of
    ``cpu_time_ns``). Empty when no sample carries the counter (an older run). Columns: ``BUSY_COLUMNS``."""
    return counter_per_step(devices, steps, "cpu_time_ns", "cpu_busy_frac")


def counter_per_step(devices: pd.DataFrame, steps: pd.DataFrame, counter: str, name: str) -> pd.DataFrame:
    """Per (rank, step) inside the span the rank's samples cover: the growth of the cumulative ns ``counter`` over
    the step, over the step's wall time, as column ``name``. The counter between two samples is interpolated
    linearly (samples come every ``device_interval_s``, steps are shorter), so a window of steps gets the share of
    the samples it spans. A counter that drops started again (a restarted process counts from 0). Empty when no
    sample carries the counter. Columns: rank, step, ``name``."""
    empty = pd.DataFrame({"rank": pd.Series([], dtype="int64"), "step": pd.Series([], dtype="int64"),
                          name: pd.Series([], dtype="float64")})
    if devices is None or devices.empty or counter not in devices.columns or steps.empty:
        return empty
    d = devices[["rank", "time_ns", counter]].dropna()
    s = steps[["rank", "step", "start_ns", "end_ns"]].dropna()
    if d.empty or s.empty:
        return empty
    d = d.sort_values(["rank", "time_ns"], kind="stable")
    rows_of = s.groupby(s["rank"].to_numpy(dtype="int64")).indices     # each rank's steps located once
    out = []
    for rank, g in d.groupby("rank", sort=False):
        t = g["time_ns"].to_numpy(dtype="int64")
        c = g[counter].to_numpy(dtype="float64")
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
        lost = np.interp(end, t, cum) - np.interp(start, t, cum)
        out.append(pd.DataFrame({"rank": int(rank), "step": mine["step"].to_numpy(dtype="int64")[inside],
                                 name: lost / (end - start)}))
    if not out:
        return empty
    return pd.concat(out, ignore_index=True).drop_duplicates(["rank", "step"], keep="last")[["rank", "step", name]]
