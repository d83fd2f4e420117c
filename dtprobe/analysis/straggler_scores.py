"""The straggler scores: per (group, member rank), its lateness judged over sliding windows of steps against its
peers' noise (arrival, phases, persistence, steady, CPU-throttle and run-queue views), and the predicates that read
a score row; read by ``stragglers`` (the STRAGGLER detector), ``straggler_causes``, ``stage_trend`` and the facade.

A window qualifies a rank when its median lateness is a clear share of the step and it arrives after its peers in
most of the window's steps, and that lateness stands out of the run's own noise: how late its peers got in the same
window (``peer_noise``), since on a busy host any rank can be late for a dozen steps. The other views name what the
arrivals hide: a steady data+fwd excess (persistence), a steady mean excess (steady), the kernel's throttle count
(CPU quota) or run-queue wait (another process on the rank's core).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pandas as pd

from dtprobe.analysis.arrivals import LATENESS_COLUMNS, LATENESS_OPTIONAL
from dtprobe.analysis.score_memo import ScoreMemo, window_keys
from dtprobe.analysis.tables import group_codes
from dtprobe.lexsort import lexsort
from dtprobe.store.columns import require_columns

SCORE_COLUMNS = [
    "pg", "pg_ranks", "rank", "num_steps", "window_steps", "window_first_step", "window_last_step",
    "median_lateness_frac", "positive_frac", "median_pre_excess_frac", "pre_positive_frac", "last_frac",
    "mean_lateness_ns", "mean_victims_wait_ns", "mean_step_ns", "detected_at_step", "detected_by",
    "gain_first_step", "gain_last_step", "gain_victims_wait_ns", "gain_step_ns",
]
NOISE_COLUMNS = ["noise_frac", "lateness_over_noise", "phase_noise_frac", "pre_excess_over_noise", "pre_excess_t",
                 "peer_pre_excess_t", "mean_excess_frac", "excess_positive_frac", "excess_t", "peer_excess_t",
                 "median_comm_excess_frac", "peer_level_frac"]
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
LEVELLED_PEERS_SHARE = 0.5
"""Arrival view: where the median of the peers' lateness over the window (``peer_level_frac``) is at least this share
of their noise (``noise_frac``), the group is *levelled*: its members come late to their latest collective of most
steps themselves, as in a group whose members issue several collectives per step (tensor parallel, FSDP, DDP with
several buckets), where every member's worst lateness of a step is positive. There the noise, their 90th
percentile, holds that common level as well as their spread, and a slowed rank's lateness at its worst collective
is only the largest of its delays between two collectives (a tp rank computing 10% slower: about 5% of the step),
while its peers wait at each. So the arrival view asks ``LEVELLED_NOISE_SHARE`` of the noise multiple and
``LEVELLED_LATENESS_SHARE`` of ``min_lateness_frac`` there (``arrival_view``). In the windows of 172 clean
``benchmarks/verdicts.py`` runs the tp groups' share was 0.22-0.87; the other groups' (one collective per step)
reached 0.5 only for ranks that came early."""
LEVELLED_NOISE_SHARE = 0.6
"""Arrival view, levelled group: the share of ``min_lateness_over_noise`` asked (1.5 x the noise by default)."""
LEVELLED_LATENESS_SHARE = 0.8
"""Arrival view, levelled group: the share of ``min_lateness_frac`` asked of the median lateness (4% of the step by
default). No levelled window of the 172 clean runs above (52 of them dp2 x tp2) went above 2.8% median lateness or
1.32 x its noise, while the faulted rank of 28 dp2 x tp2 runs with a 10% slowdown reached 3.8-6.8% at 1.2-4.3 x
over the 20 steps after its fault: the arrival view named 9 of them within those steps at 5% and 2.5 x, all 28 at
4% and 1.5 x (docs/findings.md)."""
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
MIN_STAGE_T = 4.0
"""Stage view (``stragglers.pipeline_origin_scores``): a pipeline rank's mean excess of its own time on its stage
over the same stage's in the other pipelines must be at least this many standard errors above zero over the window
(``stage_excess_t``), besides ``MIN_STEADY_EXCESS_FRAC`` of the stage's time and ``MIN_STEADY_T_OVER_PEERS`` x
every other pipeline rank's t. Laxer than the steady view's ``MIN_STEADY_T``: a rank's own time on its stage holds
no wait for a peer and is measured against the same stage at the same step, so a host's slow spell that slows
every rank alike cancels out, and its excesses of neighbouring steps barely correlate (median lag-1
autocorrelation 0.0 on the runs below). On 90 clean dp2 x pp2 runs of a 2-core VM (7,200 windows of 20 steps) the
largest t was 3.3 and no window with a mean excess of 6% reached 2.8; over the 20 steps after a 10% slowdown's
start (29 runs) the slowed rank's t was 3.1 to 10.4, and a bound of 6 named a third of them later than 20 steps
after it, 4 all within 19."""

MIN_LATE_PIPELINE_T = 3.0
"""Stage view, in a late pipeline: a pipeline whose ranks arrive late at their dp groups (the mean over its ranks of
their lateness excess over their group's median, per step: ``pipeline_late_t``, its mean over its standard error
over the window) at least this many standard errors above zero holds its dp peers back, and one of its ranks is
the cause; its rank whose own time on its stage stands out from the other pipelines' by ``MIN_STEADY_EXCESS_FRAC``
of the stage's time, ``MIN_STAGE_T_IN_LATE_PIPELINE`` standard errors and ``MIN_STEADY_T_OVER_PEERS`` x every
other pipeline rank's t is named (where ``MIN_STAGE_T`` alone would wait for more steps). On 100 clean dp2 x pp2
runs of a 2-core VM no window had both: the 3 windows whose stage figures passed had a pipeline t of at most
2.2."""
MIN_STAGE_T_IN_LATE_PIPELINE = 2.5
"""Stage view, in a late pipeline (``MIN_LATE_PIPELINE_T``): the stage excess's t asked of the rank named."""

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
    lateness and the mean wait it imposed on peers; the same wait and the mean step over its qualifying window of
    median wait (the chosen one when none qualifies), steps ``gain_first_step``-``gain_last_step``
    (``gain_victims_wait_ns``, ``gain_step_ns``: what its fix would save, where the first window may straddle the
    fault's start). ``detected_at_step``: the last step of the first window with
    median lateness >= ``min_lateness_frac`` and positive share >= ``min_positive_frac`` (null if none).
    Medians ignore NaN (phases not recorded). ``noise_frac``: the run's own noise in that window, how late its
    peers got by chance (robust spread or 90th percentile of their lateness over the window, ``peer_noise``); the
    arrival view qualifies a window only when its median lateness is also at least ``min_lateness_over_noise`` x
    that noise (``lateness_over_noise``; less of both where the peers' own median lateness, ``peer_level_frac``,
    is a level the noise stands on: ``arrival_view``), the phases view only when the median data+fwd excess is
    at least ``min_pre_excess_over_noise`` x the peers' excess noise (``phase_noise_frac``,
    ``pre_excess_over_noise``); unknown noise does not block. The persistence view qualifies a window when the
    median data+fwd excess is at least ``min_lateness_frac``, ``min_pre_excess_t`` standard errors above zero
    (``pre_excess_t``), ``min_pre_excess_t_over_peers`` x the largest of its peers' (``peer_pre_excess_t``), at least
    ``min_persistent_pre_over_noise`` x the peers' excess noise, and the median lateness is positive. The steady
    view (``steady_view``) qualifies a window when the rank's mean lateness excess over the group's median is at least
    ``min_lateness_frac`` and ``MIN_STEADY_EXCESS_FRAC``, ``min_steady_t`` standard errors above zero and
    ``MIN_STEADY_T_OVER_PEERS`` x any peer's, positive in ``MIN_STEADY_POSITIVE_FRAC`` of the steps. With
    ``cpu_throttled`` (rank, step, cpu_throttled_frac: ``cpu_throttle.cpu_throttled_per_step``), the CPU-throttle
    view (``throttle_view``) qualifies a window when the rank's cgroup was throttled at least
    ``MIN_CPU_THROTTLED_FRAC`` of it while no peer's was a ``MAX_PEER_THROTTLED_SHARE`` of that, and its mean
    lateness excess is at least ``min_lateness_frac``, ``MIN_THROTTLED_T`` standard errors above zero and
    ``MIN_STEADY_T_OVER_PEERS`` x any peer's. Every window of every (group, rank) is scored at once (one
    windows x steps matrix), so the cost grows with the rows; with ``memo`` (``score_memo.ScoreMemo``: a live run
    scored again after a refresh) only the windows over steps whose rows changed are, with the same result.
    Columns: ``SCORE_COLUMNS`` + ``NOISE_COLUMNS`` (+ ``THROTTLE_SCORE_COLUMNS`` with ``cpu_throttled``, +
    ``WAIT_SCORE_COLUMNS`` with ``cpu_wait``, + ``IDLE_SCORE_COLUMNS`` with ``cpu_wait`` and ``cpu_busy``). With
    both, the run-queue view (``run_queue_view``) qualifies a window where the rank's main thread waited for a CPU at
    least ``MIN_WAIT_VIEW_EXCESS_FRAC`` longer than any peer's while every peer sat idle."""
    require_columns(lateness, [c for c in LATENESS_COLUMNS if c not in LATENESS_OPTIONAL], table="rank_lateness")
    missing = {c: np.nan for c in LATENESS_OPTIONAL if c not in lateness}
    lateness = lateness.assign(**missing) if missing else lateness
    keys = ["pg", "pg_ranks", "rank"]
    lat = lateness.dropna(subset=keys) if lateness[keys].isna().any(axis=None) else lateness
    # (pg, pg_ranks) coded once, in their sorted order: the groupings below read the codes, not the long strings
    group, pg_names, pr_names = group_codes(lat["pg"], lat["pg_ranks"])
    lat = lat.assign(excess_frac=excess_over_group(lat, group))
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
    order = lexsort((lat["step"].to_numpy(), gid))             # by (group, rank), then step

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
    by_core = run_queue_view(waited, peer_waited, peer_idle) & ~held_by_quota(thr, peer_thr)   # no noise in it
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
    # the arrival view's noise and the peers' level (their median) come from one pool: two columns of "noise"
    noise_of = {"noise": _PeerNoise(lat, windows, column="lateness_frac", reduce=_noise_and_level_rows, columns=2,
                                    grids=grids),
                "pnoise": _PeerNoise(lat, windows, column="pre_excess_frac", grids=grids),
                "esd": _PeerNoise(lat, windows, column="excess_frac", reduce=_std_rows, grids=grids)}
    noise_level, pnoise, esd = np.full((len(windows), 2), np.nan), unknown.copy(), unknown.copy()
    noise, plevel = noise_level[:, 0], noise_level[:, 1]       # views: filled in place with noise_level
    cached = {name: (np.full_like(values, np.nan), np.zeros(len(windows), dtype=bool))
              for name, values in (("noise", noise_level), ("pnoise", pnoise), ("esd", esd))}
    if not todo.all():
        for name, (values, known) in cached.items():
            values[~todo], known[~todo] = (memo.noise[name][0][reused[~todo]], memo.noise[name][1][reused[~todo]])

    def judge(*, peers_known: bool = True) -> tuple[np.ndarray, ...]:
        over, pover = _over(med, noise), _over(pmed, pnoise)
        et = t_of_count(emean, k_exc, np.fmax(own_sd, esd))
        peer_et = _peer_max(et, windows, key=span) if peers_known else unknown
        # before the noise is known, every window may be in a levelled group (the laxer bounds: a superset)
        level_of = (noise, plevel) if peers_known else (np.zeros(len(windows)), np.full(len(windows), np.inf))
        by_arrival = arrival_view(med, pos, over, *level_of, min_lateness_frac=min_lateness_frac,
                                  min_positive_frac=min_positive_frac, min_lateness_over_noise=min_lateness_over_noise)
        by_phases = ((med >= min_lateness_frac) & (pmed >= min_lateness_frac) & (ppos >= min_positive_frac)
                     & ~(pover < min_pre_excess_over_noise))
        by_persistence = persistent_view(med, pmed, pre_t, peer_t, pover, emean, epos, cmed,
                                     min_lateness_frac=min_lateness_frac,
                                     min_t=min_pre_excess_t, min_t_over_peers=min_pre_excess_t_over_peers,
                                     min_over_noise=min_persistent_pre_over_noise)
        by_steady = steady_view(emean, epos, et, peer_et, min_lateness_frac=min_lateness_frac, min_t=min_steady_t)
        by_throttle = throttle_view(emean, epos, et, peer_et, thr, peer_thr, stall,
                                     min_lateness_frac=min_lateness_frac)
        by_throttle |= by_core
        return over, pover, et, peer_et, by_arrival, by_phases, by_persistence, by_steady, by_throttle

    def fill(where_noise: np.ndarray, where_pnoise: np.ndarray, where_esd: np.ndarray) -> None:
        for name, values, where in (("noise", noise_level, where_noise), ("pnoise", pnoise, where_pnoise),
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
    # what fixing the rank would save: the wait it imposed over its qualifying window of median wait (the first one,
    # which names the straggler soonest, may begin before the fault and average its cost with clean steps; the last
    # may hold the run's last steps, whose waits differ)
    qualifying = np.flatnonzero(ok)
    typical = _median_index(_nanmean_rows(_windows(victims, win_start[qualifying], wlen[qualifying])),
                            win_gid[qualifying], len(n))
    gain_at = best.copy()
    gain_at[typical >= 0] = qualifying[typical[typical >= 0]]
    gain_start = win_start[gain_at]
    step_ns = column("step_ns", "float64")
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
        "mean_step_ns": _nanmean_rows(_windows(step_ns, sel_start, w)),
        "detected_at_step": pd.array([int(steps_[win_start[d] + w[g] - 1]) if d >= 0 else None
                                      for g, d in enumerate(detected)], dtype="Int64"),
        "detected_by": [None if d < 0 else "arrival" if by_arrival[d] else "arrival+phases" if by_phases[d]
                        else "persistence" if by_persistence[d] else "steady" if by_steady[d]
                        else "cpu_wait" if by_core[d] else "cpu_throttle"
                        for d in detected],
        "gain_first_step": steps_[gain_start], "gain_last_step": steps_[gain_start + w - 1],
        "gain_victims_wait_ns": _nanmean_rows(_windows(victims, gain_start, w)),
        "gain_step_ns": _nanmean_rows(_windows(step_ns, gain_start, w)),
        "noise_frac": noise[best], "lateness_over_noise": over[best],
        "phase_noise_frac": pnoise[best], "pre_excess_over_noise": pover[best],
        "pre_excess_t": pre_t[best], "peer_pre_excess_t": peer_t[best],
        "mean_excess_frac": emean[best], "excess_positive_frac": epos[best], "excess_t": et[best],
        "peer_excess_t": peer_et[best], "median_comm_excess_frac": cmed[best], "peer_level_frac": plevel[best],
        "cpu_throttled_frac": thr[best],
        "peer_cpu_throttled_frac": peer_thr[best], "step_stall_frac": stall[best],
        "cpu_wait_frac": waited[best], "peer_cpu_wait_frac": peer_waited[best], "peer_idle_frac": peer_idle[best],
    })
    return out[columns]


