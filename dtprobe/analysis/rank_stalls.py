"""RANK_STALL: a rank that stopped making progress for a while and then went on, while the members of its groups
waited for it (a frozen or swapped-out process, a read from stalled storage, a recompilation or an evaluation on
one rank). Neither a HANG (the collective completed) nor a STRAGGLER (it is late once, not in most steps of a
window), so without this detector the lost time would go unreported.

Two kinds, read from per-step frames kept at compaction or in a live window:

- ``late_arrival`` (``arrivals.late_per_step``: per group and step, the last arriver at the collective with
  the largest margin over the second-last one; per point-to-point link and step, the later side of the send/recv
  pair with the largest delay between its two sides): the margin is at least ``MIN_STALL_STEPS`` median step
  times of the run, ``MIN_STALL_S`` and ``MIN_STALL_OVER_NOISE`` times the group's median margin (its own noise).
  Left out when the late rank spent at least ``VICTIM_WAIT_SHARE`` of the margin longer than usual in
  communication in that step or the step before (``exposure``): it was itself waiting for a peer (a pipeline stage
  behind a stalled one, a tensor-parallel peer of the stalled rank, a rank held in the previous step's all-reduce
  by a frozen peer), a victim, not the stalled rank; unless its process was ``frozen`` then (below): a rank
  stopped inside a send/recv has that time in communication too, but a waiting one's sampler goes on writing. A
  frozen rank's late arrival caused by its stall found in the step before is that stall, counted once.
- ``in_collective`` (``comm_efficiency.collective_bandwidth``: per collective, last arrival to latest completion):
  every member arrived, but the transfer took as long, against the median of its group and operation; the
  stalled rank is the one member whose process was frozen then (below). With none or several, nothing names a
  rank (a network stall is SLOW_LINK's), and no finding is made.

Either kind is left out when its group has fewer than ``MIN_GROUP_STEPS`` analysed steps (no noise to judge it
against), in the first ``SETTLE_STEPS`` steps of an attempt after a restart (every rank restores), and when the
rank loaded a checkpoint in that step or the one before, or a save blocked it there for half the stall or more
(CHECKPOINT_STALL's part; an asynchronous save's writing beside the steps blocks nothing).

Per stall, what the rank did: where the time went (``phase``: the span that ran longest beyond the rank's own
median among that step's phases, the previous step's optimizer and the gap between the two steps), and its
liveness from its host sampler's rows (``devices``): ``frozen`` when the rows stopped for most of the stall (no
thread of the process ran: stopped, swapped out, a call holding the GIL), ``running`` when they kept coming,
``unknown`` when the stall is too short for the sampler's interval or there are no rows. Only a source whose
ranks' clocks are aligned (a dtprobe run) has the frames this needs; a trace folder gets no RANK_STALL.
"""

from __future__ import annotations

from typing import Callable

import numpy as np
import pandas as pd

from dtprobe.analysis.findings import Finding, PredictedGain
from dtprobe.analysis.phases import PHASES
from dtprobe.analysis.tables import group_members
from dtprobe.store.columns import require_columns

