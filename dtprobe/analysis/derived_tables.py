"""The per-step frames the analysis keeps at compaction, one step block at a time (``LatenessExposure``, a
``store.derived.Deriver``): ``lateness`` (``arrivals.rank_lateness``, per group, step and rank), ``exposure``
(``exposed_comm.comm_exposure``, per rank and step), ``late_rank`` (``arrivals.late_per_step``, per group or
point-to-point link, and step), ``blocked`` (``straggler_causes.blocked_outside_groups``, per rank, step and group: the
waits the STRAGGLER causes read), ``bandwidth`` (``comm_efficiency.collective_bandwidth``, per collective: its
rows are all in one block, and its output order is explicit, not the table's) and ``groups``
(``arrivals.group_rows``: one row per group and p2p link, for the group clocks, linked ranks and pipelines) and
``suspects`` (``mismatch.suspect_calls``: the collectives whose members' calls differ, none in a clean run, so
COLLECTIVE_MISMATCH judges only their groups' rows); passed to ``store.compact`` by ``dtprobe compact`` and read
back by the facade instead of computing them from the whole ``collectives`` table.

Each block's frames come from the same functions over the block's rows as the facade's over the whole run
(``inputs.analysed_table``, ``arrivals.on_arrival_clock``, ``collective_skew``), so they are equal whenever a
step's lateness and exposure depend on that step's rows only: every collective (pg, pg_ranks, seq) has all its
rows in one step block, each group's arrival clock is the same in every block, and no attempt's numbering restarts
inside a block (``arrivals.unique_seq`` left every block unchanged). ``invalid_reason`` says which of these failed;
then the store keeps no derived frames and the facade computes from the rows. A step window of a live run derives
the same frames per unit of steps (``derive_steps``, with ``groups`` and ``suspects`` per step and the
``StepFacts`` that say whether cutting them at any step is exact: ``window_derived``). No frame depends on an
``AnalysisOptions`` field (the facade applies ``steps_analyzed`` afterwards), so the key holds only ``VERSION``.
``bandwidth`` keeps the collectives outside steps (block -1) too: ``collective_bandwidth`` uses them only when no
collective is inside a step, and ``whole_run_frame`` applies that rule to the blocks' rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc

from dtprobe.analysis.arrivals import GROUP_ROW_COLUMNS, LATE_RANK_COLUMNS, LATENESS_COLUMNS, arrival_clocks
from dtprobe.analysis.arrivals import collective_skew, collective_waits, group_rows, group_rows_per_step
from dtprobe.analysis.arrivals import late_per_step
from dtprobe.analysis.arrivals import on_arrival_clock, rank_lateness
from dtprobe.analysis.arrivals import unique_seq
from dtprobe.analysis.comm_efficiency import BANDWIDTH_COLUMNS, BANDWIDTH_ORDER, collective_bandwidth
from dtprobe.analysis.exposed_comm import EXPOSURE_COLUMNS, comm_exposure
from dtprobe.analysis.hangs import merge_pending
from dtprobe.analysis.mismatch import SUSPECT_COLUMNS, suspect_calls
from dtprobe.analysis.straggler_causes import BLOCKED_COLUMNS, blocked_outside_groups
from dtprobe.analysis.tables import P2P_OPS, group_codes, step_collectives
from dtprobe.lexsort import lexsort

VERSION = 8
"""Bumped whenever the derived tables or what ``rank_lateness``, ``comm_exposure``, ``collective_bandwidth``,
``late_per_step``, ``blocked_outside_groups``, ``group_rows`` or ``suspect_calls`` compute change (4 added
``suspects``; 5 left a checkpoint group's rows out of lateness, exposure and waits: ``tables.step_collectives``; 6
added the point-to-point links' rows to ``late_rank``; 7 took a send/recv's wait for its peer out of
``exposure``'s exposed time; 8 added ``comm_excess_frac`` to ``lateness``):
older derived frames are then ignored (the marker's key differs), computed from the rows, and
derived again by the next ``dtprobe compact`` / ``compaction.add_derived``. A change to what they compute for
runs whose collective numbering restarts (a torchrun restart) alone needs no bump: no frame of such a run is
kept (``invalid_reason``)."""
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
        return _step_frames(collectives, frames["steps"], per_step=False)

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


def _step_frames(collectives: pd.DataFrame, steps: pd.DataFrame, *, per_step: bool) -> dict[str, pd.DataFrame]:
    """Every derived frame of the rows of some steps (``collectives`` with the pending rows merged); ``per_step``:
    ``groups`` and ``suspects`` of each step apart, with a ``step`` column (the other frames have one)."""
    arrival = step_collectives(on_arrival_clock(collectives))
    skew = collective_skew(arrival)
    return {LATENESS: rank_lateness(arrival, steps), EXPOSURE: comm_exposure(arrival, steps, skew),
            LATE_RANK: late_per_step(skew, arrival, steps),
            BLOCKED: blocked_outside_groups(arrival, collective_waits(arrival, skew)),
            BANDWIDTH: collective_bandwidth(collectives),
            GROUPS: group_rows_per_step(collectives) if per_step else group_rows(collectives),
            SUSPECTS: _suspects_per_step(collectives) if per_step else suspect_calls(collectives)}


def _suspects_per_step(collectives: pd.DataFrame) -> pd.DataFrame:
    """``suspect_calls`` of each step's rows on their own, with a ``step`` column (none in a clean run: then the
    rows are compared once)."""
    whole = suspect_calls(collectives)
    if whole.empty:
        return whole.assign(step=pd.Series([], dtype="int64"))
    step = collectives["step"].to_numpy(dtype="float64", na_value=-1).astype("int64")
    parts = [suspect_calls(collectives[step == s]).assign(step=s) for s in np.unique(step)]
    return pd.concat(parts, ignore_index=True)


@dataclass(frozen=True)
class StepFacts:
    """What must hold of the units of a step window (``window_derived``) for the derived frames of their steps to
    equal those computed from the window's rows, whatever step it starts at: what ``LatenessExposure`` checks
    between step blocks, here between steps."""

    reason: str | None
    """Why the unit's own steps fail it: a collective numbering restarts inside the unit, or a collective has rows
    in two of its steps."""
    keys: np.ndarray
    """Its collectives, each once: group code * 2**40 + seq (codes from the window's ``codes``)."""
    clocks: np.ndarray
    """Each group's arrival clock in each of its steps, once: group code * 2 + 1 for the device clock, + 0 host."""
    arrivals: pd.DataFrame
    """Per (rank, group code) of its rows that ``arrivals.unique_seq`` orders: ``ARRIVAL_COLUMNS``, ``pair`` (rank *
    2**32 + code), the first and last arrival (``t_first``, ``t_last``) and their ``seq``."""


ARRIVAL_COLUMNS = ["pair", "t_first", "seq_first", "t_last", "seq_last"]
"""Columns of ``StepFacts.arrivals``."""


def derive_steps(frames: dict[str, pd.DataFrame], codes: dict[tuple[str, str], int]
                 ) -> tuple[dict[str, pd.DataFrame], StepFacts]:
    """The derived frames of some consecutive steps of one step block (``frames``: their rows of
    ``LatenessExposure.inputs``) with ``groups`` and ``suspects`` per step, and their ``StepFacts``. ``codes``:
    (pg, pg_ranks) -> group code, shared by the units of one window (new groups are added)."""
    collectives = merge_pending(frames["collectives"], frames["pending"])
    return _step_frames(collectives, frames["steps"], per_step=True), _step_facts(collectives, codes)


def _step_facts(collectives: pd.DataFrame, codes: dict[tuple[str, str], int]) -> StepFacts:
    local, pg_names, pr_names = group_codes(collectives["pg"], collectives["pg_ranks"])
    table = np.array([codes.setdefault(g, len(codes)) for g in zip(pg_names, pr_names)], dtype=np.int64)
    code = table[local] if len(collectives) else np.empty(0, dtype=np.int64)
    step = collectives["step"].to_numpy(dtype="int64", na_value=-1)
    device = collectives["arrive_ns"].notna().to_numpy(dtype=bool)
    if device.any():
        per_step = pd.Series(device).groupby([code, step]).any()
        clocks = np.unique(per_step.index.get_level_values(0).to_numpy() * 2 + per_step.to_numpy())
    else:
        clocks = np.unique(code) * 2
    # the rows arrivals.unique_seq numbers (no send/recv), per (rank, group) in arrival order (as it sorts them):
    # its first and last arrival, and whether its seq ever fails to increase (unique_seq would renumber)
    ordered = (~collectives["op"].isin(P2P_OPS) & collectives["seq"].notna()).to_numpy(dtype=bool)
    seq = collectives["seq"].to_numpy(dtype="int64", na_value=0)
    timed = ordered & collectives["enqueue_ns"].notna().to_numpy(dtype=bool)
    t = collectives["enqueue_ns"].to_numpy(dtype="int64", na_value=0)[timed]
    pair = collectives["rank"].to_numpy(dtype="int64")[timed] * (1 << 32) + code[timed]
    by = lexsort((t, pair))
    pair, t, seq_t = pair[by], t[by], seq[timed][by]
    new = np.r_[True, pair[1:] != pair[:-1]] if len(pair) else np.empty(0, dtype=bool)
    reason = None
    if (~new[1:] & (seq_t[1:] <= seq_t[:-1])).any():
        reason = "a collective numbering restarts inside the window (a torchrun restart)"
    first = np.flatnonzero(new)
    last = np.r_[first[1:] - 1, len(pair) - 1] if len(pair) else first
    arrivals = pd.DataFrame({"pair": pair[first], "t_first": t[first], "seq_first": seq_t[first],
                             "t_last": t[last], "seq_last": seq_t[last]})
    # each collective once, and whether one has rows in two steps
    steps_of = pd.Series(step[ordered]).groupby(code[ordered] * (1 << 40) + seq[ordered]).agg(["min", "max"])
    across = steps_of[steps_of["min"] != steps_of["max"]]
    if len(across) and reason is None:
        key = int(across.index[0])
        group = next(g for g, c in codes.items() if c == key >> 40)
        reason = (f"collective seq {key & ((1 << 40) - 1)} of group {group[0]!r} has rows in steps "
                  f"{int(across['min'].iloc[0])} and {int(across['max'].iloc[0])} (ranks were at different steps "
                  f"in it)")
    return StepFacts(reason=reason, keys=steps_of.index.to_numpy(dtype=np.int64), clocks=clocks, arrivals=arrivals)


def deriver() -> LatenessExposure:
    """A fresh deriver for one compaction (``store.compact(run, derive=deriver())``)."""
    return LatenessExposure()


def read_order(name: str) -> list[str] | None:
    """The order to ask the store to read the derived table ``name`` in (``derived_table(order=...)``: it sorts in
    Arrow, where a long member list moves as a dictionary code), so that ``whole_run_frame`` finds it sorted;
    None for the tables it does not sort (``groups``, ``blocked``) and for ``bandwidth``, whose blocks' rows are
    already in its order (by step first): a sort there would only move every row."""
    return None if name in (GROUPS, BLOCKED, BANDWIDTH) else ORDER[name][0]


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
