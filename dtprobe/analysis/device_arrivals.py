"""Arrival, wait and transfer of each collective on the device clock, and STRAGGLER from them; read by the facade
(``dtprobe analyze``: ``metrics.arrivals``, findings) for Kineto trace folders, whose ranks keep their own clocks.

Input: matched collectives (``collective_matching``) moved onto the reference rank's clock
(``clock_alignment.corrected``). An NCCL kernel starts when its stream reaches the collective and then spins until
every member has arrived, so a member's kernel start is its device arrival:
- *lateness* of a member = its start minus the median start of the other members;
- *wait* of a member = the last member's start minus its own start (time spent waiting for peers);
- *transfer* = the last start to the end; the collective's true latency is the shortest member duration (the
  last arriver does not wait), which needs no clock at all; algbw/busbw are computed from it.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pandas as pd

from dtprobe.analysis.arrivals import lateness_vs_peers
from dtprobe.analysis.clocks import DEVICE
from dtprobe.analysis.findings import Finding, PredictedGain
from dtprobe.analysis.tables import axis_of, group_members, group_phrase
from dtprobe.store.columns import require_columns

MIN_MATCHED_COLLECTIVES = 20
"""Matched collectives a group needs before STRAGGLER judges its arrivals on the device clock."""
MIN_LAST_FRAC = 0.5
"""A device straggler starts last in at least this share of its group's collectives."""
CRITICAL_WAIT_FRAC = 0.2
"""Critical when the group's waits on the straggler are at least this share of the profiled time."""

ARRIVAL_INPUT_COLUMNS = ("coll_id", "pg", "pg_ranks", "step", "op", "num_bytes", "rank", "start_ns", "end_ns")
MEMBER_COLUMNS = ["coll_id", "pg", "pg_ranks", "step", "op", "num_bytes", "rank", "start_ns", "end_ns", "dur_us",
                  "lateness_us", "wait_us", "transfer_us", "is_last"]
COLLECTIVE_COLUMNS = ["coll_id", "pg", "pg_ranks", "step", "op", "num_bytes", "group_size", "last_rank",
                      "wait_us", "latency_us", "end_spread_us", "algbw_gb_per_s", "busbw_gb_per_s"]
SUMMARY_COLUMNS = ["rank", "pg", "pg_ranks", "num_collectives", "last_frac", "median_lateness_us",
                   "positive_frac", "caused_wait_us", "group_span_us"]