MIN_STALL_STEPS = 2.0
"""A stall's margin is at least this many median step times: the job lost two steps or more to one rank. Clean
runs of this project's matrix (``benchmarks/verdicts.py``) reach at most one."""
MIN_STALL_S = 0.1
"""... and at least this long: with steps of a few milliseconds, two steps are a spell of the host (a garbage
collection, a burst of page faults) that every run has; a clean 2-ms-step `dtprobe launch` run had a dozen of
4-10 ms."""
MIN_STALL_OVER_NOISE = 10.0
"""... and this many times the group's median margin, so that a run whose margins are wide anyway (shared cores)
needs a proportionally longer stall."""
MIN_GROUP_STEPS = 10
"""Analysed steps a group needs before its margins are judged."""
SETTLE_STEPS = 2
"""First steps of each attempt after a restart not judged (every rank loads the checkpoint and rebuilds)."""
MAX_TRANSFERS_JUDGED = 32
"""Of the stalled transfers, only the longest this many have their members' liveness read (each reads every
member's rows: a network that slows hundreds of transfers of a 1,024-rank group is SLOW_LINK's, not a stall)."""
CHECKPOINT_SHARE_OF_STALL = 0.5
"""A checkpoint save that blocked the rank for at least this share of a stall, in its step or the one before,
explains it (CHECKPOINT_STALL's part)."""
VICTIM_WAIT_SHARE = 0.5
"""A late rank whose time in communication grew by at least this share of the margin in that step was waiting."""
FROZEN_GAP_SHARE = 0.8
"""A stalled rank whose sampler wrote nothing for this share of the stall was ``frozen`` ..."""
RUNNING_GAP_SHARE = 0.6
"""... one whose sampler rows were never further apart than this share of it was ``running``."""
WARNING_LOST_FRAC = 0.01
"""Stalls that cost at least this share of the run's wall time are a warning ..."""
CRITICAL_LOST_FRAC = 0.25
"""... and at least this share critical."""
BETWEEN_STEPS = "between_steps"
"""``phase`` of a stall that fell between two of the rank's steps (after one's end, before the next one's start)."""
STALL_COLUMNS = ["rank", "step", "kind", "pg", "pg_ranks", "seq", "op", "stall_ns", "noise_ns", "median_step_ns",
                 "phase", "phase_step", "phase_excess_ns", "liveness", "max_gap_ns", "sampler_interval_ns"]
"""Columns of ``rank_stalls`` (one row per stalled rank and step)."""


def rank_stalls(late_rank: pd.DataFrame, *, bandwidth: pd.DataFrame, exposure: pd.DataFrame, steps: pd.DataFrame,
                devices: pd.DataFrame, checkpoints: pd.DataFrame, step_ns: float | None) -> pd.DataFrame:
    """One row per (rank, step) where the rank stalled (see the module docstring), its longest stall of the step
    (over its groups, and both kinds), oldest first. Columns: ``STALL_COLUMNS``."""
    require_columns(late_rank, ["pg", "pg_ranks", "step", "seq", "op", "late_rank", "margin_ns"], table="late_rank")
    empty = pd.DataFrame({c: [] for c in STALL_COLUMNS})
    if not step_ns or steps.empty:
        return empty
    late = _late_arrivals(late_rank, step_ns)
    late = late.assign(rank=late["late_rank"].astype("int64"))
    by_rank = _PerRank(steps, devices)
    # waiting in that step, or at the end of the step before (a collective of that step it was held in while
    # this group moved on): a victim, unless frozen while inside a send/recv or another group's collective
    waited_now, waited_before = _waiting(late, exposure)
    waiting = waited_now | waited_before
    if waiting.any():
        waiting &= np.array([not w or by_rank.liveness(r, s, stall)[0] != "frozen" for w, r, s, stall
                             in zip(waiting, late["rank"].tolist(), late["step"].tolist(), late["stall_ns"].tolist())],
                            dtype=bool)
    late, waited_before = late[~waiting], waited_before[~waiting]
    inside = _stalled_transfers(bandwidth, step_ns).nlargest(MAX_TRANSFERS_JUDGED, "stall_ns")
    if late.empty and inside.empty:
        return empty
    # the member whose process froze while the others waited inside the collective: exactly one, or no one named
    frozen = [[m for m in group_members(r.pg_ranks) if by_rank.liveness(m, int(r.step), r.stall_ns)[0] == "frozen"]
              for r in inside.itertuples(index=False)]
    one = np.array([len(f) == 1 for f in frozen], dtype=bool)
    inside = inside[one].assign(rank=[f[0] for f, ok in zip(frozen, one) if ok])
    cand = pd.concat([late.assign(kind="late_arrival", held_before=waited_before),
                      inside.assign(kind="in_collective", held_before=False)], ignore_index=True)
    if cand.empty:
        return empty
    cand = cand.astype({"rank": "int64", "step": "int64"})
    # a frozen rank late in a step because it was frozen inside a collective of the step before, where that
    # stall is already found: the same stall, counted once (at the step it began in)
    before = pd.MultiIndex.from_arrays([cand["rank"], cand["step"] - 1]).isin(
        pd.MultiIndex.from_arrays([cand["rank"], cand["step"]]))
    cand = cand[~(cand["held_before"].to_numpy(dtype=bool) & before)]
    cand = cand[~_settling(cand, steps) & ~_checkpointing(cand, checkpoints)]
    cand = cand.sort_values("stall_ns", ascending=False, kind="stable").drop_duplicates(["rank", "step"])
    rows = []
    for r in cand.sort_values(["step", "rank"], kind="stable").itertuples(index=False):
        phase, phase_step, excess = by_rank.longest_phase(r.rank, r.step, r.stall_ns)
        liveness, gap, interval = by_rank.liveness(r.rank, r.step, r.stall_ns)
        rows.append({"rank": r.rank, "step": r.step, "kind": r.kind, "pg": r.pg, "pg_ranks": r.pg_ranks,
                     "seq": r.seq, "op": r.op, "stall_ns": float(r.stall_ns), "noise_ns": float(r.noise_ns),
                     "median_step_ns": float(step_ns), "phase": phase, "phase_step": phase_step,
                     "phase_excess_ns": excess, "liveness": liveness, "max_gap_ns": gap,
                     "sampler_interval_ns": interval})
    return pd.DataFrame(rows, columns=STALL_COLUMNS)


