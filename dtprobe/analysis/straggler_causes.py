"""The cause class of a straggler (data, compute, communication, device): its phases, its time blocked outside
the group and its device samples against its group peers', per score row; read by ``stragglers`` (the STRAGGLER
detector), ``derived_tables`` (``blocked``, kept at compaction), ``devices`` and the facade."""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import pandas as pd

from dtprobe.analysis.arrivals import collective_skew, collective_waits
from dtprobe.analysis.straggler_scores import LATE_TIE_FRAC, row_core_shared, row_quota_held
from dtprobe.analysis.tables import P2P_OPS, coded_rows, completing_attempts, group_members, run_starts
from dtprobe.intervals import union_length_by_group
from dtprobe.lexsort import lexsort
from dtprobe.store.columns import require_columns

CAUSE_COLUMNS = [
    "pg", "pg_ranks", "rank", "data_excess_ns", "compute_excess_ns", "comm_excess_ns", "throttled_frac", "cause",
]
PHASE_EXCESS_COLUMNS = ["fwd_excess_ns", "bwd_excess_ns", "peer_unphased_ns"]
"""Extra columns of ``straggler_causes``: the rank's forward and backward against its peers' (signed) and its
peers' time in no phase, for ``outside_phases`` (a causes frame without them: not judged)."""
CAUSES = ("data", "compute", "communication", "device", "unknown")
"""Cause classes of a straggler."""

PHASES_SHARE_OF_COMPUTE = 0.25
"""A ``compute`` straggler is late for work outside its forward and backward (``outside_phases``) when they are
longer than its peers' by less than this share of its compute excess: a slower core or device, or more data,
lengthens them as well, while work only that rank runs between its optimizer step and its next forward leaves them
as its peers'. See ``outside_phases`` for peers whose backward holds their wait for it."""

THROTTLE_MASK = 0x4 | 0x8 | 0x20 | 0x40 | 0x80
"""NVML clock-throttle reasons that slow a GPU: SW power cap, HW slowdown, SW/HW thermal, power brake."""


def _blocking_waits(collectives: pd.DataFrame, waits: pd.DataFrame) -> pd.DataFrame:
    """Intervals a rank spent blocked on peers: p2p spans and [own arrival, last arrival] at collectives, of the
    attempt that redid a step after a torchrun restart (``completing_attempts``).
    Columns: rank, step, pg_ranks (categorical; ``p2p`` for p2p), a_ns, b_ns."""
    collectives, waits = completing_attempts(collectives), completing_attempts(waits)
    p2p = collectives[collectives["op"].isin(P2P_OPS) & collectives["end_ns"].notna()
                      & collectives["enqueue_ns"].notna()]
    w = waits["wait_ns"].to_numpy(dtype="int64") > 0
    group, names = pd.factorize(waits["pg_ranks"])          # codes, not copies of the long pg_ranks strings
    enq = waits["enqueue_ns"].to_numpy(dtype="int64")[w]
    return pd.DataFrame({
        "rank": np.concatenate([p2p["rank"].to_numpy(dtype="int64"), waits["rank"].to_numpy(dtype="int64")[w]]),
        "step": np.concatenate([p2p["step"].fillna(-1).to_numpy(dtype="int64"),
                                waits["step"].to_numpy(dtype="int64")[w]]),
        "pg_ranks": pd.Categorical.from_codes(np.concatenate([np.zeros(len(p2p), dtype="int64"), group[w] + 1]),
                                              categories=["p2p", *names]),
        "a_ns": np.concatenate([p2p["enqueue_ns"].to_numpy(dtype="int64"), enq]),
        "b_ns": np.concatenate([p2p["end_ns"].to_numpy(dtype="int64"),
                                enq + waits["wait_ns"].to_numpy(dtype="int64")[w]]),
    })


