"""``RunAnalysis``: the one entry point to every metric and finding of a source (a dtprobe run, a Kineto trace
folder, the newest steps of a run); read by ``dtprobe analyze``, ``dtprobe export perfetto``, the benchmarks and
the dashboard (which calls nothing else in analysis).

Every method is one line over the pure analyzers and is cached on the instance: build a new ``RunAnalysis``
after ``store.refresh()`` to see new rows. The source is read only through ``dtprobe.store.source.Source``
(``table(name)`` and the ``SourceInfo`` facts), so no method asks which kind of source it has. DataFrames have
units in their column names; findings are ``Finding`` records; ``report()`` is the ``dtprobe.findings/1`` JSON
document (renderings in ``dtprobe.analysis.render``).
"""

from __future__ import annotations

import contextlib
import os
import time
import weakref
from pathlib import Path
from typing import Any, Callable

import pandas as pd
import pyarrow.compute as pc

from dtprobe.analysis import amp as _amp
from dtprobe.analysis import arrivals as _arrivals
from dtprobe.analysis import bubble as _bubble
from dtprobe.analysis import checkpoints as _ckpt
from dtprobe.analysis import clock_alignment as _clocks
from dtprobe.analysis import clocks as _clock_names
from dtprobe.analysis import collective_groups as _groups
from dtprobe.analysis import collective_matching as _matching
from dtprobe.analysis import ckpt_corrupt as _corrupt
from dtprobe.analysis import comm_efficiency as _comm
from dtprobe.analysis import comm_steps as _comm_steps
from dtprobe.analysis import compression as _compression
from dtprobe.analysis import cpu_throttle as _cpu_throttle
from dtprobe.analysis import crashes as _crashes
from dtprobe.analysis import device_arrivals as _device_arrivals
from dtprobe.analysis import derived_tables as _derived
from dtprobe.analysis import devices as _devices
from dtprobe.analysis import exposed_comm as _exposed
from dtprobe.analysis import failure_reads as _failure_reads
from dtprobe.analysis import failures as _failures
from dtprobe.analysis import hangs as _hangs
from dtprobe.analysis import kept as _kept
from dtprobe.analysis import links as _links
from dtprobe.analysis import liveness as _liveness
from dtprobe.analysis import mismatch as _mismatch
from dtprobe.analysis import peaks as _peaks
from dtprobe.analysis import pipeline_delay as _pipeline_delay
from dtprobe.analysis import rank_stalls as _rank_stalls
from dtprobe.analysis import report as _report
from dtprobe.analysis import stage_trend as _stage_trend
from dtprobe.analysis import straggler_causes as _causes
from dtprobe.analysis import straggler_scores as _scores
from dtprobe.analysis import stragglers as _stragglers
from dtprobe.analysis import tables as _tables
from dtprobe.analysis import throughput as _throughput
from dtprobe.analysis import trace_metrics as _trace_metrics
from dtprobe.analysis.fault_detail import injected_faults, injected_ranks
from dtprobe.analysis.findings import Finding, findings_frame, info_without_gain, sort_findings
from dtprobe.analysis.inputs import analysed_table
from dtprobe.analysis.key_figures import KeyFigures, key_figures
from dtprobe.analysis.options import AnalysisOptions
from dtprobe.analysis.report import SCHEMA
from dtprobe.analysis.score_memo import ScoreMemo
from dtprobe.store.frames import arrow_to_frame
from dtprobe.store.kineto import CollectiveParts
from dtprobe.store.manifest import Manifest
from dtprobe.store.resolve import open_source
from dtprobe.store.source import Source, SourceInfo

__all__ = ["SCHEMA", "AnalysisOptions", "KeyFigures", "RunAnalysis", "open_source"]

_SCORE_MEMOS: "weakref.WeakKeyDictionary[Any, ScoreMemo]" = weakref.WeakKeyDictionary()
"""store -> the per-window figures of its last straggler scoring (``score_memo``), while its run is running."""