def _late_arrivals(late_rank: pd.DataFrame, step_ns: float) -> pd.DataFrame:
    """The (group, step) rows of ``late_rank`` whose margin makes them a stall, with ``stall_ns`` and ``noise_ns``
    (the group's median margin)."""
    lr = late_rank.dropna(subset=["margin_ns", "late_rank"])
    if lr.empty:
        return lr.assign(stall_ns=[], noise_ns=[])
    return _over_noise(lr, ["pg", "pg_ranks"], "margin_ns", step_ns)


def _stalled_transfers(bandwidth: pd.DataFrame, step_ns: float) -> pd.DataFrame:
    """The collectives of ``bandwidth`` (``comm_efficiency.collective_bandwidth``) whose transfer (last arrival to
    latest completion) makes them a stall, against the median transfer of their group and operation, with
    ``stall_ns`` and ``noise_ns``."""
    cols = ["pg", "pg_ranks", "seq", "op", "step", "duration_ns"]
    empty = pd.DataFrame({c: [] for c in cols + ["stall_ns", "noise_ns"]})
    if bandwidth is None or bandwidth.empty or not set(cols) <= set(bandwidth):
        return empty
    duration = bandwidth["duration_ns"].to_numpy(dtype="float64", na_value=np.nan)
    long = duration >= _floor_ns(step_ns)                    # (NaN: False) most runs have none: nothing grouped
    if not long.any():
        return empty
    keys = ["pg", "pg_ranks", "op"]
    suspects = bandwidth.loc[long, keys].drop_duplicates()
    b = bandwidth[cols].merge(suspects, on=keys).dropna(subset=["duration_ns", "step"])   # those groups' rows only
    return _over_noise(b, keys, "duration_ns", step_ns)


def _floor_ns(step_ns: float) -> float:
    """The shortest stall: ``MIN_STALL_STEPS`` median steps, and ``MIN_STALL_S``."""
    return max(MIN_STALL_STEPS * step_ns, MIN_STALL_S * 1e9)