_BUS_FACTOR: dict[str, Callable[[int], float]] = {
    "allreduce": lambda n: 2 * (n - 1) / n, "allgather": lambda n: (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n, "alltoall": lambda n: (n - 1) / n,
    "broadcast": lambda n: 1.0, "reduce": lambda n: 1.0,
}
"""busbw = algbw x factor(group size), as nccl-tests defines it; ops without one get no busbw."""


def member_arrivals(corrected: pd.DataFrame) -> pd.DataFrame:
    """Per (collective, member), times on the reference clock: duration, lateness against the other members'
    median start, wait for the last member, transfer (last start to own end), whether it started last (ties:
    every member at the latest start). Columns: MEMBER_COLUMNS."""
    require_columns(corrected, ARRIVAL_INPUT_COLUMNS, table="corrected_collectives")
    if corrected.empty:
        return pd.DataFrame(columns=MEMBER_COLUMNS)
    d = corrected.sort_values(["coll_id", "rank"], kind="stable").reset_index(drop=True)
    start = d["start_ns"].to_numpy(dtype="int64")
    end = d["end_ns"].to_numpy(dtype="int64")
    g = d.groupby("coll_id", sort=False)["start_ns"]
    last = g.transform("max").to_numpy(dtype="int64")
    d["dur_us"] = (end - start) / 1e3
    d["lateness_us"] = _lateness_ns(d) / 1e3
    d["wait_us"] = (last - start) / 1e3
    d["transfer_us"] = (end - last) / 1e3
    d["is_last"] = start == last
    return d[MEMBER_COLUMNS]


def _lateness_ns(d: pd.DataFrame) -> np.ndarray:
    """Each row's start minus the median start of the other members of its collective (0 for a collective of one
    member): the arrival core shared with dtprobe runs (``arrivals.lateness_vs_peers``)."""
    late = lateness_vs_peers(d["start_ns"].to_numpy(dtype="int64"), d["coll_id"].to_numpy(dtype="int64"))
    return np.nan_to_num(late, nan=0.0)


def collective_transfer(members: pd.DataFrame) -> pd.DataFrame:
    """Per collective: the last rank to start (lowest of ties), the wait (first to last start), the true latency
    (shortest member duration), how far apart the members' ends are after correction (the alignment's error),
    and algbw/busbw (GB/s, 1e9 bytes per second) of the latency. Columns: COLLECTIVE_COLUMNS."""
    require_columns(members, MEMBER_COLUMNS, table="member_arrivals")
    if members.empty:
        return pd.DataFrame(columns=COLLECTIVE_COLUMNS)
    g = members.groupby("coll_id", sort=True)
    out = g.agg(pg=("pg", "first"), pg_ranks=("pg_ranks", "first"), step=("step", "first"), op=("op", "first"),
                num_bytes=("num_bytes", "max"), group_size=("rank", "size"), wait_us=("wait_us", "max"),
                latency_us=("dur_us", "min"), end_min=("end_ns", "min"), end_max=("end_ns", "max")).reset_index()
    out["last_rank"] = out["coll_id"].map(_last_rank(members)).astype("int64")
    out["end_spread_us"] = (out["end_max"].astype("int64") - out["end_min"].astype("int64")) / 1e3
    latency_s = out["latency_us"].to_numpy(dtype="float64") / 1e6
    nbytes = out["num_bytes"].to_numpy(dtype="float64", na_value=np.nan)
    with np.errstate(divide="ignore", invalid="ignore"):
        algbw = np.where(latency_s > 0, nbytes / latency_s / 1e9, np.nan)
    factor = np.array([_BUS_FACTOR[o](int(n)) if o in _BUS_FACTOR else np.nan
                       for o, n in zip(out["op"], out["group_size"])], dtype=np.float64)
    out["algbw_gb_per_s"] = algbw
    out["busbw_gb_per_s"] = algbw * factor
    return out[COLLECTIVE_COLUMNS]


def _last_rank(members: pd.DataFrame) -> pd.Series:
    """Per coll_id: the lowest of the members that started last."""
    return members.loc[members["is_last"]].groupby("coll_id")["rank"].min()


def last_arrivers(members: pd.DataFrame) -> pd.DataFrame:
    """Per collective of ``member_arrivals``: coll_id, pg, pg_ranks, last_rank, as ``collective_transfer`` gives
    them: what ``arrival_summary`` reads of it."""
    require_columns(members, MEMBER_COLUMNS, table="member_arrivals")
    first = members.drop_duplicates("coll_id")[["coll_id", "pg", "pg_ranks"]]
    return first.assign(last_rank=first["coll_id"].map(_last_rank(members)).astype("int64").to_numpy())


def arrival_summary(members: pd.DataFrame, collectives: pd.DataFrame) -> pd.DataFrame:
    """Per (rank, group): collectives, share it started last, median lateness, share started after its peers'
    median, the group's waits in the collectives it started last (sum over them of the members' mean wait), and
    the span of the group's collectives on the reference clock. Columns: SUMMARY_COLUMNS."""
    require_columns(members, MEMBER_COLUMNS, table="member_arrivals")
    if members.empty:
        return pd.DataFrame(columns=SUMMARY_COLUMNS)
    keys = ["rank", "pg", "pg_ranks"]
    out = members.groupby(keys, sort=True).agg(
        num_collectives=("coll_id", "size"), last_frac=("is_last", "mean"),
        median_lateness_us=("lateness_us", "median"),
        positive_frac=("lateness_us", lambda x: float((x > 0).mean()))).reset_index()
    mean_wait = members.groupby("coll_id")["wait_us"].mean()
    caused = collectives.assign(w=collectives["coll_id"].map(mean_wait)).groupby(
        ["last_rank", "pg", "pg_ranks"])["w"].sum().rename("caused_wait_us").reset_index().rename(
        columns={"last_rank": "rank"})
    span = members.groupby(["pg", "pg_ranks"]).agg(lo=("start_ns", "min"), hi=("end_ns", "max"))
    span = ((span["hi"].astype("int64") - span["lo"].astype("int64")) / 1e3).rename("group_span_us").reset_index()
    out = out.merge(caused, on=keys, how="left").merge(span, on=["pg", "pg_ranks"], how="left")
    out["caused_wait_us"] = out["caused_wait_us"].fillna(0.0)
    out["last_frac"] = out["last_frac"].astype("float64")
    return out[SUMMARY_COLUMNS]


def profiled_us(steps: pd.DataFrame) -> float | None:
    """The profiled steps' length: per rank the sum of its steps' durations (each on its own clock, so no
    alignment is needed), median over ranks; None without steps."""
    require_columns(steps, ["rank", "start_ns", "end_ns"], table="steps")
    s = steps.dropna(subset=["start_ns", "end_ns"])
    if s.empty:
        return None
    per_rank = (s["end_ns"].astype("int64") - s["start_ns"].astype("int64")).groupby(s["rank"]).sum()
    return float(per_rank.median()) / 1e3


def detect_device_stragglers(summary: pd.DataFrame, *, profiled_us: float | None,
                             min_collectives: int = MIN_MATCHED_COLLECTIVES, min_last_frac: float = MIN_LAST_FRAC,
                             min_positive_frac: float = 0.8, min_wait_frac: float = 0.05,
                             critical_wait_frac: float = CRITICAL_WAIT_FRAC, matched_by: str = "seq",
                             axis_of_pg: Callable[[str], str | None] = axis_of) -> list[Finding]:
    """STRAGGLER, on the device clock, for the rank of a group (at least ``min_collectives`` matched
    collectives) that starts last in ``min_last_frac`` of them, after its peers' median in ``min_positive_frac``,
    while the group's waits on it are ``min_wait_frac`` of the profiled time (``profiled_us``: the profiled steps'
    length; the group's span when unknown). One culprit per group: the one starting last most often."""
    require_columns(summary, SUMMARY_COLUMNS, table="arrival_summary")
    if summary.empty:
        return []
    s = summary.copy()
    basis = s["group_span_us"] if profiled_us is None else pd.Series(float(profiled_us), index=s.index)
    s["wait_frac"] = np.where(basis > 0, s["caused_wait_us"] / basis, 0.0)
    ok = ((s["num_collectives"] >= min_collectives) & (s["last_frac"] >= min_last_frac)
          & (s["positive_frac"] >= min_positive_frac) & (s["wait_frac"] >= min_wait_frac))
    flagged = s.loc[ok].sort_values(["last_frac", "median_lateness_us", "rank"], ascending=[False, False, True])
    flagged = flagged.drop_duplicates(["pg", "pg_ranks"])
    findings = []
    for row in flagged.itertuples(index=False):
        members = list(group_members(row.pg_ranks))
        axis = axis_of_pg(row.pg)
        evidence = {
            "rank": int(row.rank), "pg": row.pg, "pg_ranks": members,
            "victims": [m for m in members if m != row.rank], "clock": DEVICE, "aligned_by": "device_collectives",
            "matched_by": matched_by,
            "num_collectives": int(row.num_collectives), "min_collectives": int(min_collectives),
            "last_frac": float(row.last_frac), "positive_frac": float(row.positive_frac),
            "median_lateness_us": float(row.median_lateness_us), "victims_wait_us": float(row.caused_wait_us),
            "profiled_us": float(profiled_us) if profiled_us is not None else float(row.group_span_us),
            "victims_wait_frac": float(row.wait_frac),
        }
        findings.append(Finding(
            code="STRAGGLER", severity="critical" if row.wait_frac >= critical_wait_frac else "warning",
            ranks=(int(row.rank),), group=axis,
            title=(f"rank {row.rank}'s GPU reaches its {group_phrase(axis or row.pg, members)} collectives last in "
                   f"{row.last_frac:.0%} of {row.num_collectives} (median +{row.median_lateness_us:.0f} us after "
                   f"its peers, device clock); the group waits {row.wait_frac:.0%} of the profiled time on it"),
            evidence=evidence,
            recommendation=(f"rank {row.rank}'s device reaches the collectives late: compare its kernels before "
                            f"them with its peers' (kernel breakdown per rank), its GPU clocks and throttling, "
                            f"and its host's launch gaps (idle time between kernels)."),
            predicted_gain=PredictedGain(metric="step_time", frac=min(max(float(row.wait_frac), 0.0), 1.0)),
        ))
    return findings
