"""Straggler metrics (arrival skew per collective, lateness per step, persistence per rank, cause) and the
STRAGGLER detector; read by the facade, ``dtprobe analyze`` and the dashboard's collectives page.

The culprit of a collective is its last arriver (largest clock-aligned arrival among the members of
(pg, pg_ranks, seq): ``enqueue_ns`` after ``arrivals.on_arrival_clock``, the device arrival on CUDA runs, the host
enqueue on CPU runs); the other members are victims and wait ``culprit enqueue - own enqueue``. Per step, each
member's lateness is its arrival minus the median arrival of its peers (at the step's collective where it was
latest). A rank is a straggler when, over a window of steps, its median lateness is a clear share of the step
time and it arrives after its peers in most of those steps: robust to the noise of busy hosts, where the last
arriver of any one step is often random. That lateness must also stand out of the run's own noise: how late the
rank's peers got in the same window (``peer_noise``), since on a busy host any rank can be late for a dozen steps;
or, when its arrivals jitter too much for that, its data+fwd excess must be steady (many standard errors above
zero, far more than any peer's: the persistence view). Its cause class (data / compute / communication / device) comes
from its step phases, its waits at other collectives and its device samples, compared with its group peers.
"""

from __future__ import annotations

from collections.abc import Callable, Container, Iterable
from dataclasses import dataclass

import numpy as np
import pandas as pd

from dtprobe.analysis.arrivals import (  # noqa: F401 (re-exported: the straggler metrics live there)
    LATE_RANK_COLUMNS, LATENESS_COLUMNS, LATENESS_OPTIONAL, SKEW_COLUMNS, collective_skew, collective_waits,
    late_rank_per_step, median_of_others, rank_lateness)
from dtprobe.analysis.clocks import HOST
from dtprobe.analysis.findings import Finding, PredictedGain
from dtprobe.analysis.pipeline_delay import OWN_DELAY_COLUMNS, pipeline_groups, pipeline_own_delay  # noqa: F401
from dtprobe.analysis.score_memo import ScoreMemo, window_keys
from dtprobe.analysis.tables import (P2P_OPS, axis_of, coded_rows, completing_attempts, group_codes, group_members,
                                     group_phrase, ms, run_starts)
from dtprobe.intervals import union_length_by_group
from dtprobe.store.columns import require_columns

SCORE_COLUMNS = [
    "pg", "pg_ranks", "rank", "num_steps", "window_steps", "window_first_step", "window_last_step",
    "median_lateness_frac", "positive_frac", "median_pre_excess_frac", "pre_positive_frac", "last_frac",
    "mean_lateness_ns", "mean_victims_wait_ns", "mean_step_ns", "detected_at_step", "detected_by",
]
NOISE_COLUMNS = ["noise_frac", "lateness_over_noise", "phase_noise_frac", "pre_excess_over_noise", "pre_excess_t",
                 "peer_pre_excess_t", "mean_excess_frac", "excess_positive_frac", "excess_t", "peer_excess_t",
                 "median_comm_excess_frac"]
"""Extra columns of ``straggler_scores`` (after ``SCORE_COLUMNS``): the peers' noise in the chosen window, of the
arrival view (lateness) and of the phases view (data+fwd excess); the persistence of the data+fwd excess (its
median over its standard error, ``pre_excess_t``) and the largest such value among the group's peers in the same
steps (``peer_pre_excess_t``); the steady view's lateness excess over the group's median lateness at each step:
its mean over the window (``mean_excess_frac``), the share of steps it is positive (``excess_positive_frac``),
its mean over its standard error (``excess_t``) and the largest such value among the peers (``peer_excess_t``);
the median of its time in the group's collectives minus its peers' (``median_comm_excess_frac``, a share of the
step: negative for a rank its peers wait for)."""
THROTTLE_SCORE_COLUMNS = ["cpu_throttled_frac", "peer_cpu_throttled_frac", "step_stall_frac"]
"""Extra columns of ``straggler_scores`` (last) when it is given the ranks' CPU throttling (``cpu_throttle``): the
rank's mean ``cpu_throttled_frac`` over the chosen window and the largest of its peers' over the same steps; and,
where the rank was throttled (``MIN_CPU_THROTTLED_FRAC``), how much of the group's time in the window went to
stalled steps: 1 - its median step / its mean step (NaN elsewhere)."""
WAIT_SCORE_COLUMNS = ["cpu_wait_frac", "peer_cpu_wait_frac"]
"""Extra columns of ``straggler_scores`` (after the throttle ones) when it is given the ranks' run-queue waits
(``cpu_throttle.cpu_wait_per_step``): the rank's mean ``cpu_wait_frac`` over the chosen window and the largest of
its peers' over the same steps."""
IDLE_SCORE_COLUMNS = ["peer_idle_frac"]
"""Extra column of ``straggler_scores`` (after the wait ones) when it is given both the ranks' run-queue waits and
their CPU use (``cpu_throttle.cpu_busy_per_step``): the smallest share of the chosen window any peer's process
spent neither on a CPU nor waiting for one (1 - its ``cpu_busy_frac`` - its ``cpu_wait_frac``, at least 0): the
time it sat idle, blocked (in a collective, waiting for the rank). NaN (not judged) for a rank whose cgroup was
throttled (``MIN_CPU_THROTTLED_FRAC``) in any window: its waits may be its quota's."""
CAUSE_COLUMNS = [
    "pg", "pg_ranks", "rank", "data_excess_ns", "compute_excess_ns", "comm_excess_ns", "throttled_frac", "cause",
]
PHASE_EXCESS_COLUMNS = ["fwd_excess_ns", "bwd_excess_ns", "peer_unphased_ns"]
"""Extra columns of ``straggler_causes``: the rank's forward and backward against its peers' (signed) and its
peers' time in no phase, for ``_outside_phases`` (a causes frame without them: not judged)."""
CAUSES = ("data", "compute", "communication", "device", "unknown")
"""Cause classes of a straggler."""

LATE_TIE_FRAC = 0.001
"""A step counts as late (``positive_frac``) when the rank arrived after its peers' median by more than this share of
the step; closer is a tie: ranks in lockstep leave a collective together and arrive at the next within
microseconds of each other, either one first."""
MIN_WINDOW_S = 0.5
"""A window spans at least this long: ``window_steps`` steps, more when the run's median step is shorter than
``MIN_WINDOW_S / window_steps``. Over a few tens of milliseconds, one hiccup of a rank's host (a garbage
collection, a page-cache flush, another process's burst) makes that rank late in most of the window's steps.
Half a second leaves the 20 steps of runs whose steps take 25 ms or more (every layout ``benchmarks/verdicts.py``
runs) as they are."""
MIN_LATENESS_OVER_NOISE = 2.5
"""Arrival view: a straggler's median lateness must be at least this many times its peers' lateness noise in the
same window (``noise_frac``). Calibrated on clean and slowed ``dtprobe run`` jobs of a busy host (docs/findings.md):
arrivals there carry the whole step's scheduling noise, and clean runs reach 2.3."""
MIN_PRE_EXCESS_OVER_NOISE = 1.5
"""Phases view: a straggler's median data+fwd excess must be at least this many times its peers' excess noise in
the same window (``phase_noise_frac``). The phases before the first gradient collective carry less noise than
arrivals (no waits in them): clean runs stay near 1, ranks slowed by 10% reach 1.6 on the same host."""

MIN_PRE_EXCESS_T = 5.0
"""Persistence view: a straggler's median data+fwd excess must be at least this many standard errors above zero
(``pre_excess_t`` = median / (1.4826 x MAD / sqrt(steps))): a steady slowdown of a few percent passes, where the
busy host's chance excess comes and goes with the steps and stays near zero on the median."""
MIN_PRE_EXCESS_T_OVER_PEERS = 2.0
"""Persistence view: ``pre_excess_t`` must also be this many times the largest of its peers' in the same steps
(``peer_pre_excess_t``): on a host where several ranks lose CPU alike none of them is singled out."""
MIN_PERSISTENT_LATER_FRAC = 0.5
"""Persistence view: a rank whose lateness is below its group's median on average (``mean_excess_frac`` < 0) and
above it in fewer than this share of the window's steps (``excess_positive_frac``) is not the one its peers wait
for. Its longer data+fwd is then time it spent inside its forward's collectives (tensor parallel, FSDP) waiting
for a later peer."""
MIN_STEADY_T = 6.0
"""Steady view: a straggler's mean lateness excess (its lateness minus the group's median lateness, per step) must
be at least this many standard errors above zero over the window (``excess_t``; the error from the larger of its
own spread and its peers' in the same steps: the run's own noise). A t-statistic of the mean, not
the median: a slowdown that comes in bursts (a CPU quota throttling the rank for part of every 100 ms period)
raises the mean of every window while its median moves little; a one-off stall inflates the standard error with
the mean and does not pass. Strict, because a host's slow spells last several steps (the excess of neighbouring
steps correlates) so the error is understated: windows of clean runs on a 2-core VM reached 5.4."""
MIN_STEADY_EXCESS_FRAC = 0.06
"""Steady view: the smallest mean lateness excess named (share of the step; the other views use
``min_lateness_frac``). Clean 2-rank runs of a 2-core VM with each rank bound to its own core show one core
slower by up to 5.4% for a 20-step window (3 s) at many standard errors: that steady offset is the host's."""
MIN_STEADY_T_OVER_PEERS = 2.0
"""Steady view: ``excess_t`` must also be this many times the largest of its peers' in the same steps."""
MIN_STEADY_POSITIVE_FRAC = 0.6
"""Steady view: the share of the window's steps where the rank's lateness exceeds the group's median."""

MIN_PERSISTENT_PRE_OVER_NOISE = 1.3
"""Persistence view: the median data+fwd excess must also reach the peers' excess noise (``pre_excess_over_noise``
>= this; the phases view alone needs ``MIN_PRE_EXCESS_OVER_NOISE``): a steady excess smaller than what peers reach
by chance is the host's, not the rank's. Clean runs of a busy host stay below 1, slowed ranks reach 1.05-1.4; 1.3
leaves an excess inside uniform +-10% peer noise unnamed."""

MIN_CPU_THROTTLED_FRAC = 0.02
"""CPU-throttle view: the smallest mean share of the window's wall time the rank's cgroup was throttled by its CPU
quota (``cpu_throttle.cpu_throttled_per_step``). Unquota'd processes read exactly 0, so any clear value is a
limit the rank hit; 2% leaves out a quota touched once or twice in a window."""
MAX_PEER_THROTTLED_SHARE = 0.25
"""CPU-throttle view: every peer's throttled share must stay below this share of the rank's (a quota that holds
back all members alike, one limit for a whole pod, singles out none of them)."""
MIN_THROTTLED_T = 2.5
"""CPU-throttle view: the rank's mean lateness excess over its group's median must be this many standard errors
above zero (the steady view's error; the steady view alone needs ``MIN_STEADY_T``). The kernel's throttle
counter tells that the rank lost CPU; the lateness must still show that the job waited for it. On a 2-core VM
whose vCPUs run unevenly, a rank throttled 20-30% of the time reached 3 only at the end of a 40-step run, where
2.5 named it within 15 steps of the quota; ranks of clean runs read no throttling and never reach this view. A
quota throttles in bursts (frozen for the rest of each 100 ms period), so the excess may come in every other step
or so: a positive share is not required (``MIN_THROTTLED_POSITIVE_FRAC`` is the other way to pass)."""

MIN_THROTTLED_EXCESS_SHARE = 0.4
"""CPU-throttle view: the rank's mean lateness excess must be at least this share of ``min_lateness_frac`` (2% of
the step by default). The kernel's count already singles the rank out, and in a tensor-parallel group, where every
collective re-synchronises the ranks, a rank whose quota costs the job 10% of its step is late by a few percent
at its latest collective of a step."""
MIN_THROTTLED_POSITIVE_FRAC = 0.9
"""CPU-throttle view, the other way to show that the job waited for the rank: its lateness exceeded its group's
median in at least this share of the window's steps (18 of 20; were steps independent, 2 in 10,000 for a rank no
later than its peers, but a host's slow spells make neighbouring steps alike: the kernel's throttle count, which
clean runs never show, is what singles the rank out). On a busy host whose peers scatter widely the t can stay
below ``MIN_THROTTLED_T`` for a rank late in every step: a 4-rank run on 2 cores whose rank 1 was held to 1/1.1 of
its CPU was the last in all 20 steps of a window, its excess 8% of the step, at t 2.46."""

STALL_THROTTLE_RATIO = 2.0
"""CPU-throttle view, the third way to show that the job waited for the rank: its group's steps stalled
(``step_stall_frac``, the share of the window's time beyond its median step) by at least ``min_lateness_frac``,
the stall and the rank's throttled share within this factor of each other, and the rank later than its group's
median on average. A quota whose period is longer than the step freezes the rank for whole steps at a time, often
inside a collective it had already arrived at: its peers then wait inside that collective, not for its arrival, so
its lateness hardly moves, while the steps it froze in grow by the time it was frozen. Where peers wait for the rank
at once (a collective every few milliseconds: FSDP, tensor parallel) the job loses about the frozen time; a rank
whose quota took only its slack stalls nothing, and a stall far longer than the rank was frozen (a checkpoint save,
another rank's hiccup) is not its quota's."""

MIN_WAIT_VIEW_EXCESS_FRAC = 0.15
"""Run-queue view: a rank whose main thread waited for a CPU (``cpu_wait_frac``) at least this share of the window
more than any peer's, while every peer sat idle (``peer_idle_frac``) at least ``PEER_IDLE_SHARE_OF_WAIT`` of that
extra wait, is named: another process (or thread) took its core, and its peers had nothing to do but wait for it.
Its arrivals need not show it: in a job whose steps are mostly collectives (FSDP of a small model on gloo), the
kernel takes its core inside collectives as often as between them, and its peers wait inside them. Clean runs
differ by at most about 6 points between ranks with a core each and 2 between ranks sharing cores alike (40 clean
runs of ``benchmarks/verdicts.py``'s layouts); a busy process on one rank's core makes 25-40."""
PEER_IDLE_SHARE_OF_WAIT = 0.5
"""Run-queue view: the share of the rank's extra wait every peer must have sat idle: a rank whose core is shared
while its peers compute anyway (it had slack) costs the job nothing."""