BLOCKED_COLUMNS = ["rank", "step", "outside_pg_ranks", "blocked_ns"]
OUTSIDE_NONE = "none"
"""``outside_pg_ranks`` of the blocked time in every group (no group's member list is spelled so)."""


def blocked_outside_groups(collectives: pd.DataFrame, waits: pd.DataFrame) -> pd.DataFrame:
    """Per (rank, step): how long the rank was blocked on peers (p2p spans and [own arrival, last arrival] at
    collectives, overlaps counted once) outside each group it waited in (``outside_pg_ranks``: the intervals of
    that group left out) and in all (``OUTSIDE_NONE``); the communication part of ``straggler_causes``, which reads
    the row of a candidate's group, else the ``OUTSIDE_NONE`` row (nothing of that group to leave out), else 0. Steps
    depend on their own rows only, so it is computed per step block at compaction (``derived_tables``).
    Columns: ``BLOCKED_COLUMNS`` (``outside_pg_ranks`` a category)."""
    b = _blocking_waits(collectives, waits) if not collectives.empty else pd.DataFrame()
    if b.empty:
        return pd.DataFrame({"rank": pd.Series(dtype="int64"), "step": pd.Series(dtype="int64"),
                             "outside_pg_ranks": pd.Categorical([]), "blocked_ns": pd.Series(dtype="float64")})
    rank, step = b["rank"].to_numpy(dtype="int64"), b["step"].to_numpy(dtype="int64")
    group = b["pg_ranks"].cat.codes.to_numpy().astype("int64")           # 0: p2p, never left out
    start, end = b["a_ns"].to_numpy(dtype="int64"), b["b_ns"].to_numpy(dtype="int64")
    order = lexsort((group, step, rank))
    rank, step, group, start, end = rank[order], step[order], group[order], start[order], end[order]
    new = run_starts(rank, step)
    rs = np.cumsum(new) - 1                                              # (rank, step) id of each interval
    first = np.flatnonzero(new)
    pair = run_starts(rs, group) & (group > 0)                           # each (rank, step, group) once
    pair_rs, pair_group = rs[pair], group[pair]
    num_pairs = np.bincount(pair_rs, minlength=len(first))
    pair_first = np.cumsum(num_pairs) - num_pairs
    # every interval once per group of its (rank, step) other than its own, in that group's copy
    copies = np.repeat(np.arange(len(rs)), num_pairs[rs])
    within = np.arange(len(copies)) - np.repeat(np.cumsum(num_pairs[rs]) - num_pairs[rs], num_pairs[rs])
    which = pair_first[rs[copies]] + within
    copies, which = copies[group[copies] != pair_group[which]], which[group[copies] != pair_group[which]]
    covered = union_length_by_group(np.concatenate([rs, len(first) + which]),
                                    np.concatenate([start, start[copies]]), np.concatenate([end, end[copies]]),
                                    num_groups=len(first) + len(pair_rs))
    names = b["pg_ranks"].cat.categories
    outside = np.concatenate([np.full(len(first), -1), pair_group])
    return pd.DataFrame({
        "rank": np.concatenate([rank[first], rank[first][pair_rs]]),
        "step": np.concatenate([step[first], step[first][pair_rs]]),
        "outside_pg_ranks": pd.Categorical.from_codes(np.where(outside < 0, 0, outside),
                                                      categories=[OUTSIDE_NONE, *names[1:]]),
        "blocked_ns": covered.astype("float64"),
    })[BLOCKED_COLUMNS]


def _as_text(values: pd.Series) -> pd.api.extensions.ExtensionArray:
    """``values.astype(str)`` as an array an index level is made of without a Python string per row; of a category
    column, its categories as text with the same codes (a kept ``blocked`` table has hundreds of thousands of rows
    and a few groups)."""
    text = values.cat.categories.astype(str) if isinstance(values.dtype, pd.CategoricalDtype) else None
    if text is None or not len(text) or text.has_duplicates:
        return values.astype(str).array
    return pd.Categorical.from_codes(values.cat.codes.to_numpy(), categories=text)