def arrival_view(med: np.ndarray, pos: np.ndarray, over: np.ndarray, noise: np.ndarray, peer_level: np.ndarray, *,
                 min_lateness_frac: float, min_positive_frac: float, min_lateness_over_noise: float) -> np.ndarray:
    """The arrival view: median lateness at least ``min_lateness_frac`` of the step, after the peers' median in
    ``min_positive_frac`` of the steps, and at least ``min_lateness_over_noise`` x the peers' noise (``over``;
    unknown does not block); in a levelled group (the peers' median lateness ``peer_level`` at least
    ``LEVELLED_PEERS_SHARE`` of their ``noise``; unknown: not levelled) ``LEVELLED_LATENESS_SHARE`` of that share
    and ``LEVELLED_NOISE_SHARE`` of that multiple."""
    peer_level, noise = np.asarray(peer_level, dtype="float64"), np.asarray(noise, dtype="float64")
    levelled = peer_level >= LEVELLED_PEERS_SHARE * noise
    floor = np.where(levelled, LEVELLED_LATENESS_SHARE * min_lateness_frac, min_lateness_frac)
    multiple = np.where(levelled, LEVELLED_NOISE_SHARE * min_lateness_over_noise, min_lateness_over_noise)
    return (np.asarray(med) >= floor) & (np.asarray(pos) >= min_positive_frac) & ~(np.asarray(over) < multiple)


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


