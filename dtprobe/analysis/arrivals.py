"""Arrival metrics of collectives: skew per collective, each member's wait and lateness vs its peers per step;
read by ``stragglers`` (detector), ``exposed_comm``, ``hangs``, the facade and the dashboard; the median of the
other members (``lateness_vs_peers``) is also the arrival core of ``device_arrivals`` (Kineto trace folders).

Arrival = clock-aligned ``enqueue_ns`` of a rank at a collective (pg, pg_ranks, seq); the store aligns clocks.
On a CUDA run the host runs ahead of its device, so ``on_arrival_clock`` first puts each group on its best clock:
the device arrival (``arrive_ns``: a CUDA event on the caller's stream) for groups whose rows have it, the host
enqueue otherwise (CPU/gloo runs: the table is returned unchanged).
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from dtprobe.analysis.clocks import DEVICE, HOST
from dtprobe.analysis.tables import (P2P_OPS, attempts_of, coded_rows, coded_text, completing_attempts,
                                     frame_group_codes, group_members, lookup_group_codes, p2p_pairs, run_starts,
                                     step_durations)
from dtprobe.lexsort import lexsort
from dtprobe.store.columns import require_columns

CLOCK_COLUMNS = ["pg", "pg_ranks", "clock"]


def arrival_clocks(collectives: pd.DataFrame) -> pd.DataFrame:
    """Per group (pg, pg_ranks): the clock its arrivals are read on, ``device`` when any of its rows has
    ``arrive_ns`` (a CUDA run's collector writes it on every resolved row; a row whose event never resolved, e.g.
    a hung collective, lacks it), else ``host``. Columns: ``CLOCK_COLUMNS``."""
    require_columns(collectives, ["pg", "pg_ranks", "arrive_ns"], table="collectives")
    if collectives.empty:
        return pd.DataFrame({col: [] for col in CLOCK_COLUMNS})
    code, pg_names, pr_names = frame_group_codes(collectives)
    device = np.bincount(code, weights=collectives["arrive_ns"].notna().to_numpy(dtype=float),
                         minlength=len(pg_names)) > 0    # codes number the pairs in sorted order
    return pd.DataFrame({"pg": pg_names, "pg_ranks": pr_names,
                         "clock": np.where(device, DEVICE, HOST)})[CLOCK_COLUMNS]


def on_arrival_clock(collectives: pd.DataFrame) -> pd.DataFrame:
    """``collectives`` with ``enqueue_ns`` holding each row's arrival on its group's clock (``arrival_clocks``):
    ``arrive_ns`` in device-clock groups (null where a row lacks it, so that row is no arrival), the host enqueue
    elsewhere. The same object when no row has ``arrive_ns`` (CPU/gloo runs, runs written before the column), so
    every host-clock verdict stays what it was. Completion (``end_ns``) is left as recorded: NCCL's device end
    on ``cuda_event`` rows."""
    require_columns(collectives, ["pg", "pg_ranks", "enqueue_ns", "arrive_ns"], table="collectives")
    has = collectives["arrive_ns"].notna()
    if not has.any():
        return collectives
    clocks = arrival_clocks(collectives)
    device = clocks.loc[clocks["clock"] == DEVICE]
    in_device = np.isin(frame_group_codes(collectives)[0], device.index.to_numpy())  # arrival_clocks' rows: codes
    out = collectives.copy()
    out["enqueue_ns"] = collectives["enqueue_ns"].where(~in_device, collectives["arrive_ns"])
    return out


GROUP_ROW_COLUMNS = ["pg", "pg_ranks", "op", "rank", "peer", "arrive_ns"]


def group_rows(collectives: pd.DataFrame) -> pd.DataFrame:
    """The collectives reduced to what ``arrival_clocks``, ``stragglers.linked_ranks`` and
    ``pipeline_delay.pipeline_groups`` read, each giving on it what it gives on every row: one row per group
    (pg, pg_ranks; nulls as "") with ``arrive_ns`` the latest device arrival of its rows (null when none has
    one), and one per p2p link (pg, pg_ranks, op, rank, peer of a send/recv naming its peer). Computed per step
    block at compaction (``derived_tables``); ``group_rows`` of blocks' frames together is the whole run's.
    Columns: ``GROUP_ROW_COLUMNS``."""
    return _group_rows(collectives, per_step=False)


def group_rows_per_step(collectives: pd.DataFrame) -> pd.DataFrame:
    """``group_rows`` of each step's rows on their own (``step`` null as -1), with a ``step`` column last: a step
    window keeps those of its steps, and ``group_rows`` of them is the window's."""
    return _group_rows(collectives, per_step=True)


