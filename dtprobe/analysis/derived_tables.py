"""The per-step frames the analysis keeps at compaction, one step block at a time (``LatenessExposure``, a
``store.derived.Deriver``): ``lateness`` (``arrivals.rank_lateness``, per group, step and rank), ``exposure``
(``exposed_comm.comm_exposure``, per rank and step), ``late_rank`` (``arrivals.late_rank_per_step``, per group and
step), ``blocked`` (``stragglers.blocked_outside_groups``, per rank, step and group: the waits the STRAGGLER causes
read), ``bandwidth`` (``comm_efficiency.collective_bandwidth``, per collective: its rows are all in one block, and
its output order is explicit, not the table's) and ``groups`` (``arrivals.group_rows``: one row per group and p2p
link, for the group clocks, linked ranks and pipelines) and ``suspects`` (``mismatch.suspect_calls``: the
collectives whose members' calls differ, none in a clean run, so COLLECTIVE_MISMATCH judges only their groups'
rows); passed to ``store.compact`` by ``dtprobe compact`` and read back by the facade instead of computing them
from the whole ``collectives`` table.

Each block's frames come from the same functions over the block's rows as the facade's over the whole run
(``inputs.analysed_table``, ``arrivals.on_arrival_clock``, ``collective_skew``), so they are equal whenever a
step's lateness and exposure depend on that step's rows only: every collective (pg, pg_ranks, seq) has all its
rows in one step block, each group's arrival clock is the same in every block, and no attempt's numbering restarts
inside a block (``arrivals.unique_seq`` left every block unchanged). ``invalid_reason`` says which of these failed;
then the store keeps no derived frames and the facade computes from the rows. No frame depends on an
``AnalysisOptions`` field (the facade applies ``steps_analyzed`` afterwards), so the key holds only ``VERSION``.
``bandwidth`` keeps the collectives outside steps (block -1) too: ``collective_bandwidth`` uses them only when no
collective is inside a step, and ``whole_run_frame`` applies that rule to the blocks' rows.
"""

from __future__ import annotations

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc

from dtprobe.analysis.arrivals import GROUP_ROW_COLUMNS, LATE_RANK_COLUMNS, LATENESS_COLUMNS, arrival_clocks
from dtprobe.analysis.arrivals import collective_skew, collective_waits, group_rows, late_rank_per_step
from dtprobe.analysis.arrivals import on_arrival_clock, rank_lateness
from dtprobe.analysis.arrivals import unique_seq
from dtprobe.analysis.comm_efficiency import BANDWIDTH_COLUMNS, BANDWIDTH_ORDER, collective_bandwidth
from dtprobe.analysis.exposed_comm import EXPOSURE_COLUMNS, comm_exposure
from dtprobe.analysis.hangs import merge_pending
from dtprobe.analysis.mismatch import SUSPECT_COLUMNS, suspect_calls
from dtprobe.analysis.stragglers import BLOCKED_COLUMNS, blocked_outside_groups
from dtprobe.analysis.tables import P2P_OPS, group_codes

VERSION = 4
"""Bumped whenever the derived tables or what ``rank_lateness``, ``comm_exposure``, ``collective_bandwidth``,
``late_rank_per_step``, ``blocked_outside_groups``, ``group_rows`` or ``suspect_calls`` compute change (4 added
``suspects``): older derived frames are then ignored (the marker's key differs), computed from the rows, and
derived again by the next ``dtprobe compact`` / ``compaction.add_derived``."""
KEY = {"deriver": "dtprobe.analysis.derived_tables", "version": VERSION, "options": []}
"""The marker's ``derived.key``: no analysis option changes these frames."""
LATENESS = "lateness"
EXPOSURE = "exposure"
BANDWIDTH = "bandwidth"
GROUPS = "groups"
LATE_RANK = "late_rank"
BLOCKED = "blocked"
SUSPECTS = "suspects"
ORDER = {LATENESS: (["pg", "pg_ranks", "rank", "step"], LATENESS_COLUMNS),
         EXPOSURE: (["rank", "step"], EXPOSURE_COLUMNS),
         BANDWIDTH: (BANDWIDTH_ORDER, BANDWIDTH_COLUMNS),
         GROUPS: (["pg", "pg_ranks", "rank", "peer", "op"], GROUP_ROW_COLUMNS),
         LATE_RANK: (["pg", "pg_ranks", "step"], LATE_RANK_COLUMNS),
         BLOCKED: (["rank", "step", "outside_pg_ranks"], BLOCKED_COLUMNS),
         SUSPECTS: (SUSPECT_COLUMNS, SUSPECT_COLUMNS)}
"""Per derived table: the sort order of the whole-run frame, and its columns."""