def excess_over_group(lat: pd.DataFrame, group: np.ndarray | None = None) -> np.ndarray:
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
    return t_of_count(mean, (~np.isnan(x)).sum(axis=1), sd)


def t_of_count(mean: np.ndarray, k: np.ndarray, sd: np.ndarray) -> np.ndarray:
    """``_t_of_mean`` of rows of ``k`` values each."""
    with np.errstate(divide="ignore", invalid="ignore"):
        se = sd / np.sqrt(np.maximum(k, 1))
        t = np.where(se > 0, mean / se, np.where(mean != 0, np.inf * np.sign(mean), 0.0))
    return np.where(k >= 5, t, np.nan)


def steady_view(mean: np.ndarray, pos: np.ndarray, t: np.ndarray, peer_t: np.ndarray, *, min_lateness_frac: float,
            min_t: float, min_t_over_peers: float = MIN_STEADY_T_OVER_PEERS,
            min_positive_frac: float = MIN_STEADY_POSITIVE_FRAC) -> np.ndarray:
    """The steady view: mean lateness excess over the group's median at least ``min_lateness_frac`` and
    ``MIN_STEADY_EXCESS_FRAC``, positive in ``min_positive_frac`` of the steps, ``min_t`` standard errors above
    zero and ``min_t_over_peers`` x any peer's (a peer's non-positive value does not block)."""
    return ((mean >= max(min_lateness_frac, MIN_STEADY_EXCESS_FRAC)) & (pos >= min_positive_frac) & (t >= min_t)
            & ~(t < min_t_over_peers * np.maximum(peer_t, 0)))


