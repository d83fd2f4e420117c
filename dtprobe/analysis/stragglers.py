"""Straggler metrics (arrival skew per collective, lateness per step, persistence per rank, cause) and the
STRAGGLER detector; read by the facade, ``dtprobe analyze`` and the dashboard's collectives page.

The culprit of a collective is its last arriver (largest clock-aligned ``enqueue_ns`` among the members of
(pg, pg_ranks, seq)); the other members are victims and wait ``culprit enqueue - own enqueue``. A rank is a
straggler when it is the late rank of its group, by a margin over the second-last arriver of at least a share of
the step time, in most steps of a window. Its cause class (data / compute / communication / device) comes
from its step phases, its waits at other collectives and its device samples, compared with its group peers.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import pandas as pd

from dtprobe.analysis.findings import Finding, PredictedGain
from dtprobe.analysis.tables import P2P_OPS, axis_of, group_members, ms, require_columns, step_durations

SKEW_COLUMNS = [
    "pg", "pg_ranks", "seq", "op", "step", "num_bytes", "num_members", "num_arrived", "complete",
    "first_enqueue_ns", "last_enqueue_ns", "skew_ns", "margin_ns", "victims_wait_ns", "late_rank",
]
LATENESS_COLUMNS = [
    "pg", "pg_ranks", "step", "seq", "op", "late_rank", "skew_ns", "margin_ns", "victims_wait_ns", "step_ns",
    "margin_frac",
]
SCORE_COLUMNS = [
    "pg", "pg_ranks", "rank", "num_steps", "num_late_steps", "late_frac", "window_steps", "window_late_frac",
    "window_first_step", "window_last_step", "detected_at_step", "mean_margin_ns", "mean_margin_frac",
    "mean_skew_ns", "mean_victims_wait_ns", "mean_step_ns",
]
CAUSE_COLUMNS = [
    "pg", "pg_ranks", "rank", "data_excess_ns", "compute_excess_ns", "comm_excess_ns", "throttled_frac", "cause",
]
CAUSES = ("data", "compute", "communication", "device", "unknown")
"""Cause classes of a straggler."""

THROTTLE_MASK = 0x4 | 0x8 | 0x20 | 0x40 | 0x80
"""NVML clock-throttle reasons that slow a GPU: SW power cap, HW slowdown, SW/HW thermal, power brake."""

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
    Columns: pg, pg_ranks, seq, step, rank, wait_ns, late_rank."""
    require_columns(collectives, _COLL_COLUMNS, table="collectives")
    cols = ["pg", "pg_ranks", "seq", "step", "rank", "wait_ns", "late_rank"]
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


def step_lateness(skew: pd.DataFrame, steps: pd.DataFrame) -> pd.DataFrame:
    """Per (group, step): the complete collective with the largest margin, its late rank, and that margin as a
    share of the group's median step time (``margin_frac``). Columns: ``LATENESS_COLUMNS``."""
    require_columns(skew, SKEW_COLUMNS, table="collective_skew")
    done = skew[skew["complete"].astype(bool) & (skew["step"] >= 0) & (skew["num_members"] > 1)]
    if done.empty:
        return pd.DataFrame({col: [] for col in LATENESS_COLUMNS})
    top = done.loc[done.groupby(["pg", "pg_ranks", "step"], sort=True)["margin_ns"].idxmax()].copy()
    durations = step_durations(steps)
    step_ns = durations.groupby("step")["step_ns"].median()
    per_group = []
    for (pg, pg_ranks), rows in top.groupby(["pg", "pg_ranks"], sort=False):
        members = group_members(pg_ranks)
        d = durations[durations["rank"].isin(members)] if members else durations
        med = d.groupby("step")["step_ns"].median()
        per_group.append(rows["step"].map(med).fillna(rows["step"].map(step_ns)))
    top["step_ns"] = pd.concat(per_group).astype("float64") if per_group else np.nan
    top["margin_frac"] = top["margin_ns"] / top["step_ns"]
    return top[LATENESS_COLUMNS].sort_values(["pg", "pg_ranks", "step"], kind="stable").reset_index(drop=True)


