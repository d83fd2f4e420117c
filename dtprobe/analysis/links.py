"""Inter-node links: the bus bandwidth of the collectives crossing each node pair, its change point, and the
SLOW_LINK detector; read by the facade (``RunAnalysis.link_bandwidth``, ``link_changes``, ``slow_links``) and,
through ``slow_link_ranks``, by the STRAGGLER detector (a slow link is not a rank's slow compute).

A collective crosses the link (node a, node b) when its group has members on both nodes. Its bus bandwidth is
``collective_bandwidth``'s (transfer time = after the last arrival, so a late rank does not lower it). To compare
collectives of different sizes and ops, each one is taken relative to the median busbw of its (pg, op, size)
class over the run (``rel_busbw``); the change point is the step that best splits a link's per-step median of
log(rel_busbw) into two flat segments.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from dtprobe.analysis.clocks import HOST, clock_of_timing
from dtprobe.analysis.comm_efficiency import BANDWIDTH_COLUMNS
from dtprobe.analysis.findings import Finding, PredictedGain
from dtprobe.analysis.tables import axis_of, group_members, step_durations
from dtprobe.store.columns import require_columns

RANK_NODE_COLUMNS = ["rank", "node_rank", "host"]
LINK_BW_COLUMNS = ["node_a", "node_b", "pg", "pg_ranks", "seq", "op", "step", "num_bytes", "duration_ns",
                   "busbw_bytes_per_s", "rel_busbw"]
LINK_CHANGE_COLUMNS = [
    "node_a", "node_b", "changed_at_step", "num_steps_before", "num_steps_after", "num_collectives_before",
    "num_collectives_after", "busbw_before_bytes_per_s", "busbw_after_bytes_per_s", "rel_busbw_ratio",
    "after_below_frac", "change_over_noise", "duration_before_ns_per_step", "duration_after_ns_per_step", "pgs",
]


def node_names(rank_nodes: pd.DataFrame) -> dict[int, str]:
    """rank -> name of its node: the host name when every node has its own, else ``node<node_rank>``.
    ``rank_nodes`` has one row per rank (columns ``RANK_NODE_COLUMNS``, e.g. from the run manifest)."""
    require_columns(rank_nodes, RANK_NODE_COLUMNS, table="rank_nodes")
    pairs = rank_nodes[["node_rank", "host"]].drop_duplicates()
    by_host = pairs["host"].nunique() == len(pairs) == pairs["node_rank"].nunique()
    return {int(r.rank): str(r.host) if by_host else f"node{int(r.node_rank)}"
            for r in rank_nodes.itertuples(index=False)}


def link_bandwidth(bw: pd.DataFrame, node_of: dict[int, str]) -> pd.DataFrame:
    """One row per (link, collective crossing it), from ``collective_bandwidth`` rows: the link's two nodes
    (sorted), the collective, its transfer time and busbw, and ``rel_busbw`` = busbw / the median busbw of its
    (pg, op, num_bytes) class. A group listing no members counts as every rank in ``node_of`` when its size
    matches. Empty on a single node. Columns: ``LINK_BW_COLUMNS``."""
    require_columns(bw, BANDWIDTH_COLUMNS, table="collective_bandwidth")
    empty = pd.DataFrame({col: [] for col in LINK_BW_COLUMNS})
    if bw.empty or len(set(node_of.values())) < 2:
        return empty
    ok, links_of = _crossing(bw, node_of)
    parts = []
    for (pr, size), links in links_of.items():
        rows = ok[(ok["pg_ranks"] == pr) & (ok["num_members"] == size)] if links else ok.iloc[:0]
        for a, b in links:
            parts.append(rows.assign(node_a=a, node_b=b))
    if not parts:
        return empty
    out = pd.concat(parts, ignore_index=True)
    cls = out.groupby(["pg", "op", "num_bytes"], dropna=False)["busbw_bytes_per_s"].transform("median")
    out["rel_busbw"] = out["busbw_bytes_per_s"].astype("float64") / cls.astype("float64")
    out["step"] = out["step"].astype("int64")
    return out.sort_values(["node_a", "node_b", "step", "seq"], kind="stable").reset_index(drop=True)[LINK_BW_COLUMNS]


def _crossing(bw: pd.DataFrame, node_of: dict[int, str]) -> tuple[pd.DataFrame, dict[tuple, list[tuple[str, str]]]]:
    """The ``bw`` rows with a bandwidth and a step, and per (pg_ranks, num_members) class the links it crosses."""
    ok = bw[bw["busbw_bytes_per_s"].notna() & (bw["busbw_bytes_per_s"] > 0) & bw["step"].notna()]
    everyone = tuple(sorted(node_of))
    links_of: dict[tuple[str, int], list[tuple[str, str]]] = {}
    for pr, size in ok[["pg_ranks", "num_members"]].drop_duplicates().itertuples(index=False):
        members = group_members(None if pd.isna(pr) else pr) or (everyone if int(size) == len(everyone) else ())
        nodes = sorted({node_of[m] for m in members if m in node_of})
        links_of[(pr, int(size))] = [(a, b) for i, a in enumerate(nodes) for b in nodes[i + 1:]]
    return ok, links_of


def changes_of_links(bw: pd.DataFrame, node_of: dict[int, str], *, min_steps: int = 3) -> pd.DataFrame:
    """``link_changes(link_bandwidth(bw, node_of))`` without a row per (link, crossing collective): links crossed by
    the same groups have the same collectives, so each such set of links is computed once and its change row
    repeated per link (a group spanning n nodes crosses n(n-1)/2 links: the rows would grow with the square of the
    nodes). ``rel_busbw`` divides by the median of the class over the rows ``link_bandwidth`` would hold, where
    each collective counts once per link it crosses. Columns: ``LINK_CHANGE_COLUMNS``."""
    require_columns(bw, BANDWIDTH_COLUMNS, table="collective_bandwidth")
    empty = pd.DataFrame(columns=LINK_CHANGE_COLUMNS)
    if bw.empty or len(set(node_of.values())) < 2:
        return empty
    # the member lists as categories: the rows are filtered and copied below, and copies of a long string per row
    # cost more than the rest (no output column holds them). Only the rows of groups with members on two nodes or
    # more are kept (a tp x dp run's tp groups lie within a node: most of its rows), before any other work; rows
    # of a group listing no members never equal its class in link_bandwidth either: none of them count
    groups = pd.Categorical(bw["pg_ranks"])
    spans = np.array([len({node_of[m] for m in group_members(g) if m in node_of}) > 1 for g in groups.categories]
                     + [False], dtype=bool)        # (code -1, a missing member list: last)
    keep = spans[groups.codes]
    bw = bw[keep].assign(pg_ranks=groups[keep])
    ok, links_of = _crossing(bw, node_of)
    classes = [k for k, links in links_of.items() if links and not pd.isna(k[0])]
    if not classes:
        return empty
    class_of = pd.MultiIndex.from_tuples(classes).get_indexer(
        pd.MultiIndex.from_arrays([ok["pg_ranks"], ok["num_members"].astype("int64")]))
    rows = ok[class_of >= 0].copy()
    code = class_of[class_of >= 0]
    weight = np.array([len(links_of[k]) for k in classes], dtype="int64")[code]
    median = _weighted_median(rows[["pg", "op", "num_bytes"]], rows["busbw_bytes_per_s"].to_numpy(dtype="float64"),
                              weight)
    rows["rel_busbw"] = rows["busbw_bytes_per_s"].astype("float64") / median
    rows["step"] = rows["step"].astype("int64")
    sets: dict[tuple[int, ...], list[tuple[str, str]]] = {}
    crossed: dict[tuple[str, str], list[int]] = {}
    for i, k in enumerate(classes):
        for link in links_of[k]:
            crossed.setdefault(link, []).append(i)
    for link, members in crossed.items():
        sets.setdefault(tuple(members), []).append(link)
    out = []
    for members, links in sets.items():
        (a, b) = links[0]
        mine = pd.concat([rows[code == i] for i in members]).assign(node_a=a, node_b=b)
        mine = mine.sort_values(["step", "seq"], kind="stable").reset_index(drop=True)[LINK_BW_COLUMNS]
        change = link_changes(mine, min_steps=min_steps)
        if change.empty:
            continue
        row = change.iloc[0].to_dict()
        out += [{**row, "node_a": a, "node_b": b} for a, b in links]
    if not out:
        return empty
    return pd.DataFrame(out, columns=LINK_CHANGE_COLUMNS).sort_values(
        ["node_a", "node_b"], kind="stable").reset_index(drop=True)


def _weighted_median(keys: pd.DataFrame, values: np.ndarray, weight: np.ndarray) -> np.ndarray:
    """Per row, the median of ``values`` in its group of ``keys`` (nulls a group too) with each value counted
    ``weight`` times: the median of the repeated values, exactly."""
    gid = keys.groupby(list(keys.columns), dropna=False, sort=False).ngroup().to_numpy()
    order = np.lexsort((values, gid))
    g, v, w = gid[order], values[order], weight[order]
    out = np.empty(gid.max() + 1 if len(gid) else 0, dtype="float64")
    starts = np.flatnonzero(np.r_[True, g[1:] != g[:-1]])
    for s, e in zip(starts, np.r_[starts[1:], len(g)]):
        cum = np.cumsum(w[s:e])
        total = int(cum[-1])
        lo = v[s + np.searchsorted(cum, (total - 1) // 2, side="right")]
        hi = v[s + np.searchsorted(cum, total // 2, side="right")]
        out[g[s]] = lo if total % 2 else (lo + hi) / 2
    return out[gid]


def link_changes(link_bw: pd.DataFrame, *, min_steps: int = 3) -> pd.DataFrame:
    """Per link with at least ``2 * min_steps`` steps of crossing collectives: the step where its bandwidth changes
    most (the split of its per-step median log ``rel_busbw`` into two segments, each of ``min_steps`` steps or
    more, with the least squared error), and on each side the number of steps and collectives, the median busbw,
    the mean crossing transfer time per step; ``rel_busbw_ratio`` = median rel busbw after / before;
    ``after_below_frac`` = share of the collectives after whose rel busbw is below the geometric middle of the
    two medians (how consistent the change is); ``change_over_noise`` = the drop of the per-step mean log busbw
    over the standard deviation of the per-step values around their segment's mean (how far the change stands out
    of the link's own step-to-step noise; inf when the segments are flat). Columns: ``LINK_CHANGE_COLUMNS``."""
    require_columns(link_bw, LINK_BW_COLUMNS, table="link_bandwidth")
    rows = []
    for (a, b), d in link_bw.groupby(["node_a", "node_b"], sort=True):
        per_step = np.log(d.groupby("step")["rel_busbw"].median())
        steps, y = per_step.index.to_numpy(dtype="int64"), per_step.to_numpy(dtype="float64")
        n = len(y)
        if n < 2 * min_steps:
            continue
        k = np.arange(min_steps, n - min_steps + 1)            # split: steps[:k] before, steps[k:] after
        c1, c2 = np.concatenate([[0.0], np.cumsum(y)]), np.concatenate([[0.0], np.cumsum(y * y)])
        sse = (c2[k] - c1[k] ** 2 / k) + ((c2[n] - c2[k]) - (c1[n] - c1[k]) ** 2 / (n - k))
        best = int(np.argmin(sse))
        split = int(k[best])
        at = int(steps[split])
        drop = c1[split] / split - (c1[n] - c1[split]) / (n - split)
        spread = np.sqrt(max(float(sse[best]), 0.0) / (n - 2))
        before, after = d[d["step"] < at], d[d["step"] >= at]
        rel_b, rel_a = float(before["rel_busbw"].median()), float(after["rel_busbw"].median())
        middle = np.sqrt(rel_b * rel_a)
        rows.append({
            "node_a": a, "node_b": b, "changed_at_step": at, "num_steps_before": split,
            "num_steps_after": n - split, "num_collectives_before": len(before), "num_collectives_after": len(after),
            "busbw_before_bytes_per_s": float(before["busbw_bytes_per_s"].median()),
            "busbw_after_bytes_per_s": float(after["busbw_bytes_per_s"].median()),
            "rel_busbw_ratio": rel_a / rel_b, "after_below_frac": float((after["rel_busbw"] < middle).mean()),
            "change_over_noise": drop / spread if spread > 1e-12 else (np.inf if drop > 0 else 0.0),
            "duration_before_ns_per_step": float(before.groupby("step")["duration_ns"].sum().mean()),
            "duration_after_ns_per_step": float(after.groupby("step")["duration_ns"].sum().mean()),
            "pgs": sorted(str(p) for p in pd.unique(d["pg"])),
        })
    return pd.DataFrame(rows, columns=LINK_CHANGE_COLUMNS)