def _group_rows(collectives: pd.DataFrame, *, per_step: bool) -> pd.DataFrame:
    needed = ["pg", "pg_ranks", "op", "rank", "peer", "arrive_ns"] + (["step"] if per_step else [])
    require_columns(collectives, needed, table="collectives")
    code, pg_names, pr_names = frame_group_codes(collectives)
    step = collectives["step"].to_numpy(dtype="float64", na_value=-1).astype("int64") if per_step else 0
    arrive = collectives["arrive_ns"].to_numpy(dtype="float64", na_value=np.nan)
    keys = pd.DataFrame({"code": code, "step": step})
    latest = (pd.Series(arrive).groupby([keys["code"], keys["step"]]).max().reset_index() if len(code)
              else pd.DataFrame({"code": np.empty(0, "int64"), "step": np.empty(0, "int64"), 0: np.empty(0)}))
    groups = pd.DataFrame({"pg": pg_names.take(latest["code"]), "pg_ranks": pr_names.take(latest["code"]),
                           "op": None, "rank": -1, "peer": np.nan, "arrive_ns": latest[0].to_numpy(),
                           "step": latest["step"].to_numpy()})
    link = (collectives["op"].isin(P2P_OPS) & collectives["peer"].notna()).to_numpy(dtype=bool)
    links = pd.DataFrame({"code": code[link], "step": keys["step"].to_numpy()[link],
                          "op": collectives["op"].to_numpy()[link].astype(str),
                          "rank": collectives["rank"].to_numpy()[link].astype("int64"),
                          "peer": collectives["peer"].to_numpy()[link].astype("float64")}
                         ).drop_duplicates().sort_values(["step", "code", "rank", "peer", "op"])
    links = pd.DataFrame({"pg": pg_names.take(links["code"]), "pg_ranks": pr_names.take(links["code"]),
                          "op": links["op"].to_numpy(), "rank": links["rank"].to_numpy(),
                          "peer": links["peer"].to_numpy(), "arrive_ns": np.nan, "step": links["step"].to_numpy()})
    out = pd.concat([groups, links], ignore_index=True) if len(links) else groups
    columns = GROUP_ROW_COLUMNS + ["step"] if per_step else GROUP_ROW_COLUMNS
    return out.astype({"pg": object, "pg_ranks": object, "op": object, "rank": "int64", "peer": "float64",
                       "arrive_ns": "float64", "step": "int64"})[columns]


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
    d, code, _, _ = coded_rows(c, mask, ["rank", "seq", "enqueue_ns"])
    rank = d["rank"].to_numpy(dtype="int64")
    order = lexsort((d["enqueue_ns"].to_numpy(dtype="int64"), code, rank))      # by rank, group, arrival
    seq = d["seq"].to_numpy(dtype="int64")[order]
    first = run_starts(rank[order], code[order])
    restart = np.zeros(len(seq), dtype=bool)
    restart[1:] = ~first[1:] & (seq[1:] <= seq[:-1])
    if not restart.any():
        return collectives
    done = np.cumsum(restart)
    attempt = done - (done - restart)[np.flatnonzero(first)][np.cumsum(first) - 1]
    out = collectives.copy()
    out.loc[d.index[order], "seq"] = pd.array(seq + attempt * ATTEMPT_SEQ_STRIDE, dtype="Int64")
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
                    "lateness_frac", "pre_excess_frac", "comm_excess_frac"]
LATENESS_OPTIONAL = ("comm_excess_frac",)
"""Columns of ``LATENESS_COLUMNS`` a reader does without (NaN: unknown), as in hand-made tables."""
_COLL_COLUMNS = ["rank", "pg", "pg_ranks", "pg_size", "seq", "op", "num_bytes", "enqueue_ns", "end_ns", "step"]