def straggler_scores(lateness: pd.DataFrame, *, min_margin_frac: float = 0.05,
                     window_steps: int = 20) -> pd.DataFrame:
    """Per (group, member rank): how often it is the late rank by at least ``min_margin_frac`` of the step time,
    over the whole run and in its worst sliding window of ``window_steps`` steps. Columns: ``SCORE_COLUMNS``.
    ``detected_at_step`` is the step closing that worst window (the earliest with the maximum count)."""
    require_columns(lateness, LATENESS_COLUMNS, table="step_lateness")
    rows = []
    for (pg, pg_ranks), grp in lateness.groupby(["pg", "pg_ranks"], sort=True):
        grp = grp.sort_values("step")
        members = group_members(pg_ranks) or tuple(sorted(grp["late_rank"].unique()))
        n = len(grp)
        w = max(1, min(window_steps, n))
        late_ok = (grp["margin_frac"] >= min_margin_frac).to_numpy()
        for rank in members:
            hit = late_ok & (grp["late_rank"].to_numpy() == rank)
            roll = np.convolve(hit.astype(int), np.ones(w, dtype=int), mode="valid")
            best = int(np.argmax(roll))
            mine = grp[hit]
            rows.append({
                "pg": pg, "pg_ranks": pg_ranks, "rank": int(rank), "num_steps": n,
                "num_late_steps": int(hit.sum()), "late_frac": float(hit.mean()) if n else 0.0,
                "window_steps": w, "window_late_frac": float(roll[best]) / w,
                "window_first_step": int(grp["step"].iloc[best]),
                "window_last_step": int(grp["step"].iloc[best + w - 1]),
                "detected_at_step": int(grp["step"].iloc[best + w - 1]),
                "mean_margin_ns": float(mine["margin_ns"].mean()) if len(mine) else 0.0,
                "mean_margin_frac": float(mine["margin_frac"].mean()) if len(mine) else 0.0,
                "mean_skew_ns": float(mine["skew_ns"].mean()) if len(mine) else 0.0,
                "mean_victims_wait_ns": float(mine["victims_wait_ns"].mean()) if len(mine) else 0.0,
                "mean_step_ns": float(grp["step_ns"].mean()),
            })
    if not rows:
        return pd.DataFrame({col: [] for col in SCORE_COLUMNS})
    return pd.DataFrame(rows)[SCORE_COLUMNS]


def _blocking_waits(collectives: pd.DataFrame, waits: pd.DataFrame) -> pd.DataFrame:
    """Per (rank, step, pg_ranks): time blocked waiting for peers: p2p spans plus collective waits."""
    p2p = collectives[collectives["op"].isin(P2P_OPS) & collectives["end_ns"].notna()
                      & collectives["enqueue_ns"].notna()]
    parts = [pd.DataFrame({
        "rank": p2p["rank"].astype("int64"), "step": p2p["step"].fillna(-1).astype("int64"),
        "pg_ranks": "p2p", "wait_ns": (p2p["end_ns"] - p2p["enqueue_ns"]).astype("int64"),
    })]
    if not waits.empty:
        parts.append(waits[["rank", "step", "pg_ranks", "wait_ns"]])
    return pd.concat(parts, ignore_index=True)


def straggler_causes(scores: pd.DataFrame, lateness: pd.DataFrame, steps: pd.DataFrame,
                     collectives: pd.DataFrame, waits: pd.DataFrame, devices: pd.DataFrame, *,
                     min_margin_frac: float = 0.05,
                     min_explained_frac: float = 0.25, throttle_frac: float = 0.5) -> pd.DataFrame:
    """For each scored (group, rank) with late steps: its excess over the median of its group peers in those
    steps, by class: data (``data_ns``), compute (fwd+bwd+opt minus time blocked on peers), communication (time
    blocked on peers outside this group: p2p and other groups' collectives), and the share of its device samples
    with a slowing throttle reason. ``cause`` is ``device`` when throttled, else the largest excess if it explains
    at least ``min_explained_frac`` of the mean margin, else ``unknown``. Columns: ``CAUSE_COLUMNS``."""
    require_columns(steps, ["rank", "step", "start_ns", "end_ns", "data_ns", "fwd_ns", "bwd_ns", "opt_ns"],
                    table="steps")
    blocked = _blocking_waits(collectives, waits) if not collectives.empty else pd.DataFrame(
        {"rank": [], "step": [], "pg_ranks": [], "wait_ns": []})
    ph = steps.dropna(subset=["end_ns"]).copy()
    ph["rank"] = ph["rank"].astype("int64")
    ph["step"] = ph["step"].astype("int64")
    for col in ("data_ns", "fwd_ns", "bwd_ns", "opt_ns"):
        ph[col] = ph[col].astype("float64").fillna(0.0)
    rows = []
    for s in scores[scores["num_late_steps"] > 0].itertuples(index=False):
        late = lateness[(lateness["pg"] == s.pg) & (lateness["pg_ranks"] == s.pg_ranks)
                        & (lateness["late_rank"] == s.rank) & (lateness["margin_frac"] >= min_margin_frac)]
        late_steps = set(int(x) for x in late["step"])
        members = group_members(s.pg_ranks)
        peers = [m for m in members if m != s.rank]
        b = blocked[(blocked["pg_ranks"] != s.pg_ranks) & blocked["step"].isin(late_steps)]
        comm = b.groupby(["rank", "step"])["wait_ns"].sum()
        p = ph[ph["step"].isin(late_steps) & ph["rank"].isin(list(members))].set_index(["rank", "step"])
        p["comm_ns"] = comm.reindex(p.index).fillna(0.0).astype("float64")
        p = p.reset_index()
        diffs = {}
        for col in ("data_ns", "fwd_ns", "bwd_ns", "opt_ns", "comm_ns"):
            mine = p[p["rank"] == s.rank].set_index("step")[col]
            theirs = p[p["rank"].isin(peers)].groupby("step")[col].median()
            diff = (mine - theirs.reindex(mine.index)).dropna()
            diffs[col] = max(0.0, float(diff.mean())) if len(diff) else 0.0
        # A phase that is longer only because the rank waited on peers inside it (p2p recv in fwd, the
        # all-reduce wait at the end of bwd) is communication, not compute: peers' waits shorten nothing here,
        # so compare phase by phase and take the waits out of the compute excess.
        excess = {
            "data": diffs["data_ns"],
            "compute": max(0.0, diffs["fwd_ns"] + diffs["bwd_ns"] + diffs["opt_ns"] - diffs["comm_ns"]),
            "communication": diffs["comm_ns"],
        }
        throttled = _throttled_frac(devices, s.rank, steps, late_steps)
        margin = float(late["margin_ns"].mean()) if len(late) else 0.0
        best = max(excess, key=excess.get)
        if throttled is not None and throttled >= throttle_frac:
            cause = "device"
        elif margin > 0 and excess[best] >= min_explained_frac * margin:
            cause = best
        else:
            cause = "unknown"
        rows.append({"pg": s.pg, "pg_ranks": s.pg_ranks, "rank": int(s.rank),
                     "data_excess_ns": excess["data"], "compute_excess_ns": excess["compute"],
                     "comm_excess_ns": excess["communication"],
                     "throttled_frac": np.nan if throttled is None else throttled, "cause": cause})
    if not rows:
        return pd.DataFrame({col: [] for col in CAUSE_COLUMNS})
    return pd.DataFrame(rows)[CAUSE_COLUMNS]