def detect_slow_links(changes: pd.DataFrame, node_of: dict[int, str], steps: pd.DataFrame, *,
                      max_ratio: float = 0.5, min_collectives: int = 10, min_consistent_frac: float = 0.8,
                      min_change_over_noise: float = 3.0, axis_of_pg=axis_of, clock: str = HOST) -> list[Finding]:
    """SLOW_LINK (warning) for each link whose busbw after its change point is below ``max_ratio`` x before
    (``rel_busbw_ratio``), with ``min_collectives`` collectives or more on each side, at least
    ``min_consistent_frac`` of the later ones below the middle of the two levels (a lasting drop, not a few slow
    collectives) and a drop of at least ``min_change_over_noise`` x the link's step-to-step noise (on a busy host,
    CPU contention alone moves host-timed transfers by 2-3x for stretches of steps). ``group``: the axis when every crossing group has the same one, else None. Predicted gain:
    ``step_time`` by the added crossing transfer time per step / the median step time after the change."""
    require_columns(changes, LINK_CHANGE_COLUMNS, table="link_changes")
    findings = []
    durations = step_durations(steps)
    for c in changes.itertuples(index=False):
        if not (c.rel_busbw_ratio < max_ratio and c.num_collectives_before >= min_collectives
                and c.num_collectives_after >= min_collectives and c.after_below_frac >= min_consistent_frac
                and c.change_over_noise >= min_change_over_noise):
            continue
        ranks = {node: sorted(r for r, n in node_of.items() if n == node) for node in (c.node_a, c.node_b)}
        axes = {axis_of_pg(pg) for pg in c.pgs}
        axis = axes.pop() if len(axes) == 1 else None
        after = durations[durations["step"] >= c.changed_at_step]["step_ns"]
        step_ns = float(after.median()) if len(after) else float("nan")
        added = c.duration_after_ns_per_step - c.duration_before_ns_per_step
        gain = min(max(added / step_ns, 0.0), 1.0) if step_ns > 0 else None
        before_gbps, after_gbps = _gbps(c.busbw_before_bytes_per_s), _gbps(c.busbw_after_bytes_per_s)
        findings.append(Finding(
            code="SLOW_LINK", severity="warning", ranks=tuple(ranks[c.node_a] + ranks[c.node_b]), group=axis,
            title=(f"link {c.node_a} <-> {c.node_b} slowed from step {c.changed_at_step}: bus bandwidth of the "
                   f"collectives crossing it {before_gbps:.3g} -> {after_gbps:.3g} Gb/s "
                   f"({c.rel_busbw_ratio:.2f}x, median)"),
            evidence={
                "clock": clock, "nodes": [c.node_a, c.node_b], "ranks": ranks,
                "changed_at_step": int(c.changed_at_step),
                "busbw_before_gbps": before_gbps, "busbw_after_gbps": after_gbps,
                "busbw_ratio": c.rel_busbw_ratio, "after_below_frac": c.after_below_frac,
                "change_over_noise": c.change_over_noise,
                "num_collectives_before": int(c.num_collectives_before),
                "num_collectives_after": int(c.num_collectives_after),
                "num_steps_before": int(c.num_steps_before), "num_steps_after": int(c.num_steps_after),
                "transfer_ms_per_step_before": c.duration_before_ns_per_step / 1e6,
                "transfer_ms_per_step_after": c.duration_after_ns_per_step / 1e6,
                "pgs": list(c.pgs),
            },
            recommendation=(f"The network path between {c.node_a} and {c.node_b} delivers "
                            f"{c.rel_busbw_ratio:.0%} of its earlier bandwidth since step {c.changed_at_step}: check "
                            f"that link (NIC errors and speed: ethtool -S / ip -s link, switch port, traffic "
                            f"shaping or competing jobs), or drain one of the two nodes."),
            predicted_gain=PredictedGain(metric="step_time", frac=gain) if gain is not None else None,
        ))
    return findings


