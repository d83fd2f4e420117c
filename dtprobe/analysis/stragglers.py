"""The STRAGGLER detector: from the straggler scores and causes, one finding per culprit rank (not its victims),
with its evidence, advice and predicted gain; read by the facade, ``dtprobe analyze`` and the dashboard's
collectives page.

The culprit of a collective is its last arriver (largest clock-aligned arrival among the members of
(pg, pg_ranks, seq): ``enqueue_ns`` after ``arrivals.on_arrival_clock``, the device arrival on CUDA runs, the host
enqueue on CPU runs); the other members are victims and wait ``culprit enqueue - own enqueue``. Per step, each
member's lateness is its arrival minus the median arrival of its peers (at the step's collective where it was
latest: ``arrivals.rank_lateness``). ``straggler_scores`` judges each (group, rank) over windows of steps against
the run's own noise; ``straggler_causes`` gives a candidate's cause class (data / compute / communication / device)
from its step phases, its waits at other collectives and its device samples, compared with its group peers. This
module names the culprits: a rank late in several groups once, a victim's blame passed to the rank it waited for,
a pipeline stage only when the schedule does not explain its lateness.
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
from dtprobe.analysis.straggler_causes import outside_phases, phase_excess
from dtprobe.analysis.straggler_scores import (
    MIN_LATENESS_OVER_NOISE, MIN_PERSISTENT_PRE_OVER_NOISE, MIN_PRE_EXCESS_OVER_NOISE, MIN_PRE_EXCESS_T,
    MIN_PRE_EXCESS_T_OVER_PEERS, MIN_LATE_PIPELINE_T, MIN_STAGE_T, MIN_STAGE_T_IN_LATE_PIPELINE,
    MIN_STEADY_EXCESS_FRAC, MIN_STEADY_T, MIN_STEADY_T_OVER_PEERS, MIN_WINDOW_S, SCORE_COLUMNS, WAIT_SCORE_COLUMNS,
    arrival_view, excess_over_group, held_by_quota, opt_float, persistent_view, row_core_shared, row_core_taken,
    row_cpu_counted, row_quota_held, run_queue_view, stalled_view, steady_view, t_of_count, throttle_view)
from dtprobe.analysis.tables import P2P_OPS, axis_of, group_members, group_phrase, ms, run_starts
from dtprobe.store.columns import require_columns

OFF_CPU_SHARE_OF_LATENESS = 1 / 3
"""A straggler of a run on CPU (cause ``compute``, no quota or shared core to blame) was off the CPU when the CPU
time its process used per step exceeded its peers' median, plus the time its main thread waited for a CPU beyond
its peers', by less than this share of its lateness: a rank that computes longer uses about its lateness more (a
slow core as well), one that sleeps, waits for a lock or for I/O uses none of it. On a GPU the host thread of a
rank waiting for a slow device may sleep too: not judged there."""


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
                           "peer_stage_excess_t", "pipeline_late_t", "confirmed"]
PIPELINE_LATENESS_COLUMNS = ["pipeline", "step", "excess_frac"]


def pipeline_lateness(lateness: pd.DataFrame | None, stage: pd.DataFrame,
                      axis_of_pg: Callable[[str], str | None] = axis_of) -> pd.DataFrame:
    """Per (pipeline, step) of a pipelined run: the mean over the pipeline's ranks of their lateness excess over
    their ``dp`` group's median at that step (``lateness``: ``arrivals.rank_lateness``; share of the step). The dp
    all-reduces of a pipeline wait for its slowest stage, so a pipeline held back by one of its ranks arrives late
    at every dp group it is in. ``stage``: ``pipeline_delay.stage_excess`` (who is in which pipeline). Columns:
    ``PIPELINE_LATENESS_COLUMNS``."""
    empty = pd.DataFrame({col: [] for col in PIPELINE_LATENESS_COLUMNS})
    if lateness is None or lateness.empty or stage.empty:
        return empty
    pipe = dict(zip(stage["rank"].astype("int64"), stage["pipeline"].astype("int64")))
    dp_names = {pg for pg in lateness["pg"].unique() if axis_of_pg(pg) == "dp"}    # per group name, not per row
    d = lateness[lateness["pg"].isin(dp_names) & lateness["rank"].isin(pipe)]
    if d.empty:
        return empty
    out = pd.DataFrame({"pipeline": d["rank"].map(pipe).to_numpy(), "step": d["step"].to_numpy(dtype="int64"),
                        "excess_frac": excess_over_group(d)})
    return out.groupby(["pipeline", "step"], as_index=False)["excess_frac"].mean()[PIPELINE_LATENESS_COLUMNS]


def pipeline_origin_scores(stage: pd.DataFrame, first_step: int, last_step: int, *,
                           min_lateness_frac: float = 0.05, min_t: float = MIN_STAGE_T,
                           late: pd.DataFrame | None = None) -> pd.DataFrame:
    """Per pipelined rank over steps ``first_step``..``last_step`` of ``stage`` (``pipeline_delay.stage_excess``):
    the mean excess of its own time on its stage over the same stage of the other pipelines
    (``stage_excess_frac``, share of the step; ``stage_excess_rel``, share of the other pipelines' own time on
    the stage), that mean over its standard error (``stage_excess_t``; the error from the larger of its own spread
    and the largest of the other ranks' in the same steps: the run's own noise), and the largest such t among the
    other ranks of any stage (``peer_stage_excess_t``). ``pipeline_late_t``: how many standard errors above zero
    its pipeline's mean lateness excess at its dp groups is over the window (``late``: ``pipeline_lateness``; NaN
    without it). ``confirmed``: its own time stands out beyond that noise as the steady view judges lateness, with
    the stage's time in the place of the step (a stage is a share of the step: a rank computing 10% slower on a
    stage that is half the step is 5% of the step later): a mean excess of at least ``min_lateness_frac`` and
    ``MIN_STEADY_EXCESS_FRAC`` of the stage's time, ``min_t`` standard errors above zero
    (``MIN_STAGE_T_IN_LATE_PIPELINE`` when ``pipeline_late_t`` is at least ``MIN_LATE_PIPELINE_T``: its pipeline
    holds the others back) and ``MIN_STEADY_T_OVER_PEERS`` x any other rank's (when the host slows a whole
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
    t = t_of_count(mean, out["k"].to_numpy(), np.fmax(sd, other_sd))
    out["stage_excess_t"], out["peer_stage_excess_t"] = t, _max_of_others(t)
    out["pipeline_late_t"] = out["pipeline"].map(_late_t(late, first_step, last_step)).astype("float64")
    rel = out["stage_excess_rel"].to_numpy(dtype="float64")
    in_late = out["pipeline_late_t"].to_numpy() >= MIN_LATE_PIPELINE_T
    out["confirmed"] = ((rel >= max(min_lateness_frac, MIN_STEADY_EXCESS_FRAC))
                        & (t >= np.where(in_late, min(min_t, MIN_STAGE_T_IN_LATE_PIPELINE), min_t))
                        & ~(t < MIN_STEADY_T_OVER_PEERS * np.maximum(out["peer_stage_excess_t"].to_numpy(), 0)))
    return out.reset_index()[PIPELINE_ORIGIN_COLUMNS]