MIN_CPU_WAIT_EXCESS_FRAC = 0.03
"""A straggler's core counts as shared when its main thread waited for a CPU (run queue, ``cpu_wait_frac``) at
least this share of its window more than any peer's: ranks with a core each still wait a few % of the time (their
own gloo and sampler threads run beside them), by up to about 6 points more on one core than another."""
CPU_WAIT_SHARE_OF_LATENESS = 0.5
"""... and that extra wait is at least this share of its median lateness (it explains the lateness, not a sliver
of it)."""

OFF_CPU_SHARE_OF_LATENESS = 1 / 3
"""A straggler of a run on CPU (cause ``compute``, no quota or shared core to blame) was off the CPU when the CPU
time its process used per step exceeded its peers' median, plus the time its main thread waited for a CPU beyond
its peers', by less than this share of its lateness: a rank that computes longer uses about its lateness more (a
slow core as well), one that sleeps, waits for a lock or for I/O uses none of it. On a GPU the host thread of a
rank waiting for a slow device may sleep too: not judged there."""
PHASES_SHARE_OF_COMPUTE = 0.25
"""A ``compute`` straggler is late for work outside its forward and backward (``outside_phases``) when they are
longer than its peers' by less than this share of its compute excess: a slower core or device, or more data,
lengthens them as well, while work only that rank runs between its optimizer step and its next forward leaves them
as its peers'. See ``_outside_phases`` for peers whose backward holds their wait for it."""

THROTTLE_MASK = 0x4 | 0x8 | 0x20 | 0x40 | 0x80
"""NVML clock-throttle reasons that slow a GPU: SW power cap, HW slowdown, SW/HW thermal, power brake."""

def straggler_scores(lateness: pd.DataFrame, *, cpu_throttled: pd.DataFrame | None = None,
                     cpu_wait: pd.DataFrame | None = None, cpu_busy: pd.DataFrame | None = None,
                     window_steps: int = 20, min_lateness_frac: float = 0.05,
                     min_positive_frac: float = 0.8,
                     min_lateness_over_noise: float = MIN_LATENESS_OVER_NOISE,
                     min_pre_excess_over_noise: float = MIN_PRE_EXCESS_OVER_NOISE,
                     min_pre_excess_t: float = MIN_PRE_EXCESS_T,
                     min_pre_excess_t_over_peers: float = MIN_PRE_EXCESS_T_OVER_PEERS,
                     min_persistent_pre_over_noise: float = MIN_PERSISTENT_PRE_OVER_NOISE,
                     min_steady_t: float = MIN_STEADY_T, min_window_s: float = MIN_WINDOW_S,
                     memo: ScoreMemo | None = None) -> pd.DataFrame:
    """Per (group, member rank), over sliding windows of ``window_steps`` steps, or of ``min_window_s`` seconds of
    the median step when that is more (``window_length``; the whole run when shorter):
    the first window where its median lateness (share of the step) is at least ``min_lateness_frac`` and it
    arrived after its peers' median in at least ``min_positive_frac`` of the steps (else the window with the
    largest median lateness), that median, the share of the window's
    steps it arrived after the median of its peers (``positive_frac``) and was last (``last_frac``), its mean
    lateness and the mean wait it imposed on peers. ``detected_at_step``: the last step of the first window with
    median lateness >= ``min_lateness_frac`` and positive share >= ``min_positive_frac`` (null if none).
    Medians ignore NaN (phases not recorded). ``noise_frac``: the run's own noise in that window, how late its
    peers got by chance (robust spread or 90th percentile of their lateness over the window, ``peer_noise``); the
    arrival view qualifies a window only when its median lateness is also at least ``min_lateness_over_noise`` x
    that noise (``lateness_over_noise``), the phases view only when the median data+fwd excess is at least
    ``min_pre_excess_over_noise`` x the peers' excess noise (``phase_noise_frac``, ``pre_excess_over_noise``);
    unknown noise does not block. The persistence view qualifies a window when the median data+fwd excess is
    at least ``min_lateness_frac``, ``min_pre_excess_t`` standard errors above zero (``pre_excess_t``),
    ``min_pre_excess_t_over_peers`` x the largest of its peers' (``peer_pre_excess_t``), at least
    ``min_persistent_pre_over_noise`` x the peers' excess noise, and the median lateness is positive. The steady
    view (``_steady``) qualifies a window when the rank's mean lateness excess over the group's median is at least
    ``min_lateness_frac`` and ``MIN_STEADY_EXCESS_FRAC``, ``min_steady_t`` standard errors above zero and
    ``MIN_STEADY_T_OVER_PEERS`` x any peer's, positive in ``MIN_STEADY_POSITIVE_FRAC`` of the steps. With
    ``cpu_throttled`` (rank, step, cpu_throttled_frac: ``cpu_throttle.cpu_throttled_per_step``), the CPU-throttle
    view (``_cpu_throttled``) qualifies a window when the rank's cgroup was throttled at least
    ``MIN_CPU_THROTTLED_FRAC`` of it while no peer's was a ``MAX_PEER_THROTTLED_SHARE`` of that, and its mean
    lateness excess is at least ``min_lateness_frac``, ``MIN_THROTTLED_T`` standard errors above zero and
    ``MIN_STEADY_T_OVER_PEERS`` x any peer's. Every window of every (group, rank) is scored at once (one
    windows x steps matrix), so the cost grows with the rows; with ``memo`` (``score_memo.ScoreMemo``: a live run
    scored again after a refresh) only the windows over steps whose rows changed are, with the same result.
    Columns: ``SCORE_COLUMNS`` + ``NOISE_COLUMNS`` (+ ``THROTTLE_SCORE_COLUMNS`` with ``cpu_throttled``, +
    ``WAIT_SCORE_COLUMNS`` with ``cpu_wait``, + ``IDLE_SCORE_COLUMNS`` with ``cpu_wait`` and ``cpu_busy``). With
    both, the run-queue view (``_core_taken``) qualifies a window where the rank's main thread waited for a CPU at
    least ``MIN_WAIT_VIEW_EXCESS_FRAC`` longer than any peer's while every peer sat idle."""
    require_columns(lateness, [c for c in LATENESS_COLUMNS if c not in LATENESS_OPTIONAL], table="rank_lateness")
    missing = {c: np.nan for c in LATENESS_OPTIONAL if c not in lateness}
    lateness = lateness.assign(**missing) if missing else lateness
    keys = ["pg", "pg_ranks", "rank"]
    lat = lateness.dropna(subset=keys) if lateness[keys].isna().any(axis=None) else lateness
    # (pg, pg_ranks) coded once, in their sorted order: the groupings below read the codes, not the long strings
    group, pg_names, pr_names = group_codes(lat["pg"], lat["pg_ranks"])
    lat = lat.assign(excess_frac=_excess_over_group(lat, group))
    with_throttle, with_wait = cpu_throttled is not None, cpu_wait is not None
    with_idle = with_wait and cpu_busy is not None
    columns = (SCORE_COLUMNS + NOISE_COLUMNS + (THROTTLE_SCORE_COLUMNS if with_throttle else [])
               + (WAIT_SCORE_COLUMNS if with_wait else []) + (IDLE_SCORE_COLUMNS if with_idle else []))
    if lat.empty:
        return pd.DataFrame({col: [] for col in columns})
    if with_throttle:
        lat = lat.assign(cpu_throttled_frac=_per_step_of_rows(lat, cpu_throttled, "cpu_throttled_frac"))
    if with_wait:
        lat = lat.assign(cpu_wait_frac=_per_step_of_rows(lat, cpu_wait, "cpu_wait_frac"))
    if with_idle:
        lat = lat.assign(cpu_busy_frac=_per_step_of_rows(lat, cpu_busy, "cpu_busy_frac"))
    rank_of_row = lat["rank"].to_numpy(dtype="int64")
    gid = pd.factorize(group * (int(rank_of_row.max()) + 1) + rank_of_row, sort=True)[0].astype("int64")
    order = np.lexsort((lat["step"].to_numpy(), gid))          # by (group, rank), then step

    def column(name: str, dtype: str) -> np.ndarray:
        """The column in (group, rank, step) order."""
        if dtype == "float64":
            return lat[name].to_numpy(dtype=dtype, na_value=np.nan)[order]
        return lat[name].to_numpy(dtype=dtype)[order]

    gid = gid[order]
    n = np.bincount(gid)                                        # steps per (group, rank)
    first_row = np.cumsum(n) - n
    window_steps = window_length(window_steps, lat["step_ns"], min_window_s)
    w = np.maximum(1, np.minimum(window_steps, n))              # window length per (group, rank)
    num_windows = n - w + 1
    first_window = np.cumsum(num_windows) - num_windows
    win_gid = np.repeat(np.arange(len(n)), num_windows)
    win_start = first_row[win_gid] + np.arange(len(win_gid)) - first_window[win_gid]
    wlen = w[win_gid]
    steps_ = column("step", "int64")
    first_key = lat[keys].iloc[order[first_row]]
    windows = pd.DataFrame({    # groups as categories: one string per group, not per window
        "pg": pd.Categorical(first_key["pg"]).take(win_gid),
        "pg_ranks": pd.Categorical(first_key["pg_ranks"]).take(win_gid),
        "rank": first_key["rank"].to_numpy(dtype="int64")[win_gid], "first_step": steps_[win_start],
        "last_step": steps_[win_start + wlen - 1]})
    span = windows.groupby(["pg", "pg_ranks", "first_step", "last_step"], sort=False).ngroup().to_numpy()
    # each window's figures (of its group's rows in its steps alone): from the memo where they still hold, the
    # others computed (every window of a span together: peer maxima read them all)
    settings = (window_steps, with_throttle, with_wait, with_idle)
    reused, remember = np.full(len(windows), -1, dtype=np.int64), None
    if memo is not None:
        group_code = memo.group_codes(first_key["pg"], first_key["pg_ranks"])     # per (group, rank)
        win_code, win_first, win_last = group_code[win_gid], steps_[win_start], steps_[win_start + wlen - 1]
        wkeys = window_keys(win_code, windows["rank"].to_numpy(), win_first, win_last, wlen)
        if wkeys is not None:
            reused, step_keys, prints = memo.reuse(settings, lat, order, group_code[gid], steps_, wkeys, win_code,
                                                   win_first, win_last)
            remember = (step_keys, prints, wkeys)
    todo = np.isin(span, span[reused < 0])
    fig = _window_figures(column, win_start, wlen, span, todo, with_throttle=with_throttle, with_wait=with_wait,
                          with_idle=with_idle)
    if not todo.all():
        for name, values in fig.items():
            values[~todo] = memo.figures[name][reused[~todo]]
    med, pos, pmed, ppos, pre_t, peer_t, cmed = (fig[k] for k in ("med", "pos", "pmed", "ppos", "pre_t", "peer_t",
                                                                  "cmed"))
    emean, epos, own_sd, k_exc = (fig[k] for k in ("emean", "epos", "own_sd", "k_exc"))
    thr, peer_thr, waited, peer_waited, stall, peer_idle = (fig[k] for k in ("thr", "peer_thr", "waited",
                                                                             "peer_waited", "stall", "peer_idle"))
    # a rank whose cgroup hit its quota in any window: its run-queue waits may be the quota's (the kernel counts
    # throttled time as wait, and a process moved into a quota'd cgroup shows the throttle a sample later than the
    # wait), so the run-queue view does not judge it (the throttle view does)
    quota_ever = np.maximum.reduceat(np.nan_to_num(thr, nan=0.0), first_window) >= MIN_CPU_THROTTLED_FRAC
    peer_idle = np.where(quota_ever[win_gid], np.nan, peer_idle)
    by_core = _core_taken(waited, peer_waited, peer_idle) & ~held_by_quota(thr, peer_thr)   # no noise in it
    # The peers' noise (the costly part: a pool of the peers' values per window) is needed only where a view's
    # other conditions hold (unknown noise does not block, so those windows are a superset of the qualifying ones)
    # and at each (group, rank)'s chosen window; the steady view's peer_et also needs its peers' windows of the
    # same steps. Noise is computed there alone, each value as peer_noise computes it over all windows (or taken
    # from the memo where it computed it).
    unknown = np.full(len(windows), np.nan)
    by_group = np.argsort(group, kind="stable")
    bounds = np.flatnonzero(np.r_[True, group[by_group][1:] != group[by_group][:-1], True])
    rows_of = {(pg_names[group[by_group[a]]], pr_names[group[by_group[a]]]): by_group[a:b]
               for a, b in zip(bounds[:-1], bounds[1:])}
    grids = _GroupGrids(lat, ["lateness_frac", "pre_excess_frac", "excess_frac"], rows_of=rows_of)
    noise_of = {"noise": _PeerNoise(lat, windows, column="lateness_frac", grids=grids),
                "pnoise": _PeerNoise(lat, windows, column="pre_excess_frac", grids=grids),
                "esd": _PeerNoise(lat, windows, column="excess_frac", reduce=_std_rows, grids=grids)}
    noise, pnoise, esd = unknown.copy(), unknown.copy(), unknown.copy()
    cached = {name: (unknown.copy(), np.zeros(len(windows), dtype=bool)) for name in noise_of}
    if not todo.all():
        for name, (values, known) in cached.items():
            values[~todo], known[~todo] = (memo.noise[name][0][reused[~todo]], memo.noise[name][1][reused[~todo]])

    def judge(*, peers_known: bool = True) -> tuple[np.ndarray, ...]:
        over, pover = _over(med, noise), _over(pmed, pnoise)
        et = _t_of_count(emean, k_exc, np.fmax(own_sd, esd))
        peer_et = _peer_max(et, windows, key=span) if peers_known else unknown
        by_arrival = (med >= min_lateness_frac) & (pos >= min_positive_frac) & ~(over < min_lateness_over_noise)
        by_phases = ((med >= min_lateness_frac) & (pmed >= min_lateness_frac) & (ppos >= min_positive_frac)
                     & ~(pover < min_pre_excess_over_noise))
        by_persistence = _persistent(med, pmed, pre_t, peer_t, pover, emean, epos, cmed,
                                     min_lateness_frac=min_lateness_frac,
                                     min_t=min_pre_excess_t, min_t_over_peers=min_pre_excess_t_over_peers,
                                     min_over_noise=min_persistent_pre_over_noise)
        by_steady = _steady(emean, epos, et, peer_et, min_lateness_frac=min_lateness_frac, min_t=min_steady_t)
        by_throttle = _cpu_throttled(emean, epos, et, peer_et, thr, peer_thr, stall,
                                     min_lateness_frac=min_lateness_frac)
        by_throttle |= by_core
        return over, pover, et, peer_et, by_arrival, by_phases, by_persistence, by_steady, by_throttle

    def fill(where_noise: np.ndarray, where_pnoise: np.ndarray, where_esd: np.ndarray) -> None:
        for name, values, where in (("noise", noise, where_noise), ("pnoise", pnoise, where_pnoise),
                                    ("esd", esd, np.isin(span, span[where_esd]))):
            known_values, known = cached[name]
            values[where & known] = known_values[where & known]
            need = where & ~known
            if need.any():
                values[need] = noise_of[name].at(need)[need]
                known_values[need], known[need] = values[need], True

    # noise unknown everywhere: the windows that qualify whatever the noise (own spread bounds the steady t)
    *_, may_arrive, may_phase, may_persist, may_steady, may_throttle = judge(peers_known=False)
    fill(may_arrive, may_phase | may_persist, may_steady | may_throttle)
    over, pover, et, peer_et, by_arrival, by_phases, by_persistence, by_steady, by_throttle = judge()
    # a window qualifies only if it spans min_window_s by its own steps, as detect_stragglers requires: a run whose
    # steps slow down has short windows of its fast steps before its fault, and the first window of the fault
    # straddles them (the windows after it are judged, not the rank)
    ok = (by_arrival | by_phases | by_persistence | by_steady | by_throttle) & _spans(
        column("step_ns", "float64"), win_start, wlen, min_window_s)
    detected = _first_true(ok, win_gid, len(n))                 # first qualifying window (global index) or -1
    # Else the window with the largest median (the first of equals, NaN ignored), or the first window when no
    # median is finite.
    med_or_low = np.where(np.isnan(med), -np.inf, med)
    is_max = med_or_low == np.maximum.reduceat(med_or_low, first_window)[win_gid]
    any_finite = np.add.reduceat(np.isfinite(med).astype("int64"), first_window) > 0
    fallback = np.where(any_finite, _first_true(is_max, win_gid, len(n)), first_window)
    best = np.where(detected >= 0, detected, fallback)
    chosen = np.zeros(len(windows), dtype=bool)
    chosen[best] = True
    done_steady = np.isin(span, span[may_steady | may_throttle])
    fill(chosen & ~may_arrive, chosen & ~(may_phase | may_persist), chosen & ~done_steady)
    over, pover, et, peer_et = judge()[:4]
    if remember is not None:
        memo.keep(settings, remember[0], remember[1], remember[2], fig, cached)
    sel_start = win_start[best]                                 # first row of each (group, rank)'s chosen window
    victims = np.clip(column("victims_wait_ns", "float64"), 0, None)
    out = lat[keys].iloc[order[first_row]].reset_index(drop=True)
    out = pd.DataFrame({
        "pg": list(out["pg"]), "pg_ranks": list(out["pg_ranks"]), "rank": out["rank"].astype("int64"),
        "num_steps": n, "window_steps": w, "window_first_step": steps_[sel_start],
        "window_last_step": steps_[sel_start + w - 1],
        "median_lateness_frac": med[best], "positive_frac": pos[best], "median_pre_excess_frac": pmed[best],
        "pre_positive_frac": ppos[best],
        "last_frac": np.nansum(_windows(column("is_last", "bool"), sel_start, w), axis=1) / w,
        "mean_lateness_ns": _nanmean_rows(_windows(column("lateness_ns", "float64"), sel_start, w)),
        "mean_victims_wait_ns": _nanmean_rows(_windows(victims, sel_start, w)),
        "mean_step_ns": _nanmean_rows(_windows(column("step_ns", "float64"), sel_start, w)),
        "detected_at_step": pd.array([int(steps_[win_start[d] + w[g] - 1]) if d >= 0 else None
                                      for g, d in enumerate(detected)], dtype="Int64"),
        "detected_by": [None if d < 0 else "arrival" if by_arrival[d] else "arrival+phases" if by_phases[d]
                        else "persistence" if by_persistence[d] else "steady" if by_steady[d]
                        else "cpu_wait" if by_core[d] else "cpu_throttle"
                        for d in detected],
        "noise_frac": noise[best], "lateness_over_noise": over[best],
        "phase_noise_frac": pnoise[best], "pre_excess_over_noise": pover[best],
        "pre_excess_t": pre_t[best], "peer_pre_excess_t": peer_t[best],
        "mean_excess_frac": emean[best], "excess_positive_frac": epos[best], "excess_t": et[best],
        "peer_excess_t": peer_et[best], "median_comm_excess_frac": cmed[best], "cpu_throttled_frac": thr[best],
        "peer_cpu_throttled_frac": peer_thr[best], "step_stall_frac": stall[best],
        "cpu_wait_frac": waited[best], "peer_cpu_wait_frac": peer_waited[best], "peer_idle_frac": peer_idle[best],
    })
    return out[columns]