def throttle_view(mean: np.ndarray, pos: np.ndarray, t: np.ndarray, peer_t: np.ndarray, throttled: np.ndarray,
                   peer_throttled: np.ndarray, stall: np.ndarray, *, min_lateness_frac: float) -> np.ndarray:
    """The CPU-throttle view: the rank's cgroup throttled at least ``MIN_CPU_THROTTLED_FRAC`` of the window, no peer
    a ``MAX_PEER_THROTTLED_SHARE`` of that (unknown peers do not block), ``MIN_STEADY_T_OVER_PEERS`` x any peer's t,
    and the job shown to wait for it: its mean lateness excess at least ``MIN_THROTTLED_EXCESS_SHARE`` x
    ``min_lateness_frac`` and ``MIN_THROTTLED_T`` standard errors above zero or positive in
    ``MIN_THROTTLED_POSITIVE_FRAC`` of the steps (``pos``); or its mean excess positive and the group's steps
    stalled (``stalled_view``)."""
    late = ((mean >= MIN_THROTTLED_EXCESS_SHARE * min_lateness_frac)
            & ((t >= MIN_THROTTLED_T) | (pos >= MIN_THROTTLED_POSITIVE_FRAC)))
    late |= (mean > 0) & stalled_view(stall, throttled, min_lateness_frac=min_lateness_frac)
    return (held_by_quota(throttled, peer_throttled) & late
            & ~(t < MIN_STEADY_T_OVER_PEERS * np.maximum(peer_t, 0)))