def collective_skew(collectives: pd.DataFrame) -> pd.DataFrame:
    """One row per collective (pg, pg_ranks, seq): arrival skew (last - first enqueue), margin of the last arriver
    over the second-last, victims' mean wait, the late rank. P2P ops excluded. Columns: ``SKEW_COLUMNS``."""
    require_columns(collectives, _COLL_COLUMNS, table="collectives")
    c, code, pg_names, pr_names = coded_rows(
        collectives, ~collectives["op"].isin(P2P_OPS) & collectives["seq"].notna() & collectives["enqueue_ns"].notna(),
        ["rank", "seq", "op", "num_bytes", "enqueue_ns", "step", "pg_size"])
    if c.empty:
        return pd.DataFrame({col: [] for col in SKEW_COLUMNS})
    seq, enq = c["seq"].to_numpy(dtype="int64"), c["enqueue_ns"].to_numpy(dtype="int64")
    order = lexsort((enq, seq, code))                # by collective, then arrival (stable: ties keep table order)
    code, seq, enq = code[order], seq[order], enq[order]
    rank = c["rank"].to_numpy(dtype="int64")[order]
    first = np.flatnonzero(run_starts(code, seq))    # first and last arrival of each collective
    last = np.append(first[1:], len(code)) - 1
    coll = np.repeat(np.arange(len(first)), last - first + 1)
    rank_sorted = lexsort((rank, coll))
    new_rank = run_starts(coll[rank_sorted], rank[rank_sorted])
    num_arrived = np.bincount(coll[rank_sorted][new_rank], minlength=len(first))
    size_of = np.array([len(group_members(p)) for p in pr_names], dtype="int64")[code[first]]
    pg_size = np.fmax.reduceat(c["pg_size"].to_numpy(dtype="float64", na_value=np.nan)[order], first)
    num_members = np.where(size_of == 0, np.nan_to_num(pg_size, nan=0.0), size_of).astype("int64")
    skew_ns = enq[last] - enq[first]
    rel_sum = np.add.reduceat(enq - enq[first][coll], first).astype("float64")
    n = num_arrived.astype("float64")
    last_rel = skew_ns.astype("float64")
    out = pd.DataFrame({
        "pg": pg_names.take(code[first]), "pg_ranks": pr_names.take(code[first]), "seq": seq[first],
        "op": c["op"].iloc[order[first]].astype(str).to_numpy(),
        "step": c["step"].fillna(-1).to_numpy(dtype="int64")[order[last]],
        "num_bytes": np.maximum.reduceat(c["num_bytes"].fillna(0).to_numpy(dtype="int64")[order], first),
        "num_members": num_members, "num_arrived": num_arrived, "complete": num_arrived >= num_members,
        "first_enqueue_ns": enq[first], "last_enqueue_ns": enq[last], "skew_ns": skew_ns,
        "margin_ns": enq[last] - enq[np.maximum(last - 1, first)],         # exact: never through float64
        "victims_wait_ns": np.where(n > 1, last_rel - (rel_sum - last_rel) / np.clip(n - 1, 1, None), 0.0),
        "late_rank": rank[last],
    })
    return out[SKEW_COLUMNS]


def collective_waits(collectives: pd.DataFrame, skew: pd.DataFrame) -> pd.DataFrame:
    """Per member of each collective: ``wait_ns`` = last arrival - own arrival (0 for the late rank).
    Columns: pg, pg_ranks (a category: one row per collective row), seq, step, rank, enqueue_ns, wait_ns,
    late_rank, restart (the row's torchrun attempt; 0 when ``collectives`` has no such column)."""
    require_columns(collectives, _COLL_COLUMNS, table="collectives")
    cols = ["pg", "pg_ranks", "seq", "step", "rank", "enqueue_ns", "wait_ns", "late_rank", "restart"]
    if collectives.empty or skew.empty:
        return pd.DataFrame({col: [] for col in cols})
    c, code, pg_names, pr_names = coded_rows(
        collectives, ~collectives["op"].isin(P2P_OPS) & collectives["seq"].notna() & collectives["enqueue_ns"].notna(),
        ["rank", "seq", "enqueue_ns", "step"] + (["restart"] if "restart" in collectives.columns else []))
    if c.empty:
        return pd.DataFrame({col: [] for col in cols})
    restart = attempts_of(c)
    skew_code = lookup_group_codes(skew["pg"], skew["pg_ranks"], pg_names, pr_names)
    m = pd.DataFrame({"code": code, "seq": c["seq"].to_numpy(dtype="int64"), "row": np.arange(len(c))}).merge(
        pd.DataFrame({"code": skew_code, "seq": skew["seq"].to_numpy(dtype="int64"),
                      "last_enqueue_ns": skew["last_enqueue_ns"].to_numpy(),
                      "late_rank": skew["late_rank"].to_numpy()}),
        on=["code", "seq"])
    rows = m["row"].to_numpy()
    enq = c["enqueue_ns"].to_numpy(dtype="int64")[rows]
    out = pd.DataFrame({
        "pg": pg_names.take(code[rows]), "pg_ranks": coded_text(pr_names, code[rows]), "seq": m["seq"].to_numpy(),
        "step": c["step"].fillna(-1).to_numpy(dtype="int64")[rows], "rank": c["rank"].to_numpy(dtype="int64")[rows],
        "enqueue_ns": enq, "wait_ns": (m["last_enqueue_ns"].to_numpy() - enq).astype("int64"),
        "late_rank": m["late_rank"].to_numpy(), "restart": restart[rows],
    })
    return out[cols]