def _over_noise(rows: pd.DataFrame, keys: list[str], column: str, step_ns: float) -> pd.DataFrame:
    """The ``rows`` whose ``column`` is a stall: at least ``MIN_STALL_STEPS`` x ``step_ns`` and ``MIN_STALL_S``,
    ``MIN_STALL_OVER_NOISE`` x the median of their ``keys`` (``noise_ns``), in a ``keys`` group of
    ``MIN_GROUP_STEPS`` rows or more; with ``stall_ns`` (that column) and ``noise_ns``."""
    by = rows.groupby(keys, observed=True)[column]
    size, noise = by.transform("size"), by.transform("median").astype("float64")
    value = rows[column].astype("float64")
    hit = ((size >= MIN_GROUP_STEPS) & (value >= _floor_ns(step_ns))
           & (value >= MIN_STALL_OVER_NOISE * noise)).to_numpy(dtype=bool)
    return rows[hit].assign(step=rows["step"][hit].astype("int64"), stall_ns=value[hit], noise_ns=noise[hit])


def _settling(cand: pd.DataFrame, steps: pd.DataFrame) -> np.ndarray:
    """Per candidate: its step is one of the first ``SETTLE_STEPS`` of an attempt after a restart (``restart`` > 0;
    the first attempt's warm-up is not analysed, and a live window's first steps are no attempt's)."""
    s = steps.dropna(subset=["step"])
    if "restart" not in s or cand.empty:
        return np.zeros(len(cand), dtype=bool)
    s = s[s["restart"].fillna(0).to_numpy() > 0]
    first = s.groupby(s["restart"].to_numpy())["step"].min()
    settle = {int(f) + k for f in first for k in range(SETTLE_STEPS)}
    return cand["step"].isin(settle).to_numpy(dtype=bool)


def _checkpointing(cand: pd.DataFrame, checkpoints: pd.DataFrame) -> np.ndarray:
    """Per candidate: its rank has a checkpoint row in its step or the one before that explains the stall: a load,
    or a save that blocked the rank (``blocking_ns``; unknown: assumed) for at least ``CHECKPOINT_SHARE_OF_STALL``
    of it. An asynchronous save blocks only while it stages the state; its writing beside the steps holds back
    nothing, so a rank frozen meanwhile is still a stall."""
    if checkpoints is None or checkpoints.empty:
        return np.zeros(len(cand), dtype=bool)
    c = checkpoints.dropna(subset=["step"])
    blocking = c["blocking_ns"].astype("float64").to_numpy(na_value=np.inf) if "blocking_ns" in c else \
        np.full(len(c), np.inf)
    blocking = np.where(c["kind"].astype(str).to_numpy() == "save", blocking, np.inf) if "kind" in c else blocking
    held: dict[tuple[int, int], float] = {}
    for r, s, b in zip(c["rank"].astype("int64"), c["step"].astype("int64"), blocking):
        held[(r, s)] = held.get((r, s), 0.0) + b
    return np.array([max(held.get((r, s), 0.0), held.get((r, s - 1), 0.0)) >= CHECKPOINT_SHARE_OF_STALL * stall
                     for r, s, stall in zip(cand["rank"], cand["step"], cand["stall_ns"].astype("float64"))],
                    dtype=bool)


def _waiting(cand: pd.DataFrame, exposure: pd.DataFrame) -> tuple[np.ndarray, np.ndarray]:
    """Per candidate, in that step and in the step before: the rank's time in communication exceeds its median by
    at least ``VICTIM_WAIT_SHARE`` of the margin (it was waiting for a peer, in another group or a send/recv)."""
    if cand.empty or exposure is None or exposure.empty:
        return np.zeros(len(cand), dtype=bool), np.zeros(len(cand), dtype=bool)
    comm = exposure.dropna(subset=["comm_ns"]).astype({"rank": "int64", "step": "int64"})
    usual = comm.groupby("rank")["comm_ns"].median().reindex(cand["rank"]).to_numpy(dtype="float64")
    at = comm.set_index(["rank", "step"])["comm_ns"]
    at = at[~at.index.duplicated()]
    bar = VICTIM_WAIT_SHARE * cand["stall_ns"].to_numpy(dtype="float64")

    def grown(offset: int) -> np.ndarray:
        key = pd.MultiIndex.from_arrays([cand["rank"].to_numpy(), cand["step"].to_numpy() + offset])
        return np.nan_to_num(at.reindex(key).to_numpy(dtype="float64") - usual, nan=0.0) >= bar

    return grown(0), grown(-1)