def find_slow_links(bw: pd.DataFrame, ranks, steps: pd.DataFrame, *, axis_of_pg=axis_of) -> list[Finding]:
    """SLOW_LINK findings of a run from its ``collective_bandwidth`` rows, its ranks' node facts (objects with
    ``rank``, ``node_rank``, ``host``: the manifest's ``RankInfo``) and its ``steps`` table (the facade's one call);
    ``evidence.clock`` is the clock of the transfer times (``clocks.clock_of_timing``)."""
    rank_nodes = pd.DataFrame([{"rank": r.rank, "node_rank": r.node_rank, "host": r.host} for r in ranks],
                              columns=RANK_NODE_COLUMNS)
    if rank_nodes.empty:
        return []
    node_of = node_names(rank_nodes)
    return detect_slow_links(changes_of_links(bw, node_of), node_of, steps, axis_of_pg=axis_of_pg,
                             clock=clock_of_timing(bw["timing"]))


def slow_link_ranks(findings: list[Finding]) -> dict[int, int]:
    """rank -> the earliest ``changed_at_step`` of a SLOW_LINK finding naming its node (for the STRAGGLER
    detector: lateness from then on may be the link's, not the rank's compute)."""
    out: dict[int, int] = {}
    for f in findings:
        if f.code != "SLOW_LINK":
            continue
        at = int(f.evidence["changed_at_step"])
        for rank in f.ranks:
            out[rank] = min(out.get(rank, at), at)
    return out


def _gbps(bytes_per_s: float) -> float:
    return float(bytes_per_s) * 8 / 1e9
