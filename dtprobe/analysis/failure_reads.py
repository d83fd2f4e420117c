"""The collective rows the failure verdicts read (HANG, RANK_CRASH, liveness, last seen), read with filters pushed
down from a source that can (``RunStore.arrow``: of a compacted run only the row groups that can match), so those
verdicts never load a long run's whole ``collectives`` table; built by the facade, read by ``hangs``,
``liveness`` and ``crashes`` as plain frames.

Every frame holds exactly the rows the same question asks of the analysers' ``collectives``
(``inputs.analysed_table``: the ``pending`` rows no completed row matches are added). ``read_failure_rows`` returns
None, and the facade uses the whole table, for a source without ``arrow`` (a trace folder, a step window) or a
run with more than one attempt: ``arrivals.unique_seq`` renumbers a restarted group's ``seq`` from the order of
all of its rows.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc

from dtprobe.analysis.hangs import merge_pending, unfinished_rows
from dtprobe.analysis.tables import P2P_OPS, group_members, text_or
from dtprobe.store.frames import arrow_to_frame, empty_frame, memory_schema


RECENT_COLUMNS = ["rank", "pg", "pg_ranks", "seq", "op", "peer", "step", "enqueue_ns", "end_ns", "restart"]
"""The columns of ``FailureRows.recent`` read (the others are null there): what ``hangs.last_seen``,
``liveness.Activity``, ``liveness.attempt_starts`` and ``crashes.crash_events`` read of each rank's latest rows."""


CALL_COLUMNS = ["rank", "pg", "pg_ranks", "pg_size", "seq", "op", "num_bytes", "dtype", "step", "restart",
                "enqueue_ns"]
"""The columns of ``FailureRows.group_calls`` read: what ``mismatch.collective_mismatches`` reads."""


@dataclass(frozen=True, kw_only=True)
class FailureRows:
    """The collectives rows the failure verdicts read (see the module docstring)."""

    unfinished: pd.DataFrame
    """Every row of the collectives (pg, pg_ranks, seq) some row of which never finished (``hangs.unfinished_rows``
    of the whole table)."""
    p2p: pd.DataFrame
    """Every send/recv row with a peer (all that ``hangs.p2p_stalls`` reads)."""
    recent: pd.DataFrame
    """Per rank, every row with a timestamp (``enqueue_ns`` or ``end_ns``) at or after ``recent_from[rank]``,
    among them its last arrival: each rank's latest rows (``hangs.last_seen``, ``liveness.reference_ns``, what a
    crashed rank was doing)."""
    recent_from: dict[int, int] = field(default_factory=dict)
    """rank -> the time from which ``recent`` holds all of its collective timestamps (a rank not listed: all)."""
    rank_rows: Callable[[int], pd.DataFrame] | None = None
    """All rows of one rank (``enqueue_ns``, ``end_ns``), for a liveness question about a time before
    ``recent_from``."""
    group_calls: Callable[[pd.DataFrame | None], pd.DataFrame] | None = None
    """Every collective (not send/recv) row with the columns ``mismatch.collective_mismatches`` reads (the
    others null), read when called: the members' calls compared. Called with a frame of groups (``pg``,
    ``pg_ranks``): only those groups' rows (their members' files read alone)."""

    @property
    def doing(self) -> pd.DataFrame:
        """What a rank was doing when it stopped (``crashes.crash_events``): its unfinished and its latest rows."""
        parts = [f for f in (self.unfinished, self.recent) if not f.empty]
        if len(parts) < 2:     # (a concat with an empty frame would turn the pg_ranks category into strings)
            return parts[0] if parts else self.recent
        return pd.concat(parts, ignore_index=True)