def late_rank_per_step(skew: pd.DataFrame, steps: pd.DataFrame) -> pd.DataFrame:
    """Per (group, step): the complete collective with the largest margin, its late rank, and that margin as a
    share of the group's median step time (``margin_frac``). A step redone after a torchrun restart is read from
    the last attempt's collectives (``unique_seq``'s attempt) and step times (``completing_attempts``).
    Columns: ``LATE_RANK_COLUMNS``."""
    require_columns(skew, SKEW_COLUMNS, table="collective_skew")
    done = skew[skew["complete"].astype(bool) & (skew["step"] >= 0) & (skew["num_members"] > 1)]
    if done.empty:
        return pd.DataFrame({col: [] for col in LATE_RANK_COLUMNS})
    attempt = done["seq"].to_numpy(dtype="int64") // ATTEMPT_SEQ_STRIDE
    if attempt.any():
        last = pd.Series(attempt).groupby([done["pg"].to_numpy(), done["pg_ranks"].to_numpy(),
                                           done["step"].to_numpy()]).transform("max").to_numpy()
        done = done[attempt == last]
    return _largest_margin_per_step(done, completing_attempts(steps))


def _largest_margin_per_step(skew: pd.DataFrame, steps: pd.DataFrame) -> pd.DataFrame:
    """Of ``skew`` rows (``collective_skew``'s, ``step`` set): per (group, step) the one with the largest margin,
    with the group's step time and the margin's share of it. Columns: ``LATE_RANK_COLUMNS``."""
    top = skew.loc[skew.groupby(["pg", "pg_ranks", "step"], sort=True, observed=True)["margin_ns"].idxmax()].copy()
    codes, pg_ranks = pd.factorize(top["pg_ranks"])
    top["step_ns"] = _group_step_ns(pg_ranks, codes, top["step"].to_numpy(dtype="int64"), steps)
    top["margin_frac"] = top["margin_ns"] / top["step_ns"]
    return top[LATE_RANK_COLUMNS].sort_values(["pg", "pg_ranks", "step"], kind="stable").reset_index(drop=True)


def late_between_steps(collectives: pd.DataFrame, steps: pd.DataFrame) -> pd.DataFrame:
    """``late_rank_per_step``'s rows for the collectives issued outside any step (``step`` null or -1) whose last
    arrival falls inside one of the late rank's steps: under ``dtprobe launch`` a step starts where the previous
    one ended, so a barrier between two optimizer steps (rank 0 preparing the next epoch's data while the others
    wait) is in the next step's time, though no step was open when it was called. Per (group, step) the one with
    the largest margin. Collectives before the first step or after the last, or between the steps of a script
    that times its own (no step row spans them), stay out. Each attempt's rows are paired on their own.
    Columns: ``LATE_RANK_COLUMNS``."""
    empty = pd.DataFrame({col: [] for col in LATE_RANK_COLUMNS})
    need = ["start_ns", "end_ns", "step", "rank"]
    if collectives.empty or steps.empty or not set(need) <= set(steps.columns):
        return empty
    outside = collectives["step"].isna().to_numpy(dtype=bool) | (collectives["step"].fillna(-1) < 0).to_numpy()
    c = collectives[outside]
    if c.empty:
        return empty
    steps = completing_attempts(steps).dropna(subset=need)
    parts = []
    for attempt in np.unique(attempts_of(c)):
        skew = collective_skew(c[attempts_of(c) == attempt])
        done = skew[skew["complete"].astype(bool) & (skew["num_members"] > 1)]
        mine = steps[attempts_of(steps) == attempt]
        if done.empty or mine.empty:
            continue
        step = _step_spanning(mine, done["late_rank"].to_numpy(dtype="int64"),
                              done["last_enqueue_ns"].to_numpy(dtype="int64"))
        parts.append(done.assign(step=step)[step >= 0])
    done = pd.concat(parts, ignore_index=True) if parts else empty
    return empty if done.empty else _largest_margin_per_step(done, steps)