def _late_t(late: pd.DataFrame | None, first_step: int, last_step: int) -> dict[int, float]:
    """pipeline -> its mean lateness excess over the window over its standard error (``pipeline_lateness`` rows)."""
    if late is None or late.empty:
        return {}
    w = late[late["step"].between(first_step, last_step)].dropna(subset=["excess_frac"])
    g = w.groupby("pipeline")["excess_frac"]
    stats = pd.DataFrame({"mean": g.mean(), "sd": g.std(), "k": g.count()})
    t = t_of_count(stats["mean"].to_numpy(), stats["k"].to_numpy(), stats["sd"].to_numpy(dtype="float64"))
    return dict(zip(stats.index.astype("int64"), t))


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

    def __init__(self, stage: pd.DataFrame, *, min_lateness_frac: float, late: pd.DataFrame | None = None) -> None:
        self._stage, self._min_lateness_frac, self._late = stage, min_lateness_frac, late
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
            self._scores[key] = pipeline_origin_scores(self._stage, *key, min_lateness_frac=self._min_lateness_frac,
                                                       late=self._late).set_index("rank")
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
    A victim's own victims are passed to its culprit, up to the chain's end (``_follow_chains``).
    Critical when the victims wait ``critical_wait_frac`` of the step or more; ``info`` when its cause is
    communication (it waited on others: a victim whose culprit was not found). ``axis_of_pg`` maps a process
    group name to ``dp``/``tp``/``pp``; groups of ``skip_axes`` are not judged (in a pipeline group the arrival
    order follows the schedule: the first stage finishes its last backward last; a slow stage shows up as
    stage imbalance in PIPELINE_BUBBLE and as a straggler of its dp group).
    Noise rule (when ``scores`` has ``NOISE_COLUMNS``): the arrival view also needs the median lateness to be at
    least ``min_lateness_over_noise`` x the peers' lateness noise in the same window (in a levelled group, whose
    peers are late at their worst collective themselves, less of both bounds: ``straggler_scores.arrival_view``),
    the phases view the median
    data+fwd excess to be ``min_pre_excess_over_noise`` x the peers' excess noise, so a busy host's chance
    lateness is not a verdict; the persistence view (``persistent_view``, with ``pre_excess_t`` in ``scores``) names a
    rank whose data+fwd excess is steady where the other views' noise hides it. ``slow_link_ranks`` (rank -> step
    a SLOW_LINK on its node began, ``links.slow_link_ranks``): a rank late in a window reaching that step is not
    blamed unless its cause is data or device (its lateness is the link's: the link's finding carries it).
    ``group_clock``: (pg, pg_ranks) -> the clock its arrivals were read on (``arrivals.arrival_clocks``), told in
    ``evidence.clock`` (``host`` when not given). ``stage_excess``: per (rank, step) of a pipelined run, its own
    time's excess over its stage's in the other pipelines (``pipeline_delay.stage_excess``); None or empty: the
    pipeline rules above are not applied. Predicted gain: the victims' mean wait per step time; for a pipelined
    rank, when ``schedule_gain`` (rank, first step, last step -> ns per step, ``pipeline_delay.schedule_gain_ns``,
    None where unknown) gives less over the finding's window (the steps the victims' wait is measured on; not the
    stage view's window, which may start before a slowdown did), that: a wait the schedule does not put on the
    step's critical path is not a gain. Critical when the gain is ``critical_wait_frac`` or more.
    ``cpu_busy`` (``cpu_throttle.cpu_busy_per_step``): the rank's and its peers' CPU use per step over the window,
    in evidence; with ``host_compute`` (the ranks compute on the CPU), a rank late by compute while its process used
    no more CPU than its peers (``OFF_CPU_SHARE_OF_LATENESS``) is said to be off the CPU (``off_cpu``), with advice
    to find what it waits for."""
    require_columns(scores, SCORE_COLUMNS, table="straggler_scores")
    if scores.empty:
        return []
    scores = scores.loc[np.array([axis_of_pg(pg) not in skip_axes for pg in scores["pg"]], dtype=bool)]

    def col(name: str) -> np.ndarray:
        return scores[name].to_numpy(dtype="float64", na_value=np.nan)
    unknown = np.full(len(scores), np.nan)
    late = col("median_lateness_frac")
    by_phases = (late >= min_lateness_frac) & (col("median_pre_excess_frac") >= min_lateness_frac) & (
        col("pre_positive_frac") >= min_positive_frac)
    if "lateness_over_noise" in scores:                         # NaN (noise unknown) does not block
        by_arrival = arrival_view(late, col("positive_frac"), col("lateness_over_noise"), col("noise_frac"),
                                  col("peer_level_frac") if "peer_level_frac" in scores else unknown,
                                  min_lateness_frac=min_lateness_frac, min_positive_frac=min_positive_frac,
                                  min_lateness_over_noise=min_lateness_over_noise)
        by_phases &= ~(col("pre_excess_over_noise") < min_pre_excess_over_noise)
    else:
        by_arrival = (late >= min_lateness_frac) & (col("positive_frac") >= min_positive_frac)
    ok = pd.Series(by_arrival | by_phases, index=scores.index)
    if "pre_excess_t" in scores:
        ok |= pd.Series(persistent_view(
            col("median_lateness_frac"), col("median_pre_excess_frac"), col("pre_excess_t"),
            col("peer_pre_excess_t"), col("pre_excess_over_noise"),
            *(col(c) if c in scores else unknown
              for c in ("mean_excess_frac", "excess_positive_frac", "median_comm_excess_frac")),
            min_lateness_frac=min_lateness_frac,
            min_t=min_pre_excess_t, min_t_over_peers=min_pre_excess_t_over_peers,
            min_over_noise=min_persistent_pre_over_noise), index=scores.index)
    if "excess_t" in scores:
        ok |= pd.Series(steady_view(
            col("mean_excess_frac"), col("excess_positive_frac"), col("excess_t"), col("peer_excess_t"),
            min_lateness_frac=min_lateness_frac, min_t=min_steady_t), index=scores.index)
    if "cpu_throttled_frac" in scores:
        ok |= pd.Series(throttle_view(
            col("mean_excess_frac"), col("excess_positive_frac"), col("excess_t"), col("peer_excess_t"),
            col("cpu_throttled_frac"), col("peer_cpu_throttled_frac"),
            col("step_stall_frac") if "step_stall_frac" in scores else unknown,
            min_lateness_frac=min_lateness_frac),
            index=scores.index)
    if "peer_idle_frac" in scores:
        ok |= pd.Series(run_queue_view(col("cpu_wait_frac"), col("peer_cpu_wait_frac"), col("peer_idle_frac"))
                        & ~held_by_quota(*(col(c) if c in scores else unknown
                                            for c in ("cpu_throttled_frac", "peer_cpu_throttled_frac"))),
                        index=scores.index)
    long_enough = ~(scores["window_steps"] * scores["mean_step_ns"].astype("float64") < min_window_s * 1e9)
    flagged = scores[ok & (scores["window_steps"] >= min_steps) & long_enough]
    judge = (_PipelineJudge(stage_excess, min_lateness_frac=min_lateness_frac,
                            late=pipeline_lateness(lateness, stage_excess, axis_of_pg))
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
    _follow_chains(propagated)
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
        # what its fix saves: the wait it imposed over its qualifying window of median wait (gain_*)
        gain_first, gain_last = int(row.gain_first_step), int(row.gain_last_step)
        wait_frac = row.gain_victims_wait_ns / row.gain_step_ns if row.gain_step_ns else 0.0
        quota_held, core_shared = row_quota_held(row), row_core_shared(row)
        # frozen by its quota inside collectives it had reached, the rank made its peers wait there, not for its
        # arrival: the job's loss is its steps' stall
        stall = opt_float(getattr(row, "step_stall_frac", None)) if quota_held else None
        if stall is not None and not stalled_view(np.float64(stall), np.float64(row.cpu_throttled_frac),
                                              min_lateness_frac=min_lateness_frac):
            stall = None
        # the schedule's cap on the victims' wait, over the steps that wait was measured on
        sched = schedule_gain(int(row.rank), gain_first, gain_last) if schedule_gain is not None else None
        sched_frac = sched / row.gain_step_ns if sched is not None and row.gain_step_ns else None
        lost_frac = wait_frac if stall is None else max(wait_frac, stall)
        if row_core_taken(row):        # its peers sat idle while it waited for its core: that is the job's loss
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
            "victims_mean_wait_ms": ms(row.gain_victims_wait_ns), "step_time_ms": ms(row.gain_step_ns),
            "victims_wait_frac": wait_frac, "gain_window": [gain_first, gain_last],
            "detected_at_step": _first_step(row.detected_at_step, first_flagged.get(int(row.rank))),
            "cause": cause,
            "cause_excess_ms": {
                "data": ms(c.data_excess_ns) if c is not None else None,
                "compute": ms(c.compute_excess_ns) if c is not None else None,
                "communication": ms(c.comm_excess_ns) if c is not None else None,
            },
            "throttled_frac": (None if c is None or pd.isna(c.throttled_frac) else float(c.throttled_frac)),
            "noise_frac": opt_float(getattr(row, "noise_frac", None)),
            "lateness_over_noise": opt_float(getattr(row, "lateness_over_noise", None)),
            "peer_level_frac": opt_float(getattr(row, "peer_level_frac", None)),
            "phase_noise_frac": opt_float(getattr(row, "phase_noise_frac", None)),
            "pre_excess_over_noise": opt_float(getattr(row, "pre_excess_over_noise", None)),
            "pre_excess_t": opt_float(getattr(row, "pre_excess_t", None)),
            "peer_pre_excess_t": opt_float(getattr(row, "peer_pre_excess_t", None)),
            "mean_excess_frac": opt_float(getattr(row, "mean_excess_frac", None)),
            "excess_positive_frac": opt_float(getattr(row, "excess_positive_frac", None)),
            "excess_t": opt_float(getattr(row, "excess_t", None)),
            "peer_excess_t": opt_float(getattr(row, "peer_excess_t", None)),
            "median_comm_excess_frac": opt_float(getattr(row, "median_comm_excess_frac", None)),
            "cpu_throttled_frac": opt_float(getattr(row, "cpu_throttled_frac", None)),
            "peer_cpu_throttled_frac": opt_float(getattr(row, "peer_cpu_throttled_frac", None)),
            "step_stall_frac": stall,
            "cpu_wait_frac": opt_float(getattr(row, "cpu_wait_frac", None)),
            "peer_idle_frac": opt_float(getattr(row, "peer_idle_frac", None)),
            "peer_cpu_wait_frac": opt_float(getattr(row, "peer_cpu_wait_frac", None)),
            "propagated_to": sorted(propagated.get(int(row.rank), [])),
            "injected": (injected or {}).get(int(row.rank)),
            "pipeline_origin": how,
            "stage_window": None if stage_fig is None else [first, last],
            "stage_excess_frac": None if stage_fig is None else opt_float(stage_fig["stage_excess_frac"]),
            "stage_excess_rel": None if stage_fig is None else opt_float(stage_fig["stage_excess_rel"]),
            "stage_excess_t": None if stage_fig is None else opt_float(stage_fig["stage_excess_t"]),
            "peer_stage_excess_t": None if stage_fig is None else opt_float(stage_fig["peer_stage_excess_t"]),
            "pipeline_late_t": None if stage_fig is None else opt_float(stage_fig["pipeline_late_t"]),
            "schedule_gain_frac": opt_float(sched_frac),
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
            wait, peer_wait = (opt_float(getattr(row, c, None)) for c in WAIT_SCORE_COLUMNS)
            waited = max(0.0, wait - peer_wait) if wait is not None and peer_wait is not None else 0.0
            off_cpu = bool(busy - peer_busy + waited < OFF_CPU_SHARE_OF_LATENESS * late_frac)
        fwd_excess, bwd_excess, _ = phase_excess(c) if c is not None else (None, None, None)
        outside = (outside_phases(c) if c is not None and cause == "compute" and how is None and not quota_held
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
                                            cpu_counted=row_cpu_counted(row), off_cpu=bool(off_cpu),
                                            outside_phases=(ms(max(0.0, fwd_excess) + max(0.0, bwd_excess)),
                                                            ms(c.compute_excess_ns)) if outside else None),
            predicted_gain=PredictedGain(metric="step_time", frac=gain_frac),
            rows=evidence_rows,
        ))
    return findings


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


def _follow_chains(propagated: dict[int, list[int]]) -> None:
    """Pass a victim's victims up to its own culprit (``propagated``: culprit -> the ranks late because of it,
    changed in place). A rank that waited on another is no culprit of the ranks that waited on it: when rank 1
    waited on rank 3 in their dp group and rank 3 on rank 2 in their tp group (rank 2 held back by a CPU quota, its
    whole replica late in the dp groups), rank 2 is the culprit of both. A victim of several culprits follows the
    first that is no one's victim, if any. Ranks each other's victims (a cycle) with no such way out are left as
    they are: the rules could not tell which one waited."""
    victims_of_any = {v for vs in propagated.values() for v in vs}
    culprit_of: dict[int, int] = {}
    for culprit, victims in propagated.items():
        for victim in victims:
            if victim not in culprit_of or (culprit_of[victim] in victims_of_any and culprit not in victims_of_any):
                culprit_of[victim] = culprit
    for rank in list(propagated):
        top, seen = rank, {rank}
        while top in culprit_of:
            top = culprit_of[top]
            if top in seen:             # a cycle: no rank on it is the root
                top = rank
                break
            seen.add(top)
        if top == rank:
            continue
        for victim in propagated.pop(rank):
            if victim != top and victim not in propagated[top]:
                propagated[top].append(victim)


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