def _spans(step_ns: np.ndarray, win_start: np.ndarray, wlen: np.ndarray, min_window_s: float) -> np.ndarray:
    """Per window: its length times its mean step (NaN steps ignored) is at least ``min_window_s`` (unknown: True)."""
    known = np.isfinite(step_ns)
    total = np.concatenate([[0.0], np.cumsum(np.where(known, step_ns, 0.0))])
    count = np.concatenate([[0], np.cumsum(known)])
    end = win_start + wlen
    num = count[end] - count[win_start]
    mean = np.divide(total[end] - total[win_start], num, out=np.full(len(win_start), np.nan), where=num > 0)
    return ~(wlen * mean < min_window_s * 1e9)


def _window_figures(column: Callable[[str, str], np.ndarray], win_start: np.ndarray, wlen: np.ndarray,
                    span: np.ndarray, todo: np.ndarray, *, with_throttle: bool, with_wait: bool,
                    with_idle: bool = False) -> dict[str, np.ndarray]:
    """``straggler_scores``' figures of the windows where ``todo`` holds (NaN elsewhere): each window's medians and
    shares of its steps (``med``, ``pos``, ``pmed``, ``ppos``), the persistence t and its peers' largest
    (``pre_t``, ``peer_t``), its mean excess, share positive, spread and count (``emean``, ``epos``, ``own_sd``,
    ``k_exc``), the median of its communication excess (``cmed``), and its CPU throttle and wait shares and the
    peers' largest. ``column(name, dtype)``: the lateness column in (group, rank, step) order; ``span``: each
    window's (group, steps) code (``todo`` holds every window of a span or none)."""
    sel = np.flatnonzero(todo)
    out = {name: np.full(len(todo), np.nan) for name in ("med", "pos", "pmed", "ppos", "pre_t", "peer_t", "emean",
                                                           "epos", "own_sd", "k_exc", "cmed", "thr", "peer_thr",
                                                           "waited", "peer_waited", "stall", "peer_idle")}
    if not len(sel):
        return out
    starts, lengths, key = win_start[sel], wlen[sel], span[sel]
    frac = _windows(column("lateness_frac", "float64"), starts, lengths)
    exc = _windows(column("excess_frac", "float64"), starts, lengths)
    pre = _windows(column("pre_excess_frac", "float64"), starts, lengths)
    med, pmed = _nanmedian_rows(frac), _nanmedian_rows(pre)
    pre_t = _median_t(pre, pmed)
    part = {"med": med, "pos": (frac > LATE_TIE_FRAC).sum(axis=1) / lengths, "pmed": pmed,
            "ppos": (pre > 0).sum(axis=1) / lengths, "pre_t": pre_t, "peer_t": _peer_max(pre_t, None, key=key),
            "emean": _nanmean_rows(exc), "epos": (exc > LATE_TIE_FRAC).sum(axis=1) / lengths, "own_sd": _std_rows(exc),
            "k_exc": (~np.isnan(exc)).sum(axis=1),
            "cmed": _nanmedian_rows(_windows(column("comm_excess_frac", "float64"), starts, lengths))}
    for name, peer, given in (("thr", "peer_thr", with_throttle), ("waited", "peer_waited", with_wait)):
        if given:
            source = "cpu_throttled_frac" if name == "thr" else "cpu_wait_frac"
            part[name] = _nanmean_rows(_windows(column(source, "float64"), starts, lengths))
            part[peer] = _peer_max(part[name], None, key=key)
    if with_throttle:       # the steps' stall, where the rank was throttled alone (clean runs: nowhere)
        part["stall"] = np.full(len(sel), np.nan)
        held = part["thr"] >= MIN_CPU_THROTTLED_FRAC
        if held.any():
            step = _windows(column("step_ns", "float64"), starts[held], lengths[held])
            mean = _nanmean_rows(step)
            with np.errstate(divide="ignore", invalid="ignore"):
                part["stall"][held] = np.where(mean > 0, 1.0 - _nanmedian_rows(step) / mean, np.nan)
    if with_idle:           # every peer's idle share: the smallest of them (the negated largest negated one)
        idle = np.clip(1.0 - _nanmean_rows(_windows(column("cpu_busy_frac", "float64"), starts, lengths))
                       - part["waited"], 0.0, None)
        part["peer_idle"] = -_peer_max(-idle, None, key=key)
    for name, values in part.items():
        out[name][sel] = values
    return out


def _per_step_of_rows(lat: pd.DataFrame, per_step: pd.DataFrame, name: str) -> np.ndarray:
    """Per row of ``rank_lateness``: its rank's ``name`` (a column of ``per_step``: rank, step, name) at its step
    (NaN where not sampled)."""
    if per_step.empty:
        return np.full(len(lat), np.nan)
    known = pd.Series(per_step[name].to_numpy(dtype="float64"), index=pd.MultiIndex.from_arrays(
        [per_step["rank"].to_numpy(dtype="int64"), per_step["step"].to_numpy(dtype="int64")]))
    where = pd.MultiIndex.from_arrays([lat["rank"].to_numpy(dtype="int64"),
                                       lat["step"].to_numpy(dtype="float64", na_value=-1).astype("int64")])
    return known.reindex(where).to_numpy(dtype="float64")


def _excess_over_group(lat: pd.DataFrame, group: np.ndarray | None = None) -> np.ndarray:
    """Per row of ``rank_lateness``: its ``lateness_frac`` minus the median ``lateness_frac`` of its group's members
    (itself included) at the same step. In a group of two that is the lateness itself; in a group with many
    collectives per step, where every member's worst lateness is positive, it removes that common part.
    ``group``: each row's (pg, pg_ranks) code when known (``tables.group_codes``)."""
    x = lat["lateness_frac"].to_numpy(dtype="float64", na_value=np.nan)
    if group is not None and not lat["step"].isna().any():
        med = pd.Series(x).groupby([group, lat["step"].to_numpy(dtype="int64")]).transform("median")
        return x - med.to_numpy(dtype="float64")
    code = lat.groupby(["pg", "pg_ranks", "step"], sort=False).ngroup().to_numpy(dtype="int64")
    med = pd.Series(x).groupby(code).transform("median").to_numpy(dtype="float64")
    return x - med


def _std_rows(x: np.ndarray) -> np.ndarray:
    """Sample standard deviation of each row ignoring NaN (NaN for rows of fewer than two values)."""
    k = (~np.isnan(x)).sum(axis=1)
    mean = _nanmean_rows(x)
    with np.errstate(invalid="ignore", divide="ignore"):
        var = np.nansum((x - mean[:, None]) ** 2, axis=1) / np.maximum(k - 1, 1)
    return np.where(k >= 2, np.sqrt(var), np.nan)


def _mean_t(x: np.ndarray, peer_sd: np.ndarray) -> np.ndarray:
    """Per row: the mean over its standard error, sd / sqrt(values) (NaN ignored), where sd is the larger of the
    row's own standard deviation and ``peer_sd`` (its peers' in the same steps: a rank steadily late by less than
    its peers swing by chance does not stand out); NaN with fewer than five values, +-inf for a non-zero mean
    without any spread."""
    return _t_of_mean(_nanmean_rows(x), x, np.fmax(_std_rows(x), peer_sd))


def _t_of_mean(mean: np.ndarray, x: np.ndarray, sd: np.ndarray) -> np.ndarray:
    """``_mean_t`` of rows ``x`` given their ``mean`` and the standard deviation ``sd`` already chosen; the larger
    ``sd``, the smaller a positive t (so a row's own spread alone bounds it from above)."""
    return _t_of_count(mean, (~np.isnan(x)).sum(axis=1), sd)


def _t_of_count(mean: np.ndarray, k: np.ndarray, sd: np.ndarray) -> np.ndarray:
    """``_t_of_mean`` of rows of ``k`` values each."""
    with np.errstate(divide="ignore", invalid="ignore"):
        se = sd / np.sqrt(np.maximum(k, 1))
        t = np.where(se > 0, mean / se, np.where(mean != 0, np.inf * np.sign(mean), 0.0))
    return np.where(k >= 5, t, np.nan)


def _steady(mean: np.ndarray, pos: np.ndarray, t: np.ndarray, peer_t: np.ndarray, *, min_lateness_frac: float,
            min_t: float, min_t_over_peers: float = MIN_STEADY_T_OVER_PEERS,
            min_positive_frac: float = MIN_STEADY_POSITIVE_FRAC) -> np.ndarray:
    """The steady view: mean lateness excess over the group's median at least ``min_lateness_frac`` and
    ``MIN_STEADY_EXCESS_FRAC``, positive in ``min_positive_frac`` of the steps, ``min_t`` standard errors above
    zero and ``min_t_over_peers`` x any peer's (a peer's non-positive value does not block)."""
    return ((mean >= max(min_lateness_frac, MIN_STEADY_EXCESS_FRAC)) & (pos >= min_positive_frac) & (t >= min_t)
            & ~(t < min_t_over_peers * np.maximum(peer_t, 0)))