def _throttled_frac(devices: pd.DataFrame, rank: int, steps: pd.DataFrame, step_ids: Iterable[int]) -> float | None:
    """Share of ``rank``'s device samples inside ``step_ids`` with a slowing throttle reason; None without samples."""
    if devices is None or devices.empty or "throttle_reasons" not in devices.columns:
        return None
    d = devices[(devices["rank"] == rank) & devices["throttle_reasons"].notna()]
    if d.empty:
        return None
    own = steps[(steps["rank"] == rank) & steps["step"].isin(list(step_ids))].dropna(subset=["start_ns", "end_ns"])
    if own.empty:
        return None
    t = d["time_ns"].astype("int64").to_numpy()
    inside = np.zeros(len(d), dtype=bool)
    for a, b in zip(own["start_ns"].astype("int64"), own["end_ns"].astype("int64")):
        inside |= (t >= a) & (t <= b)
    if not inside.any():
        inside[:] = True
    reasons = d["throttle_reasons"].astype("int64").to_numpy()[inside]
    return float(((reasons & THROTTLE_MASK) != 0).mean())


def linked_ranks(collectives: pd.DataFrame) -> set[frozenset[int]]:
    """Pairs of ranks that share a process group or a p2p link (a delay on one propagates to the other)."""
    pairs: set[frozenset[int]] = set()
    if collectives.empty:
        return pairs
    for pg_ranks in collectives["pg_ranks"].dropna().unique():
        members = group_members(pg_ranks)
        pairs.update(frozenset((a, b)) for a in members for b in members if a < b)
    p2p = collectives[collectives["op"].isin(P2P_OPS) & collectives["peer"].notna()]
    for a, b in p2p[["rank", "peer"]].drop_duplicates().itertuples(index=False):
        if int(a) != int(b):
            pairs.add(frozenset((int(a), int(b))))
    return pairs