def read_failure_rows(source: Any, steps: pd.DataFrame) -> FailureRows | None:
    """The ``FailureRows`` of ``source`` read with filters pushed down, or None when it cannot be (see the
    module docstring). ``steps``: the source's steps table (each rank's last step start bounds its recent rows)."""
    read = getattr(source, "arrow", None)
    if read is None:
        return None
    info = source.info
    ranks = {r.rank for r in info.ranks} | set(range(info.world_size or 0))
    pending = source.table("pending")
    if not pending.empty and (pending["restart"].isna() | (pending["restart"] != 0)).any():
        return None

    def frame(expr: pc.Expression | None = None, columns: list[str] | None = None, **kw) -> pd.DataFrame:
        return collectives_frame(read("collectives", columns=columns, filter=expr, **kw))

    starts = (steps.dropna(subset=["start_ns"]).groupby("rank")["start_ns"].max()
              if not steps.empty else pd.Series(dtype="int64"))
    starts = {int(r): int(t) for r, t in starts.items()}
    newest_t = int(np.median(list(starts.values()))) if starts else None
    # one pass over the table for the rows out of the ordinary (another attempt's, unfinished, send/recv: none on
    # a clean run of one attempt, whose files' statistics then skip every row group) and the newest rows of all
    # ranks (since the median of their last step starts: the last step's row groups)
    odd_expr = (pc.field("restart").is_null() | (pc.field("restart") != 0) | pc.field("end_ns").is_null()
                | pc.field("peer").is_valid())
    first = read("collectives", columns=RECENT_COLUMNS,
                 filter=odd_expr if newest_t is None else odd_expr | _since(newest_t))
    odd = collectives_frame(first.filter(odd_expr))
    if (odd["restart"].isna() | (odd["restart"] != 0)).any():
        return None
    p2p = odd[(odd["peer"].notna() & odd["op"].isin(P2P_OPS)).to_numpy(dtype=bool)].reset_index(drop=True)
    # the rows of every seq some unfinished (or pending) row has: every row matching a pending row is among them
    seqs = set(odd.loc[odd["end_ns"].isna().to_numpy(dtype=bool), "seq"].dropna().astype("int64"))
    seqs |= set(pending["seq"].dropna().astype("int64"))
    with_seq = frame(pc.field("seq").isin(sorted(seqs))) if seqs else empty_frame("collectives")
    merged = merge_pending(with_seq, pending)
    added = merged.iloc[len(with_seq):]                          # the pending rows no completed row matches
    unfinished = unfinished_rows(merged)
    if not added.empty:
        p2p = pd.concat([p2p, added[added["op"].isin(P2P_OPS) & added["peer"].notna()]], ignore_index=True)
    newest = None if newest_t is None else (newest_t, collectives_frame(first.filter(_since(newest_t))))
    recent, recent_from = _recent_rows(lambda expr=None, **kw: frame(expr, RECENT_COLUMNS, **kw), starts, ranks,
                                       newest=newest)
    if not added.empty:
        recent = pd.concat([recent, added], ignore_index=True)

    def rank_rows(rank: int) -> pd.DataFrame:
        rows = read("collectives", columns=["enqueue_ns", "end_ns"], ranks=[rank])
        return rows.to_pandas(types_mapper={pa.int64(): pd.Int64Dtype()}.get)     # ns exact, nulls kept

    def group_calls(groups: pd.DataFrame | None = None) -> pd.DataFrame:
        calls_added = added[~added["op"].isin(P2P_OPS) & added["seq"].notna()]
        if groups is not None and groups.empty:
            return empty_frame("collectives")
        members = None if groups is None else [group_members(g) for g in groups["pg_ranks"]]
        ranks = None if members is None or not all(members) else sorted({r for m in members for r in m})
        calls = frame(pc.field("seq").is_valid() & ~pc.field("op").isin(sorted(P2P_OPS)), CALL_COLUMNS,
                      ranks=ranks)
        calls = calls if calls_added.empty else pd.concat([calls, calls_added], ignore_index=True)
        return calls if groups is None else _of_groups(calls, groups)

    return FailureRows(unfinished=unfinished, p2p=p2p, recent=recent, recent_from=recent_from, rank_rows=rank_rows,
                       group_calls=group_calls)


def _of_groups(rows: pd.DataFrame, groups: pd.DataFrame) -> pd.DataFrame:
    """The ``rows`` of the groups (``pg``, ``pg_ranks``) listed in ``groups``, in their order."""
    wanted = list(zip(groups["pg"].astype(str), text_or(groups["pg_ranks"]).astype(str)))
    keys = pd.MultiIndex.from_arrays([rows["pg"].astype(str), text_or(rows["pg_ranks"]).astype(str)])
    return rows[keys.isin(wanted)].reset_index(drop=True)


def _since(t: int) -> pc.Expression:
    """Rows with a timestamp (``enqueue_ns`` or ``end_ns``) at or after ``t``."""
    return (pc.field("enqueue_ns") >= t) | (pc.field("end_ns") >= t)


def _recent_rows(frame: Callable[..., pd.DataFrame], starts: dict[int, int], ranks: set[int], *,
                 newest: tuple[int, pd.DataFrame] | None) -> tuple[pd.DataFrame, dict[int, int]]:
    """Per rank, its rows with a timestamp at or after a time ``t`` such that one of them arrived at or after
    ``t`` (so its last arrival is among them), and that ``t`` per rank. ``newest``: (``t``, the rows of all
    ranks ``_since(t)``), ``t`` the median of the ranks' last step starts (``starts``); the ranks with no
    arrival since then are read from the earliest of their own last step starts, and the ranks still without
    one (or without steps) whole."""
    left = set(ranks) | set(starts)
    parts, since = [], {}

    def take(t: int, rows: pd.DataFrame) -> None:
        arrived = set(rows.loc[(rows["enqueue_ns"] >= t).fillna(False).to_numpy(dtype=bool), "rank"].astype("int64"))
        arrived &= left
        parts.append(rows[rows["rank"].isin(arrived)])
        since.update(dict.fromkeys(arrived, t))
        left.difference_update(arrived)

    if newest is not None:
        take(*newest)
    with_steps = sorted(r for r in left if r in starts)
    if with_steps:
        t = min(starts[r] for r in with_steps)
        take(t, frame(_since(t), ranks=with_steps))
    if left:
        parts.append(frame(ranks=sorted(left)))
    parts = [p for p in parts if not p.empty]
    if not parts:
        return empty_frame("collectives"), since
    recent = pd.concat(parts, ignore_index=True) if len(parts) > 1 else parts[0].reset_index(drop=True)
    return recent.sort_values("rank", kind="stable", ignore_index=True), since


def collectives_frame(rows: pa.Table) -> pd.DataFrame:
    """The collectives frame (schema dtypes) of Arrow rows holding some of its columns (the others null)."""
    if not rows.num_rows:
        return empty_frame("collectives")
    schema = memory_schema("collectives")
    for name in schema.names:
        if name not in rows.column_names:
            rows = rows.append_column(schema.field(name), pa.nulls(rows.num_rows, type=schema.field(name).type))
    return arrow_to_frame(rows.select(schema.names), "collectives")