def stalled_view(stall: np.ndarray, throttled: np.ndarray, *, min_lateness_frac: float) -> np.ndarray:
    """The group's steps stalled (``step_stall_frac``) by at least ``min_lateness_frac``, within
    ``STALL_THROTTLE_RATIO`` of the rank's throttled share either way (NaN: not shown)."""
    return ((stall >= min_lateness_frac) & (stall * STALL_THROTTLE_RATIO >= throttled)
            & (throttled * STALL_THROTTLE_RATIO >= stall))


def run_queue_view(waited: np.ndarray, peer_waited: np.ndarray, peer_idle: np.ndarray) -> np.ndarray:
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


def persistent_view(med: np.ndarray, pmed: np.ndarray, pre_t: np.ndarray, peer_t: np.ndarray, pover: np.ndarray,
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
                 reduce: Callable[[np.ndarray], np.ndarray] | None = None, columns: int = 1,
                 grids: _GroupGrids | None = None) -> None:
        """``grids``: the groups' grids of ``column`` (and others), shared between columns. ``columns``: how many
        figures ``reduce`` gives per row (``at`` then gives one row of them per window)."""
        self._column, self._reduce, self._columns = column, reduce or _noise_rows, columns
        self._windows = windows
        self._wkey: np.ndarray | None = None    # each window's group code, on first use
        self._of_group: dict[int, np.ndarray] = {}   # group code -> its windows, in order
        self._grids = grids if grids is not None else _GroupGrids(lateness, [column]) if len(windows) else None

    def at(self, select: np.ndarray) -> np.ndarray:
        """The noise of the windows where ``select`` is true (NaN elsewhere)."""
        shape = (len(self._windows),) if self._columns == 1 else (len(self._windows), self._columns)
        windows, out = self._windows, np.full(shape, np.nan)
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
    return _noise_and_level_rows(x)[:, 0]