def detect_stragglers(scores: pd.DataFrame, causes: pd.DataFrame, *, links: set[frozenset[int]] = frozenset(),
                      min_persist_frac: float = 0.6, min_late_steps: int = 3, min_margin_frac: float = 0.05,
                      critical_wait_frac: float = 0.2, injected: dict[int, dict] | None = None,
                      lateness: pd.DataFrame | None = None) -> list[Finding]:
    """STRAGGLER for each rank that is its group's late rank in at least ``min_persist_frac`` of the steps of some
    window (and ``min_late_steps`` steps). A flagged rank whose cause is communication and that shares a group or
    p2p link with another flagged rank is that rank's victim (the delay propagated): it is reported inside the
    culprit's finding, not as its own. Critical when victims wait ``critical_wait_frac`` of the step or more."""
    require_columns(scores, SCORE_COLUMNS, table="straggler_scores")
    flagged = scores[(scores["window_late_frac"] >= min_persist_frac) & (scores["num_late_steps"] >= min_late_steps)]
    if flagged.empty:
        return []
    # One entry per rank: the group where it is most persistently late.
    flagged = flagged.sort_values(["window_late_frac", "mean_margin_frac"], ascending=False)
    best = flagged.drop_duplicates("rank")
    cause_of = {(c.pg, c.pg_ranks, c.rank): c for c in causes.itertuples(index=False)}
    ranks = set(int(r) for r in best["rank"])
    propagated: dict[int, list[int]] = {}
    for row in best.itertuples(index=False):
        c = cause_of.get((row.pg, row.pg_ranks, row.rank))
        if c is not None and c.cause == "communication":
            upstream = [r for r in ranks if r != row.rank and frozenset((r, row.rank)) in links]
            for r in upstream:
                propagated.setdefault(r, []).append(int(row.rank))
    victims_of_others = {v for vs in propagated.values() for v in vs}
    findings = []
    for row in best.itertuples(index=False):
        if row.rank in victims_of_others and row.rank not in propagated:
            continue
        c = cause_of.get((row.pg, row.pg_ranks, row.rank))
        cause = c.cause if c is not None else "unknown"
        axis = axis_of(row.pg)
        wait_frac = row.mean_victims_wait_ns / row.mean_step_ns if row.mean_step_ns else 0.0
        group_label = axis or row.pg
        evidence = {
            "rank": int(row.rank), "pg": row.pg, "pg_ranks": list(group_members(row.pg_ranks)),
            "steps_analyzed": int(row.num_steps), "late_steps": int(row.num_late_steps),
            "late_frac": row.late_frac, "window_steps": int(row.window_steps),
            "window_late_frac": row.window_late_frac,
            "window": [int(row.window_first_step), int(row.window_last_step)],
            "detected_at_step": int(row.detected_at_step),
            "mean_margin_ms": ms(row.mean_margin_ns), "mean_margin_frac": row.mean_margin_frac,
            "mean_skew_ms": ms(row.mean_skew_ns), "victims_mean_wait_ms": ms(row.mean_victims_wait_ns),
            "step_time_ms": ms(row.mean_step_ns), "victims_wait_frac": wait_frac,
            "cause": cause,
            "cause_excess_ms": {
                "data": ms(c.data_excess_ns) if c is not None else None,
                "compute": ms(c.compute_excess_ns) if c is not None else None,
                "communication": ms(c.comm_excess_ns) if c is not None else None,
            },
            "throttled_frac": (None if c is None or pd.isna(c.throttled_frac) else float(c.throttled_frac)),
            "propagated_to": sorted(propagated.get(int(row.rank), [])),
            "injected": (injected or {}).get(int(row.rank)),
        }
        evidence_rows = None
        if lateness is not None:
            evidence_rows = lateness[(lateness["pg"] == row.pg) & (lateness["pg_ranks"] == row.pg_ranks)]
        findings.append(Finding(
            code="STRAGGLER",
            severity="critical" if wait_frac >= critical_wait_frac else "warning",
            ranks=(int(row.rank),), group=axis,
            title=(f"rank {row.rank} is the last to arrive in its {group_label} group "
                   f"{list(group_members(row.pg_ranks))} in {row.num_late_steps}/{row.num_steps} steps "
                   f"(+{ms(row.mean_margin_ns)} ms, {row.mean_margin_frac:.0%} of the step; cause: {cause})"),
            evidence=evidence,
            recommendation=_advice(cause, int(row.rank)),
            predicted_gain=PredictedGain(metric="step_time", frac=min(max(wait_frac, 0.0), 1.0)),
            rows=evidence_rows,
        ))
    return findings


def _advice(cause: str, rank: int) -> str:
    return {
        "data": (f"Rank {rank} spends longer loading data than its peers: add DataLoader workers or "
                 f"prefetching (num_workers, pin_memory, prefetch_factor) and check its host's disk/CPU load."),
        "compute": (f"Rank {rank} computes slower than its peers: check its host for CPU contention or a "
                    f"slower device, and for unequal work (sequence lengths, uneven layer split)."),
        "communication": (f"Rank {rank} waits on other ranks' p2p/collectives before it arrives: look upstream "
                          f"(its pipeline or tensor-parallel peers) for the origin of the delay."),
        "device": (f"Rank {rank}'s device is throttling (power/thermal): check cooling, power capping "
                   f"(nvidia-smi -q -d PERFORMANCE) and replace or drain the GPU."),
    }.get(cause, f"Rank {rank} arrives last without a visible phase cause: profile it (dtprobe run "
                 f"--collect.profile_steps) and compare its host and device with its peers.")