class _PerRank:
    """Each rank's ``steps`` and sampler (``devices``) rows, indexed once, for what a stalled rank was doing."""

    def __init__(self, steps: pd.DataFrame, devices: pd.DataFrame) -> None:
        self._all_steps, self._devices = steps.dropna(subset=["step"]), devices
        self._step_rows: dict | None = None                  # rank -> positions of its rows, made at first use
        self._device_rows: dict | None = None
        self._steps: dict[int, pd.DataFrame] = {}
        self._times: dict[int, np.ndarray | None] = {}
        self._gaps: dict[tuple[int, int], tuple[float | None, float | None]] = {}   # (rank, step) -> _gap

    def _mine(self, rank: int) -> pd.DataFrame:
        """``rank``'s step rows (only the stalled ranks' and their groups' members' are ever asked for)."""
        if rank not in self._steps:
            if self._step_rows is None:
                self._step_rows = self._all_steps.groupby("rank").indices
            rows = self._step_rows.get(rank)
            s = self._all_steps
            self._steps[rank] = s.iloc[rows] if rows is not None else s.iloc[:0]
        return self._steps[rank]

    def _sampled(self, rank: int) -> np.ndarray | None:
        """``rank``'s sampler row times, sorted (None without a sampler)."""
        if rank not in self._times:
            d = self._devices
            if d is None or d.empty or "time_ns" not in d:
                self._times[rank] = None
            else:
                if self._device_rows is None:
                    self._device_rows = d.groupby("rank").indices
                rows = self._device_rows.get(rank)
                t = d["time_ns"].iloc[rows].dropna() if rows is not None else d["time_ns"].iloc[:0]
                self._times[rank] = np.sort(t.to_numpy(dtype="int64"))
        return self._times[rank]

    def _rows(self, rank: int, step: int) -> tuple[pd.Series | None, pd.Series | None]:
        """``rank``'s rows of ``step`` and of the step before it (None when missing)."""
        mine = self._mine(rank)
        if mine.empty:
            return None, None
        this, before = mine[mine["step"] == step], mine[mine["step"] == step - 1]
        return (None if this.empty else this.iloc[-1]), (None if before.empty else before.iloc[-1])

    def longest_phase(self, rank: int, step: int, stall_ns: float) -> tuple[str | None, int | None, float | None]:
        """Where ``rank`` spent the stall that showed at ``step``'s collective: the span that ran longest beyond
        the rank's median of it among the phases of that step, the optimizer phase of the step before (after that
        step's collectives) and ``between_steps`` (the previous step's end to this one's start): (its name, its
        step, the excess); the name is None when the excess is under half of ``stall_ns`` (no span the steps
        table times holds the stall)."""
        this, before = self._rows(rank, step)
        if this is None:
            return None, None, None
        mine = self._mine(rank)
        medians = {p: mine[f"{p}_ns"].median() for p in PHASES if f"{p}_ns" in mine}
        ordered = mine.sort_values("step")
        between = ordered["start_ns"].astype("float64") - ordered["end_ns"].astype("float64").shift()
        candidates = [(p, step, float(this[f"{p}_ns"]) - float(m)) for p, m in medians.items()
                      if pd.notna(this[f"{p}_ns"]) and pd.notna(m)]
        last = PHASES[-1]                      # of the step before, only what runs after its collectives
        if before is not None and last in medians and pd.notna(before[f"{last}_ns"]) and pd.notna(medians[last]):
            candidates.append((last, step - 1, float(before[f"{last}_ns"]) - float(medians[last])))
        if before is not None and pd.notna(between.loc[this.name]):
            candidates.append((BETWEEN_STEPS, step, float(between.loc[this.name]) - float(between.median())))
        if not candidates:
            return None, None, None
        name, at, excess = max(candidates, key=lambda c: c[2])
        return (name, at, excess) if excess >= 0.5 * stall_ns else (None, None, excess)

    def _gap(self, rank: int, step: int) -> tuple[float | None, float | None]:
        """(the largest gap between ``rank``'s sampler rows from the last one before the stall could begin (the
        previous step's start; without that row, as long before this step's start as the step lasted) to the first
        one after ``step``'s end, the sampler's usual interval)."""
        if (rank, step) not in self._gaps:
            t = self._sampled(rank)
            this, before = self._rows(rank, step)
            if t is None or len(t) < 3 or this is None or pd.isna(this["start_ns"]) or pd.isna(this["end_ns"]):
                self._gaps[(rank, step)] = (None, None)
            else:
                begin = (int(before["start_ns"]) if before is not None and pd.notna(before["start_ns"])
                         else 2 * int(this["start_ns"]) - int(this["end_ns"]))
                lo = np.searchsorted(t, begin, side="right") - 1
                hi = np.searchsorted(t, int(this["end_ns"]), side="left")
                around = t[max(lo, 0):min(hi, len(t) - 1) + 1]
                gap = float(np.diff(around).max()) if len(around) >= 2 else None
                self._gaps[(rank, step)] = (gap, float(np.median(np.diff(t))))
        return self._gaps[(rank, step)]

    def liveness(self, rank: int, step: int, stall_ns: float) -> tuple[str, float | None, float | None]:
        """(liveness, ``_gap``): ``frozen`` when the gap covers ``FROZEN_GAP_SHARE`` of the stall and at least two
        sampler intervals, ``running`` when it stays under ``RUNNING_GAP_SHARE`` of a stall of three intervals or
        more (rows kept coming through it), else ``unknown``."""
        gap, interval = self._gap(rank, step)
        if gap is None or interval <= 0:
            return "unknown", gap, interval
        if gap >= FROZEN_GAP_SHARE * stall_ns and gap >= 2 * interval:
            return "frozen", gap, interval
        if gap <= RUNNING_GAP_SHARE * stall_ns and stall_ns >= 3 * interval:
            return "running", gap, interval
        return "unknown", gap, interval