def _noise_and_level_rows(x: np.ndarray) -> np.ndarray:
    """Per row, as two columns: ``_noise_rows`` and the median the spread is taken around (the level the values
    stand on; NaN for a row without values)."""
    med = _nanmedian_rows(x)
    mad = 1.4826 * _nanmedian_rows(np.abs(x - med[:, None]))
    k = (~np.isnan(x)).sum(axis=1)
    srt = np.sort(x, axis=1)                                    # NaN last: the k values first
    pos = 0.9 * np.maximum(k - 1, 0)                            # linear interpolation, as np.nanquantile
    lo = np.floor(pos).astype("int64")
    hi = np.minimum(lo + 1, np.maximum(k - 1, 0))
    rows = np.arange(len(x))
    q90 = srt[rows, lo] + (pos - lo) * (srt[rows, hi] - srt[rows, lo])
    return np.stack([np.where(k >= 2, np.maximum(mad, q90), np.nan), med], axis=1)


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


def _median_index(values: np.ndarray, gid: np.ndarray, num_groups: int) -> np.ndarray:
    """Per group (``gid`` sorted): the index of its median value (the lower one of an even count; NaN sorts last),
    -1 for a group without values."""
    out = np.full(num_groups, -1, dtype="int64")
    if not len(values):
        return out
    order = np.lexsort((values, gid))
    groups, first, count = np.unique(gid[order], return_index=True, return_counts=True)
    out[groups] = order[first + (count - 1) // 2]
    return out


def row_quota_held(row) -> bool:
    """The score row's rank was held back by its cgroup's CPU quota in its window while its peers were not."""
    return quota_held(*(opt_float(getattr(row, c, None)) for c in ("cpu_throttled_frac", "peer_cpu_throttled_frac")))


def row_core_shared(row) -> bool:
    """The score row's rank's main thread waited for a CPU in its window clearly more than any peer's
    (``MIN_CPU_WAIT_EXCESS_FRAC``), enough to explain half its lateness (``CPU_WAIT_SHARE_OF_LATENESS``): something
    else ran on its core. The kernel counts time a CPU quota throttles a thread as run-queue wait too, so a rank
    its quota held back (``row_quota_held``) is not called shared. Unknown (no host samples, no schedstat) is
    False."""
    wait, peer = (opt_float(getattr(row, c, None)) for c in WAIT_SCORE_COLUMNS)
    if wait is None or peer is None or row_quota_held(row):
        return False
    if row_core_taken(row):
        return True
    late = opt_float(getattr(row, "median_lateness_frac", None)) or 0.0
    return wait - peer >= max(MIN_CPU_WAIT_EXCESS_FRAC, CPU_WAIT_SHARE_OF_LATENESS * late)


def row_core_taken(row) -> bool:
    """The score row's window passes the run-queue view (``run_queue_view``) and its quota did not hold it back."""
    wait, peer, idle = (opt_float(getattr(row, c, None)) for c in WAIT_SCORE_COLUMNS + IDLE_SCORE_COLUMNS)
    if wait is None or peer is None or idle is None or row_quota_held(row):
        return False
    return bool(run_queue_view(np.float64(wait), np.float64(peer), np.float64(idle)))


def row_cpu_counted(row) -> bool:
    """The kernel's counts of the rank's lost CPU (quota throttling, run-queue wait) are known in its window."""
    return all(opt_float(getattr(row, c, None)) is not None
               for c in ["cpu_throttled_frac", "peer_cpu_throttled_frac"] + WAIT_SCORE_COLUMNS)


def opt_float(x) -> float | None:
    """``x`` as a float, None when missing or NaN (infinite stays: noise 0 with a late rank)."""
    return None if x is None or pd.isna(x) else float(x)
