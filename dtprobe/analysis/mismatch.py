"""Collective mismatches: members of a group that issued different operations, dtypes or sizes at the same
sequence number, one member that skipped a collective (or issued an extra one) so that everything after is
shifted, or one that ended its program while the others waited in a collective (``ended_mismatches``);
detector COLLECTIVE_MISMATCH. Read by the facade (which also silences the HANG and STRAGGLER findings
of a mismatched group: their waits are this mismatch's consequence)."""

from __future__ import annotations

from collections import Counter
from typing import Callable

import numpy as np
import pandas as pd

from dtprobe.analysis.arrivals import ATTEMPT_SEQ_STRIDE
from dtprobe.analysis.findings import Finding
from dtprobe.analysis.hangs import int_or_none, ranks_of
from dtprobe.analysis.liveness import attempt_at, ended_normally, exit_of
from dtprobe.analysis.phases import phase_at
from dtprobe.analysis.tables import (P2P_OPS, axis_of, group_members, group_phrase, in_no_step, size_label,
                                     step_phrase, text_or)
from dtprobe.store.columns import require_columns

MISMATCH_COLUMNS = ["pg", "pg_ranks", "restart", "seq", "kind", "odd_ranks", "issued", "expected", "step", "phase",
                    "ended"]
"""``collective_mismatches()``: per mismatched group and attempt, its first mismatch. ``kind``: ``different``
(other op/dtype/size at the same seq), ``skipped`` (the odd rank's calls from this seq are the others' from the
next one), ``extra`` (the reverse), ``ended`` (the odd ranks ended their program normally without it:
``ended_mismatches``); ``issued``: rank -> {op, dtype, num_bytes, step}; ``expected``: what the other members
issued (null when the odd rank cannot be told); ``step``/``phase``: where the odd rank issued it (of ``skipped``,
where the others issued the call it skipped; of ``ended``, the others' step, no phase); ``ended``: of ``ended``,
odd rank -> {last_step, exit_code, time_ns}, else null."""
UNEVEN_OPS = frozenset({"alltoall"})
"""Ops whose members may legally send different sizes (all-to-all with split sizes): their sizes are not compared."""


SUSPECT_COLUMNS = ["pg", "pg_ranks", "attempt", "seq"]
"""``suspect_calls()``: per collective (group, attempt, seq) whose members' rows differ in op, dtype, size or step."""