def _step_spanning(steps: pd.DataFrame, rank: np.ndarray, t_ns: np.ndarray) -> np.ndarray:
    """Per (``rank``, ``t_ns``): the step of ``rank`` whose row spans ``t_ns`` (start <= t <= end), else -1."""
    out = np.full(len(rank), -1, dtype="int64")
    r_all = steps["rank"].to_numpy(dtype="int64")
    for r in np.unique(rank):
        mine = steps[r_all == r].sort_values("start_ns", kind="stable")
        if mine.empty:
            continue
        start, end = mine["start_ns"].to_numpy(dtype="int64"), mine["end_ns"].to_numpy(dtype="int64")
        at = np.flatnonzero(rank == r)
        i = np.searchsorted(start, t_ns[at], side="right") - 1      # the last step started by then
        ok = (i >= 0) & (t_ns[at] <= end[np.clip(i, 0, None)])
        out[at[ok]] = mine["step"].to_numpy(dtype="int64")[i[ok]]
    return out


def late_p2p_per_step(collectives: pd.DataFrame, steps: pd.DataFrame) -> pd.DataFrame:
    """``late_rank_per_step``'s rows for point-to-point links: per (group, link, step), the send/recv pair whose
    later side came the most after the other (the k-th send from A to B is B's k-th recv from A: the same ``seq``,
    in the same attempt and step on both sides), that side's rank late by that margin (a receiver waited for a
    sender, or a sender for a receiver). ``pg_ranks`` names the link's two ranks ("A,B", lower first), so each
    link's margins are judged against its own; ``op`` and ``seq`` are the late side's. A step redone after a
    torchrun restart is read from the attempt that redid it. Columns: ``LATE_RANK_COLUMNS``."""
    empty = pd.DataFrame({col: [] for col in LATE_RANK_COLUMNS})
    need = ["rank", "pg", "op", "peer", "seq", "enqueue_ns", "step"]
    if collectives.empty or not set(need) <= set(collectives.columns):
        return empty
    c = collectives[collectives["op"].isin(P2P_OPS) & collectives["peer"].notna() & collectives["seq"].notna()
                    & collectives["enqueue_ns"].notna() & collectives["step"].notna()]
    if c.empty:
        return empty
    c = completing_attempts(c[c["step"] >= 0])
    pairs = p2p_pairs(group=c["pg"].astype(str).to_numpy(), rank=c["rank"].to_numpy(dtype="int64"),
                      peer=c["peer"].to_numpy(dtype="float64", na_value=np.nan), op=c["op"].astype(str).to_numpy(),
                      seq=c["seq"].to_numpy(dtype="float64", na_value=np.nan), step=c["step"].to_numpy(dtype="int64"),
                      restart=attempts_of(c), enqueue=c["enqueue_ns"].to_numpy(dtype="int64"))
    if pairs.empty:
        return empty
    sender_late = (pairs["enq_s"] >= pairs["enq_r"]).to_numpy()
    margin = (pairs["enq_s"] - pairs["enq_r"]).abs().to_numpy(dtype="int64")
    out = pd.DataFrame({
        "pg": pairs["group"].to_numpy(),
        "pg_ranks": [f"{min(a, b)},{max(a, b)}" for a, b in zip(pairs["src"].tolist(), pairs["dst"].tolist())],
        "step": pairs["step"].to_numpy(), "seq": pairs["seq"].to_numpy(),
        "op": np.where(sender_late, "send", "recv"),
        "late_rank": np.where(sender_late, pairs["src"].to_numpy(), pairs["dst"].to_numpy()),
        "skew_ns": margin, "margin_ns": margin, "victims_wait_ns": margin})
    top = out.loc[out.groupby(["pg", "pg_ranks", "step"], sort=True)["margin_ns"].idxmax()].copy()
    codes, pg_ranks = pd.factorize(top["pg_ranks"])
    top["step_ns"] = _group_step_ns(pg_ranks, codes, top["step"].to_numpy(dtype="int64"), completing_attempts(steps))
    top["margin_frac"] = top["margin_ns"] / top["step_ns"]
    return top[LATE_RANK_COLUMNS].sort_values(["pg", "pg_ranks", "step"], kind="stable").reset_index(drop=True)