def _cpu_throttled(mean: np.ndarray, pos: np.ndarray, t: np.ndarray, peer_t: np.ndarray, throttled: np.ndarray,
                   peer_throttled: np.ndarray, stall: np.ndarray, *, min_lateness_frac: float) -> np.ndarray:
    """The CPU-throttle view: the rank's cgroup throttled at least ``MIN_CPU_THROTTLED_FRAC`` of the window, no peer
    a ``MAX_PEER_THROTTLED_SHARE`` of that (unknown peers do not block), ``MIN_STEADY_T_OVER_PEERS`` x any peer's t,
    and the job shown to wait for it: its mean lateness excess at least ``MIN_THROTTLED_EXCESS_SHARE`` x
    ``min_lateness_frac`` and ``MIN_THROTTLED_T`` standard errors above zero or positive in
    ``MIN_THROTTLED_POSITIVE_FRAC`` of the steps (``pos``); or its mean excess positive and the group's steps
    stalled (``_stalled``)."""
    late = ((mean >= MIN_THROTTLED_EXCESS_SHARE * min_lateness_frac)
            & ((t >= MIN_THROTTLED_T) | (pos >= MIN_THROTTLED_POSITIVE_FRAC)))
    late |= (mean > 0) & _stalled(stall, throttled, min_lateness_frac=min_lateness_frac)
    return (held_by_quota(throttled, peer_throttled) & late
            & ~(t < MIN_STEADY_T_OVER_PEERS * np.maximum(peer_t, 0)))


def _stalled(stall: np.ndarray, throttled: np.ndarray, *, min_lateness_frac: float) -> np.ndarray:
    """The group's steps stalled (``step_stall_frac``) by at least ``min_lateness_frac``, within
    ``STALL_THROTTLE_RATIO`` of the rank's throttled share either way (NaN: not shown)."""
    return ((stall >= min_lateness_frac) & (stall * STALL_THROTTLE_RATIO >= throttled)
            & (throttled * STALL_THROTTLE_RATIO >= stall))


def _core_taken(waited: np.ndarray, peer_waited: np.ndarray, peer_idle: np.ndarray) -> np.ndarray:
    """The run-queue view: the rank's main thread waited for a CPU at least ``MIN_WAIT_VIEW_EXCESS_FRAC`` of the
    window longer than any peer's, and every peer sat idle at least ``PEER_IDLE_SHARE_OF_WAIT`` of that (NaN: not
    shown)."""
    extra = waited - peer_waited
    return (extra >= MIN_WAIT_VIEW_EXCESS_FRAC) & (peer_idle >= PEER_IDLE_SHARE_OF_WAIT * extra)


def held_by_quota(throttled: np.ndarray, peer_throttled: np.ndarray) -> np.ndarray:
    """The rank's cgroup throttled at least ``MIN_CPU_THROTTLED_FRAC`` while no peer's was a
    ``MAX_PEER_THROTTLED_SHARE`` of that (NaN: unknown, a rank's does not pass, a peer's does not block)."""
    return (throttled >= MIN_CPU_THROTTLED_FRAC) & ~(peer_throttled >= MAX_PEER_THROTTLED_SHARE * throttled)


def quota_held(throttled: float | None, peer_throttled: float | None) -> bool:
    """``held_by_quota`` of one rank's throttled share and its peers' largest (None: unknown)."""
    return throttled is not None and bool(held_by_quota(
        np.float64(throttled), np.float64(np.nan if peer_throttled is None else peer_throttled)))


