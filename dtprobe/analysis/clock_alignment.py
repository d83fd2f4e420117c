"""Each rank's clock offset estimated from the collectives themselves; read by ``device_arrivals`` and, through the
facade, by ``dtprobe analyze`` (``metrics.clock_alignment``) on Kineto trace folders. Also, for dtprobe runs, how
the host clock offsets the store applied were re-measured while the job ran (``clock_resync``,
``metrics.run.clock_resync``).

The kernels of one collective end together on every member (within the last hop of the algorithm), so the
difference of two members' end times is the difference of their clocks. The reference is the lowest rank
present; every other rank is placed from the placed rank it shares the most matched collectives with (ties: the
lowest unplaced rank, the earliest placed one), at that rank's offset plus the median end difference of their shared collectives, floored to a
whole nanosecond. The choice of pairs depends on counts only, and medians and floors of integer nanoseconds
move exactly with a shift: shifting one non-reference rank's trace by d changes its offset by exactly -d and
nothing else.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from dtprobe.store.columns import require_columns

OFFSET_COLUMNS = ["rank", "offset_ns", "offset_us", "residual_us", "num_collectives"]


def _member_ends(matched: pd.DataFrame) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(ranks, rank index, coll_id, end_ns) of the matched rows, sorted by (rank, coll_id): one row per
    (collective, member), never a collectives x ranks matrix (its size would grow with the square of the ranks)."""
    require_columns(matched, ["coll_id", "rank", "end_ns", "status"], table="matched_collectives")
    m = matched.loc[(matched["status"] == "matched").to_numpy(dtype=bool, na_value=False), ["coll_id", "rank",
                                                                                           "end_ns"]]
    rank = m["rank"].to_numpy(dtype="int64")
    coll = m["coll_id"].to_numpy(dtype="int64")
    end = m["end_ns"].to_numpy(dtype="int64")
    ranks, ri = np.unique(rank, return_inverse=True)
    order = np.lexsort((coll, ri))
    return ranks, ri[order], coll[order], end[order]


def _shared_counts(ri: np.ndarray, coll: np.ndarray, n: int) -> np.ndarray:
    """[rank x rank] matched collectives two ranks are both members of (0 on the diagonal): each distinct member
    set adds its number of collectives to the pairs of its members."""
    shared = np.zeros((n, n), dtype=np.int64)
    by_coll = np.lexsort((ri, coll))
    members, colls = ri[by_coll], coll[by_coll]
    first = np.flatnonzero(np.r_[True, colls[1:] != colls[:-1]])
    sizes = np.diff(np.r_[first, len(colls)])
    for size in np.unique(sizes):                      # collectives of one size as rows of their members
        at = first[sizes == size]
        sets, counts = np.unique(members[at[:, None] + np.arange(size)[None, :]], axis=0, return_counts=True)
        for member_set, count in zip(sets, counts):
            shared[np.ix_(member_set, member_set)] += count
    np.fill_diagonal(shared, 0)
    return shared


def clock_offsets(matched: pd.DataFrame) -> pd.DataFrame:
    """Per rank of the matched collectives: ``offset_ns`` (added to its times puts them on the reference rank's
    clock; 0 for the reference, null for a rank sharing no matched collective with the others),
    ``residual_us`` (median over its collectives of |corrected end - the collective's median corrected end|),
    ``num_collectives`` (matched collectives it is a member of). Columns: OFFSET_COLUMNS. Memory: the matched
    rows and a [rank x rank] count, whatever the number of collectives."""
    ranks, ri, coll, end = _member_ends(matched)
    n = len(ranks)
    if n == 0:
        return pd.DataFrame(columns=OFFSET_COLUMNS)
    bounds = np.searchsorted(ri, np.arange(n + 1))     # rank i's rows: bounds[i]:bounds[i + 1], by coll_id
    shared = _shared_counts(ri, coll, n)
    offset = np.zeros(n, dtype=np.int64)
    placed = np.zeros(n, dtype=bool)
    placed[0] = True
    best = np.where(placed, -1, shared[0])               # per unplaced rank: most collectives shared with a placed
    parent = np.zeros(n, dtype=np.int64)                 # ... rank, and that rank (the earliest placed on ties)
    while True:
        u = int(np.argmax(best))                         # ties: the lowest rank
        if best[u] <= 0:
            break
        p = int(parent[u])
        _, at_p, at_u = np.intersect1d(coll[bounds[p]:bounds[p + 1]], coll[bounds[u]:bounds[u + 1]],
                                       assume_unique=True, return_indices=True)
        diff = end[bounds[p] + at_p] - end[bounds[u] + at_u]
        offset[u] = offset[p] + int(np.floor(np.median(diff)))
        placed[u] = True
        best[u] = -1
        better = ~placed & (shared[u] > best)
        best[better], parent[better] = shared[u][better], u
    residual = _residuals(ri, coll, end + offset[ri], placed[ri], n)
    out = pd.DataFrame({
        "rank": ranks.astype("int64"),
        "offset_ns": pd.array(np.where(placed, offset, 0), dtype="Int64"),
        "residual_us": np.where(placed, residual / 1e3, np.nan),
        "num_collectives": np.diff(bounds).astype("int64"),
    })
    out.loc[~placed, "offset_ns"] = pd.NA
    out["offset_us"] = out["offset_ns"].astype("Float64") / 1e3
    return out[OFFSET_COLUMNS]