def _comm_ns(blocked: pd.Series, index: pd.MultiIndex, pg_ranks: str) -> np.ndarray:
    """Per (rank, step) of ``index``: its blocked time outside group ``pg_ranks`` (``blocked_outside_groups`` as a
    series by rank, step, outside_pg_ranks), the time outside none when it had no wait there, else 0."""
    rank, step = index.get_level_values(0), index.get_level_values(1)
    own = blocked.reindex(pd.MultiIndex.from_arrays([rank, step, [pg_ranks] * len(index)])).to_numpy()
    every = blocked.reindex(pd.MultiIndex.from_arrays([rank, step, [OUTSIDE_NONE] * len(index)])).to_numpy()
    return np.nan_to_num(np.where(np.isnan(own), every, own), nan=0.0)


def cause_candidates(scores: pd.DataFrame, *, min_lateness_frac: float = 0.0) -> pd.DataFrame:
    """The ``scores`` rows ``straggler_causes`` examines: late in their best window by ``min_lateness_frac``, or
    named by a view (``detected_at_step``; a quota'd rank late in bursts can have a median lateness of 0)."""
    detected = scores["detected_at_step"].notna() if "detected_at_step" in scores else False
    return scores[((scores["median_lateness_frac"] > 0) & (scores["median_lateness_frac"] >= min_lateness_frac))
                  | detected]


def cause_rows(collectives: pd.DataFrame, scores: pd.DataFrame, *, min_lateness_frac: float = 0.0) -> pd.DataFrame:
    """The rows of ``collectives`` that ``straggler_causes`` reads for the candidates of ``scores`` (their waits,
    ``collective_waits``, included): every row of each collective (pg, pg_ranks, seq) with a row in a candidate's
    window, and the p2p rows of those steps; the causes computed from them equal those computed from every row,
    since a collective's waits depend on its own rows and only the windows' steps are compared."""
    candidates = cause_candidates(scores, min_lateness_frac=min_lateness_frac)
    if candidates.empty or collectives.empty:
        return collectives.iloc[:0]
    window = np.unique(np.concatenate([np.arange(int(a), int(b) + 1) for a, b in
                                       zip(candidates["window_first_step"], candidates["window_last_step"])]))
    in_window = np.isin(collectives["step"].fillna(-1).to_numpy(dtype="int64"), window)
    grouped = (~collectives["op"].isin(P2P_OPS) & collectives["seq"].notna()).to_numpy(dtype=bool, na_value=False)
    _, code, _, _ = coded_rows(collectives, pd.Series(grouped, index=collectives.index), [])
    key = code * (1 << 40) + collectives["seq"].to_numpy(dtype="float64", na_value=0)[grouped].astype("int64")
    keep = in_window & ~grouped                                  # p2p (and unnumbered) rows of the window's steps
    keep[grouped] = np.isin(key, key[in_window[grouped]])
    return collectives if keep.all() else collectives[keep]   # windows over the whole run: no copy of every row


def window_blocked(collectives: pd.DataFrame, scores: pd.DataFrame, *, min_lateness_frac: float = 0.0) -> pd.DataFrame:
    """``blocked_outside_groups`` of the rows ``straggler_causes`` reads for the candidates of ``scores``
    (``cause_rows``): the steps of their windows only, which is all the causes compare."""
    rows = cause_rows(collectives, scores, min_lateness_frac=min_lateness_frac)
    return blocked_outside_groups(rows, collective_waits(rows, collective_skew(rows)))