def medians_and_se(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per row of ``x`` (NaN ignored): its median and that median's standard error (``_median_se``)."""
    med = _nanmedian_rows(x)
    return med, _median_se(x, med)


def _median_se(x: np.ndarray, med: np.ndarray) -> np.ndarray:
    """Per row: the standard error of its median ``med``, 1.4826 x MAD / sqrt(values) (NaN ignored)."""
    k = (~np.isnan(x)).sum(axis=1)
    return 1.4826 * _nanmedian_rows(np.abs(x - med[:, None])) / np.sqrt(np.maximum(k, 1))


def _median_t(x: np.ndarray, med: np.ndarray) -> np.ndarray:
    """Per row: the median ``med`` over its standard error (``_median_se``); +-inf for a non-zero median without
    spread, NaN with fewer than three values."""
    k = (~np.isnan(x)).sum(axis=1)
    se = _median_se(x, med)
    with np.errstate(divide="ignore", invalid="ignore"):
        t = np.where(se > 0, med / se, np.where(med != 0, np.inf * np.sign(med), 0.0))
    return np.where(k >= 3, t, np.nan)


def _peer_max(values: np.ndarray, windows: pd.DataFrame | None, *, key: np.ndarray | None = None) -> np.ndarray:
    """Per window: the largest ``values`` among the other members' windows of the same group and steps (NaN
    without any). ``key``: the windows' (group, steps) codes when already known."""
    if key is None:
        key = windows.groupby(["pg", "pg_ranks", "first_step", "last_step"], sort=False).ngroup().to_numpy()
    v = np.where(np.isnan(values), -np.inf, values)
    if not len(v):
        return np.full(0, np.nan)
    order = np.argsort(key, kind="stable")                      # by key, each key's windows in their order
    vs = v[order]
    first = np.r_[True, key[order][1:] != key[order][:-1]]
    starts = np.flatnonzero(first)
    gid = np.cumsum(first) - 1
    top1 = np.maximum.reduceat(vs, starts)
    pos = np.arange(len(vs))
    holder = np.minimum.reduceat(np.where(vs == top1[gid], pos, len(vs)), starts)   # first window holding it
    rest = vs.copy()
    rest[holder] = -np.inf
    top2 = np.maximum.reduceat(rest, starts)                    # the largest of the others (-inf: no other)
    out = np.empty(len(v))
    out[order] = np.where(pos == holder[gid], top2[gid], top1[gid])   # the largest member gets the second largest
    return np.where(np.isneginf(out), np.nan, out)


def _persistent(med: np.ndarray, pmed: np.ndarray, pre_t: np.ndarray, peer_t: np.ndarray, pover: np.ndarray,
                emean: np.ndarray, epos: np.ndarray, cmed: np.ndarray, *, min_lateness_frac: float, min_t: float,
                min_t_over_peers: float, min_over_noise: float) -> np.ndarray:
    """The persistence view: median data+fwd excess at least ``min_lateness_frac`` of the step, ``min_t``
    standard errors above zero and ``min_t_over_peers`` x any peer's (a peer's non-positive value does not block),
    at least ``min_over_noise`` x the peers' excess noise (unknown noise does not block), a positive median
    lateness (it does arrive late), not below its group's median lateness on average while above it in fewer
    than ``MIN_PERSISTENT_LATER_FRAC`` of the steps (``emean``, ``epos``; unknown does not block), and less time
    in the group's collectives than its peers (``cmed`` < 0, the median of ``comm_excess_frac``; unknown does not
    block): the peers of a rank whose own work is longer wait for it there, and it does not wait for them."""
    return ((pmed >= min_lateness_frac) & (med > 0) & (pre_t >= min_t)
            & ~(pre_t < min_t_over_peers * np.maximum(peer_t, 0)) & ~(pover < min_over_noise)
            & ~((emean < 0) & (epos < MIN_PERSISTENT_LATER_FRAC)) & ~(cmed >= 0))


MAX_PEERS_EXCLUDED = 16
"""Groups up to this size pool each rank's peers without it; larger ones pool every member (one rank's share of
the pool is small there, and one pool per window instead of one per member keeps the cost linear in ranks)."""


def _over(value: np.ndarray, noise: np.ndarray) -> np.ndarray:
    """value / noise; inf for a positive value over zero noise, NaN when the noise is unknown."""
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(noise > 0, value / noise, np.where(noise == 0, np.inf * np.sign(value), np.nan))


def _step_rank_grid(g: pd.DataFrame, column: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``g.pivot_table(index="step", columns="rank", values=column, aggfunc="first", dropna=False)`` as (sorted
    steps, sorted ranks, steps x ranks values: each cell's first non-null value, else NaN), without pandas'
    per-call overhead (peer_noise builds one per group and column: thousands at a thousand ranks)."""
    return _step_rank_grids(g, [column])[column]


def _step_rank_grids(g: pd.DataFrame, columns: list[str]) -> dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """``_step_rank_grid(g, column)`` of each of ``columns``, the steps and ranks located once."""
    if g["step"].isna().any() or g["rank"].isna().any():
        out = {}
        for column in columns:
            m = g.pivot_table(index="step", columns="rank", values=column, aggfunc="first", dropna=False)
            out[column] = (m.index.to_numpy(dtype="int64"), m.columns.to_numpy(dtype="int64"),
                           m.to_numpy(dtype="float64"))
        return out
    grid, si = np.unique(g["step"].to_numpy(dtype="int64"), return_inverse=True)
    members, ri = np.unique(g["rank"].to_numpy(dtype="int64"), return_inverse=True)
    out = {}
    for column in columns:
        vals = g[column].to_numpy(dtype="float64", na_value=np.nan)
        values = np.full((len(grid), len(members)), np.nan)
        known = np.flatnonzero(~np.isnan(vals))
        cell = si[known] * len(members) + ri[known]
        _, first = np.unique(cell, return_index=True)          # each cell's first non-null row, in table order
        values.flat[cell[first]] = vals[known[first]]
        out[column] = (grid, members, values)
    return out


class _GroupGrids:
    """Each group's step x rank grids (``_step_rank_grids``) of ``columns`` of ``lateness``, built on first use and
    shared by the ``_PeerNoise`` of each column."""

    def __init__(self, lateness: pd.DataFrame, columns: list[str], *, rows_of: dict | None = None) -> None:
        # each group's rows located once (on first use): a mask per group over the whole frame costs groups x rows
        # (ranks squared)
        self._lateness, self._rows_of = lateness, rows_of
        self._numbers = lateness[["step", "rank", *columns]]     # taken per group: no copy of the group strings
        self._columns = list(columns)
        self._grids: dict[tuple, dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]]] = {}

    def get(self, pg: str, pg_ranks: str, column: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        if (pg, pg_ranks) not in self._grids:
            if self._rows_of is None:
                self._rows_of = self._lateness.groupby(["pg", "pg_ranks"], sort=False).indices
            rows = self._rows_of.get((pg, pg_ranks), np.empty(0, dtype="int64"))
            self._grids[pg, pg_ranks] = _step_rank_grids(self._numbers.iloc[np.sort(rows)], self._columns)
        return self._grids[pg, pg_ranks][column]


def peer_noise(lateness: pd.DataFrame, windows: pd.DataFrame, *, column: str = "lateness_frac",
               reduce: Callable[[np.ndarray], np.ndarray] | None = None) -> np.ndarray:
    """For each window (rows of ``windows``: pg, pg_ranks, rank, first_step, last_step): the noise of ``column``
    (a share of the step) of the rank's group peers at the steps first_step..last_step, pooled (between them and over
    steps): the larger of 1.4826 x their median absolute deviation and their 90th percentile. NaN with fewer than
    two peer values. In a clean run this is how late any rank gets by chance (on a busy host, or in a group whose
    many collectives per step make every member's worst lateness positive); a straggler stands out of it.
    ``reduce`` (rows of pooled values -> one value per row) replaces that statistic, e.g. ``_std_rows``."""
    return _PeerNoise(lateness, windows, column=column, reduce=reduce).at(np.ones(len(windows), dtype=bool))


class _PeerNoise:
    """``peer_noise`` of some of the windows at a time (``at``): each value as ``peer_noise`` gives it over all
    ``windows`` (the same pool, padded to the same width), each group's step x rank grid built once."""

    def __init__(self, lateness: pd.DataFrame, windows: pd.DataFrame, *, column: str,
                 reduce: Callable[[np.ndarray], np.ndarray] | None = None, grids: _GroupGrids | None = None) -> None:
        """``grids``: the groups' grids of ``column`` (and others), shared between columns."""
        self._column, self._reduce = column, reduce or _noise_rows
        self._windows = windows
        self._wkey: np.ndarray | None = None    # each window's group code, on first use
        self._of_group: dict[int, np.ndarray] = {}   # group code -> its windows, in order
        self._grids = grids if grids is not None else _GroupGrids(lateness, [column]) if len(windows) else None

    def at(self, select: np.ndarray) -> np.ndarray:
        """The noise of the windows where ``select`` is true (NaN elsewhere)."""
        windows, out = self._windows, np.full(len(self._windows), np.nan)
        if windows.empty or not select.any():
            return out
        if self._wkey is None:
            self._wkey = windows.groupby(["pg", "pg_ranks"], sort=False).ngroup().to_numpy()
            by = np.argsort(self._wkey, kind="stable")
            bounds = np.flatnonzero(np.r_[True, self._wkey[by][1:] != self._wkey[by][:-1], True])
            self._of_group = {int(self._wkey[by[a]]): by[a:b] for a, b in zip(bounds[:-1], bounds[1:])}
        first_step = windows["first_step"].to_numpy(dtype="int64")
        last_step = windows["last_step"].to_numpy(dtype="int64")
        wrank = windows["rank"].to_numpy(dtype="int64")
        for key in np.unique(self._wkey[select]):     # the groups of the windows asked for, each window of them
            idx = self._of_group[int(key)]
            grid, members, values = self._grids.get(windows["pg"].iloc[idx[0]], windows["pg_ranks"].iloc[idx[0]],
                                                    self._column)
            lo = np.searchsorted(grid, first_step[idx], side="left")
            hi = np.searchsorted(grid, last_step[idx], side="right")
            width = int((hi - lo).max())                         # over all of the group's windows: the same pool
            padded = np.vstack([values, np.full((width, len(members)), np.nan)])
            view = np.lib.stride_tricks.sliding_window_view(padded, width, axis=0)      # start x members x width

            def pooled(sel: np.ndarray, cols: np.ndarray) -> np.ndarray:
                """The values of members ``cols`` over the windows ``sel`` (positions in ``idx``), one row each."""
                rows = view[lo[sel]][:, cols, :]
                rows = np.where(np.arange(width)[None, None, :] < (hi - lo)[sel][:, None, None], rows, np.nan)
                return rows.reshape(len(sel), -1)

            wanted = select[idx]
            if len(members) > MAX_PEERS_EXCLUDED:
                chosen = np.flatnonzero(wanted)
                _, first, inverse = np.unique(np.stack([lo[chosen], hi[chosen]]), axis=1, return_index=True,
                                              return_inverse=True)
                out[idx[chosen]] = self._reduce(pooled(chosen[first], np.arange(len(members))))[inverse.ravel()]
                continue                                          # (once per step span)
            sel = np.flatnonzero(wanted)
            own = np.minimum(np.searchsorted(members, wrank[idx][sel]), len(members) - 1)
            if (members[own] == wrank[idx][sel]).all():     # every member's peers at once, in member order
                peers = np.arange(len(members) - 1)
                peers = peers[None, :] + (peers[None, :] >= own[:, None])
                rows = np.take_along_axis(view[lo[sel]], peers[:, :, None], axis=1)
                rows = np.where(np.arange(width)[None, None, :] < (hi - lo)[sel][:, None, None], rows, np.nan)
                out[idx[sel]] = self._reduce(rows.reshape(len(sel), -1))
                continue
            rank = wrank[idx]
            for r in np.unique(rank[wanted]):
                sel = np.flatnonzero((rank == r) & wanted)
                out[idx[sel]] = self._reduce(pooled(sel, members != r))
        return out


def _noise_rows(x: np.ndarray) -> np.ndarray:
    """Per row, NaN ignored: the larger of 1.4826 x the median absolute deviation (robust spread) and the 90th
    percentile (how late the values get); NaN for rows of fewer than two values."""
    med = _nanmedian_rows(x)
    mad = 1.4826 * _nanmedian_rows(np.abs(x - med[:, None]))
    k = (~np.isnan(x)).sum(axis=1)
    srt = np.sort(x, axis=1)                                    # NaN last: the k values first
    pos = 0.9 * np.maximum(k - 1, 0)                            # linear interpolation, as np.nanquantile
    lo = np.floor(pos).astype("int64")
    hi = np.minimum(lo + 1, np.maximum(k - 1, 0))
    rows = np.arange(len(x))
    q90 = srt[rows, lo] + (pos - lo) * (srt[rows, hi] - srt[rows, lo])
    return np.where(k >= 2, np.maximum(mad, q90), np.nan)


def window_length(window_steps: int, step_ns: pd.Series, min_window_s: float = MIN_WINDOW_S) -> int:
    """Steps per window: ``window_steps``, or as many of the median step (``step_ns``, NaN ignored) as span
    ``min_window_s`` seconds when that is more."""
    median = float(pd.to_numeric(step_ns, errors="coerce").median()) if len(step_ns) else np.nan
    if not median > 0 or not min_window_s > 0:
        return int(window_steps)
    return max(int(window_steps), int(np.ceil(min_window_s * 1e9 / median)))


def _windows(values: np.ndarray, starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Rows ``values[start:start + length]``, right-padded with NaN to the longest length."""
    width = int(lengths.max()) if len(lengths) else 1
    values = np.asarray(values, dtype="float64")
    if len(starts) and bool((lengths == width).all()) and int(starts.max()) + width <= len(values):
        return np.lib.stride_tricks.sliding_window_view(values, width)[starts]   # all whole: a copy, no padding
    padded = np.concatenate([values, np.full(width, np.nan)])
    out = np.lib.stride_tricks.sliding_window_view(padded, width)[starts]
    return np.where(np.arange(width) < lengths[:, None], out, np.nan)


def _nanmedian_rows(x: np.ndarray) -> np.ndarray:
    """Median of each row ignoring NaN (NaN for a row without values): ``np.nanmedian(x, axis=1)``, faster."""
    x = np.sort(x, axis=1)                                      # NaN sort last
    k = (~np.isnan(x)).sum(axis=1)
    rows = np.arange(len(x))
    lo, hi = x[rows, np.maximum(k - 1, 0) // 2], x[rows, k // 2]
    return np.where(k > 0, (lo + hi) / 2, np.nan)


def _nanmean_rows(x: np.ndarray) -> np.ndarray:
    """Mean of each row ignoring NaN (NaN for a row without values), as ``Series.mean`` does."""
    k = (~np.isnan(x)).sum(axis=1)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(k > 0, np.nansum(x, axis=1) / k, np.nan)


def _first_true(flags: np.ndarray, gid: np.ndarray, num_groups: int) -> np.ndarray:
    """Per group (``gid`` sorted): the index of its first true flag, -1 when none."""
    out = np.full(num_groups, -1, dtype="int64")
    idx = np.flatnonzero(flags)
    groups, first = np.unique(gid[idx], return_index=True)
    out[groups] = idx[first]
    return out


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
    order = np.lexsort((group, step, rank))
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
        elif _cpu_quota_held(s) or _core_shared(s):
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


@dataclass(frozen=True)
class LinkedRanks:
    """Pairs of ranks that share a process group or a p2p link, asked with ``frozenset((a, b)) in links`` (as of a
    set of such pairs) without listing every pair of a large group (a 128-rank group has 8,128)."""

    groups_of: dict[int, frozenset[str]]
    """rank -> the member lists (``pg_ranks``) of the groups it belongs to."""
    p2p: frozenset[frozenset[int]]
    """Pairs of ranks linked by a send/recv."""

    def __contains__(self, pair: object) -> bool:
        ranks = tuple(pair) if isinstance(pair, frozenset) else ()
        if len(ranks) != 2:
            return False
        a, b = ranks
        return pair in self.p2p or not self.groups_of.get(a, frozenset()).isdisjoint(self.groups_of.get(b, ()))


def linked_ranks(collectives: pd.DataFrame) -> LinkedRanks:
    """Pairs of ranks that share a process group or a p2p link (a delay on one propagates to the other)."""
    groups_of: dict[int, set[str]] = {}
    if collectives.empty:
        return LinkedRanks({}, frozenset())
    for pg_ranks in collectives["pg_ranks"].dropna().unique():
        members = group_members(pg_ranks)
        if len(members) > 1:
            for r in members:
                groups_of.setdefault(r, set()).add(str(pg_ranks))
    p2p = collectives[collectives["op"].isin(P2P_OPS) & collectives["peer"].notna()]
    pairs = {frozenset((int(a), int(b))) for a, b in p2p[["rank", "peer"]].drop_duplicates().itertuples(index=False)
             if int(a) != int(b)}
    return LinkedRanks({r: frozenset(g) for r, g in groups_of.items()}, frozenset(pairs))


PIPELINE_ORIGIN_COLUMNS = ["rank", "pipeline", "stage_excess_frac", "stage_excess_rel", "stage_excess_t",
                           "peer_stage_excess_t", "confirmed"]


def pipeline_origin_scores(stage: pd.DataFrame, first_step: int, last_step: int, *,
                           min_lateness_frac: float = 0.05, min_t: float = MIN_STEADY_T) -> pd.DataFrame:
    """Per pipelined rank over steps ``first_step``..``last_step`` of ``stage`` (``pipeline_delay.stage_excess``):
    the mean excess of its own time on its stage over the same stage of the other pipelines
    (``stage_excess_frac``, share of the step; ``stage_excess_rel``, share of the other pipelines' own time on
    the stage), that mean over its standard error (``stage_excess_t``; the error from the larger of its own spread
    and the largest of the other ranks' in the same steps: the run's own noise), and the largest such t among the
    other ranks of any stage (``peer_stage_excess_t``). ``confirmed``: its own time stands out beyond that noise
    as the steady view judges lateness, with the stage's time in the place of the step (a stage is a share of
    the step: a rank computing 10% slower on a stage that is half the step is 5% of the step later): a mean
    excess of at least ``min_lateness_frac`` and ``MIN_STEADY_EXCESS_FRAC`` of the stage's time, ``min_t``
    standard errors above zero and ``MIN_STEADY_T_OVER_PEERS`` x any other rank's (when the host slows a whole
    pipeline's ranks alike, none of them is singled out). Columns: ``PIPELINE_ORIGIN_COLUMNS``."""
    w = stage[stage["step"].between(first_step, last_step)].dropna(subset=["own_excess_frac"])
    if w.empty:
        return pd.DataFrame({col: [] for col in PIPELINE_ORIGIN_COLUMNS})
    g = w.groupby("rank")
    out = pd.DataFrame({"pipeline": g["pipeline"].first(), "stage_excess_frac": g["own_excess_frac"].mean(),
                        "stage_excess_rel": g["own_excess_rel"].mean(), "sd": g["own_excess_frac"].std(),
                        "k": g["own_excess_frac"].count()})
    mean, sd = out["stage_excess_frac"].to_numpy(), out["sd"].to_numpy(dtype="float64")
    other_sd = _max_of_others(sd)
    t = _t_of_count(mean, out["k"].to_numpy(), np.fmax(sd, other_sd))
    out["stage_excess_t"], out["peer_stage_excess_t"] = t, _max_of_others(t)
    rel = out["stage_excess_rel"].to_numpy(dtype="float64")
    out["confirmed"] = ((rel >= max(min_lateness_frac, MIN_STEADY_EXCESS_FRAC)) & (t >= min_t)
                        & ~(t < MIN_STEADY_T_OVER_PEERS * np.maximum(out["peer_stage_excess_t"].to_numpy(), 0)))
    return out.reset_index()[PIPELINE_ORIGIN_COLUMNS]


def _max_of_others(x: np.ndarray) -> np.ndarray:
    """Per element: the largest of the other elements, NaN ignored (NaN when there is none)."""
    v = np.where(np.isnan(x), -np.inf, x)
    if len(v) < 2:
        return np.full(len(v), np.nan)
    top = np.argsort(-v, kind="stable")[:2]
    out = np.full(len(v), v[top[0]])
    out[top[0]] = v[top[1]]
    return np.where(np.isneginf(out), np.nan, out)


class _PipelineJudge:
    """``pipeline_origin_scores`` of a run's ``stage_excess`` rows, per window on first use: who shares a pipeline,
    and whose own time on its stage is confirmed slower than its stage's in the other pipelines."""

    def __init__(self, stage: pd.DataFrame, *, min_lateness_frac: float) -> None:
        self._stage, self._min_lateness_frac = stage, min_lateness_frac
        self._pipeline = dict(zip(stage["rank"].astype("int64"), stage["pipeline"].astype("int64")))
        self._scores: dict[tuple[int, int], pd.DataFrame] = {}

    def same_pipeline(self, a: int, b: int) -> bool:
        return a in self._pipeline and self._pipeline[a] == self._pipeline.get(b)

    def peers(self, rank: int) -> list[int]:
        """The other ranks of ``rank``'s pipeline."""
        return sorted(r for r, p in self._pipeline.items() if r != rank and p == self._pipeline.get(rank))

    def figures(self, rank: int, first_step: int, last_step: int) -> dict | None:
        """``rank``'s row of ``pipeline_origin_scores`` over the window, as a dict; None when it has none."""
        key = (int(first_step), int(last_step))
        if key not in self._scores:
            self._scores[key] = pipeline_origin_scores(self._stage, *key, min_lateness_frac=self._min_lateness_frac
                                                       ).set_index("rank")
        scores = self._scores[key]
        return scores.loc[rank].to_dict() if rank in scores.index else None

    def confirmed(self, rank: int, first_step: int, last_step: int) -> bool:
        fig = self.figures(rank, first_step, last_step)
        return fig is not None and bool(fig["confirmed"])

    def first_confirmed(self, window_steps: int) -> dict[int, tuple[int, int]]:
        """rank -> the first window of ``window_steps`` steps (sliding by one; the whole run when shorter) over
        which its own time on its stage is confirmed slower than the other pipelines' (``pipeline_origin_scores``):
        the stage view, which finds a slow pipeline rank that no arrival shows late (the dp all-reduces couple the
        pipelines, so both ranks of a stage arrive together at theirs)."""
        steps = np.unique(self._stage["step"].to_numpy(dtype="int64"))
        if len(steps) == 0:
            return {}
        w = max(1, min(int(window_steps), len(steps)))
        found: dict[int, tuple[int, int]] = {}
        for end in range(w - 1, len(steps)):
            first, last = int(steps[end - w + 1]), int(steps[end])
            for rank in self._pipeline:
                if rank not in found and self.confirmed(rank, first, last):
                    found[rank] = (first, last)
        return found

    def culprit(self, ranks: Iterable[int], first_step: int, last_step: int) -> int | None:
        """Of ``ranks``, the one confirmed slower over the window with the largest ``stage_excess_t``; None if none."""
        found = [(self.figures(r, first_step, last_step)["stage_excess_t"], r) for r in ranks
                 if self.confirmed(r, first_step, last_step)]
        return max(found)[1] if found else None


def detect_stragglers(scores: pd.DataFrame, causes: pd.DataFrame, *, links: Container[frozenset[int]] = frozenset(),
                      min_lateness_frac: float = 0.05, min_positive_frac: float = 0.8, min_steps: int = 3,
                      min_window_s: float = MIN_WINDOW_S, critical_wait_frac: float = 0.2,
                      injected: dict[int, dict] | None = None,
                      lateness: pd.DataFrame | None = None,
                      axis_of_pg: Callable[[str], str | None] = axis_of,
                      skip_axes: tuple[str, ...] = ("pp",),
                      own_delay_ns: dict[int, float] | None = None,
                      min_lateness_over_noise: float = MIN_LATENESS_OVER_NOISE,
                      min_pre_excess_over_noise: float = MIN_PRE_EXCESS_OVER_NOISE,
                      min_pre_excess_t: float = MIN_PRE_EXCESS_T,
                      min_pre_excess_t_over_peers: float = MIN_PRE_EXCESS_T_OVER_PEERS,
                      min_persistent_pre_over_noise: float = MIN_PERSISTENT_PRE_OVER_NOISE,
                      min_steady_t: float = MIN_STEADY_T,
                      slow_link_ranks: dict[int, int] | None = None,
                      group_clock: dict[tuple[str, str], str] | None = None,
                      stage_excess: pd.DataFrame | None = None,
                      schedule_gain: Callable[[int, int, int], float | None] | None = None,
                      cpu_busy: pd.DataFrame | None = None, host_compute: bool = False) -> list[Finding]:
    """STRAGGLER for each rank whose median lateness over some window is at least ``min_lateness_frac`` of the step
    and which arrived after its peers' median in at least ``min_positive_frac`` of that window's steps (and the
    window has ``min_steps`` steps or more and spans ``min_window_s`` seconds of its mean step: a run shorter
    than that is not judged), or whose data+fwd time exceeds its peers' by that share in that
    many steps while its median lateness passes (arrivals jitter more than phases on busy hosts); only the latest
    such rank of a group (the others are its victims).
    Of two flagged ranks of one pipeline, when ``stage_excess`` (``pipeline_delay.stage_excess``) is given: the
    one whose cause is communication is the victim of the other; of two late by their own time, the one whose
    own time on its stage is confirmed longer than the same stage's in the other pipelines
    (``pipeline_origin_scores`` over its window: beyond the run's noise) is the origin, and when neither is, the
    one reported (by the rule below) is at most ``info`` (``pipeline_origin`` ``unconfirmed``: the host slowed
    both alike, or the origin is not known). A flagged rank whose cause is communication and whose origin is not
    found so is followed upstream: the pipeline peer confirmed slower on its stage in the victim's window is
    named (cause compute; ``detected_by`` ``via_victim`` from its judged group's row when no view named it).
    Else, of two flagged ranks sharing a group or p2p link, the victim (the delay propagated to it) is the one
    with the smaller median pipeline ``own_delay_ns`` (rank -> ns, from ``pipeline_own_delay``) when both are
    known, else the earlier of the two in every judged group they share (``_later_in_shared_groups``), else the
    one whose cause is communication: it is reported inside the culprit's finding, not as its own. A flagged rank
    earlier than an unflagged one in every group they share, while that one is late in its own group, is such a
    victim too: the later rank is reported (``detected_by`` ``via_victim``, ``_with_culprits_of_victims``).
    Critical when the victims wait ``critical_wait_frac`` of the step or more; ``info`` when its cause is
    communication (it waited on others: a victim whose culprit was not found). ``axis_of_pg`` maps a process
    group name to ``dp``/``tp``/``pp``; groups of ``skip_axes`` are not judged (in a pipeline group the arrival
    order follows the schedule: the first stage finishes its last backward last; a slow stage shows up as
    stage imbalance in PIPELINE_BUBBLE and as a straggler of its dp group).
    Noise rule (when ``scores`` has ``NOISE_COLUMNS``): the arrival view also needs the median lateness to be at
    least ``min_lateness_over_noise`` x the peers' lateness noise in the same window, the phases view the median
    data+fwd excess to be ``min_pre_excess_over_noise`` x the peers' excess noise, so a busy host's chance
    lateness is not a verdict; the persistence view (``_persistent``, with ``pre_excess_t`` in ``scores``) names a
    rank whose data+fwd excess is steady where the other views' noise hides it. ``slow_link_ranks`` (rank -> step
    a SLOW_LINK on its node began, ``links.slow_link_ranks``): a rank late in a window reaching that step is not
    blamed unless its cause is data or device (its lateness is the link's: the link's finding carries it).
    ``group_clock``: (pg, pg_ranks) -> the clock its arrivals were read on (``arrivals.arrival_clocks``), told in
    ``evidence.clock`` (``host`` when not given). ``stage_excess``: per (rank, step) of a pipelined run, its own
    time's excess over its stage's in the other pipelines (``pipeline_delay.stage_excess``); None or empty: the
    pipeline rules above are not applied. Predicted gain: the victims' mean wait per step time; for a pipelined
    rank, when ``schedule_gain`` (rank, first step, last step -> ns per step, ``pipeline_delay.schedule_gain_ns``,
    None where unknown) gives less over the window its stage was judged on, that: a wait the schedule does not put
    on the step's critical path is not a gain. Critical when the gain is ``critical_wait_frac`` or more.
    ``cpu_busy`` (``cpu_throttle.cpu_busy_per_step``): the rank's and its peers' CPU use per step over the window,
    in evidence; with ``host_compute`` (the ranks compute on the CPU), a rank late by compute while its process used
    no more CPU than its peers (``OFF_CPU_SHARE_OF_LATENESS``) is said to be off the CPU (``off_cpu``), with advice
    to find what it waits for."""
    require_columns(scores, SCORE_COLUMNS, table="straggler_scores")
    if scores.empty:
        return []
    scores = scores.loc[np.array([axis_of_pg(pg) not in skip_axes for pg in scores["pg"]], dtype=bool)]
    by_arrival = scores["positive_frac"] >= min_positive_frac
    by_phases = (scores["median_pre_excess_frac"].fillna(-1) >= min_lateness_frac) & (
        scores["pre_positive_frac"] >= min_positive_frac)
    if "lateness_over_noise" in scores:                         # NaN (noise unknown) does not block
        by_arrival &= ~(scores["lateness_over_noise"] < min_lateness_over_noise)
        by_phases &= ~(scores["pre_excess_over_noise"] < min_pre_excess_over_noise)
    ok = (scores["median_lateness_frac"] >= min_lateness_frac) & (by_arrival | by_phases)

    def col(name: str) -> np.ndarray:
        return scores[name].to_numpy(dtype="float64", na_value=np.nan)
    if "pre_excess_t" in scores:
        ok |= pd.Series(_persistent(
            col("median_lateness_frac"), col("median_pre_excess_frac"), col("pre_excess_t"),
            col("peer_pre_excess_t"), col("pre_excess_over_noise"),
            *(col(c) if c in scores else np.full(len(scores), np.nan)
              for c in ("mean_excess_frac", "excess_positive_frac", "median_comm_excess_frac")),
            min_lateness_frac=min_lateness_frac,
            min_t=min_pre_excess_t, min_t_over_peers=min_pre_excess_t_over_peers,
            min_over_noise=min_persistent_pre_over_noise), index=scores.index)
    if "excess_t" in scores:
        ok |= pd.Series(_steady(
            col("mean_excess_frac"), col("excess_positive_frac"), col("excess_t"), col("peer_excess_t"),
            min_lateness_frac=min_lateness_frac, min_t=min_steady_t), index=scores.index)
    if "cpu_throttled_frac" in scores:
        ok |= pd.Series(_cpu_throttled(
            col("mean_excess_frac"), col("excess_positive_frac"), col("excess_t"), col("peer_excess_t"),
            col("cpu_throttled_frac"), col("peer_cpu_throttled_frac"),
            col("step_stall_frac") if "step_stall_frac" in scores else np.full(len(scores), np.nan),
            min_lateness_frac=min_lateness_frac),
            index=scores.index)
    if "peer_idle_frac" in scores:
        unknown = np.full(len(scores), np.nan)
        ok |= pd.Series(_core_taken(col("cpu_wait_frac"), col("peer_cpu_wait_frac"), col("peer_idle_frac"))
                        & ~held_by_quota(*(col(c) if c in scores else unknown
                                            for c in ("cpu_throttled_frac", "peer_cpu_throttled_frac"))),
                        index=scores.index)
    long_enough = ~(scores["window_steps"] * scores["mean_step_ns"].astype("float64") < min_window_s * 1e9)
    flagged = scores[ok & (scores["window_steps"] >= min_steps) & long_enough]
    judge = (_PipelineJudge(stage_excess, min_lateness_frac=min_lateness_frac)
             if stage_excess is not None and not stage_excess.empty else None)
    by_stage = _stage_view_rows(scores, judge, min_steps=min_steps) if judge is not None else {}
    if flagged.empty and not by_stage:
        return []
    flagged = flagged.sort_values(["median_lateness_frac"], ascending=False)
    flagged = flagged.drop_duplicates(["pg", "pg_ranks"])      # one culprit per group: the latest
    best = flagged.drop_duplicates("rank")                      # one entry per rank: its worst group
    # the verdict on a rank was available once it was the culprit of any of its groups (a CPU quota can show in
    # its dp group's throttle view 20 steps before its tp group's lateness is the larger), or once the stage view
    # confirmed it (which names it alone when no arrival view does)
    first_flagged = {int(r): int(v) for r, v in flagged.groupby("rank")["detected_at_step"].min().dropna().items()}
    for rank, (_, (_, last)) in by_stage.items():
        first_flagged[rank] = min(first_flagged.get(rank, last), last)
    cause_of = {(c.pg, c.pg_ranks, c.rank): c for c in causes.itertuples(index=False)}
    later = _later_in_shared_groups(scores)
    best = _with_culprits_of_victims(best, scores, later, min_lateness_frac=min_lateness_frac)
    flagged_ranks = {int(r) for r in best["rank"]}
    new_by_stage = [row for rank, (row, _) in by_stage.items() if rank not in flagged_ranks]
    if new_by_stage:
        best = pd.concat([best, pd.DataFrame(new_by_stage)[best.columns]], ignore_index=True)
    # rank -> the window its own stage time was judged over; rank -> how it was found the origin of its late
    # pipeline peers (every rank of the stage view is in best now, flagged by another view or added above)
    stage_window: dict[int, tuple[int, int]] = {rank: window for rank, (_, window) in by_stage.items()}
    origin_how: dict[int, str] = dict.fromkeys(by_stage, "confirmed")
    ranks = set(int(r) for r in best["rank"])
    own = own_delay_ns or {}
    best_of = {int(b.rank): b for b in best.itertuples(index=False)}

    def waited(rank: int) -> bool:
        """Its lateness is explained by waiting on other ranks (cause communication)."""
        b = best_of[rank]
        c = cause_of.get((b.pg, b.pg_ranks, b.rank))
        return c is not None and c.cause == "communication"

    def stage_confirmed(rank: int) -> bool:
        b = best_of[rank]
        return judge.confirmed(rank, *stage_window.get(rank, (b.window_first_step, b.window_last_step)))

    propagated: dict[int, list[int]] = {}
    upstream_of = {}                    # a culprit named through a victim -> the victim's score row (its title)
    for row in best.itertuples(index=False):
        c = cause_of.get((row.pg, row.pg_ranks, row.rank))
        for r in ranks:
            if r == row.rank or frozenset((r, row.rank)) not in links:
                continue
            if judge is not None and judge.same_pipeline(r, int(row.rank)):
                # Both late, in one pipeline: either may be late only because it waited on the other. The one
                # whose lateness is its waits is the victim; of two late by their own time, the one whose own
                # time on its stage stands out of the other pipelines' (beyond the run's noise) is the origin;
                # when neither does (the host slowed both alike), the one reported is at most info.
                if waited(int(row.rank)) and not waited(r):
                    propagated.setdefault(r, []).append(int(row.rank))
                    origin_how.setdefault(r, "victim_waits")
                    if best_of[r].detected_by == "stage":        # told through its victim's lateness
                        upstream_of.setdefault(r, row)
                    continue
                if waited(int(row.rank)) or waited(r):
                    continue                     # the other way round, or both waited: each is followed upstream
                if stage_confirmed(r) and not stage_confirmed(int(row.rank)):
                    propagated.setdefault(r, []).append(int(row.rank))
                    origin_how[r] = "confirmed"
                    continue
                if stage_confirmed(int(row.rank)):
                    continue
                origin_how.setdefault(r, "unconfirmed")
                origin_how.setdefault(int(row.rank), "unconfirmed")
            if row.rank in own and r in own:
                # Both late and linked (same pipeline): the one idle outside its actions longer is the origin.
                if own[r] > own[row.rank]:
                    propagated.setdefault(r, []).append(int(row.rank))
            elif later.get((r, int(row.rank))):
                # r arrives later than row.rank in every group they share (their TP group): row.rank waits on r
                # there, and its lateness in its own other group is r's. A slowdown inside r's collectives (a CPU
                # quota freezing r's communication thread) shows as no arrival wait, so the cause cannot tell.
                propagated.setdefault(r, []).append(int(row.rank))
            elif c is not None and c.cause == "communication":
                propagated.setdefault(r, []).append(int(row.rank))
    if judge is not None:
        # A rank late only because it waited on its pipeline peers and whose origin no rule above found: the blame
        # follows upstream to the peer whose own time on its stage is confirmed slower in the victim's window.
        victims = {v for vs in propagated.values() for v in vs}
        for row in list(best.itertuples(index=False)):
            rank = int(row.rank)
            if not waited(rank) or rank in victims or rank in propagated:
                continue
            culprit = judge.culprit(judge.peers(rank), row.window_first_step, row.window_last_step)
            if culprit is None:
                continue
            if culprit not in best_of:          # named by no view: reported from its judged group's row
                top = _culprit_row(scores, culprit, row)
                if top is None:
                    continue
                best = pd.concat([best, pd.DataFrame([top])[best.columns]], ignore_index=True)
                best_of[culprit] = next(best.iloc[[-1]].itertuples(index=False))
                upstream_of[culprit] = row
            propagated.setdefault(culprit, []).append(rank)
            origin_how[culprit] = "confirmed"
            stage_window[culprit] = (int(row.window_first_step), int(row.window_last_step))
    victims_of_others = {v for vs in propagated.values() for v in vs}
    behind_link = slow_link_ranks or {}
    findings = []
    for row in best.itertuples(index=False):
        if row.rank in victims_of_others and row.rank not in propagated:
            continue
        c = cause_of.get((row.pg, row.pg_ranks, row.rank))
        cause = c.cause if c is not None else "unknown"
        how = origin_how.get(int(row.rank))
        if how == "confirmed" and cause in ("communication", "unknown"):
            cause = "compute"            # its own time on its stage is longer: not a wait, whatever its arrivals say
        first, last = stage_window.get(int(row.rank), (int(row.window_first_step), int(row.window_last_step)))
        stage_fig = judge.figures(int(row.rank), first, last) if judge is not None else None
        pipeline_victims = sorted(v for v in propagated.get(int(row.rank), [])
                                  if judge is not None and judge.same_pipeline(v, int(row.rank)))
        if (int(row.rank) in behind_link and row.window_last_step >= behind_link[int(row.rank)]
                and cause not in ("data", "device")):
            continue
        axis = axis_of_pg(row.pg)
        wait_frac = row.mean_victims_wait_ns / row.mean_step_ns if row.mean_step_ns else 0.0
        quota_held, core_shared = _cpu_quota_held(row), _core_shared(row)
        # frozen by its quota inside collectives it had reached, the rank made its peers wait there, not for its
        # arrival: the job's loss is its steps' stall
        stall = _opt_float(getattr(row, "step_stall_frac", None)) if quota_held else None
        if stall is not None and not _stalled(np.float64(stall), np.float64(row.cpu_throttled_frac),
                                              min_lateness_frac=min_lateness_frac):
            stall = None
        sched = schedule_gain(int(row.rank), first, last) if schedule_gain is not None else None
        sched_frac = sched / row.mean_step_ns if sched is not None and row.mean_step_ns else None
        lost_frac = wait_frac if stall is None else max(wait_frac, stall)
        if _core_taken_row(row):        # its peers sat idle while it waited for its core: that is the job's loss
            lost_frac = max(lost_frac, min(row.cpu_wait_frac - row.peer_cpu_wait_frac, row.peer_idle_frac))
        gain_frac = min(max(lost_frac if sched_frac is None else min(lost_frac, sched_frac), 0.0), 1.0)
        members = list(group_members(row.pg_ranks))
        evidence = {
            "rank": int(row.rank), "pg": row.pg, "pg_ranks": members, "victims": [m for m in members if m != row.rank],
            "clock": (group_clock or {}).get((row.pg, row.pg_ranks), HOST),
            "steps_analyzed": int(row.num_steps), "window": [int(row.window_first_step), int(row.window_last_step)],
            "window_steps": int(row.window_steps),
            "median_lateness_frac": row.median_lateness_frac, "positive_frac": row.positive_frac,
            "median_pre_excess_frac": None if pd.isna(row.median_pre_excess_frac) else row.median_pre_excess_frac,
            "pre_positive_frac": row.pre_positive_frac, "detected_by": row.detected_by,
            "last_frac": row.last_frac, "mean_lateness_ms": ms(row.mean_lateness_ns),
            "victims_mean_wait_ms": ms(row.mean_victims_wait_ns), "step_time_ms": ms(row.mean_step_ns),
            "victims_wait_frac": wait_frac,
            "detected_at_step": _first_step(row.detected_at_step, first_flagged.get(int(row.rank))),
            "cause": cause,
            "cause_excess_ms": {
                "data": ms(c.data_excess_ns) if c is not None else None,
                "compute": ms(c.compute_excess_ns) if c is not None else None,
                "communication": ms(c.comm_excess_ns) if c is not None else None,
            },
            "throttled_frac": (None if c is None or pd.isna(c.throttled_frac) else float(c.throttled_frac)),
            "noise_frac": _opt_float(getattr(row, "noise_frac", None)),
            "lateness_over_noise": _opt_float(getattr(row, "lateness_over_noise", None)),
            "phase_noise_frac": _opt_float(getattr(row, "phase_noise_frac", None)),
            "pre_excess_over_noise": _opt_float(getattr(row, "pre_excess_over_noise", None)),
            "pre_excess_t": _opt_float(getattr(row, "pre_excess_t", None)),
            "peer_pre_excess_t": _opt_float(getattr(row, "peer_pre_excess_t", None)),
            "mean_excess_frac": _opt_float(getattr(row, "mean_excess_frac", None)),
            "excess_positive_frac": _opt_float(getattr(row, "excess_positive_frac", None)),
            "excess_t": _opt_float(getattr(row, "excess_t", None)),
            "peer_excess_t": _opt_float(getattr(row, "peer_excess_t", None)),
            "median_comm_excess_frac": _opt_float(getattr(row, "median_comm_excess_frac", None)),
            "cpu_throttled_frac": _opt_float(getattr(row, "cpu_throttled_frac", None)),
            "peer_cpu_throttled_frac": _opt_float(getattr(row, "peer_cpu_throttled_frac", None)),
            "step_stall_frac": stall,
            "cpu_wait_frac": _opt_float(getattr(row, "cpu_wait_frac", None)),
            "peer_idle_frac": _opt_float(getattr(row, "peer_idle_frac", None)),
            "peer_cpu_wait_frac": _opt_float(getattr(row, "peer_cpu_wait_frac", None)),
            "propagated_to": sorted(propagated.get(int(row.rank), [])),
            "injected": (injected or {}).get(int(row.rank)),
            "pipeline_origin": how,
            "stage_window": None if stage_fig is None else [first, last],
            "stage_excess_frac": None if stage_fig is None else _opt_float(stage_fig["stage_excess_frac"]),
            "stage_excess_rel": None if stage_fig is None else _opt_float(stage_fig["stage_excess_rel"]),
            "stage_excess_t": None if stage_fig is None else _opt_float(stage_fig["stage_excess_t"]),
            "peer_stage_excess_t": None if stage_fig is None else _opt_float(stage_fig["peer_stage_excess_t"]),
            "schedule_gain_frac": _opt_float(sched_frac),
        }
        evidence_rows = None
        if lateness is not None:
            evidence_rows = lateness[(lateness["pg"] == row.pg) & (lateness["pg_ranks"] == row.pg_ranks)]
        # A rank late only because it waited on others (p2p, other groups) is a victim whose culprit no view
        # named (e.g. a pipeline stage waiting on a slowed upstream stage), and of a late pipeline whose ranks
        # none stands out from the other pipelines' the origin is not known: told, as info, not blamed.
        passed = (_episode_passed(evidence_rows, row, min_lateness_frac=min_lateness_frac, min_window_s=min_window_s)
                  if row.detected_by == "arrival" else None)
        evidence["passed"] = passed
        severity = ("info" if cause == "communication" or how == "unconfirmed" or passed else
                    "critical" if gain_frac >= critical_wait_frac else "warning")
        busy, peer_busy = _busy_figures(cpu_busy, int(row.rank), members, int(row.window_first_step),
                                        int(row.window_last_step))
        late_frac = row.mean_lateness_ns / row.mean_step_ns if row.mean_step_ns else None
        off_cpu = None
        if host_compute and busy is not None and late_frac is not None and late_frac > 0 and cause == "compute" \
                and not quota_held and not core_shared:
            wait, peer_wait = (_opt_float(getattr(row, c, None)) for c in WAIT_SCORE_COLUMNS)
            waited = max(0.0, wait - peer_wait) if wait is not None and peer_wait is not None else 0.0
            off_cpu = bool(busy - peer_busy + waited < OFF_CPU_SHARE_OF_LATENESS * late_frac)
        fwd_excess, bwd_excess, _ = _phase_excess(c) if c is not None else (None, None, None)
        outside = (_outside_phases(c) if c is not None and cause == "compute" and how is None and not quota_held
                   and not core_shared else None)
        evidence.update(cpu_busy_frac=busy, peer_cpu_busy_frac=peer_busy, off_cpu=off_cpu,
                        forward_excess_ms=ms(fwd_excess), backward_excess_ms=ms(bwd_excess), outside_phases=outside)
        findings.append(Finding(
            code="STRAGGLER",
            severity=severity,
            ranks=(int(row.rank),), group=axis,
            title=(_stage_phrase(int(row.rank), stage_fig, first, last, pipeline_victims, how)
                   + (_arrival_phrase(upstream_of[int(row.rank)], axis_of_pg) + f"; cause: {cause}"
                      if int(row.rank) in upstream_of else
                      f"its stage-mates meet it in its {group_phrase(axis or row.pg, members)}; cause: {cause}"
                      if row.detected_by == "stage" and stage_fig is not None else
                   (f"rank {row.rank} holds up its {group_phrase(axis or row.pg, members)}: its peers sat idle "
                    f"{row.peer_idle_frac:.0%} of the time over steps {row.window_first_step}-{row.window_last_step}, "
                    f"waiting for it (its arrivals: {_lateness_phrase(row).replace(', later', '; later')})"
                    if row.detected_by == "cpu_wait" else
                    f"rank {row.rank} arrives late at its {group_phrase(axis or row.pg, members)} collectives: "
                    + _lateness_phrase(row))
                   + (f"; its data+fwd is {row.median_pre_excess_frac:.0%} of the step longer than its peers' "
                      f"(median, {row.pre_excess_t:.1f} standard errors)" if row.detected_by == "persistence" else "")
                   + (f"; on average {row.mean_excess_frac:.0%} of the step later than its group's median "
                      f"({row.excess_t:.1f} standard errors)" if row.detected_by in ("steady", "cpu_throttle")
                      else "")
                   + (f"; its CPU cgroup was throttled by its quota for {row.cpu_throttled_frac:.0%} of the time"
                      if quota_held else "")
                   + (f", and its group's steps stalled: {ms(row.mean_step_ns)} ms on average where the median "
                      f"step took {ms(row.mean_step_ns * (1 - stall))} ms (frozen inside collectives it had reached, "
                      f"it kept its peers waiting there)" if stall is not None else "")
                   + (f"; its main thread waited for a CPU {row.cpu_wait_frac:.0%} of the time (its peers at most "
                      f"{row.peer_cpu_wait_frac:.0%})" if core_shared else "")
                   + (f"; its process used {busy:.2f} cores' worth of CPU over the steps, its peers {peer_busy:.2f}: "
                      f"it was off the CPU, neither computing nor waiting for a core, for most of its lateness"
                      if off_cpu else "")
                   + _unconfirmed_phrase(stage_fig, how)
                   + (f"; its pipeline peer rank{'s' if len(pipeline_victims) > 1 else ''} "
                      f"{', '.join(map(str, pipeline_victims))} arrive{'' if len(pipeline_victims) > 1 else 's'} "
                      f"late only by waiting on it" if how == "victim_waits" and pipeline_victims else "")
                   + f"; cause: {cause}")
                   + _schedule_phrase(wait_frac, sched_frac)
                   + (f"; then no more: {passed['median_lateness_frac']:.0%} of the step (median) over its "
                      f"{passed['num_steps']} steps after (steps {passed['steps'][0]}-{passed['steps'][1]}), an "
                      f"episode that passed" if passed else "")),
            evidence=evidence,
            recommendation=straggler_advice(cause, int(row.rank), cpu_quota=quota_held, core_shared=core_shared,
                                            cpu_counted=_cpu_counted(row), off_cpu=bool(off_cpu),
                                            outside_phases=(ms(max(0.0, fwd_excess) + max(0.0, bwd_excess)),
                                                            ms(c.compute_excess_ns)) if outside else None),
            predicted_gain=PredictedGain(metric="step_time", frac=gain_frac),
            rows=evidence_rows,
        ))
    return findings


def _outside_phases(c) -> bool | None:
    """Whether a compute straggler's lateness (``compute_excess_ns`` of its ``straggler_causes`` row) lies outside
    its forward and backward. Its forward must be as its peers'. Where its peers' waits for it fall outside their
    phases (their unphased time, step minus data, fwd, bwd and opt, is at least half that lateness: as under ``dtprobe
    launch``), so must its backward's excess be (``PHASES_SHARE_OF_COMPUTE``). Where their phases span their steps,
    their backward holds their wait (DDP waits for the all-reduce inside it), and a rank slower in its backward alone
    has a backward as long as theirs: outside only when its own is shorter by half the lateness or more. None without
    a positive compute excess."""
    compute, fwd, bwd, unphased = c.compute_excess_ns, *_phase_excess(c)
    if not compute > 0 or pd.isna(fwd) or pd.isna(bwd):
        return None
    if fwd >= PHASES_SHARE_OF_COMPUTE * compute:
        return False
    if not pd.isna(unphased) and unphased >= 0.5 * compute:
        return bool(max(0.0, fwd) + max(0.0, bwd) < PHASES_SHARE_OF_COMPUTE * compute)
    return bool(bwd <= -0.5 * compute)


def _phase_excess(c) -> tuple[float, float, float]:
    """The ``PHASE_EXCESS_COLUMNS`` of a causes row (NaN where the frame has none)."""
    return tuple(float(getattr(c, col, np.nan)) for col in PHASE_EXCESS_COLUMNS)


def _episode_passed(lateness: pd.DataFrame | None, row, *, min_lateness_frac: float,
                    min_window_s: float) -> dict | None:
    """For a window the arrival view judged: the steps of the rank's group after it, when they show the lateness
    gone (a host's passing hiccup, not a slow rank): at least as many steps as the window, spanning ``min_window_s``,
    whose median lateness is below ``min_lateness_frac`` and half the window's. ``{steps, num_steps,
    median_lateness_frac}``, else None (also when the run ends too soon after the window to tell)."""
    if lateness is None or lateness.empty:
        return None
    after = lateness[(lateness["rank"] == row.rank) & (lateness["step"] > row.window_last_step)]
    values = after["lateness_frac"].to_numpy(dtype="float64", na_value=np.nan)
    values = values[~np.isnan(values)]
    if len(values) < max(int(row.window_steps), 1) or not row.mean_step_ns > 0 \
            or len(values) * float(row.mean_step_ns) < min_window_s * 1e9:
        return None
    median = float(np.median(values))
    if median >= min(min_lateness_frac, 0.5 * float(row.median_lateness_frac)):
        return None
    steps = after["step"].to_numpy(dtype="int64")
    return {"steps": [int(steps.min()), int(steps.max())], "num_steps": int(len(values)),
            "median_lateness_frac": median}


def _first_step(*steps) -> int | None:
    """The earliest of the known steps (None and NA left out), None when none is known."""
    known = [int(s) for s in steps if s is not None and not pd.isna(s)]
    return min(known) if known else None


def _schedule_phrase(wait_frac: float, sched_frac: float | None) -> str:
    """What the pipeline schedule gives back of the victims' wait, when it is visibly less (else empty)."""
    if sched_frac is None or round(100 * sched_frac) >= round(100 * wait_frac):
        return ""
    return (f"; its peers wait {wait_frac:.0%} of the step for it, but with the pipeline's schedule and the other "
            f"stages' times the step would be only {max(sched_frac, 0.0):.0%} shorter without it")


def _stage_phrase(rank: int, fig: dict | None, first: int, last: int, victims: list[int], how: str | None) -> str:
    """The title's opening for a rank confirmed the origin of its late pipeline peers (``victims``) by its own time
    on its stage (``pipeline_origin_scores`` figures ``fig`` over steps ``first``..``last``); empty otherwise."""
    if how != "confirmed" or fig is None:
        return ""
    waiting = ", ".join(str(v) for v in victims)
    return (f"rank {rank}'s own time on its pipeline stage is {fig['stage_excess_rel']:.0%} longer "
            f"({fig['stage_excess_frac']:.0%} of the step) than the same stage's in the other pipelines "
            f"({fig['stage_excess_t']:.1f} standard errors, steps "
            f"{first}-{last})" + (f", and its pipeline peer rank{'s' if len(victims) > 1 else ''} {waiting} "
                                  f"wait{'' if len(victims) > 1 else 's'} on it" if victims else "") + "; ")


def _arrival_phrase(victim, axis_of_pg: Callable[[str], str | None]) -> str:
    """How the ``victim`` (a score row) of a culprit named by no view of its own arrives late."""
    axis = axis_of_pg(victim.pg)
    return (f"rank {victim.rank} arrives late at its {group_phrase(axis or victim.pg, group_members(victim.pg_ranks))} "
            f"collectives: " + _lateness_phrase(victim))


def _lateness_phrase(row) -> str:
    """A score row's lateness over its window: the mean in ms and the median as a share of the step, said apart
    (a lateness in bursts, e.g. a CPU quota's, has a mean far above its median), and how often it came late."""
    return (f"+{ms(row.mean_lateness_ns)} ms on average (median {row.median_lateness_frac:.0%} of the step), later "
            f"than its peers in {row.positive_frac:.0%} of steps {row.window_first_step}-{row.window_last_step}")


def _unconfirmed_phrase(fig: dict | None, how: str | None) -> str:
    """The title's note on a rank of a late pipeline none of whose ranks stands out of the other pipelines."""
    if how != "unconfirmed" or fig is None:
        return ""
    return (f"; a rank of its pipeline is late with it and neither one's own time on its stage stands out of the "
            f"other pipelines' (its own {fig['stage_excess_frac']:+.0%} of the step, "
            f"{fig['stage_excess_t']:.1f} standard errors; another rank's {fig['peer_stage_excess_t']:.1f}): "
            f"the origin is not known")


def _culprit_row(scores: pd.DataFrame, rank: int, victim) -> pd.Series | None:
    """``rank``'s score row in its latest judged group (largest ``median_lateness_frac``), as a culprit found
    through its ``victim``'s score row: ``detected_by`` ``via_victim`` and the victim's ``detected_at_step``;
    None when it has no row."""
    own = scores[scores["rank"] == rank]
    if own.empty:
        return None
    top = own.sort_values("median_lateness_frac", ascending=False).iloc[0].copy()
    top["detected_by"], top["detected_at_step"] = "via_victim", victim.detected_at_step
    return top


def _stage_view_rows(scores: pd.DataFrame, judge: "_PipelineJudge", *, min_steps: int) -> dict[int, tuple]:
    """rank -> (its score row, the window) for each pipeline rank whose own time on its stage is confirmed slower
    than the same stage's in the other pipelines (``_PipelineJudge.first_confirmed``, first such window): the row
    of its judged group that holds ranks of other pipelines (where its stage-mates are), ``detected_by`` ``stage``
    and ``detected_at_step`` the window's last step."""
    if scores.empty:
        return {}
    found = judge.first_confirmed(int(scores["window_steps"].max()))
    out = {}
    for rank, (first, last) in found.items():
        if last - first + 1 < min_steps:
            continue
        own = scores[scores["rank"] == rank]
        across = own[[any(not judge.same_pipeline(m, rank) for m in group_members(g)) for g in own["pg_ranks"]]]
        if across.empty:
            continue
        top = across.sort_values("median_lateness_frac", ascending=False).iloc[0].copy()
        top["detected_by"], top["detected_at_step"] = "stage", last
        out[rank] = (top, (first, last))
    return out


def _with_culprits_of_victims(best: pd.DataFrame, scores: pd.DataFrame, later: dict[tuple[int, int], bool], *,
                              min_lateness_frac: float) -> pd.DataFrame:
    """``best`` plus, for each flagged rank that arrived before an unflagged rank in every group they share
    (``later``) while that rank is itself late in a group of its own (median lateness and mean excess >=
    ``min_lateness_frac``): that rank's latest such score row, ``detected_by`` ``via_victim`` and the victim's
    ``detected_at_step``. The flagged rank waited on it (inside their TP collectives) and is late only
    downstream of it; the victim rule then reports the flagged rank in its ``propagated_to``. A rank of the group
    the flagged rank was found late in is no such culprit: there both arrivals are measured at the same
    collectives, so the flagged rank's lateness is its own, not a wait passed on through another group (ranks of a
    shared core, or of a slow host, late together)."""
    flagged = set(int(r) for r in best["rank"])
    added: dict[int, pd.Series] = {}
    for row in best.itertuples(index=False):
        judged_with = set(group_members(row.pg_ranks))
        for (a, b), is_later in later.items():
            if b != int(row.rank) or not is_later or a in flagged or a in added or a in judged_with:
                continue
            own = scores[(scores["rank"] == a) & (scores["median_lateness_frac"] >= min_lateness_frac)]
            if "mean_excess_frac" in own:
                own = own[own["mean_excess_frac"] >= min_lateness_frac]
            if own.empty:
                continue
            top = own.sort_values("median_lateness_frac", ascending=False).iloc[0].copy()
            top["detected_by"], top["detected_at_step"] = "via_victim", row.detected_at_step
            added[a] = top
    if not added:
        return best
    return pd.concat([best, pd.DataFrame(list(added.values()))[best.columns]], ignore_index=True)


def _later_in_shared_groups(scores: pd.DataFrame) -> dict[tuple[int, int], bool]:
    """(a, b) -> True when rank a arrived later than rank b (larger ``mean_excess_frac``, else
    ``median_lateness_frac``) in every judged group both belong to, False when not in every one; pairs sharing no
    group are absent."""
    col = "mean_excess_frac" if "mean_excess_frac" in scores else "median_lateness_frac"
    known = scores[scores[col].notna().to_numpy(dtype=bool)]
    if known.empty:
        return {}
    gid = known.groupby(["pg", "pg_ranks"], sort=False).ngroup().to_numpy(dtype="int64")
    order = np.argsort(gid, kind="stable")
    gid = gid[order]
    rank = known["rank"].to_numpy(dtype="int64")[order]
    value = known[col].to_numpy(dtype="float64")[order]
    new = run_starts(gid)
    start, group = np.flatnonzero(new), np.cumsum(new) - 1
    size = np.diff(np.append(start, len(gid)))[group]           # per row: its group's size
    a = np.repeat(np.arange(len(gid)), size)                    # every ordered pair of rows of one group
    b = np.repeat(start[group], size) + np.arange(len(a)) - np.repeat(np.cumsum(size) - size, size)
    other = rank[a] != rank[b]
    a, b = a[other], b[other]
    width = int(rank.max()) + 1
    pair = rank[a] * width + rank[b]
    votes = pd.Series(value[a] > value[b]).groupby(pair).all()                        # later in every group
    first, second = np.divmod(votes.index.to_numpy(dtype="int64"), width)
    return dict(zip(zip(first.tolist(), second.tolist()), votes.tolist()))


def _cpu_quota_held(row) -> bool:
    """The score row's rank was held back by its cgroup's CPU quota in its window while its peers were not."""
    return quota_held(*(_opt_float(getattr(row, c, None)) for c in ("cpu_throttled_frac", "peer_cpu_throttled_frac")))


def _core_shared(row) -> bool:
    """The score row's rank's main thread waited for a CPU in its window clearly more than any peer's
    (``MIN_CPU_WAIT_EXCESS_FRAC``), enough to explain half its lateness (``CPU_WAIT_SHARE_OF_LATENESS``): something
    else ran on its core. The kernel counts time a CPU quota throttles a thread as run-queue wait too, so a rank
    its quota held back (``_cpu_quota_held``) is not called shared. Unknown (no host samples, no schedstat) is
    False."""
    wait, peer = (_opt_float(getattr(row, c, None)) for c in WAIT_SCORE_COLUMNS)
    if wait is None or peer is None or _cpu_quota_held(row):
        return False
    if _core_taken_row(row):
        return True
    late = _opt_float(getattr(row, "median_lateness_frac", None)) or 0.0
    return wait - peer >= max(MIN_CPU_WAIT_EXCESS_FRAC, CPU_WAIT_SHARE_OF_LATENESS * late)


def _core_taken_row(row) -> bool:
    """The score row's window passes the run-queue view (``_core_taken``) and its quota did not hold it back."""
    wait, peer, idle = (_opt_float(getattr(row, c, None)) for c in WAIT_SCORE_COLUMNS + IDLE_SCORE_COLUMNS)
    if wait is None or peer is None or idle is None or _cpu_quota_held(row):
        return False
    return bool(_core_taken(np.float64(wait), np.float64(peer), np.float64(idle)))


def _cpu_counted(row) -> bool:
    """The kernel's counts of the rank's lost CPU (quota throttling, run-queue wait) are known in its window."""
    return all(_opt_float(getattr(row, c, None)) is not None
               for c in ["cpu_throttled_frac", "peer_cpu_throttled_frac"] + WAIT_SCORE_COLUMNS)


def _opt_float(x) -> float | None:
    """``x`` as a float, None when missing or NaN (infinite stays: noise 0 with a late rank)."""
    return None if x is None or pd.isna(x) else float(x)


def _busy_figures(cpu_busy: pd.DataFrame | None, rank: int, members: list[int], first: int,
                  last: int) -> tuple[float | None, float | None]:
    """The rank's mean ``cpu_busy_frac`` over steps ``first``..``last`` and the median of its peers' (the other
    ``members``) over the same steps; (None, None) unless the rank and a peer have it for at least half the steps."""
    if cpu_busy is None or cpu_busy.empty:
        return None, None
    mine = cpu_busy[cpu_busy["step"].between(first, last) & cpu_busy["rank"].isin(members)]
    enough = mine.groupby("rank")["cpu_busy_frac"].agg(["mean", "size"])
    enough = enough[enough["size"] * 2 >= last - first + 1]["mean"]
    peers = enough.drop(rank, errors="ignore")
    if rank not in enough.index or peers.empty:
        return None, None
    return float(enough[rank]), float(peers.median())


def straggler_advice(cause: str, rank: int, *, cpu_quota: bool = False, core_shared: bool = False,
                     cpu_counted: bool = False, off_cpu: bool = False,
                     outside_phases: tuple[float, float] | None = None) -> str:
    """The recommendation of a STRAGGLER of ``cause``; ``outside_phases``: (its forward's and backward's excess,
    its compute excess) in ms when they explain little of it (``PHASES_SHARE_OF_COMPUTE``)."""
    if cause == "compute" and cpu_quota:
        return (f"Rank {rank}'s CPU cgroup hits its CPU quota (the kernel throttles it for part of every period): "
                f"raise or remove the CPU limit of its container (cpu.cfs_quota_us / cpu.max; Kubernetes "
                f"resources.limits.cpu), or move the other processes out of its cgroup.")
    if cause == "compute" and core_shared:
        return (f"Another process or thread runs on rank {rank}'s core and takes its CPU: find it (top -H, or "
                f"ps -eLo pid,tid,psr,pcpu,comm for the core), move it off the cores the ranks use or stop it, and "
                f"bind each rank to cores of its own (dtprobe run --cpu-bind auto, taskset or numactl).")
    if cause == "compute" and off_cpu:
        return (f"Rank {rank} is late without using more CPU than its peers: its process was off the CPU, not "
                f"computing slower, waiting for something outside the collectives (a sleep, a lock, file or network "
                f"I/O, another process). Find where its main thread waits (py-spy dump --pid <its pid>, or dtprobe "
                f"run --profile-steps A-B) and take that wait out of the step." + (
                    " Its forward and backward take about as long as its peers', so the wait is outside them: "
                    "most often between its optimizer step and its next forward, in code only this rank runs (if "
                    "rank == 0: around logging, a save or an upload)." if outside_phases else ""))
    if cause == "compute" and outside_phases:
        phases, compute = outside_phases
        return (f"Rank {rank}'s forward and backward take about as long as its peers' (+{phases:.1f} ms against "
                f"{compute:.1f} ms of lateness it causes itself), which a slower core or device, or a larger batch, "
                f"would lengthen too: it does work its peers do not, outside them. Most often that is between its "
                f"optimizer step and its next forward, in code only this rank runs: logging, metrics, an "
                f"evaluation, a save or an upload under if rank == 0: (or a callback or hook registered on it "
                f"alone). Run that work every N steps, in a background thread or process, or split it over the "
                f"ranks; dtprobe launch --profile-steps A-B shows what the rank runs there.")
    if cause == "compute" and cpu_counted:
        return (f"Rank {rank} computes slower than its peers, and the kernel's counts do not explain it (no CPU "
                f"quota held it back, and waiting for a CPU is not what makes it late): its core or device itself "
                f"runs slower (a VM's vCPU shared with other guests, a lower clock, a slower device) or it has more "
                f"work (sequence lengths, an uneven layer split). Compare its host with its peers' or move the rank.")
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
