"""Arrival metrics of collectives: skew per collective, each member's wait and lateness vs its peers per step;
read by ``stragglers`` (detector), ``exposed_comm``, ``hangs``, the facade and the dashboard.

Arrival = clock-aligned ``enqueue_ns`` of a rank at a collective (pg, pg_ranks, seq); the store aligns clocks.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from dtprobe.analysis.tables import P2P_OPS, group_members, require_columns, step_durations

ATTEMPT_SEQ_STRIDE = 1_000_000_000
"""``seq`` offset per torchrun attempt after ``unique_seq`` (attempt k's seq n becomes k * stride + n)."""


def unique_seq(collectives: pd.DataFrame) -> pd.DataFrame:
    """``collectives`` with ``seq`` made unique across torchrun restarts. A restarted worker recreates its process
    groups and numbers collectives from 1 again, so (pg, pg_ranks, seq) would match collectives of different
    attempts; per (rank, group), every time ``seq`` does not increase (in arrival order) a new attempt starts, and
    attempt k's seq n becomes ``k * ATTEMPT_SEQ_STRIDE + n``. P2P rows are left as they are. Unchanged (same
    object) when no group's numbering restarts."""
    require_columns(collectives, ["rank", "pg", "pg_ranks", "seq", "op", "enqueue_ns"], table="collectives")
    c = collectives
    mask = ~c["op"].isin(P2P_OPS) & c["seq"].notna() & c["enqueue_ns"].notna()
    if not mask.any():
        return collectives
    d = c.loc[mask, ["rank", "pg", "pg_ranks", "seq", "enqueue_ns"]].copy()
    d["pg"] = d["pg"].fillna("")
    d["pg_ranks"] = d["pg_ranks"].fillna("")
    d = d.sort_values(["rank", "pg", "pg_ranks", "enqueue_ns"], kind="stable")
    prev = d.groupby(["rank", "pg", "pg_ranks"])["seq"].shift()
    attempt = (prev.notna() & (d["seq"] <= prev)).astype("int64").groupby(
        [d["rank"], d["pg"], d["pg_ranks"]]).cumsum()
    if not attempt.any():
        return collectives
    out = collectives.copy()
    out.loc[attempt.index, "seq"] = (d["seq"] + attempt * ATTEMPT_SEQ_STRIDE).astype("Int64")
    return out

SKEW_COLUMNS = [
    "pg", "pg_ranks", "seq", "op", "step", "num_bytes", "num_members", "num_arrived", "complete",
    "first_enqueue_ns", "last_enqueue_ns", "skew_ns", "margin_ns", "victims_wait_ns", "late_rank",
]
LATE_RANK_COLUMNS = [
    "pg", "pg_ranks", "step", "seq", "op", "late_rank", "skew_ns", "margin_ns", "victims_wait_ns", "step_ns",
    "margin_frac",
]
LATENESS_COLUMNS = ["pg", "pg_ranks", "step", "rank", "lateness_ns", "victims_wait_ns", "is_last", "step_ns",
                    "lateness_frac", "pre_excess_frac"]
_COLL_COLUMNS = ["rank", "pg", "pg_ranks", "pg_size", "seq", "op", "num_bytes", "enqueue_ns", "end_ns", "step"]


def collective_skew(collectives: pd.DataFrame) -> pd.DataFrame:
    """One row per collective (pg, pg_ranks, seq): arrival skew (last - first enqueue), margin of the last arriver
    over the second-last, victims' mean wait, the late rank. P2P ops excluded. Columns: ``SKEW_COLUMNS``."""
    require_columns(collectives, _COLL_COLUMNS, table="collectives")
    c = collectives[~collectives["op"].isin(P2P_OPS) & collectives["seq"].notna()
                    & collectives["enqueue_ns"].notna()]
    if c.empty:
        return pd.DataFrame({col: [] for col in SKEW_COLUMNS})
    c = pd.DataFrame({
        "pg": c["pg"].fillna("").astype(str), "pg_ranks": c["pg_ranks"].fillna("").astype(str),
        "seq": c["seq"].astype("int64"), "op": c["op"].astype(str), "rank": c["rank"].astype("int64"),
        "enqueue_ns": c["enqueue_ns"].astype("int64"), "step": c["step"].fillna(-1).astype("int64"),
        "num_bytes": c["num_bytes"].fillna(0).astype("int64"), "pg_size": c["pg_size"].astype("float64"),
    }).sort_values(["pg", "pg_ranks", "seq", "enqueue_ns"], kind="stable")
    keys = ["pg", "pg_ranks", "seq"]
    g = c.groupby(keys, sort=False)
    c["_from_end"] = g.cumcount(ascending=False)
    c["_rel"] = (c["enqueue_ns"] - g["enqueue_ns"].transform("min")).astype("float64")
    agg = g.agg(op=("op", "first"), num_bytes=("num_bytes", "max"), num_arrived=("rank", "nunique"),
                first_enqueue_ns=("enqueue_ns", "min"), pg_size=("pg_size", "max"), rel_sum=("_rel", "sum"))
    last = c[c["_from_end"] == 0].set_index(keys)
    second = c[c["_from_end"] == 1].set_index(keys)["enqueue_ns"]
    out = agg.join(last[["rank", "enqueue_ns", "step"]].rename(
        columns={"rank": "late_rank", "enqueue_ns": "last_enqueue_ns"}))
    out["second_ns"] = second
    members = pd.Series([len(group_members(k[1])) for k in out.index], index=out.index)
    out["num_members"] = out["pg_size"].fillna(members).where(members == 0, members).astype("int64")
    out["complete"] = out["num_arrived"] >= out["num_members"]
    out["skew_ns"] = out["last_enqueue_ns"] - out["first_enqueue_ns"]
    out["margin_ns"] = (out["last_enqueue_ns"] - out["second_ns"]).fillna(0).astype("int64")
    n = out["num_arrived"].astype("float64")
    last_rel = out["skew_ns"].astype("float64")
    out["victims_wait_ns"] = np.where(n > 1, last_rel - (out["rel_sum"] - last_rel) / (n - 1).clip(lower=1), 0.0)
    out = out.reset_index()
    out["late_rank"] = out["late_rank"].astype("int64")
    return out[SKEW_COLUMNS].sort_values(["pg", "pg_ranks", "seq"], kind="stable").reset_index(drop=True)


def collective_waits(collectives: pd.DataFrame, skew: pd.DataFrame) -> pd.DataFrame:
    """Per member of each collective: ``wait_ns`` = last arrival - own arrival (0 for the late rank).
    Columns: pg, pg_ranks, seq, step, rank, enqueue_ns, wait_ns, late_rank."""
    require_columns(collectives, _COLL_COLUMNS, table="collectives")
    cols = ["pg", "pg_ranks", "seq", "step", "rank", "enqueue_ns", "wait_ns", "late_rank"]
    c = collectives[~collectives["op"].isin(P2P_OPS) & collectives["seq"].notna()
                    & collectives["enqueue_ns"].notna()]
    if c.empty or skew.empty:
        return pd.DataFrame({col: [] for col in cols})
    c = pd.DataFrame({
        "pg": c["pg"].fillna("").astype(str), "pg_ranks": c["pg_ranks"].fillna("").astype(str),
        "seq": c["seq"].astype("int64"), "rank": c["rank"].astype("int64"),
        "enqueue_ns": c["enqueue_ns"].astype("int64"), "step": c["step"].fillna(-1).astype("int64"),
    })
    m = c.merge(skew[["pg", "pg_ranks", "seq", "last_enqueue_ns", "late_rank"]], on=["pg", "pg_ranks", "seq"])
    m["wait_ns"] = (m["last_enqueue_ns"] - m["enqueue_ns"]).astype("int64")
    return m[cols].reset_index(drop=True)


def late_rank_per_step(skew: pd.DataFrame, steps: pd.DataFrame) -> pd.DataFrame:
    """Per (group, step): the complete collective with the largest margin, its late rank, and that margin as a
    share of the group's median step time (``margin_frac``). Columns: ``LATE_RANK_COLUMNS``."""
    require_columns(skew, SKEW_COLUMNS, table="collective_skew")
    done = skew[skew["complete"].astype(bool) & (skew["step"] >= 0) & (skew["num_members"] > 1)]
    if done.empty:
        return pd.DataFrame({col: [] for col in LATE_RANK_COLUMNS})
    top = done.loc[done.groupby(["pg", "pg_ranks", "step"], sort=True)["margin_ns"].idxmax()].copy()
    top["step_ns"] = _group_step_ns(top, steps)
    top["margin_frac"] = top["margin_ns"] / top["step_ns"]
    return top[LATE_RANK_COLUMNS].sort_values(["pg", "pg_ranks", "step"], kind="stable").reset_index(drop=True)


def _group_step_ns(rows: pd.DataFrame, steps: pd.DataFrame) -> pd.Series:
    """For rows with pg_ranks and step: the median step time of the group's members at that step."""
    durations = step_durations(steps)
    overall = durations.groupby("step")["step_ns"].median()
    parts = []
    for pg_ranks, grp in rows.groupby("pg_ranks", sort=False):
        members = group_members(pg_ranks)
        d = durations[durations["rank"].isin(members)] if members else durations
        med = d.groupby("step")["step_ns"].median()
        parts.append(grp["step"].map(med).fillna(grp["step"].map(overall)))
    if not parts:
        return pd.Series(np.nan, index=rows.index, dtype="float64")
    return pd.concat(parts).reindex(rows.index).astype("float64")


def rank_lateness(collectives: pd.DataFrame, steps: pd.DataFrame) -> pd.DataFrame:
    """Per (group, step, member rank): how much later than the median of its peers the rank arrived, at the
    step's collective where it was latest (``lateness_ns``, negative when early), as a share of the group's
    step time; the mean wait it imposed on its peers there (``victims_wait_ns``); whether it was the last to
    arrive. Complete non-p2p collectives of steps >= 0 only. Columns: ``LATENESS_COLUMNS``."""
    require_columns(collectives, _COLL_COLUMNS, table="collectives")
    c = collectives[~collectives["op"].isin(P2P_OPS) & collectives["seq"].notna()
                    & collectives["enqueue_ns"].notna() & (collectives["step"].fillna(-1) >= 0)]
    if c.empty:
        return pd.DataFrame({col: [] for col in LATENESS_COLUMNS})
    c = pd.DataFrame({
        "pg": c["pg"].fillna("").astype(str), "pg_ranks": c["pg_ranks"].fillna("").astype(str),
        "seq": c["seq"].astype("int64"), "rank": c["rank"].astype("int64"),
        "enqueue_ns": c["enqueue_ns"].astype("int64"), "step": c["step"].astype("int64"),
    }).drop_duplicates(["pg", "pg_ranks", "seq", "rank"]).sort_values(["pg", "pg_ranks", "seq", "enqueue_ns"],
                                                                      kind="stable")
    sizes = {k: len(group_members(k)) for k in c["pg_ranks"].unique()}
    members = c["pg_ranks"].map(sizes)
    g = c.groupby(["pg", "pg_ranks", "seq"], sort=False)
    c["n"] = g["rank"].transform("size")
    c = c[(c["n"] >= 2) & ((members == 0) | (c["n"] >= members))].copy()
    if c.empty:
        return pd.DataFrame({col: [] for col in LATENESS_COLUMNS})
    g = c.groupby(["pg", "pg_ranks", "seq"], sort=False)
    c["gid"] = g.ngroup()
    c["pos"] = g.cumcount()
    c["x"] = (c["enqueue_ns"] - g["enqueue_ns"].transform("min")).astype("float64")
    lookup = pd.Series(c["x"].to_numpy(), index=pd.MultiIndex.from_arrays([c["gid"], c["pos"]]))

    def others_at(j: np.ndarray) -> np.ndarray:
        """Value of the j-th (0-based) element of the sorted arrivals without the row's own."""
        idx = np.where(j < c["pos"].to_numpy(), j, j + 1)
        return lookup.reindex(pd.MultiIndex.from_arrays([c["gid"].to_numpy(), idx])).to_numpy()

    n = c["n"].to_numpy()
    j1 = np.where(n % 2 == 0, (n - 2) // 2, (n - 3) // 2)
    j2 = np.where(n % 2 == 0, (n - 2) // 2, (n - 1) // 2)
    median_others = (others_at(j1) + others_at(j2)) / 2.0
    c["lateness_ns"] = c["x"].to_numpy() - median_others
    before = g["x"].cumsum() - c["x"]
    c["victims_wait_ns"] = (c["pos"] * c["x"] - before) / (c["n"] - 1)
    c["is_last"] = c["pos"] == c["n"] - 1
    top = c.loc[c.groupby(["pg", "pg_ranks", "step", "rank"], sort=True)["lateness_ns"].idxmax()]
    top = top[["pg", "pg_ranks", "step", "rank", "lateness_ns", "victims_wait_ns", "is_last"]].copy()
    top["step_ns"] = _group_step_ns(top, steps)
    top["lateness_frac"] = top["lateness_ns"] / top["step_ns"]
    top["pre_excess_frac"] = _pre_collective_excess(top, steps) / top["step_ns"]
    return top[LATENESS_COLUMNS].sort_values(["pg", "pg_ranks", "rank", "step"], kind="stable").reset_index(drop=True)


def median_of_others(v: np.ndarray) -> np.ndarray:
    """For each element of ``v`` (no NaN, len >= 2): the median of the other elements. O(n log n)."""
    n = len(v)
    order = np.argsort(v, kind="stable")
    x = v[order]
    pos = np.empty(n, dtype=np.int64)
    pos[order] = np.arange(n)
    if n % 2 == 0:
        j1 = j2 = (n - 2) // 2
    else:
        j1, j2 = (n - 3) // 2, (n - 1) // 2
    a = np.where(j1 < pos, x[j1], x[min(j1 + 1, n - 1)])
    b = np.where(j2 < pos, x[j2], x[min(j2 + 1, n - 1)])
    return (a + b) / 2.0


def _pre_collective_excess(rows: pd.DataFrame, steps: pd.DataFrame) -> pd.Series:
    """For rows (pg_ranks, step, rank): the rank's data+fwd time minus the median of its group peers' (NaN when
    phases are not recorded). Before its first gradient collective a data-parallel rank has waited on nobody,
    so this is a second, independent view of who is slow."""
    ph = steps.dropna(subset=["fwd_ns"])
    if ph.empty:
        return pd.Series(np.nan, index=rows.index, dtype="float64")
    pre = (ph["data_ns"].astype("float64").fillna(0) + ph["fwd_ns"].astype("float64"))
    pre.index = pd.MultiIndex.from_arrays([ph["rank"].astype("int64"), ph["step"].astype("int64")])
    pre = pre[~pre.index.duplicated(keep="last")]
    mine = pre.reindex(pd.MultiIndex.from_arrays([rows["rank"].astype("int64"), rows["step"].astype("int64")]))
    r = rows.assign(_pre=mine.to_numpy())

    def minus_median_of_others(x: pd.Series) -> pd.Series:
        v = x.to_numpy(dtype="float64")
        if len(v) < 2 or np.isnan(v).any():
            return pd.Series(np.nan, index=x.index)
        return pd.Series(v - median_of_others(v), index=x.index)

    return r.groupby(["pg", "pg_ranks", "step"], sort=False)["_pre"].transform(minus_median_of_others)