def late_per_step(skew: pd.DataFrame, collectives: pd.DataFrame, steps: pd.DataFrame) -> pd.DataFrame:
    """``late_rank_per_step`` of the collectives (``skew``: their ``collective_skew``) and ``late_p2p_per_step`` of
    the point-to-point links, in one frame ordered by (pg, pg_ranks, step). Columns: ``LATE_RANK_COLUMNS``."""
    frames = [f for f in (late_rank_per_step(skew, steps), late_p2p_per_step(collectives, steps)) if not f.empty]
    if len(frames) < 2:
        return frames[0] if frames else pd.DataFrame({col: [] for col in LATE_RANK_COLUMNS})
    return pd.concat(frames, ignore_index=True).sort_values(["pg", "pg_ranks", "step"], kind="stable"
                                                            ).reset_index(drop=True)


def _group_step_ns(pg_ranks: pd.Index, codes: np.ndarray, step: np.ndarray, steps: pd.DataFrame) -> np.ndarray:
    """Per row (``pg_ranks[codes]``, ``step``): the median step time of the group's members at that step; of all
    ranks when the group names no members or none of them recorded the step (NaN when no rank did)."""
    durations = step_durations(steps)
    overall = durations.groupby("step")["step_ns"].median()
    out = overall.reindex(step).to_numpy(dtype="float64")
    membership = pd.DataFrame([(k, m) for k in np.unique(codes) for m in group_members(pg_ranks[k])],
                              columns=["code", "rank"], dtype="int64")
    if membership.empty or durations.empty:
        return out
    m = durations.merge(membership, on="rank")
    if m.empty:
        return out
    low = min(int(m["step"].min()), int(step.min()))
    span = max(int(m["step"].max()), int(step.max())) - low + 1      # one integer key per (code, step)
    med = m["step_ns"].groupby((m["code"] * span + m["step"] - low).to_numpy()).median()
    mine = med.reindex(codes * span + step - low).to_numpy(dtype="float64")
    return np.where(np.isnan(mine), out, mine)