class LatenessExposure:
    """The ``store.derived.Deriver`` of the tables above (one per compaction: it remembers what it
    needs to tell whether the blocks' frames equal the whole run's)."""

    key = KEY
    inputs = ("collectives", "pending", "steps")

    def __init__(self) -> None:
        self._groups: dict[tuple[str, str], int] = {}
        self._keys: list[np.ndarray] = []        # per block: group code * 2**40 + seq of its collectives
        self._clocks: dict[tuple[str, str], set[str]] = {}
        self._reason: str | None = None

    def derive(self, step_block: int, frames: dict[str, pd.DataFrame]) -> dict[str, pd.DataFrame]:
        """``lateness`` and ``exposure`` of one step block's rows (every step of the block, warm-up included);
        nothing for block -1 (rows outside steps: no lateness or exposure), only its collectives remembered."""
        collectives = merge_pending(frames["collectives"], frames["pending"])
        if step_block < 0:
            self._remember(step_block, collectives)
            return {BANDWIDTH: collective_bandwidth(collectives), GROUPS: group_rows(collectives),
                    SUSPECTS: suspect_calls(collectives)}
        if unique_seq(collectives) is not collectives and self._reason is None:
            self._reason = f"a collective numbering restarts inside step block {step_block} (a torchrun restart)"
        self._remember(step_block, collectives)
        arrival = on_arrival_clock(collectives)
        steps, skew = frames["steps"], collective_skew(arrival)
        return {LATENESS: rank_lateness(arrival, steps), EXPOSURE: comm_exposure(arrival, steps, skew),
                LATE_RANK: late_rank_per_step(skew, steps),
                BLOCKED: blocked_outside_groups(arrival, collective_waits(arrival, skew)),
                BANDWIDTH: collective_bandwidth(collectives), GROUPS: group_rows(collectives),
                SUSPECTS: suspect_calls(collectives)}

    def invalid_reason(self) -> str | None:
        """Why the blocks' frames may differ from the whole run's (None: they are equal)."""
        if self._reason is not None:
            return self._reason
        mixed = sorted(g for g, clocks in self._clocks.items() if len(clocks) > 1)
        if mixed:
            return f"group {mixed[0][0]!r} has device arrivals in some step blocks only"
        if self._keys:
            keys = np.concatenate(self._keys)
            owner = np.repeat(np.arange(len(self._keys)), [len(k) for k in self._keys])
            order = np.argsort(keys, kind="stable")
            same = keys[order][1:] == keys[order][:-1]
            if same.any():
                i = int(np.flatnonzero(same)[0])
                groups = {code: g for g, code in self._groups.items()}
                pg = groups[int(keys[order][i] >> 40)][0]
                return (f"collective seq {int(keys[order][i] & ((1 << 40) - 1))} of group {pg!r} has rows in step "
                        f"blocks {sorted({int(owner[order][i]), int(owner[order][i + 1])})} (ranks were at "
                        f"different steps in it)")
        return None

    def _remember(self, step_block: int, collectives: pd.DataFrame) -> None:
        """Record the block's collectives (a collective in two blocks is split between them) and group clocks."""
        c = collectives[~collectives["op"].isin(P2P_OPS) & collectives["seq"].notna()]
        codes, pg_names, pr_names = group_codes(c["pg"], c["pg_ranks"])
        table = np.array([self._groups.setdefault(g, len(self._groups)) for g in zip(pg_names, pr_names)],
                         dtype=np.int64)
        seq = c["seq"].to_numpy(dtype="int64")
        self._keys.append(np.unique(table[codes] * (1 << 40) + seq) if len(c) else np.empty(0, dtype=np.int64))
        if collectives["arrive_ns"].notna().any():
            clocks = arrival_clocks(collectives)
            for pg, ranks, clock in zip(clocks["pg"], clocks["pg_ranks"], clocks["clock"]):
                self._clocks.setdefault((pg, ranks), set()).add(clock)


def deriver() -> LatenessExposure:
    """A fresh deriver for one compaction (``store.compact(run, derive=deriver())``)."""
    return LatenessExposure()


def whole_run_frame(name: str, blocks: pd.DataFrame) -> pd.DataFrame:
    """The derived table ``name`` as read (its blocks' frames in block order) put in the whole-run frame's row
    order and columns, as ``rank_lateness`` / ``comm_exposure`` return it."""
    by, columns = ORDER[name]
    if blocks.empty:
        return pd.DataFrame({col: [] for col in columns})
    if name == BANDWIDTH:    # collectives outside steps count only when none is inside one (collective_bandwidth)
        in_steps = (blocks["step"].notna() & (blocks["step"].fillna(-1) >= 0)).to_numpy(dtype=bool)
        if in_steps.any() and not in_steps.all():
            blocks = blocks[in_steps]
    if name == GROUPS:       # a group or link seen in several blocks is one row, its latest device arrival kept
        return group_rows(blocks)
    if name == BLOCKED or _in_order(blocks, by):    # blocked: read by key (rank, step, group), any order
        return blocks[columns].reset_index(drop=True)
    return blocks.sort_values(by, kind="stable", na_position="last").reset_index(drop=True)[columns]


def _in_order(df: pd.DataFrame, by: list[str]) -> bool:
    """Whether ``df.sort_values(by, kind="stable", na_position="last")`` would leave every row where it is (blocks
    whose rows sort by step first, as ``bandwidth``'s): each row against the next, on the keys alone, in Arrow
    (a sort copies every row, long member lists included)."""
    if len(df) < 2:
        return True
    keys = pa.Table.from_pandas(df[by], preserve_index=False)
    tied = np.ones(len(df) - 1, dtype=bool)                     # neighbours equal on the keys so far
    for name in by:
        column = keys.column(name)
        a, b = column.slice(0, len(df) - 1), column.slice(1)
        a_null, b_null = (_flags(x.is_null()) for x in (a, b))
        if (tied & (_flags(pc.greater(a, b)) | (a_null & ~b_null))).any():     # nulls sort last
            return False
        tied &= _flags(pc.equal(a, b)) | (a_null & b_null)
        if not tied.any():
            break
    return True


def _flags(values: pa.ChunkedArray) -> np.ndarray:
    """A boolean Arrow column as a numpy array, null as False."""
    return np.asarray(pc.fill_null(values, False).to_numpy(zero_copy_only=False), dtype=bool)
