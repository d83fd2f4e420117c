"""Small shared helpers of the analyzers: required-column checks, step windows, interval unions, size labels."""

from __future__ import annotations

from typing import Iterable

import numpy as np
import pandas as pd

from dtprobe.store.errors import TraceError

P2P_OPS = frozenset({"send", "recv"})
"""Point-to-point ops: numbered per (pg, peer), never part of a collective's arrival skew."""


def require_columns(df: pd.DataFrame, columns: Iterable[str], *, table: str) -> None:
    """TraceError naming ``table`` and the missing columns unless ``df`` has all of ``columns``."""
    missing = [c for c in columns if c not in df.columns]
    if missing:
        raise TraceError(
            f"table '{table}' lacks the columns {missing} (it has {sorted(df.columns)}); it was not read "
            f"through dtprobe.store.RunStore or was written by another tool. Read the run with "
            f"RunStore.open(path).table('{table}'), or re-collect it with this dtprobe.")


def step_durations(steps: pd.DataFrame) -> pd.DataFrame:
    """Per (rank, step): ``step_ns`` = end - start; rows without both timestamps dropped. Columns: rank, step, step_ns."""
    require_columns(steps, ["rank", "step", "start_ns", "end_ns"], table="steps")
    ok = steps.dropna(subset=["start_ns", "end_ns"])
    out = pd.DataFrame({
        "rank": ok["rank"].astype("int64"), "step": ok["step"].astype("int64"),
        "step_ns": (ok["end_ns"] - ok["start_ns"]).astype("int64"),
    })
    return out[["rank", "step", "step_ns"]].reset_index(drop=True)


def analyzed_steps(steps: pd.DataFrame, *, skip_first: int = 1) -> list[int]:
    """Steps analysed: every step some rank finished, minus the first ``skip_first`` (warm-up: DDP rebuilds
    its buckets and allocators warm up on the first step), unless that would leave nothing."""
    if steps.empty:
        return []
    done = sorted(int(s) for s in steps.dropna(subset=["end_ns"])["step"].unique())
    return done[skip_first:] if len(done) > skip_first else done


def median_step_ns(steps: pd.DataFrame, step_ids: Iterable[int] | None = None) -> float | None:
    """Median step time over ranks and ``step_ids`` (all finished steps when None); None without steps."""
    durations = step_durations(steps)
    if step_ids is not None:
        durations = durations[durations["step"].isin(list(step_ids))]
    if durations.empty:
        return None
    return float(durations["step_ns"].median())


def union_length(starts: np.ndarray, ends: np.ndarray) -> int:
    """Total length covered by the intervals [start, end) (overlaps counted once)."""
    if len(starts) == 0:
        return 0
    order = np.argsort(starts, kind="stable")
    s, e = np.asarray(starts)[order], np.asarray(ends)[order]
    total, cur_s, cur_e = 0, s[0], e[0]
    for a, b in zip(s[1:], e[1:]):
        if a > cur_e:
            total += cur_e - cur_s
            cur_s, cur_e = a, b
        elif b > cur_e:
            cur_e = b
    return int(total + cur_e - cur_s)


def group_members(pg_ranks: str | None) -> tuple[int, ...]:
    """``"0,2"`` -> (0, 2); empty or null -> ()."""
    if pg_ranks is None or pg_ranks is pd.NA or not str(pg_ranks).strip():
        return ()
    return tuple(int(r) for r in str(pg_ranks).split(",") if r.strip())


def axis_of(pg: str | None) -> str | None:
    """The parallel axis a process-group name denotes: ``dp``, ``tp``, ``pp`` (``dp_shard`` -> dp), else None."""
    if pg is None or pg is pd.NA:
        return None
    name = str(pg).lower()
    for axis in ("dp", "tp", "pp"):
        if name == axis or name.startswith(axis + "_") or name.endswith("_" + axis):
            return axis
    return None


def size_label(num_bytes: float) -> str:
    """Human size of a power-of-two bucket: 512 -> '512 B', 65536 -> '64 KiB'."""
    value = float(num_bytes)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{value:.0f} {unit}" if value == int(value) else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.0f} GiB"


def ms(ns: float | None) -> float | None:
    """Nanoseconds -> milliseconds rounded to 3 decimals (None stays None)."""
    if ns is None or pd.isna(ns):
        return None
    return round(float(ns) / 1e6, 3)