def rank_lateness(collectives: pd.DataFrame, steps: pd.DataFrame) -> pd.DataFrame:
    """Per (group, step, member rank): how much later than the median of its peers the rank arrived, at the
    step's collective where it was latest (``lateness_ns``, negative when early), as a share of the group's
    step time; the mean wait it imposed on its peers there (``victims_wait_ns``); whether it was the last to
    arrive; and its time in the group's collectives of that step (their durations summed) minus its peers' median
    (``comm_excess_frac``, a share of the step: negative for a rank its peers wait for, which waits less than they
    do; NaN when a member has a collective without an end). Complete non-p2p collectives of steps >= 0 only, whose
    every member issued it in a step it finished (a ``steps`` row): a member whose loop has ended, e.g. one that
    DDP's ``join()`` keeps answering its peers' all-reduces after its data ran out, is no peer to be late against.
    A step redone after a torchrun restart is read from the attempt that redid it (``completing_attempts``).
    Columns: ``LATENESS_COLUMNS``."""
    require_columns(collectives, _COLL_COLUMNS, table="collectives")
    collectives, steps = completing_attempts(collectives), completing_attempts(steps)
    c, code, pg_names, pr_names = coded_rows(
        collectives, ~collectives["op"].isin(P2P_OPS) & collectives["seq"].notna() & collectives["enqueue_ns"].notna()
        & (collectives["step"].fillna(-1) >= 0), ["rank", "seq", "enqueue_ns", "end_ns", "step"])
    if c.empty:
        return pd.DataFrame({col: [] for col in LATENESS_COLUMNS})
    seq, rank = c["seq"].to_numpy(dtype="int64"), c["rank"].to_numpy(dtype="int64")
    keep = ~pd.DataFrame({"code": code, "seq": seq, "rank": rank}).duplicated().to_numpy()   # first row per member
    keep &= _in_finished_steps(rank, c["step"].to_numpy(dtype="int64"), steps)
    enq, step = c["enqueue_ns"].to_numpy(dtype="int64")[keep], c["step"].to_numpy(dtype="int64")[keep]
    ended = c["end_ns"].notna().to_numpy()[keep]
    end = c["end_ns"].to_numpy(dtype="int64", na_value=0)[keep]
    code, seq, rank = code[keep], seq[keep], rank[keep]
    order = lexsort((enq, seq, code))                    # by collective, then arrival
    code, seq, rank, enq, step = code[order], seq[order], rank[order], enq[order], step[order]
    dur = np.where(ended[order], np.clip(end[order] - enq, 0, None), np.nan)    # exact in int64, then float
    coll = np.cumsum(run_starts(code, seq)) - 1
    n = np.bincount(coll)[coll]
    members = np.array([len(group_members(p)) for p in pr_names], dtype="int64")[code]
    complete = (n >= 2) & ((members == 0) | (n >= members))
    if not complete.any():
        return pd.DataFrame({col: [] for col in LATENESS_COLUMNS})
    code, seq, rank, enq, step, dur, n = (v[complete] for v in (code, seq, rank, enq, step, dur, n))
    start = np.flatnonzero(run_starts(code, seq))
    coll = np.cumsum(run_starts(code, seq)) - 1
    pos = np.arange(len(code)) - start[coll]
    rel = enq - enq[start][coll]                          # arrival after the first one (ns)
    x = rel.astype("float64")
    lateness = x - _median_of_others_sorted(x, start[coll], pos, n)
    before = pd.Series(rel).groupby(coll).cumsum().to_numpy() - rel
    victims = (pos * x - before) / (n - 1)
    # Per (group, step, rank): its collective with the largest lateness (the first of equals), and its time in the
    # group's collectives: their durations summed (NaN when one has no end: still in it, or lost with its rank)
    by_key = lexsort((np.arange(len(code)), -lateness, rank, step, code))
    first = run_starts(code[by_key], step[by_key], rank[by_key])
    top = by_key[first]
    comm = np.add.reduceat(dur[by_key], np.flatnonzero(first))
    comm_excess = comm - _median_of_others_grouped(comm, np.cumsum(run_starts(code[top], step[top])) - 1)
    by_rank = lexsort((step[top], rank[top], code[top]))
    top, comm_excess = top[by_rank], comm_excess[by_rank]
    step_ns = _group_step_ns(pr_names, code[top], step[top], steps)
    out = pd.DataFrame({
        "pg": pg_names.take(code[top]), "pg_ranks": pr_names.take(code[top]), "step": step[top], "rank": rank[top],
        "lateness_ns": lateness[top], "victims_wait_ns": victims[top], "is_last": (pos == n - 1)[top],
        "step_ns": step_ns, "lateness_frac": lateness[top] / step_ns,
        "pre_excess_frac": _pre_collective_excess(code[top], step[top], rank[top], steps) / step_ns,
        "comm_excess_frac": comm_excess / step_ns,
    })
    return out[LATENESS_COLUMNS]


def _in_finished_steps(rank: np.ndarray, step: np.ndarray, steps: pd.DataFrame) -> np.ndarray:
    """Per collective row (``rank``, ``step``): its rank has a ``steps`` row of that step (all true without a
    steps table: nothing to tell)."""
    if steps.empty:
        return np.ones(len(rank), dtype=bool)
    done = steps[["rank", "step"]].dropna().to_numpy(dtype="int64")
    done = np.unique((done[:, 0] << 32) + done[:, 1])
    if not len(done):
        return np.zeros(len(rank), dtype=bool)
    key = (rank << 32) + step
    return done[np.minimum(np.searchsorted(done, key), len(done) - 1)] == key


