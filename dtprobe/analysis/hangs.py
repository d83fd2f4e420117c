"""Hang forensics from collective rows alone: collectives some members never arrived at (or that every member
entered and none left), point-to-point ops whose peer never issued the matching op, the liveness of every stuck
rank; detector HANG. The watchdog's ``hang`` rows and the ranks' ``stack`` rows are evidence only. Read by the
facade and the dashboard."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

import numpy as np
import pandas as pd
from pandas.api.types import union_categoricals

from dtprobe.analysis.arrivals import ATTEMPT_SEQ_STRIDE
from dtprobe.analysis.clocks import HOST
from dtprobe.analysis.fault_detail import fault_detail, split_injected
from dtprobe.analysis.findings import Finding
from dtprobe.analysis.liveness import Activity, attempt_at, exit_of, is_own_failure, liveness
from dtprobe.analysis.stragglers import SKEW_COLUMNS
from dtprobe.analysis.tables import (P2P_OPS, axis_of, coded_rows, group_members, group_phrase, ranks_phrase,
                                     step_phrase, text_or)
from dtprobe.stack_frames import FRAME, is_library, location
from dtprobe.store.columns import require_columns

MISSING_COLUMNS = ["pg", "pg_ranks", "seq", "op", "step", "arrived_ranks", "missing_ranks", "first_enqueue_ns",
                   "waited_ns"]
STALL_COLUMNS = MISSING_COLUMNS + ["peer"]
"""``stalls()``: ``MISSING_COLUMNS`` plus ``peer`` (the peer of a stuck send/recv; null for a collective)."""
KEY_COLUMNS = ["rank", "restart", "pg", "pg_ranks", "seq", "peer", "op"]
"""What identifies one collective call of one rank (``pending`` rows match ``collectives`` rows on these)."""


def merge_pending(collectives: pd.DataFrame, pending: pd.DataFrame) -> pd.DataFrame:
    """``collectives`` plus, as unfinished rows (``end_ns`` null), every ``pending`` row no ``collectives`` row
    matches on ``KEY_COLUMNS``: the collectives a rank was still in when it stopped writing (killed, frozen, or
    blocked when the run was read). Unchanged (same object) when there is nothing to add."""
    if pending is None or pending.empty:
        return collectives

    def keys(df: pd.DataFrame) -> pd.Series:
        return pd.Series(list(zip(df["rank"].astype("int64"), df["restart"].fillna(0).astype("int64"), df["pg"],
                                  text_or(df["pg_ranks"]), df["seq"].astype("int64"),
                                  df["peer"].fillna(-2).astype("int64"), df["op"])), index=df.index)

    done = set(keys(collectives)) if not collectives.empty else set()
    new = pending[~keys(pending).isin(done)]
    if new.empty:
        return collectives
    dtypes = collectives.dtypes.to_dict()
    categories = [c for c, d in dtypes.items() if isinstance(d, pd.CategoricalDtype)]
    rows = pd.DataFrame({c: new[c] if c in new.columns else pd.Series(pd.NA, index=new.index)
                         for c in collectives.columns}).astype({c: d for c, d in dtypes.items() if c not in categories})
    merged = pd.concat([collectives, rows], ignore_index=True)
    for c in categories:   # a category column (the store's pg_ranks) stays one, with the values of both
        merged[c] = union_categoricals([collectives[c].array, pd.Categorical(rows[c])], sort_categories=True)
    return merged


def unfinished_rows(collectives: pd.DataFrame) -> pd.DataFrame:
    """Every row of the collectives (pg, pg_ranks, seq) some row of which never finished (``end_ns`` null): all that
    ``missing_arrivals`` reads, since a collective's skew depends on its own rows only (few rows, however long
    the run, unless it hung)."""
    require_columns(collectives, ["pg", "pg_ranks", "seq", "end_ns"], table="collectives")
    has_seq = collectives["seq"].notna()
    if not (collectives["end_ns"].isna() & has_seq).any():
        return collectives.iloc[:0]
    c, code, _, _ = coded_rows(collectives, has_seq, ["seq", "end_ns"])
    key = code * (1 << 40) + c["seq"].to_numpy(dtype="int64")   # seq < 2**40 after unique_seq
    stuck = np.unique(key[c["end_ns"].isna().to_numpy(dtype=bool)])
    return collectives.loc[c.index[np.isin(key, stuck)]]


def missing_arrivals(skew: pd.DataFrame, collectives: pd.DataFrame, *, now_ns: int, min_wait_ns: int) -> pd.DataFrame:
    """Per group and attempt, its first stuck collective: one some members never arrived at while some arrived
    member never finished it, or one every member entered and none finished (``missing_ranks`` empty: they wait
    for each other, e.g. across a network partition); only once the arrived ones have waited ``min_wait_ns`` by
    ``now_ns`` (the run's last timestamp, or the current time while it runs). Columns: ``MISSING_COLUMNS``."""
    require_columns(skew, SKEW_COLUMNS, table="collective_skew")
    cand = skew[skew["num_members"] > 1]
    # A collective every arrived rank finished did not wait for the missing ones: they took part, and their rows
    # were lost (a rank killed before its buffered rows were written) or are not written yet. A hang leaves at
    # least one arrived rank's row unfinished (pending, or written at close with end_ns null).
    def keys(frame: pd.DataFrame):
        return zip(frame["pg"], text_or(frame["pg_ranks"]), frame["seq"].astype("int64"))

    ends = collectives["end_ns"]
    unfinished = set(keys(collectives.loc[ends.isna()]))
    finished = set(keys(collectives.loc[ends.notna()]))
    complete = cand["complete"].astype(bool).to_numpy()
    k = list(keys(cand))
    stuck = [key in unfinished and (not c or key not in finished) for key, c in zip(k, complete)]
    open_ = cand[stuck]
    if open_.empty:
        return pd.DataFrame({col: [] for col in MISSING_COLUMNS})
    open_ = open_.assign(_attempt=open_["seq"].astype("int64") // ATTEMPT_SEQ_STRIDE)
    first = open_.sort_values("seq").drop_duplicates(["pg", "pg_ranks", "_attempt"], keep="first")
    rows = []
    for r in first.itertuples(index=False):
        arrived = sorted(int(x) for x in collectives.loc[
            (collectives["pg"] == r.pg) & (text_or(collectives["pg_ranks"]) == r.pg_ranks)
            & (collectives["seq"] == r.seq), "rank"].unique())
        missing = [m for m in group_members(r.pg_ranks) if m not in arrived]
        waited = now_ns - int(r.first_enqueue_ns)
        if waited >= min_wait_ns:
            rows.append({"pg": r.pg, "pg_ranks": r.pg_ranks, "seq": int(r.seq), "op": r.op,
                         "step": int_or_none(r.step), "arrived_ranks": ",".join(map(str, arrived)),
                         "missing_ranks": ",".join(map(str, missing)),
                         "first_enqueue_ns": int(r.first_enqueue_ns), "waited_ns": int(waited)})
    if not rows:
        return pd.DataFrame({col: [] for col in MISSING_COLUMNS})
    return pd.DataFrame(rows)[MISSING_COLUMNS]


def p2p_stalls(collectives: pd.DataFrame, *, now_ns: int, min_wait_ns: int) -> pd.DataFrame:
    """Per (rank, peer, op), its first send/recv that never finished and whose peer never issued the matching
    op (the k-th send from A to B is B's k-th recv from A: the same ``seq``; the peer's matching op has a lower
    count in the same attempt), once it has waited ``min_wait_ns``. ``arrived_ranks`` is the stuck rank,
    ``missing_ranks`` the peer that never sent (or never received). Columns: ``STALL_COLUMNS``."""
    empty = pd.DataFrame({col: [] for col in STALL_COLUMNS})
    if collectives.empty:
        return empty
    p2p = collectives[collectives["op"].isin(P2P_OPS) & collectives["peer"].notna() & collectives["seq"].notna()]
    p2p = p2p[p2p["peer"].astype("int64") >= 0]
    if p2p.empty:
        return empty
    p2p = p2p.assign(restart=p2p["restart"].fillna(0).astype("int64"), rank=p2p["rank"].astype("int64"),
                     peer=p2p["peer"].astype("int64"), seq=p2p["seq"].astype("int64"))
    # highest seq each rank issued per (restart, pg, peer, op): the peer's side of a message
    issued = p2p.groupby(["restart", "pg", "rank", "peer", "op"])["seq"].max().to_dict()
    stuck = p2p[p2p["end_ns"].isna()].sort_values("seq").drop_duplicates(["restart", "rank", "peer", "op"])
    rows = []
    for r in stuck.itertuples(index=False):
        other = "send" if r.op == "recv" else "recv"
        reached = issued.get((r.restart, r.pg, r.peer, r.rank, other), 0)
        waited = now_ns - int(r.enqueue_ns) if pd.notna(r.enqueue_ns) else 0
        if reached < r.seq and waited >= min_wait_ns:
            rows.append({"pg": r.pg, "pg_ranks": r.pg_ranks, "seq": int(r.seq), "op": r.op,
                         "step": int_or_none(r.step), "arrived_ranks": str(r.rank), "missing_ranks": str(r.peer),
                         "first_enqueue_ns": int(r.enqueue_ns), "waited_ns": int(waited), "peer": int(r.peer)})
    return pd.DataFrame(rows)[STALL_COLUMNS] if rows else empty


def stalls(missing: pd.DataFrame, p2p: pd.DataFrame) -> pd.DataFrame:
    """Collective stalls (``missing_arrivals``) and point-to-point ones (``p2p_stalls``) in one frame, oldest
    first. Columns: ``STALL_COLUMNS``."""
    frames = [f for f in (missing.assign(peer=pd.NA) if "peer" not in missing.columns else missing, p2p)
              if not f.empty]
    if not frames:
        return pd.DataFrame({col: [] for col in STALL_COLUMNS})
    return pd.concat(frames, ignore_index=True)[STALL_COLUMNS].sort_values("first_enqueue_ns").reset_index(drop=True)


def unfinished_since(collectives: pd.DataFrame) -> dict[int, list[int]]:
    """rank -> enqueue times of its collectives and p2p ops that never finished (``end_ns`` null)."""
    if collectives.empty:
        return {}
    open_ = collectives[collectives["end_ns"].isna() & collectives["enqueue_ns"].notna()]
    return {int(r): [int(t) for t in g] for r, g in open_.groupby("rank")["enqueue_ns"]}


def ranks_of(value) -> list[int]:
    """A stall's rank list (``"0,2"``, a number or a sequence) as ints."""
    if value is None or value is pd.NA:
        return []
    if isinstance(value, (int, float)):
        return [int(value)]
    if isinstance(value, str):
        return [int(x) for x in value.replace(" ", "").split(",") if x.lstrip("-").isdigit()]
    return [int(x) for x in value]


def waited_until_given_up(stall: Any, activity: Activity | None, starts: list[int] = ()) -> int:
    """How long the arrived ranks of a ``stalls`` row waited: until the last sign of life of the latest of them in
    that attempt (a finished run's end may be long after they gave up, and a restarted job's next attempt proves
    nothing about them), at most ``waited_ns`` (until the run's end)."""
    waited_ns, since = int(stall.waited_ns), int(stall.first_enqueue_ns)
    if activity is None:
        return waited_ns
    until = attempt_at(starts, since)[1]
    ends = [activity.last_ns(w, before_ns=until) for w in ranks_of(stall.arrived_ranks)]
    ends = [t - since for t in ends if t is not None and t > since]
    return min(waited_ns, max(ends)) if ends else waited_ns


def detect_hangs(missing: pd.DataFrame, faults: pd.DataFrame | None, *, last_seen: pd.DataFrame | None = None,
                 axis_of_pg: Callable[[str], str | None] = axis_of, activity: Activity | None = None,
                 exits: pd.DataFrame | None = None, nodes: dict[int, int] | None = None,
                 skip_groups: frozenset = frozenset(), starts: list[int] = (),
                 open_since: dict[int, list[int]] | None = None, own_failure_within_ns: int = 0) -> list[Finding]:
    """HANG for each stall (``missing_arrivals`` / ``stalls`` rows) with the liveness of every stuck rank
    (``liveness.liveness``). Not a HANG: a stall whose missing ranks are all ``dead`` (RANK_CRASH reports it, with
    this wait), or dead or, alive outside any collective, ended by their own failure within
    ``own_failure_within_ns`` of the stall (on their way to that failure: a DataLoader whose worker died, an
    exception after a slow operation; RANK_CRASH reports it; a rank waiting in a collective that then times out is
    a hang's), one every member entered while a member died, one whose missing ranks are all themselves stuck
    in another stall (a chain: its root is reported), one every member entered that shares a rank with a stall
    whose missing rank is neither waiting nor dead (a stopped rank also freezes the other groups it was in), and
    a group in ``skip_groups`` ((pg, pg_ranks) pairs that COLLECTIVE_MISMATCH explains). ``cause`` is
    ``network`` when every rank involved is alive and waiting and they span two or more nodes (``nodes``: rank ->
    node); ``missing_rank`` when some missing rank is not waiting;
    ``mutual_wait`` otherwise. The watchdog's ``hang`` rows (non-injected) and ``stack`` rows are evidence;
    injected rows only the ``injected`` cross-check. ``last_seen``: per rank its last step and collective;
    ``starts``: ``liveness.attempt_starts``. ``open_since``: per rank the enqueue times of its collectives that
    never finished (``unfinished_since``): a missing rank still inside an earlier collective of its own (one
    whose last message never reached it, while its peers finished it and moved on: a cut link) is waiting, not
    merely alive."""
    findings: list[tuple[int, Finding]] = []      # (when its wait began, the finding)
    if missing is None or missing.empty:
        return []
    last = {int(r.rank): r for r in last_seen.itertuples(index=False)} if last_seen is not None else {}
    observed, injected = _fault_rows(faults)
    rows = list(missing.itertuples(index=False))
    waiters_of = [set(ranks_of(r.arrived_ranks)) for r in rows]
    blocked = set().union(*waiters_of)
    verdicts: list[dict[int, str]] = []
    def inside(m: int, r) -> bool:            # entered an unfinished collective before this stall's wait ended
        end = int(r.first_enqueue_ns) + int(r.waited_ns)
        return any(t <= end for t in (open_since or {}).get(m, ()))

    for r, waiters in zip(rows, waiters_of):
        miss = ranks_of(r.missing_ranks)
        everyone = sorted(waiters | set(miss))
        verdicts.append({m: liveness(m, int(r.first_enqueue_ns), in_collective=m in waiters or m in blocked
                                     or inside(m, r),
                                     activity=activity, exits=exits, peers=[p for p in everyone if p != m],
                                     starts=starts)
                         for m in everyone})
    def failed_soon(m: int, r) -> bool:       # its own failure ended it soon after the stall began
        since = int(r.first_enqueue_ns)
        ex = exit_of(exits, m, attempt_at(starts, since)[0])
        t = None if ex is None else ex.get("exit_ns") or ex.get("close_ns")
        return (ex is not None and t is not None and is_own_failure(ex)
                and since <= int(t) <= since + own_failure_within_ns)

    roots = [i for i, r in enumerate(rows) if set(ranks_of(r.missing_ranks)) - blocked]
    # Ranks of a stall whose missing rank is stopped or busy (neither waiting nor dead): every collective
    # they entered afterwards and nobody finished is stuck behind it (the members that could finish it wait in
    # the root, or are the stopped rank), not a hang of its own.
    behind_root = set().union(*(waiters_of[i] | set(ranks_of(r.missing_ranks)) for i, r in enumerate(rows)
                                if any(verdicts[i][m] not in ("waiting", "dead") for m in ranks_of(r.missing_ranks))))
    # Ranks inside a collective every member entered and nobody finished, because a member froze inside it: a
    # stall elsewhere whose missing ranks all wait there is that rank's consequence, and the frozen rank's own
    # stall (that collective, or one where it is missing) is reported.
    frozen_in = set().union(*(waiters_of[i] for i, r in enumerate(rows) if not ranks_of(r.missing_ranks)
                              and any(v not in ("waiting", "dead") for v in verdicts[i].values())))
    for i, r in enumerate(rows):
        miss, waiters, live = ranks_of(r.missing_ranks), sorted(waiters_of[i]), verdicts[i]
        if (r.pg, r.pg_ranks) in skip_groups:
            continue
        if miss and all(live[m] == "dead" or (live[m] == "alive" and failed_soon(m, r)) for m in miss):
            continue                                  # they died: RANK_CRASH reports it (with this wait)
        if not miss and any(v == "dead" for v in live.values()):
            continue                                  # a member died inside it: RANK_CRASH
        if not miss and set(waiters) & behind_root:
            continue                                  # stuck behind a root stall: that one is reported
        if miss and not set(miss) - blocked and roots and i not in roots:
            continue                                  # the missing ranks wait elsewhere: the root is reported
        if miss and all(live[m] == "waiting" and m in frozen_in for m in miss):
            continue                                  # they wait inside a frozen rank's collective: that is reported
        everyone = sorted(set(waiters) | set(miss))
        waited_ns = waited_until_given_up(r, activity, starts)
        node_of = nodes or {}
        spans = {node_of.get(m) for m in everyone}
        if all(live[m] == "waiting" for m in everyone) and None not in spans and len(spans) >= 2:
            cause = "network"
        elif miss and any(live[m] != "waiting" for m in miss):
            cause = "missing_rank"
        else:
            cause = "mutual_wait"
        culprits = everyone if cause != "missing_rank" else [m for m in miss if live[m] != "dead"]
        sides = ({f"node{n}": [m for m in everyone if node_of.get(m) == n] for n in sorted(spans)}
                 if cause == "network" else None)
        is_p2p = getattr(r, "peer", None) is not None and not pd.isna(getattr(r, "peer", None))
        op_no = f"{r.op} #{r.seq % ATTEMPT_SEQ_STRIDE}"
        where = f"on {group_phrase(r.pg, group_members(r.pg_ranks))} ({step_phrase(r.step)})"
        what = op_no + (f" with peer {int(r.peer)}" if is_p2p else "") + f" {where}"
        waiters = list(group_members(str(r.arrived_ranks)))
        stacks = _stacks(observed, everyone)
        data_waits = [m for m in culprits if m in miss and waits_for_batch(stacks.get(str(m)))]
        states = f" ({', '.join(f'rank {m} {live[m]}' + _at(stacks.get(str(m))) for m in miss)})"
        if cause == "network":
            title = (f"ranks on {' and '.join(f'{k} {ranks_phrase(v)}' for k, v in sides.items())} wait for each other at "
                     f"{what} for {waited_ns / 1e9:.1f} s, all alive: the network between the nodes")
        elif miss and is_p2p:           # r is the waiting side's op: name what it waited for, and from whom
            title = (f"rank(s) {miss} never {'sent' if r.op == 'recv' else 'received'}: rank(s) {waiters} waited "
                     f"{waited_ns / 1e9:.1f} s in {op_no} {'from' if r.op == 'recv' else 'to'} rank {int(r.peer)} "
                     f"{where}{states}")
        elif miss:                      # in a mutual wait the finding names the waiters too; they did arrive
            title = (f"rank(s) {miss} never arrived at {what}; rank(s) {waiters} waited {waited_ns / 1e9:.1f} s"
                     f"{states}")
        else:
            title = f"ranks {everyone} all entered {what} and none finished it in {waited_ns / 1e9:.1f} s"
        report = _watchdog_report(observed, r)
        findings.append((int(r.first_enqueue_ns), Finding(
            code="HANG", severity="critical", ranks=tuple(culprits), group=axis_of_pg(r.pg), title=title,
            evidence={
                "clock": HOST,   # host enqueues: a stuck collective's device arrival may never resolve
                "pg": r.pg, "pg_ranks": list(group_members(r.pg_ranks)), "seq": r.seq % ATTEMPT_SEQ_STRIDE,
                "op": r.op, "peer": int(r.peer) if is_p2p else None, "step": r.step,
                "arrived_ranks": waiters, "missing_ranks": miss, "waited_s": waited_ns / 1e9,
                "cause": cause, "sides": sides, "liveness": {str(m): live[m] for m in everyone},
                "missing_last_seen": {str(m): ({"step": int_or_none(last[m].last_step),
                                                "last_collective": last[m].last_collective}
                                               if m in last else None) for m in miss},
                "stacks": stacks, "data_wait_ranks": data_waits,
                "watchdog_report": report, "also_stuck": [],
                "injected": bool(injected is not None and not injected.empty and (
                    injected[(injected["kind"] == "hang")]["rank"].astype("int64").isin(culprits).any())),
            },
            recommendation=(
                "Check the link between the two sides (ip link, switch port, firewall) and set a finite collective "
                "timeout so the job fails fast and torchrun can restart it." if cause == "network" else
                _data_wait_advice(data_waits) if data_waits else
                f"Look at what rank(s) {culprits} were doing at step {r.step}: their stacks in the evidence (or "
                f"py-spy dump --pid on their host), their stderr, a dataloader or checkpoint stuck. Set a finite "
                f"collective timeout (init_process_group(timeout=...)) so the job fails fast and torchrun can "
                f"restart it."),
            predicted_gain=None, rows=missing,
        )))
    return _one_per_culprits(findings)


def _data_wait_advice(ranks: list[int]) -> str:
    return (f"Rank(s) {ranks} wait for a batch from their DataLoader: its worker processes are stuck or very slow (a "
            f"read from storage that stopped answering, a lock or a deadlock in the dataset's code). Dump the "
            f"workers' stacks (py-spy dump --pid on the rank's child processes) and set DataLoader(timeout=...) so a "
            f"stuck worker raises instead of hanging the job; a finite collective timeout "
            f"(init_process_group(timeout=...)) also lets torchrun restart it.")


def _one_per_culprits(found: list[tuple[int, Finding]]) -> list[Finding]:
    """One HANG per set of culprits and cause: of the stalls they caused, the one whose wait began first, with the
    others in ``also_stuck`` and its title (a stopped pipeline rank leaves its stage peer stuck in a recv and its
    dp peer in the all-reduce: one fault, one verdict). The liveness and stacks of every rank involved are kept."""
    merged: dict[tuple, tuple[Finding, list[Finding]]] = {}
    for _, f in sorted(found, key=lambda x: x[0]):
        key = (f.ranks, f.evidence["cause"])
        if key in merged:
            merged[key][1].append(f)
        else:
            merged[key] = (f, [])
    out = []
    for first, others in merged.values():
        if not others:
            out.append(first)
            continue
        ev = dict(first.evidence)
        ev["also_stuck"] = [{k: o.evidence[k] for k in ("pg", "pg_ranks", "seq", "op", "peer", "step",
                                                         "arrived_ranks", "waited_s")} for o in others]
        ev["liveness"] = {**{k: v for o in others for k, v in o.evidence["liveness"].items()}, **ev["liveness"]}
        ev["stacks"] = {**{k: v for o in others for k, v in (o.evidence["stacks"] or {}).items()},
                        **(ev["stacks"] or {})}
        also = "; ".join(f"{e['op']} #{e['seq']} on {group_phrase(e['pg'], e['pg_ranks'])} (rank(s) "
                         f"{e['arrived_ranks']} waiting)" for e in ev["also_stuck"])
        out.append(replace(first, evidence=ev, title=f"{first.title}; also stuck on it: {also}"))
    return out


def _fault_rows(faults: pd.DataFrame | None) -> tuple[pd.DataFrame | None, pd.DataFrame | None]:
    """(observed, injected) fault rows."""
    if faults is None or faults.empty:
        return None, None
    require_columns(faults, ["rank", "time_ns", "step", "kind", "injected", "detail"], table="faults")
    return split_injected(faults)


def _watchdog_report(observed: pd.DataFrame | None, stall) -> dict | None:
    """The detail of the watchdog's ``hang`` row about this stall's group (its rank as ``reported_by``)."""
    if observed is None:
        return None
    for r in observed[observed["kind"] == "hang"].sort_values("time_ns").itertuples(index=False):
        d = fault_detail(r.detail)
        if d.get("pg") == stall.pg and d.get("pg_ranks", stall.pg_ranks) == stall.pg_ranks:
            return {"reported_by": int(r.rank), **d}
    return None


DATALOADER_FILE = "/torch/utils/data/dataloader.py"
"""torch's DataLoader iterator: a main thread inside it, below the script's last frame, waits for a batch."""


def _main_frames(stack: str | None) -> tuple[list, int]:
    """The ``FRAME`` matches of the main thread in a watchdog's stack (``hang.thread_stacks``: the main thread
    first, innermost call last; empty without a stack) and the index of its innermost frame outside the Python
    installation and dtprobe (-1 when none is)."""
    if not stack:
        return [], -1
    frames = [m for m in map(FRAME.match, stack.split("\n\nThread ", 1)[0].splitlines()) if m]
    return frames, max((i for i, m in enumerate(frames) if not is_library(m["path"], own=True)), default=-1)


def _at(stack: str | None) -> str:
    """``, at train.py:88``: where a rank's main thread was in its watchdog's stack: its innermost frame outside
    the Python installation and dtprobe, else its innermost frame; empty without a stack. ``, at train.py:58,
    waiting for a batch from its DataLoader`` when it was inside the DataLoader's iterator below that frame."""
    frames, own = _main_frames(stack)
    if not frames:
        return ""
    return f", at {location(frames[own])}" + (", waiting for a batch from its DataLoader"
                                              if waits_for_batch(stack) else "")


def waits_for_batch(stack: str | None) -> bool:
    """True when the main thread of a watchdog's stack waits inside torch's DataLoader iterator: below its
    innermost frame outside the Python installation and dtprobe there are only library frames, one of them the
    DataLoader's (with worker processes the thread waits on their queue; without, the dataset's own code, which
    is the script's, is innermost and says where it is)."""
    frames, own = _main_frames(stack)
    return any(m["path"].endswith(DATALOADER_FILE) for m in frames[own + 1:])


def _stacks(observed: pd.DataFrame | None, ranks: list[int]) -> dict[str, str]:
    """rank -> the Python stack its watchdog dumped (the latest ``stack`` row of each of ``ranks``)."""
    if observed is None:
        return {}
    s = observed[(observed["kind"] == "stack") & observed["rank"].isin(ranks)].sort_values("time_ns")
    out = {}
    for r in s.itertuples(index=False):
        d = fault_detail(r.detail)
        out[str(int(r.rank))] = d.get("stack") or d.get("raw") or ""
    return out


def last_seen(steps: pd.DataFrame, collectives: pd.DataFrame) -> pd.DataFrame:
    """Per rank: its last recorded step and last collective (``pg#seq op``). Columns: rank, last_step, last_collective."""
    out = {}
    if not steps.empty:
        for rank, s in steps.groupby("rank")["step"].max().items():
            out.setdefault(int(rank), {"rank": int(rank), "last_step": s, "last_collective": None})
    if not collectives.empty:
        enqueue = collectives["enqueue_ns"].to_numpy(dtype="float64", na_value=np.nan)
        ranks = collectives["rank"].to_numpy()
        known = np.flatnonzero(~np.isnan(enqueue))[::-1]      # newest rows first: of equal arrivals, the later
        newest = pd.Series(enqueue[known]).groupby(ranks[known], sort=True).idxmax().to_numpy()
        last = known[newest]                                   # each rank's last arrival (a hash pass, no sort)
        named = collectives[["rank", "step", "pg", "seq", "op"]].iloc[last]
        for x in named.itertuples(index=False):
            row = out.setdefault(int(x.rank), {"rank": int(x.rank), "last_step": x.step, "last_collective": None})
            row["last_collective"] = f"{x.pg}#{x.seq} {x.op}"
    if not out:
        return pd.DataFrame({"rank": [], "last_step": [], "last_collective": []})
    return pd.DataFrame(list(out.values()))[["rank", "last_step", "last_collective"]]


def int_or_none(v) -> int | None:
    """``v`` as an int, None when null."""
    return None if v is None or pd.isna(v) else int(v)