class RunAnalysis:
    """Metrics and findings of one source. ``RunAnalysis(RunStore.open(path))`` or ``RunAnalysis.open(path)``.

    ``source`` is any ``dtprobe.store.source.Source`` (``RunStore``, ``KinetoRun``, ``StepWindow``); ``baseline``
    an optional second source (loss gap of COMPRESSION, comparisons).
    """

    def __init__(self, source: Source, *, baseline: Source | None = None, options: AnalysisOptions | None = None,
                 now_ns: int | None = None) -> None:
        self.source = source
        self.baseline = baseline
        self.options = options or AnalysisOptions()
        self._now_ns = now_ns
        self._cache: dict[str, Any] = {}
        self._stored: Any = None   # results kept beside the stored summary (use_kept)

    @classmethod
    def open(cls, path: str | os.PathLike, *, baseline: str | os.PathLike | None = None,
             options: AnalysisOptions | None = None) -> "RunAnalysis":
        """Open ``path`` (run or trace folder) and the optional ``baseline`` the same way."""
        return cls(open_source(path), baseline=open_source(baseline) if baseline else None, options=options)

    # ------------------------------------------------------------------------------------------ source facts

    def _memo(self, key: str, fn: Callable[[], Any]) -> Any:
        if key not in self._cache:
            stored = self._stored.get(key) if self._stored is not None and _kept.is_kept(key) else _kept.NOT_KEPT
            self._cache[key] = fn() if stored is _kept.NOT_KEPT else stored
        return self._cache[key]

    def use_kept(self, kept: _kept.Kept | None) -> None:
        """Read the results ``kept`` holds (``kept.is_kept``: kept beside the stored summary of this source as it is
        now, under these options) instead of computing them; each is read when first asked for."""
        self._stored = kept

    def kept_results(self) -> dict[str, Any]:
        """The results ``kept.is_kept`` computed so far (what ``summary_store.store`` keeps beside the summary)."""
        return {name: value for name, value in self._cache.items() if _kept.is_kept(name)}

    @property
    def info(self) -> SourceInfo:
        """The source's facts (kind, status, clocks aligned, whole records, warm-up recorded, device ...)."""
        return self.source.info

    @property
    def is_trace_folder(self) -> bool:
        """True when the source is a folder of Kineto traces (a label: no analysis depends on it)."""
        return self.info.kind == "kineto_traces"

    @property
    def path(self) -> Path:
        """The run directory or trace folder."""
        return Path(self.source.path)

    @property
    def manifest(self) -> Manifest | None:
        """The run's ``Manifest`` (None for a source without one, e.g. a trace folder)."""
        return self.info.manifest

    @property
    def config(self) -> dict:
        """The run's job config (``run.json`` ``config``), {} when the source has none."""
        return dict(self.info.config)

    @property
    def status(self) -> str:
        """``running``, ``finished``, ``crashed``, or ``trace`` for a trace folder."""
        return self.info.status

    @property
    def world_size(self) -> int | None:
        """Ranks in the job."""
        return self.info.world_size

    @property
    def skipped_warmup_steps(self) -> int:
        """Warm-up steps left out of step-time based metrics: ``options.skip_first_steps`` when the source recorded
        the job's warm-up, else 0 (a profiler window: every ProfilerStep counts; HTA drops the last, we do not)."""
        return self.options.skip_first_steps if self.info.warmup_recorded else 0

    def layout(self) -> dict:
        """dp/tp/pp/zero and pipeline settings from the config (``layout`` section), {} when unknown."""
        return dict(self.config.get("layout") or {})

    def table(self, name: str) -> pd.DataFrame:
        """A source table as the analyzers read it (cached): ``collectives`` also holds the pending rows no
        completed row matches and has ``seq`` unique across restarts (``inputs.analysed_table``)."""
        return self._memo(f"table:{name}", lambda: analysed_table(self.source, name))

    def baseline_table(self, name: str) -> pd.DataFrame | None:
        """A table of the baseline as the analyzers read it (cached); None without a baseline."""
        return self._memo(f"baseline:{name}", lambda: analysed_table(self.baseline, name)
                          if self.baseline is not None else None)

    def steps_analyzed(self) -> list[int]:
        """Steps the step-time based metrics use: every finished step but the first ``skipped_warmup_steps``."""
        return self._memo("steps_analyzed", lambda: _tables.analyzed_steps(self.table("steps"),
                                                                           skip_first=self.skipped_warmup_steps))

    def step_time_ns(self) -> float | None:
        """Median step time over ranks and analysed steps."""
        return self._memo("step_ns", lambda: _tables.median_step_ns(self.completed_table("steps"),
                                                                    self.steps_analyzed() or None))

    def completed_table(self, name: str) -> pd.DataFrame:
        """Table ``name`` (a per-step table with a ``restart`` column: ``steps``, ``pipeline``, ``amp``,
        ``compression``, ``memory``) with a step redone after a torchrun restart read from the attempt that redid it
        (``tables.completing_attempts``): what step times, throughput, straggler causes, pipeline, loss-scale,
        compression and loss-gap figures read. The crash and hang verdicts read every attempt's rows (``table``)."""
        return self._memo(f"completed:{name}", lambda: _tables.completing_attempts(self.table(name)))

    def now_ns(self) -> int:
        """Reference time for hang waits: now while the run is running, else its end (or last event)."""
        return self._now_ns if self._now_ns is not None else _liveness.reference_ns(
            status=self.status, ended_ns=self.info.ended_ns, collectives=self._failure_collectives("recent"),
            steps=self.table("steps"), clock_ns=time.time_ns())

    # ------------------------------------------------------------------------------------------ stragglers

    def arrival_collectives(self) -> pd.DataFrame:
        """The collectives steps wait for (``tables.step_collectives``: no checkpoint group) with ``enqueue_ns`` on
        each group's arrival clock: the device arrival (``arrive_ns``) in groups of a CUDA run, the host enqueue
        elsewhere (the table itself on CPU runs without a checkpoint group)."""
        return self._memo("arrival_colls", lambda: _tables.step_collectives(
            _arrivals.on_arrival_clock(self.table("collectives"))))

    def arrival_clocks(self) -> pd.DataFrame:
        """Per group (pg, pg_ranks): ``device`` or ``host``, the clock its arrivals are read on."""
        return self._memo("arrival_clocks", lambda: _arrivals.arrival_clocks(self._group_rows()))

    def _group_rows(self) -> pd.DataFrame:
        # one row per group and p2p link (kept at compaction): what arrival clocks and linked ranks read
        return self._memo("group_rows", lambda: self._derived(_derived.GROUPS, lambda: (
            self._part_tables().group_rows if self._collective_parts() is not None
            else _arrivals.group_rows(self.table("collectives")))))

    def _collective_parts(self) -> CollectiveParts | None:
        # the source's collectives in parts (``store.kineto.CollectiveParts``) when it reads them so (a trace folder:
        # a process group at a time), else None (the whole table is read)
        return self._memo("collective_parts", lambda: self.source.collective_parts()
                          if hasattr(self.source, "collective_parts") else None)

    def _part_tables(self) -> _groups.PartTables:
        # bandwidth, group rows and collectives' clock of a source read in parts (read with the device clock's parts)
        return self._collective_passes()[1]

    def _device_clock(self) -> _groups.DeviceClock:
        # matching, clock offsets and arrivals, a part at a time (the whole table as one part when not in parts)
        return self._collective_passes()[0]

    def _collective_passes(self) -> tuple[_groups.DeviceClock, _groups.PartTables | None]:
        def compute() -> tuple[_groups.DeviceClock, _groups.PartTables | None]:
            parts = self._collective_parts()
            readers = parts.readers if parts is not None else [lambda: self.table("collectives")]
            ranks = set(parts.ranks) if parts is not None else set(
                self.table("collectives")["rank"].dropna().astype(int))
            return _groups.device_clock(readers, world_size=self.world_size, by=self.matching_method(),
                                        ranks_present=ranks | set(self.table("steps")["rank"].dropna().astype(int)),
                                        with_tables=parts is not None)
        return self._memo("collective_passes", compute)

    def arrival_clock(self) -> str | None:
        """The clock of the collectives' arrivals: ``host``, ``device``, or ``mixed`` (groups on both); on a trace
        folder, the clock of its collectives' timing (NCCL kernels: ``device``; gloo annotations: ``host``); None
        without collectives."""
        return self._memo("arrival_clock", lambda: None if self._group_rows().empty
                          else _clock_names.clock_of(self.arrival_clocks()["clock"]) if self.info.clock_aligned
                          else self._part_tables().timing_clock if self._collective_parts() is not None
                          else _clock_names.clock_of_timing(self.table("collectives")["timing"]))

    def collective_skew(self) -> pd.DataFrame:
        """Per collective (pg, pg_ranks, seq): arrival skew, late rank, its margin, victims' mean wait."""
        return self._memo("skew", lambda: _stragglers.collective_skew(self.arrival_collectives()))

    def host_collective_skew(self) -> pd.DataFrame:
        """``collective_skew`` on host enqueue times (the hang verdicts: a stuck collective's device arrival may
        never resolve)."""
        return self._memo("host_skew", lambda: self.collective_skew()
                          if self.arrival_collectives() is self.table("collectives")
                          else _stragglers.collective_skew(self.table("collectives")))

    def collective_waits(self) -> pd.DataFrame:
        """Per collective and member: how long it waited for the last arrival."""
        return self._memo("waits", lambda: _stragglers.collective_waits(self.arrival_collectives(),
                                                                        self.collective_skew()))

    def late_rank_per_step(self) -> pd.DataFrame:
        """Per (group or point-to-point link, analysed step): the last arriver of the most skewed collective, or
        the later side of the most delayed send/recv pair, and its margin (kept at compaction: ``derived_tables``)."""
        return self._memo("late_rank", lambda: _tables.only_steps(self._derived(_derived.LATE_RANK, lambda: (
            _arrivals.late_per_step(self.collective_skew(), self.arrival_collectives(), self.table("steps"))),
            analysed=True), self.steps_analyzed()))

    def rank_lateness(self) -> pd.DataFrame:
        """Per (group, analysed step, rank): arrival minus the median arrival of its peers, share of the step (kept
        at compaction: ``derived_tables``)."""
        return self._memo("lateness", lambda: _tables.only_steps(self._derived(_derived.LATENESS, lambda: (
            _stragglers.rank_lateness(self.arrival_collectives(), self.table("steps"))), analysed=True),
            self.steps_analyzed()))

    def _derived(self, name: str, compute: Callable[[], pd.DataFrame], *, analysed: bool = False) -> pd.DataFrame:
        # a compacted run's per-step frame kept at compaction when it is still the whole run's, else computed;
        # analysed: the caller keeps only the analysed steps' rows (only_steps), so the kept frame is read from the
        # first to the last of them alone (its rows in the same order; the whole frame when none is there)
        span = self.steps_analyzed() if analysed else []
        kept = self._kept(name, steps=(span[0], span[-1])) if span else self._kept(name)
        # no rows in the span: the whole frame (as only_steps then returns it); None is the same with or without
        # steps (the store keeps no frame of it now), so it is not asked twice
        if span and kept is not None and kept.empty:
            kept = self._kept(name)
        return kept if kept is not None else compute()

    def _kept(self, name: str, *, steps: tuple[int, int] | None = None) -> pd.DataFrame | None:
        # the whole-run frame of a derived table kept at compaction (of steps first..last when given), None when
        # the source has none (or not now)
        kept = getattr(self.source, "derived_table", None)
        kept = (kept(name, _derived.KEY, deriver=_derived.deriver, steps=steps, order=_derived.read_order(name))
                if kept is not None else None)
        return _derived.whole_run_frame(name, kept) if kept is not None else None

    def straggler_scores(self) -> pd.DataFrame:
        """Per (group, rank): worst-window median lateness, share of steps late, mean wait imposed on peers."""
        o = self.options

        def compute() -> pd.DataFrame:
            memo = self._score_memo()
            with memo.lock if memo is not None else contextlib.nullcontext():
                return _scores.straggler_scores(
                    self.rank_lateness(), cpu_throttled=self.cpu_throttled(), cpu_wait=self.cpu_wait(),
                    cpu_busy=self.cpu_busy(),
                    window_steps=o.window_steps, min_lateness_frac=o.min_lateness_frac,
                    min_positive_frac=o.min_positive_frac, memo=memo)
        return self._memo("scores", compute)

    def _score_memo(self) -> ScoreMemo | None:
        # a running run's scoring keeps its per-window figures for the next analysis of the same store (a window's
        # store), which then scores only the windows of the steps it added
        if self.status != "running":
            return None
        try:
            return _SCORE_MEMOS.setdefault(getattr(self.source, "store", self.source), ScoreMemo())
        except TypeError:    # a source that cannot be weakly referenced keeps none
            return None

    def cpu_throttled(self) -> pd.DataFrame | None:
        """Per (rank, step): the share of the step its CPU cgroup's quota held it back (``cpu_throttle``); None when
        no rank's host sampler read the kernel's throttle counter."""
        return self._host_counter("cpu_throttled", _cpu_throttle.cpu_throttled_per_step)

    def cpu_wait(self) -> pd.DataFrame | None:
        """Per (rank, step): the share of the step its main thread waited for a CPU (``cpu_throttle``); None when no
        rank's host sampler read the kernel's schedstat."""
        return self._host_counter("cpu_wait", _cpu_throttle.cpu_wait_per_step)

    def cpu_busy(self) -> pd.DataFrame | None:
        """Per (rank, step): the CPU time its process used over the step's wall time (``cpu_throttle``); None when
        no rank's host sampler recorded it."""
        return self._host_counter("cpu_busy", _cpu_throttle.cpu_busy_per_step)

    def _host_counter(self, key: str, per_step: Callable[[pd.DataFrame, pd.DataFrame], pd.DataFrame]
                      ) -> pd.DataFrame | None:
        # a host sampler counter per (rank, step) of the completed steps, memoized; None when no sample carries it
        def compute() -> pd.DataFrame | None:
            frame = per_step(self._sampler_rows(), self.completed_table("steps"))
            return None if frame.empty else frame
        return self._memo(key, compute)

    def _sampler_rows(self) -> pd.DataFrame:
        # the devices columns the verdicts read (device health and Xids; each sample's rank and time, the host
        # counters and the throttle reasons for STRAGGLER, RANK_STALL and liveness): of a source that reads some
        # columns of a table (a run's store) only those, unless the whole table is held already (a large run's
        # costs several times more)
        def compute() -> pd.DataFrame:
            read = getattr(self.source, "arrow", None)
            if read is None or "table:devices" in self._cache:
                return self.table("devices")
            columns = list(dict.fromkeys(_devices.HEALTH_INPUT_COLUMNS + _cpu_throttle.SAMPLE_COLUMNS))
            # (in the table's order: sums over it stay exact)
            return arrow_to_frame(read("devices", columns=columns), "devices")
        return self._memo("sampler_rows", compute)

    def rank_stalls(self) -> pd.DataFrame:
        """Per (rank, step) where a rank stalled for seconds while its groups waited for it (late to a collective,
        or frozen inside one: ``rank_stalls.rank_stalls``); empty without aligned clocks (a trace folder)."""
        return self._memo("rank_stalls", lambda: _rank_stalls.rank_stalls(
            self._late_rank_with_between_steps(), bandwidth=self.collective_bandwidth(),
            exposure=self.comm_exposure(),
            steps=self.table("steps"), devices=self._sampler_rows(), checkpoints=self.table("checkpoints"),
            step_ns=self.step_time_ns())
            if self.info.clock_aligned else pd.DataFrame({c: [] for c in _rank_stalls.STALL_COLUMNS}))

    def _late_rank_with_between_steps(self) -> pd.DataFrame:
        # late_rank_per_step plus the collectives issued between two steps in a step's time (arrivals.
        # late_between_steps), read with the filter pushed down: few rows, never the whole table
        late = self.late_rank_per_step()
        read = getattr(self.source, "arrow", None)
        if read is None:
            rows = self.table("collectives")
        else:
            rows = _failure_reads.collectives_frame(read("collectives", filter=pc.field("step").is_null()
                                                         | (pc.field("step") < 0)))
        between = _tables.only_steps(_arrivals.late_between_steps(
            _tables.step_collectives(_arrivals.on_arrival_clock(rows)), self.table("steps")), self.steps_analyzed())
        return late if between.empty else pd.concat([late, between], ignore_index=True)

    def rank_stall_findings(self) -> list[Finding]:
        """RANK_STALL: one per rank that stalled (``rank_stalls``)."""
        return self._memo("f:rank_stalls", lambda: _rank_stalls.detect_rank_stalls(
            self.rank_stalls(), wall_ns=self.wall_ns(), hosts={r.rank: r.host for r in self.info.ranks},
            axis_of_pg=self.group_axis))

    def straggler_causes(self) -> pd.DataFrame:
        """Per (group, rank) late enough to be a straggler candidate: excess data/compute/communication time in its
        late steps, throttling, cause."""
        return self._memo("causes", lambda: _causes.straggler_causes(
            self.straggler_scores(), self.rank_lateness(), self.completed_table("steps"), self._sampler_rows(),
            blocked=self._blocked(), min_lateness_frac=self.options.min_lateness_frac))

    def _blocked(self) -> pd.DataFrame:
        # per (rank, step, group): time blocked on peers outside it (kept at compaction), else from the rows of the
        # candidates' windows only
        return self._memo("blocked", lambda: self._derived(_derived.BLOCKED, lambda: _causes.window_blocked(
            self.arrival_collectives(), self.straggler_scores(), min_lateness_frac=self.options.min_lateness_frac)))

    def pipeline_own_delay(self) -> pd.DataFrame:
        """Per (pipeline rank, analysed step): time neither running a pipeline action nor waiting for its input."""
        # the rank's time in its other groups' collectives is not its own delay (read only for a pipelined run)
        return self._memo("own_delay", lambda: _tables.only_steps(_stragglers.pipeline_own_delay(
            self.completed_table("pipeline"), self.completed_table("steps"), self._pipeline_groups(),
            collectives=None if self.table("pipeline").empty
            else _tables.step_collectives(self.completed_table("collectives"))), self.steps_analyzed()))

    def pipeline_stage_excess(self) -> pd.DataFrame:
        """Per (pipeline rank, analysed step): its own time on its stage and its excess over the same stage of the
        other pipelines (share of the step)."""
        return self._memo("stage_excess", lambda: _pipeline_delay.stage_excess(
            self.completed_table("pipeline"), self.completed_table("steps"), self.pipeline_own_delay(),
            self._pipeline_groups(), replicas=self._pipeline_replicas()))

    def _pipeline_replicas(self) -> dict[int, int]:
        # rank -> its model replica (its pipeline and its tensor-parallel peers' pipelines)
        return self._memo("pipeline_replicas", lambda: _pipeline_delay.pipeline_replicas(
            self._pipeline_groups(), self._group_rows(), axis_of_pg=self.group_axis))

    def _pipeline_groups(self) -> dict:
        # without pipeline rows there is no need to find the pipelines among the collectives
        return self._memo("pipeline_groups", lambda: _stragglers.pipeline_groups(self._group_rows())
                          if not self.table("pipeline").empty else {})

    def _group_clock(self) -> dict[tuple[str, str], str]:
        c = self.arrival_clocks()
        return dict(zip(zip(c["pg"], c["pg_ranks"]), c["clock"]))

    def group_axis(self, pg: str) -> str | None:
        """``dp``/``tp``/``pp`` of a process-group name; the default group (``world``) is ``dp`` in a pure
        data-parallel layout, or without a layout unless the groups say otherwise (``tables.world_is_dp``)."""
        world_dp = self._memo("world_is_dp", lambda: _tables.world_is_dp(
            self.layout(), self.table("groups")["pg"].dropna().unique(), pipelined=not self.table("pipeline").empty))
        return _tables.axis_of_group(pg, layout=self.layout(), world_is_dp=world_dp)

    def stragglers(self) -> list[Finding]:
        """STRAGGLER findings: from host arrivals when the source's clocks are aligned (a dtprobe run), else from
        device arrivals on clocks aligned by the collectives (``device_stragglers``, a trace folder); then the
        stage-trend view's (``stage_trend``) of pipeline ranks no other finding names."""
        o = self.options

        def compute() -> list[Finding]:
            if not self.info.clock_aligned:
                return self.device_stragglers()
            found = _stragglers.detect_stragglers(
                self.straggler_scores(), self.straggler_causes(), links=_stragglers.linked_ranks(self._group_rows()),
                min_lateness_frac=o.min_lateness_frac, min_positive_frac=o.min_positive_frac,
                injected=self.injected_faults("straggler"), lateness=self.rank_lateness(),
                axis_of_pg=self.group_axis, own_delay_ns=_pipeline_delay.median_own_delay(self.pipeline_own_delay()),
                slow_link_ranks=_links.slow_link_ranks(self.slow_links()),
                group_clock=self._group_clock(), stage_excess=self.pipeline_stage_excess(),
                schedule_gain=self._schedule_gain, cpu_busy=self.cpu_busy(),
                host_compute=self.info.device_name == "cpu")
            named = {r for f in found if f.severity != "info" for r in f.ranks}
            clock = _clock_names.clock_of(self.table("pipeline")["clock"])
            return found + _stage_trend.detect_stage_trends(self.stage_trends(), named=named, clock=clock,
                                                            cpu_throttled=self.cpu_throttled(),
                                                            cpu_wait=self.cpu_wait())
        return self._memo("f:stragglers", compute)

    def stage_trends(self) -> pd.DataFrame:
        """Per pipeline rank no other pipeline runs the stage of: its actions' run time, relative to its pipeline
        peers', in its first qualifying window against the run's first (``stage_trend.stage_trends``)."""
        return self._memo("stage_trends", lambda: _stage_trend.stage_trends(
            self.pipeline_stage_excess(), self.completed_table("steps"), replicas=self._pipeline_replicas(),
            steps_analyzed=self.steps_analyzed(), window_steps=self.options.window_steps))

    def _schedule_gain(self, rank: int, first_step: int, last_step: int) -> float | None:
        # ns per step a pipelined rank costs the step by the schedule simulator (pipeline_delay.schedule_gain_ns)
        return self._memo(f"schedule_gain:{rank}:{first_step}:{last_step}", lambda: _pipeline_delay.schedule_gain_ns(
            self.completed_table("pipeline"), self.pipeline_own_delay(), self.pipeline_shape(),
            self._pipeline_groups(), rank, first_step, last_step, replicas=self._pipeline_replicas())
            if not self.table("pipeline").empty else None)

    # ------------------------------------------------------------------------------------------ device clock

    def device_collectives(self) -> pd.DataFrame:
        """Group collectives timed on the device (NCCL kernels), each with its group's members spelled out."""
        return self._memo("device_colls", lambda: _matching.device_collectives(
            self.table("collectives"), world_size=self.world_size))

    def group_coverage(self) -> pd.DataFrame:
        """Per group: members, how many are in the source, whether it is matched, and why not."""
        return self._device_clock().coverage

    def matching_method(self) -> str:
        """``seq`` when the source's sequence numbers name the same collective on every member, else ``order``."""
        return "order" if self.info.collective_seq == "order" else "seq"

    def matched_collectives(self) -> pd.DataFrame:
        """Per (collective, member) of fully present groups: matched, or why refused (op/size/count mismatch); every
        group's rows at once (``collective_matching`` reads a part at a time)."""
        return self._memo("matched", lambda: _matching.match_collectives(
            self.device_collectives(), self.group_coverage(), by=self.matching_method()))

    def collective_matching(self) -> dict:
        """Method, collectives matched and refused (by reason), groups not judged and why."""
        return self._device_clock().matching

    def clock_offsets(self) -> pd.DataFrame:
        """Per rank: offset onto the lowest rank's clock from the collectives' ends, residual, collectives used."""
        return self._device_clock().offsets

    def clock_alignment(self) -> str:
        """``host``, ``device_collectives``, or why the ranks' clocks could not be aligned."""
        return _clocks.alignment_label(clock_aligned=self.info.clock_aligned, offsets=self.clock_offsets()
                                       if not self.info.clock_aligned else pd.DataFrame(),
                                       coverage=self.group_coverage() if not self.info.clock_aligned
                                       else pd.DataFrame())

    def clock_resync(self) -> pd.DataFrame:
        """Per rank of a dtprobe run whose host clock offset was re-measured while it ran: samples, first and last
        offset, largest drift from the attach offset, whether re-measuring failed (``metrics.run.clock_resync``)."""
        return self._memo("clock_resync", lambda: _clocks.clock_resync(self.table("clock")))

    def device_arrivals(self) -> pd.DataFrame:
        """Per (collective, member) on the aligned device clock: lateness, wait, transfer, started last."""
        return self._memo("dev_arrivals", lambda: _device_arrivals.member_arrivals(
            _clocks.corrected(self.matched_collectives(), self.clock_offsets())))

    def device_collective_transfer(self) -> pd.DataFrame:
        """Per collective: last rank, wait, true latency (shortest member), end spread, algbw/busbw."""
        return self._memo("dev_transfer", lambda: _device_arrivals.collective_transfer(self.device_arrivals()))

    def arrival_summary(self) -> pd.DataFrame:
        """Per (rank, group): collectives, share started last, median lateness, waits it caused."""
        return self._device_clock().arrivals

    def device_stragglers(self) -> list[Finding]:
        """STRAGGLER from device arrivals (groups with at least ``device_arrivals.MIN_MATCHED_COLLECTIVES``)."""
        return self._memo("f:dev_stragglers", lambda: _device_arrivals.detect_device_stragglers(
            self.arrival_summary(), profiled_us=_device_arrivals.profiled_us(self.table("steps")),
            min_positive_frac=self.options.min_positive_frac, min_wait_frac=self.options.min_lateness_frac,
            matched_by=self.matching_method(), axis_of_pg=self.group_axis))

    def slow_links(self) -> list[Finding]:
        """SLOW_LINK: node pairs whose crossing collectives' bus bandwidth dropped mid-run (multi-node runs only;
        none without the ranks' nodes)."""
        return self._memo("f:links", lambda: _links.find_slow_links(
            _tables.only_steps(self.collective_bandwidth(), self.steps_analyzed()), self.info.ranks,
            self.table("steps"), axis_of_pg=self.group_axis))

    def injected_faults(self, kind: str) -> dict[int, dict]:
        """rank -> detail of the first injected fault of ``kind`` (cross-check of a verdict)."""
        return injected_faults(self.table("faults"), kind)

    # ------------------------------------------------------------------------------------------ overlap / time

    def comm_exposure(self) -> pd.DataFrame:
        """Per (rank, step): communication time, exposed tail, straggler wait, exposed share, overlap (from the
        collectives on their arrival clock; empty without aligned clocks, e.g. a trace folder: use the kernel-level
        overlap)."""
        return self._memo("exposure", lambda: self._derived(_derived.EXPOSURE, lambda: _exposed.comm_exposure(
            self.arrival_collectives(), self.table("steps"), self.collective_skew())) if self.info.clock_aligned
            else pd.DataFrame({c: [] for c in _exposed.EXPOSURE_COLUMNS}))

    def exposure_by_rank(self) -> pd.DataFrame:
        """Per rank over the analysed steps: comm / exposed / straggler-wait shares of the step, overlap."""
        return self._memo("exposure_rank", lambda: _exposed.exposure_by_rank(
            self.comm_exposure(), step_ids=self.steps_analyzed() or None))

    def kernel_exposure_by_rank(self) -> pd.DataFrame:
        """Per rank from GPU kernels: comm / exposed comm shares of the kernel span, overlap; empty without kernels."""
        return self._memo("kernel_exposure", lambda: _exposed.kernel_exposure_by_rank(
            self.comm_comp_overlap(), self.temporal_breakdown()))

    def trace_metrics(self) -> _trace_metrics.TraceMetrics:
        """Kernel-level metrics of the source's kernels (``trace_metrics.TraceMetrics``: per rank and per step)."""
        return self._memo("trace_metrics", lambda: _trace_metrics.kernel_metrics(
            self.table("kernels"), self.table("collectives"), steps_analyzed=self.steps_analyzed()))

    def temporal_breakdown(self) -> pd.DataFrame:
        """Per rank: idle / compute / non-compute share of the GPU kernel span (HTA semantics); empty without
        kernels."""
        return self._memo("temporal", lambda: _trace_metrics.kernel_breakdowns(self.source, self.table).temporal)

    def comm_comp_overlap(self) -> pd.DataFrame:
        """Per rank: share of communication-kernel time overlapped by compute kernels; empty without kernels."""
        return self._memo("overlap", lambda: _trace_metrics.kernel_breakdowns(self.source, self.table).overlap)

    def kernel_breakdown(self) -> pd.DataFrame:
        """Exclusive time per kernel-type combination over all ranks; empty without kernels."""
        return self._memo("kernel_types", lambda: _trace_metrics.kernel_breakdowns(
            self.source, self.table).kernel_types)

    def exposed_comm(self) -> list[Finding]:
        """EXPOSED_COMM from kernels when known (exposed comm kernel time), else from the host collectives tail over
        the analysed steps no rank stalled in (``_exposure_without_stalls``); a SLOW_LINK comes first in its advice."""
        return self._memo("f:exposed", lambda: _exposed.detect_exposed_comm_of(
            self._exposure_without_stalls(), self.kernel_exposure_by_rank(),
            min_exposed_frac=self.options.min_exposed_frac, host_clock=self.arrival_clock(),
            slow_links=[f.evidence for f in self.slow_links()]))

    def _exposure_without_stalls(self) -> pd.DataFrame:
        # ``exposure_by_rank`` without the steps a rank stalled in (``rank_stalls``): a rank frozen inside a
        # collective holds its peers there for seconds, which is RANK_STALL's loss, not communication that better
        # overlap would hide (a 2 s SIGSTOP made a clean run's 8% exposure 18%, a warning)
        stalled = self.rank_stalls()
        if stalled.empty:
            return self.exposure_by_rank()
        exposure = self.comm_exposure()
        by_rank = _exposed.exposure_by_rank(exposure[~exposure["step"].isin(stalled["step"])],
                                            step_ids=self.steps_analyzed() or None)
        return by_rank if not by_rank.empty else self.exposure_by_rank()   # every step stalled: all of them

    # ------------------------------------------------------------------------------------------ pipeline

    def pipeline_bubble(self) -> pd.DataFrame:
        """Per (rank, step): pipeline window, busy time, bubble fraction."""
        return self._memo("bubble", lambda: _bubble.pipeline_bubble(self.completed_table("pipeline")))

    def bubble_by_rank(self) -> pd.DataFrame:
        """Mean bubble per rank over the analysed steps."""
        return self._memo("bubble_rank", lambda: _bubble.bubble_by_rank(self.pipeline_bubble(),
                                                                        step_ids=self.steps_analyzed() or None))

    def pipeline_shape(self) -> _bubble.PipelineShape | None:
        """Schedule, ranks, virtual stages, micro-batches and measured action costs (``PipelineShape``) or None."""
        return self._memo("pshape", lambda: _bubble.pipeline_shape(
            self.completed_table("pipeline"), schedule=self.layout().get("pp_schedule")))

    def pipeline_findings(self) -> list[Finding]:
        """PIPELINE_BUBBLE with the ideal bubble and the predicted gain of doubling the micro-batches."""
        return self._memo("f:bubble", lambda: _bubble.detect_pipeline_bubble(
            self.bubble_by_rank(), self.pipeline_shape(), step_ns=self.step_time_ns(),
            min_bubble_frac=self.options.min_bubble_frac, clock=_clock_names.clock_of(self.table("pipeline")["clock"])))

    # ------------------------------------------------------------------------------------------ AMP / ckpt

    def amp_steps(self) -> pd.DataFrame:
        """Per step: overflow, skipped, overflowing ranks, loss scale before/after."""
        return self._memo("amp", lambda: _amp.amp_steps(self.completed_table("amp")))

    def amp_findings(self) -> list[Finding]:
        """AMP_OVERFLOW (rate, bursts, scale at its floor)."""
        return self._memo("f:amp", lambda: _amp.detect_amp_overflow(self.amp_steps()))

    def checkpoint_events(self) -> pd.DataFrame:
        """Per checkpoint: slowest rank's blocking/async/total time, bytes, ok."""
        return self._memo("ckpt", lambda: _ckpt.checkpoint_events(self.table("checkpoints")))

    def checkpoint_summary(self) -> dict:
        """Saves: blocking share of wall time, interval, Young/Daly interval for ``options.mtbf_hours``."""
        return self._memo("ckpt_sum", lambda: _ckpt.checkpoint_summary(
            self.checkpoint_events(), wall_ns=self.wall_ns(), step_ns=self.step_time_ns(),
            mtbf_hours=self.options.mtbf_hours, checkpoints=self.table("checkpoints")))

    def wall_ns(self) -> float | None:
        """First step start to last step end over all ranks."""
        return _tables.wall_ns(self.table("steps"))

    def checkpoint_findings(self) -> list[Finding]:
        """CHECKPOINT_STALL."""
        return self._memo("f:ckpt", lambda: _ckpt.detect_checkpoint_stall(
            self.checkpoint_events(), self.checkpoint_summary(), injected=self.injected_faults("slow-ckpt"),
            world_size=self.world_size))

    # ------------------------------------------------------------------------------------------ comm efficiency

    def collective_bandwidth(self) -> pd.DataFrame:
        """Per collective: transfer time, algbw, busbw (nccl-tests factors) (kept at compaction: ``derived_tables``)."""
        return self._memo("bw", lambda: self._derived(_derived.BANDWIDTH, lambda: (
            self._part_tables().bandwidth if self._collective_parts() is not None
            else _comm.collective_bandwidth(self.table("collectives")))))

    def baseline_bandwidth(self) -> pd.DataFrame | None:
        """``collective_bandwidth`` of the baseline; None without a baseline."""
        return self._memo("baseline_bw", lambda: _comm.collective_bandwidth(self.baseline_table("collectives"))
                          if self.baseline is not None else None)

    def bandwidth_fit(self) -> tuple[float, float] | None:
        """(latency ns, bandwidth bytes/s) fitted on the most common op, or None."""
        return self._memo("bw_fit", lambda: _comm.latency_bandwidth_fit(self.collective_bandwidth()))

    def bandwidth_by_size(self) -> pd.DataFrame:
        """Per (op, size bucket): count, time, median algbw/busbw, latency-bound flag."""
        return self._memo("bw_size", lambda: _comm.bandwidth_by_size(self.collective_bandwidth(),
                                                                     fit=self.bandwidth_fit()))

    def comm_findings(self) -> list[Finding]:
        """COMM_INEFFICIENT (latency-bound small messages with bucket advice; busbw vs a given link peak)."""
        peak = self.options.peak_busbw_gbps
        return self._memo("f:comm", lambda: _comm.detect_comm_inefficient(
            self.collective_bandwidth(), self.bandwidth_by_size(), fit=self.bandwidth_fit(),
            step_ns=self.step_time_ns(), num_steps=len(self.steps_analyzed()) or 1,
            peak_busbw_bytes_per_s=peak * 1e9 / 8 if peak else None))

    # ------------------------------------------------------------------------------------------ compression

    def compression(self) -> pd.DataFrame:
        """Per method: bytes before/after, ratio, encode/decode time per step."""
        return self._memo("compression", lambda: _compression.compression_summary(
            self.completed_table("compression")))

    def loss_gap(self) -> pd.DataFrame:
        """Loss of the last common steps vs the baseline run (empty without a baseline); a step redone after a
        restart, in either run, is read from the attempt that redid it."""
        def compute() -> pd.DataFrame:
            baseline = self.baseline_table("steps")
            return _compression.loss_gap(self.completed_table("steps"),
                                         None if baseline is None else _tables.completing_attempts(baseline))
        return self._memo("loss_gap", compute)

    def compression_findings(self) -> list[Finding]:
        """COMPRESSION per method (ratio, time saved net of encoding, loss gap vs the baseline)."""
        return self._memo("f:compression", lambda: _compression.detect_compression(
            self.compression(), self.loss_gap(),
            algbw_bytes_per_s=_compression.median_allreduce_algbw(self.collective_bandwidth()),
            step_ns=self.step_time_ns(), baseline=str(self.baseline.path) if self.baseline is not None else None,
            measured_saved_ns=_compression.measured_saving_ns(self.collective_bandwidth(), self.baseline_bandwidth())))

    # ------------------------------------------------------------------------------------------ devices / hangs

    def device_health(self) -> pd.DataFrame:
        """Per (rank, gpu): throttling, power cap, temperature, memory pressure, XIDs."""
        return self._memo("health", lambda: _devices.device_health(self._sampler_rows()))

    def device_findings(self) -> list[Finding]:
        """DEVICE_THROTTLE, DEVICE_XID, MEMORY_PRESSURE."""
        return self._memo("f:devices", lambda: _devices.detect_device_health(self.device_health()))

    def _hang_wait_ns(self) -> int:
        # a finished run's stuck collective is a hang however short its wait; a running one's after the timeout
        return 0 if self.status != "running" else int(self.options.hang_timeout_s * 1e9)

    def missing_arrivals(self) -> pd.DataFrame:
        """Per group and attempt: the first collective some members never reached, or every member entered and
        none finished (and how long the others waited)."""
        return self._memo("missing", lambda: _hangs.missing_arrivals(
            _stragglers.collective_skew(self.unfinished_collectives()), self.unfinished_collectives(),
            now_ns=self.now_ns(), min_wait_ns=self._hang_wait_ns()))

    def unfinished_collectives(self) -> pd.DataFrame:
        """Every row (host clock) of the collectives some member never finished: what the hang verdicts read."""
        return self._memo("unfinished", lambda: _hangs.unfinished_rows(self._failure_collectives("unfinished")))

    def _failure_rows(self) -> _failure_reads.FailureRows | None:
        # the few collective rows the failure verdicts read, with filters pushed down (None: whole table)
        return self._memo("failure_rows", lambda: _failure_reads.read_failure_rows(self.source, self.table("steps")))

    def _failure_collectives(self, part: str) -> pd.DataFrame:
        # a FailureRows frame ("unfinished", "p2p", "recent", "doing"), or the whole table it stands for
        rows = self._failure_rows()
        return self.table("collectives") if rows is None else getattr(rows, part)

    def last_seen(self) -> pd.DataFrame:
        """Per rank: last step and last collective recorded."""
        return self._memo("last_seen", lambda: _hangs.last_seen(self.table("steps"),
                                                                self._failure_collectives("recent")))

    def p2p_stalls(self) -> pd.DataFrame:
        """Per stuck send/recv: the peer that never issued the matching op (and how long it waited)."""
        return self._memo("p2p_stalls", lambda: _hangs.p2p_stalls(
            self._failure_collectives("p2p"), now_ns=self.now_ns(), min_wait_ns=self._hang_wait_ns()))

    def stalls(self) -> pd.DataFrame:
        """Every stuck collective (``missing_arrivals``) and send/recv (``p2p_stalls``), oldest first."""
        return self._memo("stalls", lambda: _hangs.stalls(self.missing_arrivals(), self.p2p_stalls()))

    def attempts(self) -> list[dict]:
        """run.json ``attempts``: the launcher's per-attempt record of every rank's exit ([] without one)."""
        return _liveness.attempts_of(self.manifest)

    def rank_exits(self) -> pd.DataFrame:
        """Per (rank, restart): how it ended (exit code, signal, first failure, error; probe close status/reason)."""
        return self._memo("exits", lambda: _liveness.rank_exits(self.attempts(), self.table("lifecycle")))

    def activity(self) -> _liveness.Activity:
        """Every rank's signs of life (the timestamps of all its rows), for liveness verdicts."""
        rows = self._failure_rows()
        return self._memo("activity", lambda: _liveness.Activity(     # its tables read at its first question
            lambda: {t: self.table(t) for t in ("steps", "faults", "lifecycle")}
            | {"devices": self._sampler_rows(), "collectives": self._failure_collectives("recent")},
            collectives_from=rows.recent_from if rows else None, older_collectives=rows.rank_rows if rows else None))

    def attempt_starts(self) -> list[int]:
        """Start (ns) of attempts 1, 2, ... (torchrun restarts) from the launcher or the first rows of each."""
        return self._memo("attempt_starts", lambda: _liveness.attempt_starts(
            self.attempts(), {"lifecycle": self.table("lifecycle"), "steps": self.table("steps"),
                              "collectives": self._failure_collectives("recent")}))

    def restarts(self) -> list[dict]:
        """The run's restarts: manifest ``restarts`` completed by the runtime's ``restart`` fault rows."""
        return self._memo("restarts", lambda: _crashes.restarts_of(self.manifest, self.table("faults")))

    def crash_events(self) -> pd.DataFrame:
        """Per failed attempt: the rank that died first, step, how, cause, what it was doing, recovery."""
        return self._memo("crash_events", lambda: _crashes.crash_events(
            self.rank_exits(), activity=self.activity(), collectives=self._failure_collectives("doing"),
            steps=self.table("steps"), devices=self._sampler_rows, restarts=self.restarts(),
            status=self.status, attempts_known=bool(self.attempts()), starts=self.attempt_starts(),
            stale_ns=int(self.options.hang_timeout_s * 1e9), now_ns=self.now_ns(), stalls=self.stalls()))

    def collective_mismatches(self) -> pd.DataFrame:
        """Per group and attempt: the first collective its members issued differently (or one skipped, or one
        ended its program while the others waited in it)."""
        return self._memo("mismatches", lambda: _mismatch.with_ended(
            _mismatch.collective_mismatches(self._mismatch_calls(), self.table("steps")),
            _mismatch.ended_mismatches(self.stalls(), self._failure_collectives("unfinished"), self.rank_exits(),
                                       self.table("steps"), self.attempt_starts())))

    def _mismatch_calls(self) -> pd.DataFrame:
        # the calls compared: of a run whose suspect collectives were kept at compaction only their groups' rows
        # (none in a clean run), else every call (read projected when the source can)
        rows = self._failure_rows()
        return self.table("collectives") if rows is None else rows.group_calls(self._kept(_derived.SUSPECTS))

    def mismatch_findings(self) -> list[Finding]:
        """COLLECTIVE_MISMATCH (none without whole per-rank records, e.g. profiler windows each rank cut alone)."""
        return self._memo("f:mismatch", lambda: _mismatch.detect_mismatches(
            self.collective_mismatches(), axis_of_pg=self.group_axis) if self.info.whole_record else [])

    def corrupt_checkpoints(self) -> list[Finding]:
        """CHECKPOINT_CORRUPT from the ranks' observed ``corrupt-ckpt`` rows."""
        return self._memo("f:corrupt", lambda: _corrupt.detect_corrupt_checkpoints(self.table("faults")))

    def hangs(self) -> list[Finding]:
        """HANG (stuck collectives and send/recv, from collective rows; liveness of each stuck rank) and RANK_CRASH
        (from attempts/lifecycle/restarts), neither for a group a COLLECTIVE_MISMATCH explains; none without whole
        per-rank records (a profiler window's edge is no hang)."""
        return self._memo("f:hangs", lambda: _failures.detect_failures(
            mismatches=self.collective_mismatches(), stalls=self.stalls(), faults=self.table("faults"),
            collectives=self._failure_collectives("unfinished"), last_seen=self.last_seen(), activity=self.activity(),
            exits=self.rank_exits(), nodes={r.rank: r.node_rank for r in self.info.ranks},
            starts=self.attempt_starts(), crash_events=self.crash_events(), num_restarts=len(self.restarts()),
            injected_crash_ranks=injected_ranks(self.table("faults"), "crash"), axis_of_pg=self.group_axis,
            hang_ns=int(self.options.hang_timeout_s * 1e9)) if self.info.whole_record else [])

    # ------------------------------------------------------------------------------------------ throughput

    def flops_per_token(self) -> float | None:
        """Model training FLOPs per token: config ``model_flops_per_token``, else the built-in preset's shape."""
        return _throughput.flops_per_token(self.config)

    def device_peak(self) -> tuple[float | None, str]:
        """(peak FLOP/s per device, reason) for the source's device model and the config's compute dtype."""
        return _peaks.peak_flops(self.info.device_name, (self.config.get("precision") or {}).get("dtype", "fp32"))

    def throughput(self) -> pd.DataFrame:
        """Per step: wall time, tokens (dp ranks only), tokens/s, model FLOP/s, MFU."""
        return self._memo("throughput", lambda: _throughput.throughput(
            _throughput.dp_tokens(self.completed_table("steps"), layout=self.layout()),
            flops_per_token=self.flops_per_token(), peak_flops_per_device=self.device_peak()[0],
            num_devices=self.world_size or 0))

    def throughput_summary(self) -> dict:
        """Median step time, tokens/s, TFLOP/s, MFU (null with the reason, never a made-up peak)."""
        return self._memo("tp_sum", lambda: _throughput.throughput_summary(
            self.throughput(), step_ids=self.steps_analyzed(), peak_reason=self.device_peak()[1],
            flops_per_token=self.flops_per_token()))

    # ------------------------------------------------------------------------------------------ all together

    def findings(self) -> list[Finding]:
        """Every finding, worst first; a finding whose predicted gain rounds to 0% is ``info``; no STRAGGLER in
        a group a COLLECTIVE_MISMATCH explains."""
        return self._memo("findings", lambda: sort_findings(info_without_gain(_mismatch.without_explained_stragglers(
            self.hangs() + self.mismatch_findings() + self.corrupt_checkpoints()
            + self.stragglers() + self.rank_stall_findings() + self.slow_links() + self.exposed_comm()
            + self.pipeline_findings() + self.amp_findings() + self.checkpoint_findings() + self.comm_findings()
            + self.compression_findings() + self.device_findings()
            + _throughput.detect_low_mfu(self.throughput_summary())))))

    def key_figures(self) -> KeyFigures:
        """Headline numbers: steps, step time, tokens/s, MFU, comm and exposed comm, bubble, overflows, checkpoint
        share."""
        return self._memo("key_figures", lambda: key_figures(
            steps=self.table("steps"), throughput_summary=self.throughput_summary(), step_ns=self.step_time_ns(),
            comm_frac=_comm_steps.mean_comm_frac(self.exposure_by_rank()),
            exposed_comm_frac=_exposed.mean_exposed_frac(self.exposure_by_rank(), self.kernel_exposure_by_rank(),
                                                         clock_aligned=self.info.clock_aligned),
            bubble_by_rank=self.bubble_by_rank(), amp_steps=self.amp_steps(),
            checkpoint_summary=self.checkpoint_summary()))

    def findings_table(self) -> pd.DataFrame:
        """The findings as a frame (one row each, worst first): code, severity, ranks, group, title,
        recommendation, gain_metric, gain_frac."""
        return findings_frame(self.findings())

    def evidence_rows(self, finding: Finding) -> pd.DataFrame:
        """The rows behind ``finding`` (empty frame when it has none)."""
        return finding.rows if finding.rows is not None else pd.DataFrame()

    def metrics(self) -> dict:
        """The ``metrics`` object of the JSON document (plain JSON values)."""
        return self._memo("metrics", lambda: _report.build_metrics(self))

    def report(self) -> dict:
        """The ``dtprobe.findings/1`` document: schema, source, metrics, findings."""
        return _report.document(source=str(self.path), metrics=self.metrics(), findings=self.findings())