def _median_of_others_sorted(x: np.ndarray, start: np.ndarray, pos: np.ndarray, n: np.ndarray) -> np.ndarray:
    """For ``x`` sorted within groups (``start``: first index of the row's group, ``pos``: index within it, ``n``:
    group size >= 2): the median of the group's other elements."""
    j1 = np.where(n % 2 == 0, (n - 2) // 2, (n - 3) // 2)
    j2 = np.where(n % 2 == 0, (n - 2) // 2, (n - 1) // 2)
    a = x[start + np.where(j1 < pos, j1, j1 + 1)]
    b = x[start + np.where(j2 < pos, j2, j2 + 1)]
    return (a + b) / 2.0


def _median_of_others_grouped(v: np.ndarray, gid: np.ndarray) -> np.ndarray:
    """For each element of ``v``: the median of the other elements of its group (``gid``); NaN in groups of fewer
    than two elements or with a NaN."""
    order = np.lexsort((v, gid))                          # NaN sorts last in its group
    g, x = gid[order], v[order]
    new = run_starts(g)
    start = np.flatnonzero(new)
    idx = np.cumsum(new) - 1
    n = np.bincount(idx)
    has_nan = np.add.reduceat(np.isnan(x).astype("int64"), start) > 0
    ok = ((n >= 2) & ~has_nan)[idx]
    pos = np.arange(len(x)) - start[idx]
    med = np.full(len(x), np.nan)
    med[ok] = _median_of_others_sorted(x, start[idx][ok], pos[ok], n[idx][ok])   # groups of one have no others
    out = np.empty(len(v), dtype="float64")
    out[order] = med
    return out


def lateness_vs_peers(t_ns: np.ndarray, gid: np.ndarray) -> np.ndarray:
    """Per element of ``t_ns`` (int64 arrival times): its arrival minus the median arrival of the other members of
    its group (``gid``), in ns as float64; NaN in groups of one. Times are taken relative to each group's first
    arrival first, so medians of large Unix-epoch times stay exact."""
    t_ns, gid = np.asarray(t_ns, dtype="int64"), np.asarray(gid)
    if not len(t_ns):
        return np.empty(0, dtype="float64")
    first = pd.Series(t_ns).groupby(gid).transform("min").to_numpy(dtype="int64")
    rel = (t_ns - first).astype("float64")
    return rel - _median_of_others_grouped(rel, gid)


def median_of_others(v: np.ndarray) -> np.ndarray:
    """For each element of ``v`` (no NaN, len >= 2): the median of the other elements. O(n log n)."""
    return _median_of_others_grouped(np.asarray(v, dtype="float64"), np.zeros(len(v), dtype="int64"))


def median_of_others_in_groups(v: np.ndarray, gid: np.ndarray) -> np.ndarray:
    """For each element of ``v``: the median of the other elements of its group (``gid``); NaN in groups of fewer
    than two elements or with a NaN. O(n log n)."""
    return _median_of_others_grouped(np.asarray(v, dtype="float64"), np.asarray(gid, dtype="int64"))


def _pre_collective_excess(code: np.ndarray, step: np.ndarray, rank: np.ndarray, steps: pd.DataFrame) -> np.ndarray:
    """For rows (group code, step, rank): the rank's data+fwd time minus the median of its group peers' (NaN when
    phases are not recorded). Before its first gradient collective a data-parallel rank has waited on nobody,
    so this is a second, independent view of who is slow."""
    ph = steps.dropna(subset=["fwd_ns"])
    if ph.empty:
        return np.full(len(code), np.nan)
    pre = pd.DataFrame({
        "rank": ph["rank"].to_numpy(dtype="int64"), "step": ph["step"].to_numpy(dtype="int64"),
        "pre": ph["data_ns"].astype("float64").fillna(0).to_numpy() + ph["fwd_ns"].to_numpy(dtype="float64"),
    }).drop_duplicates(["rank", "step"], keep="last")
    mine = pd.DataFrame({"rank": rank, "step": step}).merge(pre, on=["rank", "step"], how="left")["pre"].to_numpy()
    order = lexsort((step, code))
    group = np.empty(len(code), dtype="int64")
    group[order] = np.cumsum(run_starts(code[order], step[order])) - 1     # per (group, step)
    return mine - _median_of_others_grouped(mine, group)