MIN_PERIODIC_STALLS = 3
"""Stalls of one rank from which ``stall_period`` looks for a schedule."""


def stall_period(steps: np.ndarray) -> int | None:
    """The step interval at which a rank's stalls recur, or None: at least ``MIN_PERIODIC_STALLS`` stalls, and
    every gap between consecutive ones a multiple of the most common gap (2 steps or more), which half of them
    equal (a stall missed when the work took less than the noise leaves a gap of two periods)."""
    steps = np.unique(steps)
    if len(steps) < MIN_PERIODIC_STALLS:
        return None
    gaps = np.diff(steps)
    values, counts = np.unique(gaps, return_counts=True)
    period = int(values[np.argmax(counts)])
    if period < 2 or counts.max() * 2 < len(gaps) or (gaps % period).any():
        return None
    return period


def detect_rank_stalls(stalls: pd.DataFrame, *, wall_ns: float | None, hosts: dict[int, str],
                       axis_of_pg: Callable[[str], str | None]) -> list[Finding]:
    """One RANK_STALL per stalled rank (``rank_stalls``): its stalls, the time its peers lost, what it was doing.
    Critical when the stalls cost ``CRITICAL_LOST_FRAC`` of the wall time, warning from ``WARNING_LOST_FRAC``, else
    info. Predicted gain: that share of the wall time."""
    out = []
    for rank, mine in stalls.groupby("rank", sort=True):
        rank = int(rank)
        lost = float(mine["stall_ns"].sum())
        share = lost / wall_ns if wall_ns else None
        severity = ("critical" if share is not None and share >= CRITICAL_LOST_FRAC else
                    "warning" if share is not None and share >= WARNING_LOST_FRAC else "info")
        worst = mine.loc[mine["stall_ns"].idxmax()]
        livenesses = set(mine["liveness"])
        liveness = "frozen" if "frozen" in livenesses else "running" if "running" in livenesses else "unknown"
        host = hosts.get(rank)
        where = f" on host {host}" if host else ""
        count = f"{len(mine)} times" if len(mine) > 1 else "once"
        period = stall_period(mine["step"].to_numpy(dtype="int64"))
        if period is not None:
            first_steps = ", ".join(str(int(x)) for x in sorted(mine["step"])[:3])
            count += f", every {period} steps (steps {first_steps}, ...)"
        title = (f"rank {rank} stalled {count}, for up to {worst.stall_ns / 1e9:.1f} s (step {int(worst.step)}), "
                 f"while its peers waited: {lost / 1e9:.1f} s lost"
                 + (f", {share:.1%} of the run" if share is not None else ""))
        phase = worst.phase if isinstance(worst.phase, str) else None
        in_phase = (" between two of its steps" if phase == BETWEEN_STEPS else
                    f" in its {phase} phase of step {int(worst.phase_step)}" if phase else "")
        if liveness == "frozen":
            silent_ns = float(mine.loc[mine["liveness"] == "frozen", "max_gap_ns"].max())
            advice = (f"Rank {rank}'s whole process was frozen{where} (its sampler thread wrote nothing for "
                      f"{silent_ns / 1e9:.1f} s){in_phase}: look for what stops a process there: memory "
                      "pressure and swapping, a scheduler, debugger or container pause (SIGSTOP), a VM pause, a "
                      "long garbage collection or a native call holding the GIL.")
        elif liveness == "running":
            advice = (f"Rank {rank} kept running{where} but reached its group's collective "
                      f"{worst.stall_ns / 1e9:.1f} s late{in_phase}: look for what that rank alone did there: a "
                      "data-loader read from slow storage, a recompilation (torch.compile guards failing on one "
                      "rank), logging, evaluation or a file written by that rank only.")
        else:
            advice = (f"Rank {rank} reached its group's collective {worst.stall_ns / 1e9:.1f} s late{in_phase}"
                      f"{where}: look for a pause of its process (swapping, SIGSTOP, a long garbage collection) or "
                      "work that rank alone did (slow storage reads, a recompilation, evaluation, logging).")
        if period is not None:
            advice = (f"Its stalls recur every {period} steps: work that rank alone does on a schedule (evaluation, "
                      "logging or metrics, a checkpoint or file it writes alone); run it on every rank, in the "
                      "background, or less often. " + advice)
        evidence = {
            "rank": rank, "host": host, "num_stalls": int(len(mine)), "period_steps": period,
            "lost_ms": round(lost / 1e6, 3),
            "lost_frac": round(share, 4) if share is not None else None, "liveness": liveness,
            "median_step_ms": round(float(worst.median_step_ns) / 1e6, 3),
            "stalls": [{"step": int(s.step), "kind": s.kind, "pg": s.pg, "pg_ranks": s.pg_ranks,
                        "seq": int(s.seq) if pd.notna(s.seq) else None, "op": s.op,
                        "stall_ms": round(float(s.stall_ns) / 1e6, 3), "noise_ms": round(float(s.noise_ns) / 1e6, 3),
                        "phase": s.phase if isinstance(s.phase, str) else None,
                        "phase_step": int(s.phase_step) if pd.notna(s.phase_step) else None, "liveness": s.liveness,
                        "max_gap_ms": round(float(s.max_gap_ns) / 1e6, 3) if pd.notna(s.max_gap_ns) else None}
                       for s in mine.itertuples(index=False)],
        }
        out.append(Finding(
            code="RANK_STALL", severity=severity, ranks=(rank,), group=axis_of_pg(str(worst.pg)), title=title,
            evidence=evidence, recommendation=advice,
            predicted_gain=PredictedGain(metric="wall_time", frac=share) if share else None, rows=mine))
    return out