def _calls(collectives: pd.DataFrame) -> pd.DataFrame:
    """The group collectives compared (no send/recv, no single-member group) with their attempt (``_attempt``),
    ``_seq``, members' text and the values compared (null dtype ``?``, size -1: unknown or ``UNEVEN_OPS``)."""
    require_columns(collectives, ["rank", "pg", "pg_ranks", "seq", "op", "num_bytes", "dtype", "step", "restart",
                                  "enqueue_ns"], table="collectives")
    c = collectives[~collectives["op"].isin(P2P_OPS) & collectives["seq"].notna()
                    & (collectives["pg_size"].fillna(2) > 1)]
    if c.empty:
        return c
    seq = c["seq"].astype("int64")
    return c.assign(_attempt=c["restart"].fillna(seq // ATTEMPT_SEQ_STRIDE).astype("int64"), _seq=seq,
                    pg_ranks=text_or(c["pg_ranks"]), dtype=c["dtype"].fillna("?"),
                    num_bytes=c["num_bytes"].fillna(-1).where(~c["op"].isin(UNEVEN_OPS), -1))


def _suspects(c: pd.DataFrame) -> pd.DataFrame:
    """Per (pg, pg_ranks, _attempt, _seq) of ``_calls`` rows whose members differ, in order of appearance."""
    per_seq = c.groupby(["pg", "pg_ranks", "_attempt", "_seq"], sort=False)[["op", "dtype", "num_bytes",
                                                                             "step"]].nunique()
    return per_seq[(per_seq > 1).any(axis=1)].reset_index()


def suspect_calls(collectives: pd.DataFrame) -> pd.DataFrame:
    """The collectives whose members' rows differ in op, dtype, size or step: the only places
    ``collective_mismatches`` judges, so a group without any has no mismatch (kept per step block at compaction,
    ``derived_tables``). Columns: ``SUSPECT_COLUMNS`` (``seq`` as ``collective_mismatches`` reads it: unique
    across attempts)."""
    c = _calls(collectives)
    suspect = _suspects(c) if not c.empty else pd.DataFrame()
    if suspect.empty:
        return pd.DataFrame({"pg": pd.Series([], dtype="str"), "pg_ranks": pd.Series([], dtype="str"),
                             "attempt": pd.Series([], dtype="int64"), "seq": pd.Series([], dtype="int64")})
    return suspect.rename(columns={"_attempt": "attempt", "_seq": "seq"})[SUSPECT_COLUMNS]


def collective_mismatches(collectives: pd.DataFrame, steps: pd.DataFrame) -> pd.DataFrame:
    """The first mismatch of every (group, attempt) whose members did not issue the same collectives in the same
    order. Columns: ``MISMATCH_COLUMNS``."""
    c = _calls(collectives)
    empty = pd.DataFrame({k: [] for k in MISMATCH_COLUMNS})
    if c.empty:
        return empty
    suspect = _suspects(c)
    if suspect.empty:
        return empty
    rows = []
    for (pg, pr, attempt), seqs in suspect.groupby(["pg", "pg_ranks", "_attempt"], sort=False):
        g = c[(c["pg"] == pg) & (c["pg_ranks"] == pr) & (c["_attempt"] == attempt)]
        g = g.assign(_sig=g["op"].astype(str) + "|" + g["dtype"].astype(str) + "|" + g["num_bytes"].astype(str))
        calls = {int(r): d.sort_values("_seq") for r, d in g.groupby("rank")}
        for s in sorted(seqs["_seq"]):
            found = _judge(calls, int(s), steps)
            if found is not None:
                rows.append({"pg": pg, "pg_ranks": pr, "restart": int(attempt), "seq": int(s) % ATTEMPT_SEQ_STRIDE,
                             **found, "ended": None})
                break
    return pd.DataFrame(rows)[MISMATCH_COLUMNS] if rows else empty


def ended_mismatches(stalls: pd.DataFrame, unfinished: pd.DataFrame, exits: pd.DataFrame, steps: pd.DataFrame,
                     starts: list[int] = ()) -> pd.DataFrame:
    """Kind ``ended``: a stuck collective (``hangs.stalls``) whose missing members all ended their program
    normally in that attempt (``ended_normally``). Their records are whole, so they never issued it. ``ended``
    says per member how many steps it ran fewer than the others had reached when they issued it
    (``steps_behind``, from ``_reached_step``): more than 0, uneven data per rank or a stop one rank decided
    alone; 0 or less (it ran them all), a collective only some ranks reach. A send/recv whose peer ran that far
    is left to HANG (which says who never sent).
    The first such stall of each group and attempt; ``issued``/``expected``: the waiting members' call (``unfinished``:
    the stuck rows); ``step``: where the first of them issued it (``phase`` null: the odd ranks issued nothing, and
    the others' step never ended). Columns: ``MISMATCH_COLUMNS``."""
    rows: dict[tuple, dict] = {}
    for st in stalls.itertuples(index=False):
        missing, arrived = ranks_of(st.missing_ranks), ranks_of(st.arrived_ranks)
        if not missing or not arrived or pd.isna(st.first_enqueue_ns):
            continue
        restart, _ = attempt_at(list(starts), int(st.first_enqueue_ns))
        ended = {m: exit_of(exits, m, restart) for m in missing}
        if not all(ended_normally(ex) for ex in ended.values()):
            continue
        last = {m: _last_step(steps, m, restart) for m in missing}
        reached = _reached_step(st, steps, arrived, restart)
        p2p = not pd.isna(getattr(st, "peer", None))
        if p2p and any(s is not None and s >= reached for s in last.values()):
            continue                    # a peer that went on past the step without the send: HANG names it
        key = (st.pg, str(st.pg_ranks), restart)
        if key in rows:
            continue
        issued = _stuck_calls(unfinished, st, arrived)
        if not issued:
            continue
        entered = {r: call.pop("_enqueue_ns") for r, call in issued.items()}
        first = min(entered, key=entered.get)
        rows[key] = {"pg": st.pg, "pg_ranks": str(st.pg_ranks), "restart": restart, "seq": int(st.seq),
                     "kind": "ended", "odd_ranks": sorted(missing),
                     "issued": {str(r): call for r, call in sorted(issued.items())},
                     "expected": issued[first], "step": issued[first]["step"], "phase": None,
                     "ended": {str(m): {"last_step": last[m],
                                        "steps_behind": reached - (-1 if last[m] is None else last[m]),
                                        "exit_code": int_or_none(ex.get("exit_code")),
                                        "time_ns": int_or_none(ex.get("exit_ns"))}
                               for m, ex in sorted(ended.items())}}
    if not rows:
        return pd.DataFrame({k: [] for k in MISMATCH_COLUMNS})
    return pd.DataFrame(list(rows.values()))[MISMATCH_COLUMNS]


def with_ended(mismatches: pd.DataFrame, ended: pd.DataFrame) -> pd.DataFrame:
    """``mismatches`` (``collective_mismatches``) plus the ``ended`` rows of groups and attempts it has none of."""
    if ended.empty:
        return mismatches
    if mismatches.empty:
        return ended
    have = set(zip(mismatches["pg"], mismatches["pg_ranks"].astype(str), mismatches["restart"].astype("int64")))
    new = ended[[k not in have for k in zip(ended["pg"], ended["pg_ranks"].astype(str),
                                            ended["restart"].astype("int64"))]]
    return pd.concat([mismatches, new], ignore_index=True) if not new.empty else mismatches


def _stuck_calls(unfinished: pd.DataFrame, stall, ranks: list[int]) -> dict[int, dict]:
    """rank -> its call at the stall's group and seq (``_call``, plus ``_enqueue_ns``), of those of ``ranks`` that
    have one."""
    if unfinished.empty:
        return {}
    u = unfinished[(unfinished["pg"] == stall.pg) & (unfinished["seq"] == stall.seq)
                   & unfinished["rank"].isin(ranks)]
    u = u[text_or(u["pg_ranks"]).astype(str) == str(stall.pg_ranks)]
    out = {}
    for _, row in u.sort_values("enqueue_ns").iterrows():
        r = int(row["rank"])
        if r not in out:
            out[r] = {**_call(row.fillna({"dtype": "?", "num_bytes": -1})),   # _calls' marks of unknowns
                      "_enqueue_ns": int_or_none(row["enqueue_ns"]) or 0}
    return out


def _last_step(steps: pd.DataFrame, rank: int, restart: int, *, before_ns: int | None = None) -> int | None:
    """The last step ``rank`` finished in attempt ``restart`` (None if none); only of steps that ended by
    ``before_ns`` when given."""
    if steps.empty:
        return None
    mine = steps[(steps["rank"] == rank) & steps["step"].notna()]
    if "restart" in mine.columns:
        mine = mine[mine["restart"].fillna(0).astype("int64") == restart]
    if before_ns is not None:
        mine = mine[mine["end_ns"].fillna(before_ns + 1) <= before_ns]
    return int(mine["step"].max()) if not mine.empty else None


def _reached_step(stall, steps: pd.DataFrame, arrived: list[int], restart: int) -> int:
    """How far the waiting members had come when they issued the stuck call: the step they issued it in, or for a
    call outside any step (step null or -1: before the loop, between steps, after it) the last step they had
    finished by then (-1 if none)."""
    if not in_no_step(stall.step):
        return int(stall.step)
    done = [_last_step(steps, r, restart, before_ns=int(stall.first_enqueue_ns)) for r in arrived]
    return max((s for s in done if s is not None), default=-1)


def _judge(calls: dict[int, pd.DataFrame], s: int, steps: pd.DataFrame) -> dict | None:
    """The mismatch at seq ``s`` of one group, or None when its members agree there after all (the same calls,
    step numbers that differ without any member making fewer calls in a step: e.g. a call at a step boundary)."""
    at = {r: d[d["_seq"] == s].iloc[0] for r, d in calls.items() if (d["_seq"] == s).any()}
    if len(at) < 2:
        return None
    sigs = {r: row["_sig"] for r, row in at.items()}
    counts = Counter(sigs.values()).most_common()
    if len(counts) == 1:
        odd = _skipper(calls, at)
        if odd is None or not _shift_fits(calls, odd, [r for r in at if r not in odd], s):
            return None
        kind = "skipped"
    else:
        normal_sig = counts[0][0] if counts[0][1] > counts[1][1] else _usual_sig(calls, at, s)
        odd = sorted(at) if normal_sig is None else sorted(r for r, sig in sigs.items() if sig != normal_sig)
        kind = _shift(calls, odd, [r for r in at if r not in odd], s)
    normal = sorted(r for r in at if r not in odd)
    # where the odd rank issued its call; of a skip, where the others issued the call it skipped (the odd rank's
    # call at this seq is already of a later place)
    by, where = (normal[0], at[normal[0]]) if kind == "skipped" and normal else (odd[0], at[odd[0]])
    step = None if pd.isna(where["step"]) else int(where["step"])
    phase = (phase_at(steps, by, step, int(where["enqueue_ns"]))
             if step is not None and not pd.isna(where["enqueue_ns"]) else None)
    expected = _call(at[normal[0]]) if normal else None
    if kind == "skipped" and normal:   # what the odd rank skipped: the others' call at this seq
        expected = _call(at[normal[0]])
    return {"kind": kind, "odd_ranks": odd,
            "issued": {str(r): _call(row) for r, row in sorted(at.items())},
            "expected": expected, "step": step, "phase": phase}


def _shift(calls: dict[int, pd.DataFrame], odd: list[int], normal: list[int], s: int) -> str:
    """``skipped`` when the odd rank's calls from ``s`` are the others' from ``s + 1``, ``extra`` for the
    reverse, else ``different``."""
    if not odd or not normal:
        return "different"
    mine = list(calls[odd[0]].loc[calls[odd[0]]["_seq"] >= s, "_sig"])
    theirs = list(calls[normal[0]].loc[calls[normal[0]]["_seq"] >= s, "_sig"])
    k = min(len(mine), len(theirs) - 1)
    if k >= 1 and mine[:k] == theirs[1:1 + k]:
        return "skipped"
    k = min(len(mine) - 1, len(theirs))
    if k >= 1 and mine[1:1 + k] == theirs[:k]:
        return "extra"
    return "different"


def _shift_fits(calls: dict[int, pd.DataFrame], odd: list[int], normal: list[int], s: int) -> bool:
    """The odd rank's calls from ``s`` on are the others' from ``s + n`` on, for some n >= 1: what a skip of n
    calls leaves (with calls that repeat every n, e.g. DDP's buckets, a shift looks like none, which is why the
    step counts judge). False when no shift fits: its calls line up with the others' unshifted, e.g. the last
    calls of an asynchronous checkpoint, numbered with other steps, whose script ended before the rest."""
    if not normal:
        return True
    mine = list(calls[odd[0]].loc[calls[odd[0]]["_seq"] >= s, "_sig"])
    theirs = list(calls[normal[0]].loc[calls[normal[0]]["_seq"] >= s, "_sig"])
    return any(mine[:k] == theirs[n:n + k] for n in range(1, len(theirs)) if (k := min(len(mine), len(theirs) - n)))


def _skipper(calls: dict[int, pd.DataFrame], at: dict) -> list[int] | None:
    """With the same calls at a seq but different steps: the rank(s) that made fewer calls than the others by the
    end of some earlier step every member has rows around, and stayed behind at the end of every later such step,
    of which there is at least one (they skipped one, so they run ahead: their count never catches up), or None.
    A member whose calls are only numbered with another step (issued from another thread, as an asynchronous
    checkpoint's are, while its training thread moved on) is behind at one step's end and even again at the next
    (at the last step, nothing shows which it is: no verdict), and in all it made as many calls as the others, so
    a skipper must also have made fewer calls in all."""
    # calls outside any step (-1: e.g. those of a thread still running after the script's last step ended) are
    # in no step's count
    per_step = {r: d[d["step"].notna() & (d["step"] >= 0)].groupby("step").size() for r, d in calls.items() if r in at}
    if any(c.empty for c in per_step.values()):
        return None
    ahead = max(int(row["step"]) for row in at.values() if not pd.isna(row["step"]))
    # only the steps every member has rows on both sides of (a member numbering its steps from 1 is no skip)
    lo = max(int(c.index.min()) for c in per_step.values())
    hi = min(int(c.index.max()) for c in per_step.values())
    if hi <= lo:
        return None
    # per member and step from lo to hi: its calls from lo to the end of that step, fewer than another member's?
    ranks = sorted(per_step)
    done = np.array([c.reindex(range(lo, hi + 1), fill_value=0).to_numpy().cumsum() for c in
                     (per_step[r] for r in ranks)])
    behind = done < done.max(axis=0)
    # behind at a step's end and at the end of every later step up to hi (reversed cumulative "and")
    stays = np.logical_and.accumulate(behind[:, ::-1], axis=1)[:, ::-1]
    # and in all made fewer calls than another member: one whose calls were only numbered with later steps, all
    # the way to the last step the members share, made as many
    total = np.array([len(calls[r]) for r in ranks])
    short = total < total.max()
    for i in range(min(hi - 1, ahead - 1) - lo + 1):     # a later step to see it stay behind at
        if (stays[:, i] & short).any():
            return [r for r, k in zip(ranks, stays[:, i] & short) if k]
    return None


def _usual_sig(calls: dict[int, pd.DataFrame], at: dict, s: int) -> str | None:
    """With no majority (e.g. two ranks), the call the group made at the same place of the previous step: the
    members agreed then, so the member that repeats it is the normal one. The place is the lowest member's, or, when
    its call is outside any step or its previous step is unknown, the next member's that has one (a rank whose
    call under ``if rank == 0:`` falls between two steps is odd against a peer repeating its step's calls). None
    when that cannot be told."""
    for ref_rank in sorted(at):
        usual = _previous_step_sig(calls[ref_rank], at[ref_rank], s)
        if usual is not None:
            same = [r for r, x in at.items() if x["_sig"] == usual]
            return usual if same and len(same) < len(at) else None
    return None


def _previous_step_sig(d: pd.DataFrame, row: pd.Series, s: int) -> str | None:
    """The call a member (its calls ``d``) made in its previous step at the place its call ``row`` at seq ``s``
    has in its step; None for a call outside any step or without that previous call."""
    if in_no_step(row["step"]):
        return None
    this_step = d[d["step"] == row["step"]]
    prev = d[d["step"] == int(row["step"]) - 1]
    if prev.empty or this_step.empty:
        return None
    pos = int((this_step["_seq"] < s).sum())
    return prev.iloc[pos]["_sig"] if pos < len(prev) else None


def _call(row: pd.Series) -> dict:
    return {"op": row["op"], "dtype": None if row["dtype"] == "?" else row["dtype"],
            "num_bytes": None if int(row["num_bytes"]) < 0 else int(row["num_bytes"]),
            "step": None if pd.isna(row["step"]) else int(row["step"])}


def _say(call: dict | None, exact: bool = False) -> str:
    """``allreduce (float32, 1.0 MiB)``; with ``exact``, the size in bytes (``1,052,672 B``)."""
    if call is None:
        return "?"
    n = call["num_bytes"]
    size = "? B" if n is None else f"{n:,} B" if exact else size_label(n)
    return f"{call['op']} ({call['dtype'] or '?'}, {size})"


def _sizes_only(mine: dict | None, expected: dict | None) -> bool:
    """The two calls are the same operation on the same dtype with different sizes (known)."""
    return (mine is not None and expected is not None and mine["op"] == expected["op"]
            and mine["dtype"] == expected["dtype"] and None not in (mine["num_bytes"], expected["num_bytes"])
            and mine["num_bytes"] != expected["num_bytes"])


def _say_both(mine: dict | None, expected: dict | None) -> tuple[str, str]:
    """Both calls as ``_say`` gives them, in bytes when the rounded sizes would read alike (``4.0 MiB`` and
    ``4 MiB``)."""
    exact = _sizes_only(mine, expected) and _read_alike(mine["num_bytes"], expected["num_bytes"])
    return _say(mine, exact), _say(expected, exact)


def _read_alike(a: int, b: int) -> bool:
    """``size_label`` gives the two sizes the same number and unit, to its one decimal."""
    (x, unit_x), (y, unit_y) = (size_label(n).split() for n in (a, b))
    return unit_x == unit_y and round(float(x), 1) == round(float(y), 1)


def detect_mismatches(mismatches: pd.DataFrame, *, axis_of_pg: Callable[[str], str | None] = axis_of) -> list[Finding]:
    """COLLECTIVE_MISMATCH (critical) per mismatched group: the odd rank(s), what every member issued, the step
    and phase of the odd call."""
    out = []
    for m in mismatches.itertuples(index=False):
        members = list(group_members(m.pg_ranks))
        odd = list(m.odd_ranks)
        mine = m.issued.get(str(odd[0])) if odd else None
        where = (f"#{m.seq} on {group_phrase(m.pg, members)} ({step_phrase(m.step)}"
                 + (f", {m.phase}" if m.phase else "") + ")")
        ended = m.ended if isinstance(m.ended, dict) else {}
        if m.kind == "ended":
            waiting = [r for r in members if r not in odd and str(r) in m.issued]
            how = "; ".join(_ended_phrase(r, ended.get(str(r)) or {}) for r in odd)
            title = (f"rank(s) {odd} ended ({how}) without the {_say(m.expected)} that rank(s) {waiting} issued "
                     f"{where}: the ranks ran different numbers of steps or collectives")
        elif m.kind == "skipped":
            title = (f"rank(s) {odd} skipped {_say(m.expected)} {where}: every later call is shifted (each pairs "
                     f"with the others' next one)")
        elif m.kind == "extra":
            title = f"rank(s) {odd} issued an extra {_say(mine)} {where}: every later call is shifted"
        elif m.expected is not None:
            others = [r for r in members if r not in odd and str(r) in m.issued]
            unrecorded = [r for r in members if r not in odd and str(r) not in m.issued]
            said_mine, said_expected = _say_both(mine, m.expected)
            title = (f"rank(s) {odd} issued {said_mine} where rank(s) {others} issued {said_expected} {where}"
                     + (f"; rank(s) {unrecorded} left no record of it" if unrecorded else ""))
        else:
            title = ("members issued different collectives " + where + ": "
                     + "; ".join(f"rank {r} {_say(c)}" for r, c in m.issued.items()))
        out.append(Finding(
            code="COLLECTIVE_MISMATCH", severity="critical", ranks=tuple(odd), group=axis_of_pg(m.pg), title=title,
            evidence={"pg": m.pg, "pg_ranks": members, "restart": m.restart, "seq": m.seq, "kind": m.kind,
                      "odd_ranks": odd, "issued": m.issued, "expected": m.expected, "step": m.step,
                      "phase": m.phase, "ended": ended or None},
            recommendation=_ended_advice(odd, ended, m.expected) if m.kind == "ended" else _size_advice(
                odd, mine, m.expected, m.pg) if m.kind == "different" and _sizes_only(mine, m.expected) else (
                f"Make every member of group {m.pg} issue the same collectives in the same order: look "
                f"for a rank-dependent branch (if rank == ...), an early exit or a conditional "
                f"all-reduce {_around(m.step)} in rank(s) {odd}'s code path. The job otherwise "
                f"hangs until the collective timeout." + (_SKIPPED_GRADIENT_ADVICE if m.kind == "skipped"
                                                          and (m.expected or {}).get("op") == "allreduce"
                                                          else _sharded_model_advice(m))),
            predicted_gain=None,
        ))
    return out


_SKIPPED_GRADIENT_ADVICE = (
    " If it is a gradient all-reduce (DDP's, in the backward): a parameter that got no gradient on that rank in that "
    "step (a branch on the data, a layer used only sometimes) keeps its bucket, and every bucket after it, from "
    "being reduced, and while the sizes still match the job goes on with gradients paired across steps. Pass "
    "find_unused_parameters=True to DistributedDataParallel, or make every rank use every parameter in every step.")
_SHARDED_MODEL_ADVICE = (
    " Rank(s) {gathering} still gathered parameters (a sharded model's forward or its backward's re-gather, as FSDP "
    "does per module) where rank(s) {reducing} had begun to reduce gradients: the ranks' models differ in how many "
    "sharded modules they run through, more on rank(s) {gathering} or fewer on rank(s) {reducing} (a config, a layer "
    "count or a condition read per rank; fully_shard applied to different modules; a forward that skips or repeats "
    "blocks depending on the data). Build the model from the same config on every rank and make every rank's "
    "forward visit the same modules.")


def _sharded_model_advice(m) -> str:
    """``_SHARDED_MODEL_ADVICE`` when the members issued all-gathers against reduce-scatters at that sequence
    number (FSDP's two directions), else ''."""
    ops = {int(r): c["op"] for r, c in m.issued.items() if c}
    gathering = sorted(r for r, op in ops.items() if "gather" in op)
    reducing = sorted(r for r, op in ops.items() if "reduce_scatter" in op)
    if not gathering or not reducing or len(gathering) + len(reducing) != len(ops):
        return ""
    return _SHARDED_MODEL_ADVICE.format(gathering=gathering, reducing=reducing)


_ENDED_ADVICE = (
    "Rank(s) {odd} finished the script while the others still trained: every rank must run the same steps and "
    "collectives. The usual cause is uneven data per rank (a dataset split by hand, an IterableDataset without equal "
    "shards, a sampler without padding), a stop that one rank decides alone (early stopping, a time or step "
    "limit read per rank), or more micro-batches per optimizer step on some ranks (a gradient accumulation count "
    "read per rank: the same batches make fewer steps). Cap every rank at the smallest rank's number of batches, "
    "make the ranks agree on stopping (all-reduce the stop flag), or run the loop inside DDP's join() context for "
    "uneven inputs. The others otherwise wait until the collective timeout.")
_ENDED_SAME_STEPS_ADVICE = (
    "Rank(s) {odd} ran every step the others had run and ended without the {call} the others issued: a "
    "collective that only some ranks reach. Look for a rank-dependent branch: logging, evaluation or a checkpoint "
    "save under `if rank == 0:` that calls a collective, or a background save (`async_save`) whose future the "
    "script did not wait for before returning. Issue the collective on every rank of the group, or keep rank-local "
    "work free of collectives. The others otherwise wait until the collective timeout.")


_SIZE_ADVICE = (
    "Rank(s) {odd} passed {mine:,} bytes where the other members of group {pg} passed {expected:,} ({diff}): the "
    "same collective with a tensor whose size depends on the rank. Look for a buffer built from a list that differs "
    "per rank (a flat gradient buffer over the parameters that have a gradient, with a layer frozen or unused on "
    "some ranks; buffers or optimizer state gathered by hand), a batch or sequence length read per rank (an unpadded "
    "last batch, a gather of variable-length outputs: pad them, or send the sizes first), or a shape computed from "
    "the rank. On gloo the member receiving the larger message aborts (\"Received data size doesn't match expected "
    "size\"); NCCL does not check sizes: the job hangs or reduces mismatched elements.")


def _size_advice(odd: list[int], mine: dict, expected: dict, pg: str) -> str:
    """The advice when the calls differ in size alone."""
    diff = int(mine["num_bytes"]) - int(expected["num_bytes"])
    return _SIZE_ADVICE.format(odd=odd, pg=pg, mine=int(mine["num_bytes"]), expected=int(expected["num_bytes"]),
                               diff=f"{abs(diff):,} bytes {'more' if diff > 0 else 'fewer'}")


def _around(step) -> str:
    """Where the advice sends the user: ``around step 30``, or outside the steps for a call in none."""
    return "outside the training steps" if in_no_step(step) else f"around step {int(step)}"


def _ended_advice(odd: list[int], ended: dict, expected: dict | None) -> str:
    """The advice of kind ``ended``: about uneven steps when an odd rank ran fewer steps than the others had
    finished, else about a collective only some ranks issue."""
    behind = [(ended.get(str(r)) or {}).get("steps_behind") for r in odd]
    if all(b is not None and b <= 0 for b in behind):
        return _ENDED_SAME_STEPS_ADVICE.format(odd=odd, call=_say(expected))
    return _ENDED_ADVICE.format(odd=odd)


def _ended_phrase(rank: int, ended: dict) -> str:
    """``rank 1 exited with code 0 after step 59`` (what is known of it)."""
    how = "exited with code 0" if ended.get("exit_code") == 0 else "closed normally"
    last = ended.get("last_step")
    return f"rank {rank} {how}" + (f" after step {last}" if last is not None else " before any step")


def without_explained_stragglers(findings: list[Finding]) -> list[Finding]:
    """``findings`` without the STRAGGLER findings about a rank of a group a COLLECTIVE_MISMATCH names: the
    late arrivals there are the mismatch's consequence."""
    groups = [set(f.evidence["pg_ranks"]) for f in findings if f.code == "COLLECTIVE_MISMATCH"]
    return [f for f in findings if not (f.code == "STRAGGLER" and any(set(f.ranks) & g for g in groups))]