def straggler_causes(scores: pd.DataFrame, lateness: pd.DataFrame, steps: pd.DataFrame, devices: pd.DataFrame, *,
                     blocked: pd.DataFrame, min_explained_frac: float = 0.25, throttle_frac: float = 0.5,
                     min_lateness_frac: float = 0.0) -> pd.DataFrame:
    """For each scored (group, rank) late in its best window, over its late steps (later than its peers' median by
    more than ``LATE_TIE_FRAC`` of the step): how much of its mean lateness comes from data loading (``data_ns``
    above its peers' median), from waiting on other peers (p2p spans and other groups' collectives, union, above
    its peers'), and the rest from its own compute; plus the share of its device samples with a slowing throttle
    reason. ``cause`` is ``device`` when throttled, ``compute`` when its CPU cgroup's quota held it back in its
    window while its peers' did not (``cpu_throttled_frac`` of ``scores``), else the largest part if it explains
    at least ``min_explained_frac`` of the lateness, else ``unknown``. Only ranks whose median lateness reaches
    ``min_lateness_frac`` (0: every late rank) or that a view qualified (``detected_at_step``: the persistence view
    names ranks whose median lateness is below it) are examined. The waits come from ``blocked``
    (``blocked_outside_groups`` of the collectives and their waits, or of the candidates' rows only:
    ``window_blocked``; kept at compaction). Columns: ``CAUSE_COLUMNS`` + ``PHASE_EXCESS_COLUMNS``."""
    require_columns(steps, ["rank", "step", "start_ns", "end_ns", "data_ns", "fwd_ns", "bwd_ns", "opt_ns"],
                    table="steps")
    require_columns(blocked, BLOCKED_COLUMNS, table="blocked_outside_groups")
    blocked_rank, blocked_step = blocked["rank"].to_numpy(dtype="int64"), blocked["step"].to_numpy(dtype="int64")
    ph = steps.dropna(subset=["end_ns"]).copy()
    ph["rank"] = ph["rank"].astype("int64")
    ph["step"] = ph["step"].astype("int64")
    for col in ("data_ns", "fwd_ns", "bwd_ns", "opt_ns"):
        ph[col] = ph[col].astype("float64").fillna(0.0)
    rows = []
    for s in cause_candidates(scores, min_lateness_frac=min_lateness_frac).itertuples(index=False):
        late = lateness[(lateness["pg"] == s.pg) & (lateness["pg_ranks"] == s.pg_ranks) & (lateness["rank"] == s.rank)
                        & lateness["step"].between(s.window_first_step, s.window_last_step)
                        & (lateness["lateness_frac"] > LATE_TIE_FRAC)]
        late_steps = set(int(x) for x in late["step"])
        members = group_members(s.pg_ranks)
        peers = [m for m in members if m != s.rank]
        # the members' waits outside this group only: the others' (rank, step) are not compared
        p = ph[ph["step"].isin(late_steps) & ph["rank"].isin(list(members))].set_index(["rank", "step"])
        # the waits of these (rank, step)s alone, as a series by rank, step and group (a window's blocked table
        # has a row per rank, step and group)
        mine = np.isin(blocked_rank, list(members)) & np.isin(blocked_step, list(late_steps))
        by_group = pd.Series(blocked["blocked_ns"].to_numpy(dtype="float64")[mine], index=pd.MultiIndex.from_arrays(
            [blocked_rank[mine], blocked_step[mine], _as_text(blocked["outside_pg_ranks"][mine])]))
        p["comm_ns"] = _comm_ns(by_group, p.index, s.pg_ranks)
        p = p.reset_index()
        p["unphased_ns"] = (p["end_ns"] - p["start_ns"]).astype("float64") - p[
            ["data_ns", "fwd_ns", "bwd_ns", "opt_ns"]].sum(axis=1)
        diffs, signed = {}, {}
        for col in ("data_ns", "comm_ns", "fwd_ns", "bwd_ns"):
            mine = p[p["rank"] == s.rank].set_index("step")[col]
            theirs = p[p["rank"].isin(peers)].groupby("step")[col].median()
            diff = (mine - theirs.reindex(mine.index)).dropna()
            signed[col] = float(diff.mean()) if len(diff) else 0.0
            diffs[col] = max(0.0, signed[col])
        peer_unphased = p[p["rank"].isin(peers)].groupby("step")["unphased_ns"].median()
        if not (p[["fwd_ns", "bwd_ns"]].to_numpy() > 0).any():    # no forward or backward timed: not compared
            signed["fwd_ns"] = signed["bwd_ns"] = np.nan
        lateness_ns = float(late["lateness_ns"].mean()) if len(late) else 0.0
        # Whatever of its lateness neither slower data loading nor waiting on other peers (p2p, other groups'
        # collectives) explains is its own compute: phases after the first collective cannot be compared
        # directly, since a victim's bwd is as long as the culprit's (DDP waits for the all-reduce inside it).
        excess = {"data": diffs["data_ns"], "communication": diffs["comm_ns"],
                  "compute": max(0.0, lateness_ns - diffs["data_ns"] - diffs["comm_ns"])}
        throttled = _throttled_frac(devices, s.rank, steps, late_steps)
        margin = lateness_ns
        best = max(excess, key=excess.get)
        if throttled is not None and throttled >= throttle_frac:
            cause = "device"
        elif row_quota_held(s) or row_core_shared(s):
            # its CPU withheld by its quota (or taken by another process on its core) delays every thread of it,
            # the communication ones too: the waits it imposes then split between "compute" and "communication"
            # at random; the kernel's count decides
            cause = "compute"
        elif margin > 0 and excess[best] >= min_explained_frac * margin:
            cause = best
        else:
            cause = "unknown"
        rows.append({"pg": s.pg, "pg_ranks": s.pg_ranks, "rank": int(s.rank),
                     "data_excess_ns": excess["data"], "compute_excess_ns": excess["compute"],
                     "comm_excess_ns": excess["communication"], "fwd_excess_ns": signed["fwd_ns"],
                     "bwd_excess_ns": signed["bwd_ns"],
                     "peer_unphased_ns": float(peer_unphased.mean()) if len(peer_unphased) else np.nan,
                     "throttled_frac": np.nan if throttled is None else throttled, "cause": cause})
    if not rows:
        return pd.DataFrame({col: [] for col in CAUSE_COLUMNS + PHASE_EXCESS_COLUMNS})
    return pd.DataFrame(rows)[CAUSE_COLUMNS + PHASE_EXCESS_COLUMNS]


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