def _residuals(ri: np.ndarray, coll: np.ndarray, corrected_end: np.ndarray, keep: np.ndarray, n: int) -> np.ndarray:
    """Per rank (NaN without rows kept): median over its kept rows of |corrected end - the median corrected end of
    the collective's kept rows|; times relative to the earliest kept end, exact in float64."""
    residual = np.full(n, np.nan)
    if not keep.any():
        return residual
    rel = (corrected_end[keep] - corrected_end[keep].min()).astype(np.float64)
    rows = pd.DataFrame({"rank": ri[keep], "coll": coll[keep], "rel": rel})
    rows["dev"] = (rows["rel"] - rows.groupby("coll")["rel"].transform("median")).abs()
    per_rank = rows.groupby("rank")["dev"].median()
    residual[per_rank.index.to_numpy()] = per_rank.to_numpy()
    return residual


def corrected(matched: pd.DataFrame, offsets: pd.DataFrame) -> pd.DataFrame:
    """``matched`` rows of placed ranks with ``start_ns``/``end_ns`` moved onto the reference clock (int64)."""
    off = offsets.dropna(subset=["offset_ns"])
    by_rank = pd.Series(off["offset_ns"].to_numpy(dtype="int64"), index=off["rank"].to_numpy(dtype="int64"))
    shift = matched["rank"].astype("int64").map(by_rank)
    keep = ((matched["status"] == "matched") & shift.notna()).to_numpy(dtype=bool)
    m = matched.loc[keep].reset_index(drop=True)       # one copy of the rows kept (no merge copy besides)
    shift = shift.to_numpy()[keep].astype("int64")
    m["start_ns"] = m["start_ns"].to_numpy(dtype="int64") + shift
    m["end_ns"] = m["end_ns"].to_numpy(dtype="int64") + shift
    return m


def alignment_label(*, clock_aligned: bool, offsets: pd.DataFrame, coverage: pd.DataFrame) -> str:
    """How the ranks' clocks were put on one clock: ``host`` (the source aligned them, e.g. a dtprobe run's store),
    ``device_collectives`` (offsets estimated here from matched collectives), or why they could not be."""
    if clock_aligned:
        return "host"
    if not offsets.empty and offsets["offset_ns"].notna().sum() >= 2:
        return "device_collectives"
    if coverage.empty:
        return "not aligned: no collectives timed on the device in this source (arrival needs NCCL kernels)"
    reasons = sorted({str(r) for r in coverage["reason"].dropna()})
    if reasons:
        return "not aligned: " + "; ".join(reasons)
    return "not aligned: no collective was matched on every member of its group"


RESYNC_COLUMNS = ["rank", "num_samples", "first_offset_us", "last_offset_us", "max_drift_us", "failed"]


def clock_resync(clock: pd.DataFrame) -> pd.DataFrame:
    """Per rank whose host clock offset was re-measured while a dtprobe run ran (its ``clock`` table has a
    ``remeasure`` or ``failed`` row): ``num_samples`` (offsets measured, the attach one included), the offset at
    the first and the last, ``max_drift_us`` (the largest |offset - the first offset of the same restart|: how far
    the clock moved from where attach put it), ``failed`` (its re-measuring thread stopped on an error). Ranks only
    measured at attach are left out. Columns: RESYNC_COLUMNS, sorted by rank."""
    require_columns(clock, ["rank", "restart", "time_ns", "offset_ns", "event"], table="clock")
    if clock.empty:
        return pd.DataFrame(columns=RESYNC_COLUMNS)
    events = clock["event"].astype("string")
    resynced = clock.loc[events.isin(["remeasure", "failed"]), "rank"].astype("int64").unique()
    rows = clock.loc[clock["rank"].astype("int64").isin(resynced)].copy()
    if rows.empty:
        return pd.DataFrame(columns=RESYNC_COLUMNS)
    rows["rank"] = rows["rank"].astype("int64")
    rows["restart"] = rows["restart"].fillna(0).astype("int64")
    failed = rows.loc[rows["event"].astype("string") == "failed"].groupby("rank").size()
    samples = rows.dropna(subset=["offset_ns", "time_ns"]).sort_values(["rank", "restart", "time_ns"], kind="stable")
    samples["offset_ns"] = samples["offset_ns"].astype("int64")
    base = samples.groupby(["rank", "restart"])["offset_ns"].transform("first")
    samples["drift_ns"] = (samples["offset_ns"] - base).abs()
    g = samples.groupby("rank")
    out = pd.DataFrame({
        "num_samples": g.size(),
        "first_offset_us": g["offset_ns"].first() / 1e3,
        "last_offset_us": g["offset_ns"].last() / 1e3,
        "max_drift_us": g["drift_ns"].max() / 1e3,
    }).reindex(pd.Index(sorted(int(r) for r in resynced), name="rank"))
    out["num_samples"] = out["num_samples"].fillna(0).astype("int64")
    out["failed"] = out.index.isin(failed.index)
    return out.reset_index()[RESYNC_COLUMNS]
