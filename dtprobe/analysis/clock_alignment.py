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


def member_ends(matched: pd.DataFrame) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
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


def member_set_counts(ri: np.ndarray, coll: np.ndarray) -> dict[tuple[int, ...], int]:
    """Matched collectives per distinct member set (tuples of the members' ``ri`` values, sorted), from rows
    (``ri``, ``coll``) sorted by (``ri``, ``coll``)."""
    counts: dict[tuple[int, ...], int] = {}
    by_coll = np.lexsort((ri, coll))
    members, colls = ri[by_coll], coll[by_coll]
    first = np.flatnonzero(np.r_[True, colls[1:] != colls[:-1]]) if len(colls) else np.empty(0, dtype=np.int64)
    sizes = np.diff(np.r_[first, len(colls)])
    for size in np.unique(sizes):                      # collectives of one size as rows of their members
        at = first[sizes == size]
        sets, num = np.unique(members[at[:, None] + np.arange(size)[None, :]], axis=0, return_counts=True)
        for member_set, count in zip(sets.tolist(), num.tolist()):
            counts[tuple(member_set)] = counts.get(tuple(member_set), 0) + count
    return counts


def shared_counts(sets: dict[tuple[int, ...], int], n: int) -> np.ndarray:
    """[rank x rank] matched collectives two ranks are both members of (0 on the diagonal), from
    ``member_set_counts`` over rank indices 0..n-1: each member set adds its count to the pairs of its members."""
    shared = np.zeros((n, n), dtype=np.int64)
    for member_set, count in sets.items():
        shared[np.ix_(member_set, member_set)] += count
    np.fill_diagonal(shared, 0)
    return shared


def placement(shared: np.ndarray) -> list[tuple[int, int]]:
    """(rank index, the placed rank index it is placed from), in the order ranks are placed: from index 0, each
    time the unplaced rank sharing the most collectives with a placed one (ties: the lowest unplaced rank, the
    earliest placed one); ranks sharing none with the placed ones are left out."""
    n = len(shared)
    placed = np.zeros(n, dtype=bool)
    placed[0] = True
    best = np.where(placed, -1, shared[0])               # per unplaced rank: most collectives shared with a placed
    parent = np.zeros(n, dtype=np.int64)                 # ... rank, and that rank (the earliest placed on ties)
    order = []
    while True:
        u = int(np.argmax(best))                         # ties: the lowest rank
        if best[u] <= 0:
            break
        order.append((u, int(parent[u])))
        placed[u] = True
        best[u] = -1
        better = ~placed & (shared[u] > best)
        best[better], parent[better] = shared[u][better], u
    return order


def chained_offsets(order: list[tuple[int, int]], median_diff_ns: dict[tuple[int, int], float], n: int
                    ) -> tuple[np.ndarray, np.ndarray]:
    """(offset_ns, placed) per rank index: 0 for index 0, each placed rank at its parent's offset plus the floor of
    the median end difference (parent - rank) of their shared collectives (``median_diff_ns`` per (rank, parent))."""
    offset = np.zeros(n, dtype=np.int64)
    placed = np.zeros(n, dtype=bool)
    placed[0] = True
    for u, p in order:
        offset[u] = offset[p] + int(np.floor(median_diff_ns[u, p]))
        placed[u] = True
    return offset, placed


def clock_offsets(matched: pd.DataFrame) -> pd.DataFrame:
    """Per rank of the matched collectives: ``offset_ns`` (added to its times puts them on the reference rank's
    clock; 0 for the reference, null for a rank sharing no matched collective with the others),
    ``residual_us`` (median over its collectives of |corrected end - the collective's median corrected end|),
    ``num_collectives`` (matched collectives it is a member of). Columns: OFFSET_COLUMNS. Memory: the matched
    rows and a [rank x rank] count, whatever the number of collectives."""
    ranks, ri, coll, end = member_ends(matched)
    n = len(ranks)
    if n == 0:
        return pd.DataFrame(columns=OFFSET_COLUMNS)
    bounds = np.searchsorted(ri, np.arange(n + 1))     # rank i's rows: bounds[i]:bounds[i + 1], by coll_id
    order = placement(shared_counts(member_set_counts(ri, coll), n))
    medians = {}
    for u, p in order:
        medians[u, p] = np.median(edge_diffs(coll, end, bounds, u, p))
    offset, placed = chained_offsets(order, medians, n)
    rank, dev = deviations(ri, coll, end + offset[ri], placed[ri])
    return offset_frame(ranks, offset, placed, median_deviation([(rank, dev)], n), np.diff(bounds))


def edge_diffs(coll: np.ndarray, end: np.ndarray, bounds: np.ndarray, u: int, p: int) -> np.ndarray:
    """End of ``p`` minus end of ``u`` over the collectives both are members of (rows sorted by (rank index,
    coll_id); rank i's at ``bounds[i]:bounds[i + 1]``)."""
    _, at_p, at_u = np.intersect1d(coll[bounds[p]:bounds[p + 1]], coll[bounds[u]:bounds[u + 1]],
                                   assume_unique=True, return_indices=True)
    return end[bounds[p] + at_p] - end[bounds[u] + at_u]


def offset_frame(ranks: np.ndarray, offset: np.ndarray, placed: np.ndarray, residual_ns: np.ndarray,
                 num_collectives: np.ndarray) -> pd.DataFrame:
    """The ``clock_offsets`` frame of ``ranks`` from per-rank-index arrays (unplaced: null offset and residual)."""
    out = pd.DataFrame({
        "rank": ranks.astype("int64"),
        "offset_ns": pd.array(np.where(placed, offset, 0), dtype="Int64"),
        "residual_us": np.where(placed, residual_ns / 1e3, np.nan),
        "num_collectives": np.asarray(num_collectives).astype("int64"),
    })
    out.loc[~placed, "offset_ns"] = pd.NA
    out["offset_us"] = out["offset_ns"].astype("Float64") / 1e3
    return out[OFFSET_COLUMNS]


def deviations(ri: np.ndarray, coll: np.ndarray, corrected_end: np.ndarray, keep: np.ndarray
               ) -> tuple[np.ndarray, np.ndarray]:
    """Per kept row: its rank index and |corrected end - the median corrected end of the collective's kept rows|,
    times relative to the earliest kept end (exact in float64, so the same whatever rows are taken together, as
    long as every collective's rows are)."""
    if not keep.any():
        return np.empty(0, dtype=np.int64), np.empty(0)
    rel = (corrected_end[keep] - corrected_end[keep].min()).astype(np.float64)
    rows = pd.DataFrame({"coll": coll[keep], "rel": rel})
    return ri[keep], (rows["rel"] - rows.groupby("coll")["rel"].transform("median")).abs().to_numpy()


def median_deviation(parts: list[tuple[np.ndarray, np.ndarray]], n: int) -> np.ndarray:
    """Per rank index (NaN without rows): the median of its ``deviations`` over ``parts`` (their (rank index,
    deviation) arrays)."""
    residual = np.full(n, np.nan)
    by_rank: dict[int, list[np.ndarray]] = {}
    for rank, dev in parts:
        order = np.argsort(rank, kind="stable")
        ranks, starts = np.unique(rank[order], return_index=True)
        for r, values in zip(ranks.tolist(), np.split(dev[order], starts[1:])):
            by_rank.setdefault(r, []).append(values)
    for r, values in by_rank.items():
        residual[r] = np.median(np.concatenate(values))
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