def outside_phases(c) -> bool | None:
    """Whether a compute straggler's lateness (``compute_excess_ns`` of its ``straggler_causes`` row) lies outside
    its forward and backward. Its forward must be as its peers'. Where its peers' waits for it fall outside their
    phases (their unphased time, step minus data, fwd, bwd and opt, is at least half that lateness: as under ``dtprobe
    launch``), so must its backward's excess be (``PHASES_SHARE_OF_COMPUTE``). Where their phases span their steps,
    their backward holds their wait (DDP waits for the all-reduce inside it), and a rank slower in its backward alone
    has a backward as long as theirs: outside only when its own is shorter by half the lateness or more. None without
    a positive compute excess."""
    compute, fwd, bwd, unphased = c.compute_excess_ns, *phase_excess(c)
    if not compute > 0 or pd.isna(fwd) or pd.isna(bwd):
        return None
    if fwd >= PHASES_SHARE_OF_COMPUTE * compute:
        return False
    if not pd.isna(unphased) and unphased >= 0.5 * compute:
        return bool(max(0.0, fwd) + max(0.0, bwd) < PHASES_SHARE_OF_COMPUTE * compute)
    return bool(bwd <= -0.5 * compute)


def phase_excess(c) -> tuple[float, float, float]:
    """The ``PHASE_EXCESS_COLUMNS`` of a causes row (NaN where the frame has none)."""
    return tuple(float(getattr(c, col, np.nan)) for col in PHASE_EXCESS_COLUMNS)
