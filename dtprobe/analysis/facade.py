"""``RunAnalysis``: the one entry point to every metric and finding of a run (or a Kineto trace folder); read by
``dtprobe analyze``, ``dtprobe export perfetto`` and the dashboard (which calls nothing else in analysis).

Every method is one line over the pure analyzers and is cached on the instance: build a new ``RunAnalysis``
after ``store.refresh()`` to see new rows. DataFrames have units in their column names; findings are
``Finding`` records; ``report()`` is the ``dtprobe.findings/1`` JSON document.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import pandas as pd

from dtprobe.analysis import amp as _amp
from dtprobe.analysis import bubble as _bubble
from dtprobe.analysis import checkpoints as _ckpt
from dtprobe.analysis import comm_efficiency as _comm
from dtprobe.analysis import compression as _compression
from dtprobe.analysis import devices as _devices
from dtprobe.analysis import exposed_comm as _exposed
from dtprobe.analysis import ckpt_corrupt as _corrupt
from dtprobe.analysis import crashes as _crashes
from dtprobe.analysis import hangs as _hangs
from dtprobe.analysis import links as _links
from dtprobe.analysis import liveness as _liveness
from dtprobe.analysis import mismatch as _mismatch
from dtprobe.analysis import peaks as _peaks
from dtprobe.analysis import stragglers as _stragglers
from dtprobe.analysis import throughput as _throughput
from dtprobe.analysis.arrivals import unique_seq
from dtprobe.analysis.findings import Finding, info_without_gain, jsonable, sort_findings
from dtprobe.analysis.tables import analyzed_steps, axis_of, median_step_ns
from dtprobe.store.errors import TraceError

SCHEMA = "dtprobe.findings/1"
"""Value of the ``schema`` key of the JSON document."""


@dataclass(frozen=True, kw_only=True)
class AnalysisOptions:
    """Thresholds and assumptions of the analysis (the detectors' keyword arguments that users may change)."""

    window_steps: int = 20
    """Sliding window (steps) over which a straggler must persist."""
    min_lateness_frac: float = 0.05
    """A straggler's median lateness over the window (arrival minus its peers' median), as a share of the step."""
    min_positive_frac: float = 0.8
    """Share of the window's steps in which a straggler must arrive after its peers' median."""
    skip_first_steps: int = 1
    """Warm-up steps left out of step-time based metrics (DDP rebuilds buckets on step 0)."""
    mtbf_hours: float = _ckpt.DEFAULT_MTBF_HOURS
    """Mean time between failures for the Young/Daly checkpoint interval (default one failure a day)."""
    hang_timeout_s: float = 60.0
    """While a run is running, a collective some members have waited at this long is a hang."""
    peak_busbw_gbps: float | None = None
    """Link peak bus bandwidth (Gb/s) to judge large collectives against; None skips that check."""
    min_exposed_frac: float = 0.10
    """EXPOSED_COMM threshold (share of the step)."""
    min_bubble_frac: float = 0.10
    """PIPELINE_BUBBLE threshold (mean idle share of the pipeline window)."""

    def __post_init__(self) -> None:
        if self.window_steps < 1 or not 0 < self.min_positive_frac <= 1 or self.mtbf_hours <= 0:
            raise ValueError(f"invalid analysis options: window_steps={self.window_steps} (>= 1), "
                             f"min_positive_frac={self.min_positive_frac} (0..1], mtbf_hours={self.mtbf_hours} (> 0)")


def open_source(path: str | os.PathLike, *, progress: Callable[[int, int, str], None] | None = None,
                live_tail_steps: int | None = None):
    """A dtprobe run (``RunStore``) or a Kineto trace folder (``KinetoRun``) at ``path``; TraceError otherwise.

    ``live_tail_steps``: if the run is running, read only its newest that many steps of the per-step tables
    (``RunStore.open(tail_steps=...)``; ``load_head()`` reads the rest): for recent-steps views of live runs.
    """
    from dtprobe.store.kineto import is_trace_dir, load_trace_dir

    path = Path(path)
    if (path / "run.json").is_file():
        from dtprobe.store import RunStore, read_manifest

        live = live_tail_steps is not None and read_manifest(path).status == "running"
        return RunStore.open(path, tail_steps=live_tail_steps if live else None)
    if is_trace_dir(path):
        return load_trace_dir(path, progress=progress)
    if not path.exists():
        raise TraceError(f"'{path}': no such file or directory. Pass a run directory (with run.json) made by "
                         f"`dtprobe run`/`dtprobe.attach`, or a folder of Kineto traces (*.pt.trace.json[.gz]).")
    raise TraceError(f"'{path}' is neither a dtprobe run (no run.json) nor a folder of Kineto traces (no *.json or "
                     f"*.json.gz file). Pass a run directory made by `dtprobe run`/`dtprobe.attach`, or the folder "
                     f"torch.profiler's tensorboard_trace_handler wrote.")


@dataclass(frozen=True, kw_only=True)
class KeyFigures:
    """The headline numbers of a run (the dashboard's Overview); None when a figure is unknown for this run."""

    num_steps: int
    """Distinct steps recorded so far."""
    step_time_ms: float | None
    """Median step time over ranks and analysed steps."""
    tokens_per_s: float | None
    """Median tokens per second of the whole job."""
    mfu: float | None
    """Model FLOPs utilisation (None on CPU or with no known peak; ``mfu_reason`` says why)."""
    mfu_reason: str | None
    """Why MFU is (not) known: the peak used or the reason there is none."""
    exposed_comm_frac: float | None
    """Mean over ranks of the exposed communication share of the step (kernel-level for trace folders)."""
    bubble_frac: float | None
    """Mean measured pipeline bubble over ranks (None without pipeline parallelism)."""
    num_overflows: int | None
    """AMP overflow steps (None without AMP telemetry)."""
    checkpoint_share_frac: float | None
    """Blocking checkpoint time as a share of the wall time (None without saves)."""


class RunAnalysis:
    """Metrics and findings of one run. ``RunAnalysis(RunStore.open(path))`` or ``RunAnalysis.open(path)``.

    ``source`` is a ``dtprobe.store.RunStore`` or a ``dtprobe.store.kineto.KinetoRun`` (anything with
    ``table(name)``); ``baseline`` an optional second source (loss gap of COMPRESSION, comparisons).
    """

    def __init__(self, source: Any, *, baseline: Any | None = None, options: AnalysisOptions | None = None,
                 now_ns: int | None = None) -> None:
        self.source = source
        self.baseline = baseline
        self.options = options or AnalysisOptions()
        self._now_ns = now_ns
        self._cache: dict[str, Any] = {}

    @classmethod
    def open(cls, path: str | os.PathLike, *, baseline: str | os.PathLike | None = None,
             options: AnalysisOptions | None = None) -> "RunAnalysis":
        """Open ``path`` (run or trace folder) and the optional ``baseline`` the same way."""
        return cls(open_source(path), baseline=open_source(baseline) if baseline else None, options=options)

    # ------------------------------------------------------------------------------------------ source facts

    def _memo(self, key: str, fn: Callable[[], Any]) -> Any:
        if key not in self._cache:
            self._cache[key] = fn()
        return self._cache[key]

    @property
    def is_trace_folder(self) -> bool:
        """True when the source is a folder of Kineto traces (no run manifest, clocks not aligned across ranks)."""
        return not hasattr(self.source, "manifest")

    @property
    def path(self) -> Path:
        """The run directory or trace folder."""
        return Path(self.source.path)

    @property
    def manifest(self):
        """The run's ``Manifest`` (None for a trace folder)."""
        return getattr(self.source, "manifest", None)

    @property
    def config(self) -> dict:
        """The run's job config (``run.json`` ``config``), {} for a trace folder."""
        return dict(self.manifest.config) if self.manifest is not None else {}

    @property
    def status(self) -> str:
        """``running``, ``finished``, ``crashed``, or ``trace`` for a trace folder."""
        return self.manifest.status if self.manifest is not None else "trace"

    @property
    def world_size(self) -> int | None:
        """Ranks in the job."""
        return self.manifest.world_size if self.manifest is not None else self.source.world_size

    def layout(self) -> dict:
        """dp/tp/pp/zero and pipeline settings from the config (``layout`` section), {} when unknown."""
        return dict(self.config.get("layout") or {})

    def table(self, name: str) -> pd.DataFrame:
        """A store table (cached). ``collectives`` also holds the ``pending`` rows no completed row matches
        (collectives a rank was still in when it stopped writing: end_ns null, ``hangs.merge_pending``) and has its
        ``seq`` made unique across torchrun restarts (``arrivals.unique_seq``)."""
        if name == "collectives":
            return self._memo("table:collectives", lambda: unique_seq(_hangs.merge_pending(
                self.source.table("collectives"),
                self.source.table("pending") if not self.is_trace_folder else None)))
        return self._memo(f"table:{name}", lambda: self.source.table(name))

    def steps_analyzed(self) -> list[int]:
        """Steps the step-time based metrics use: every finished step but the first ``skip_first_steps``."""
        if self.is_trace_folder:  # a profiler window: every ProfilerStep counts (HTA drops the last, we do not)
            return self._memo("steps_analyzed", lambda: analyzed_steps(self.table("steps"), skip_first=0))
        return self._memo("steps_analyzed", lambda: analyzed_steps(self.table("steps"),
                                                                   skip_first=self.options.skip_first_steps))

    def step_time_ns(self) -> float | None:
        """Median step time over ranks and analysed steps."""
        return self._memo("step_ns", lambda: median_step_ns(self.table("steps"), self.steps_analyzed() or None))

    def now_ns(self) -> int:
        """Reference time for hang waits: now while the run is running, else its end (or last event)."""
        if self._now_ns is not None:
            return self._now_ns
        if self.status == "running":
            return time.time_ns()
        ends = [self.manifest.ended_ns] if self.manifest is not None and self.manifest.ended_ns else []
        for table, col in (("collectives", "end_ns"), ("collectives", "enqueue_ns"), ("steps", "end_ns")):
            df = self.table(table)
            if not df.empty and df[col].notna().any():
                ends.append(int(df[col].max()))
        return max(ends) if ends else 0

    # ------------------------------------------------------------------------------------------ stragglers

    def collective_skew(self) -> pd.DataFrame:
        """Per collective (pg, pg_ranks, seq): arrival skew, late rank, its margin, victims' mean wait."""
        return self._memo("skew", lambda: _stragglers.collective_skew(self.table("collectives")))

    def collective_waits(self) -> pd.DataFrame:
        """Per collective and member: how long it waited for the last arrival."""
        return self._memo("waits", lambda: _stragglers.collective_waits(self.table("collectives"), self.collective_skew()))

    def late_rank_per_step(self) -> pd.DataFrame:
        """Per (group, analysed step): the last arriver of the most skewed collective and its margin."""
        return self._memo("late_rank", lambda: _only_steps(
            _stragglers.late_rank_per_step(self.collective_skew(), self.table("steps")), self.steps_analyzed()))

    def rank_lateness(self) -> pd.DataFrame:
        """Per (group, analysed step, rank): arrival minus the median arrival of its peers, share of the step."""
        return self._memo("lateness", lambda: _only_steps(
            _stragglers.rank_lateness(self.table("collectives"), self.table("steps")), self.steps_analyzed()))

    def straggler_scores(self) -> pd.DataFrame:
        """Per (group, rank): worst-window median lateness, share of steps late, mean wait imposed on peers."""
        o = self.options
        return self._memo("scores", lambda: _stragglers.straggler_scores(
            self.rank_lateness(), window_steps=o.window_steps, min_lateness_frac=o.min_lateness_frac,
            min_positive_frac=o.min_positive_frac))

    def straggler_causes(self) -> pd.DataFrame:
        """Per (group, rank) late enough to be a straggler candidate: excess data/compute/communication time in its
        late steps, throttling, cause."""
        return self._memo("causes", lambda: _stragglers.straggler_causes(
            self.straggler_scores(), self.rank_lateness(), self.table("steps"), self.table("collectives"),
            self.collective_waits(), self.table("devices"), min_lateness_frac=self.options.min_lateness_frac))

    def pipeline_own_delay(self) -> pd.DataFrame:
        """Per (pipeline rank, step): time neither running a pipeline action nor waiting for its input."""
        def build() -> pd.DataFrame:
            pipeline = self.table("pipeline")       # no pipeline rows: no need to find the pipelines
            groups = _stragglers.pipeline_groups(self.table("collectives")) if not pipeline.empty else {}
            return _only_steps(_stragglers.pipeline_own_delay(pipeline, self.table("steps"), groups),
                               self.steps_analyzed())
        return self._memo("own_delay", build)

    def group_axis(self, pg: str) -> str | None:
        """``dp``/``tp``/``pp`` of a process-group name; the default group (``world``) is ``dp`` in a pure
        data-parallel layout."""
        axis = axis_of(pg)
        lay = self.layout()
        if axis is None and pg in ("world", "default", "0") and int(lay.get("tp") or 1) * int(lay.get("pp") or 1) == 1:
            return "dp"
        return axis

    def stragglers(self) -> list[Finding]:
        """STRAGGLER findings (none for a trace folder: Kineto clocks are not aligned across ranks)."""
        if self.is_trace_folder:
            return []
        o = self.options
        return self._memo("f:stragglers", lambda: _stragglers.detect_stragglers(
            self.straggler_scores(), self.straggler_causes(), links=_stragglers.linked_ranks(self.table("collectives")),
            min_lateness_frac=o.min_lateness_frac, min_positive_frac=o.min_positive_frac,
            injected=self.injected_faults("straggler"), lateness=self.rank_lateness(), axis_of_pg=self.group_axis,
            own_delay_ns=self._median_own_delay(), slow_link_ranks=_links.slow_link_ranks(self.slow_links())))

    def slow_links(self) -> list[Finding]:
        """SLOW_LINK: node pairs whose crossing collectives' bus bandwidth dropped mid-run (multi-node runs only)."""
        if self.manifest is None:
            return []
        return self._memo("f:links", lambda: _links.find_slow_links(
            _only_steps(self.collective_bandwidth(), self.steps_analyzed()), self.manifest.ranks, self.table("steps"),
            axis_of_pg=self.group_axis))

    def _median_own_delay(self) -> dict[int, float]:
        d = self.pipeline_own_delay()
        return {int(r): float(v) for r, v in d.groupby("rank")["own_delay_ns"].median().items()} if not d.empty else {}

    def injected_faults(self, kind: str) -> dict[int, dict]:
        """rank -> detail of the first injected fault of ``kind`` (cross-check of a verdict)."""
        from dtprobe.analysis.fault_detail import fault_detail

        f = self.table("faults")
        if f.empty:
            return {}
        f = f[(f["kind"] == kind) & f["injected"].fillna(False).astype(bool)]
        return {int(r.rank): fault_detail(r.detail) for r in f.drop_duplicates("rank").itertuples(index=False)}

    # ------------------------------------------------------------------------------------------ overlap / time

    def comm_exposure(self) -> pd.DataFrame:
        """Per (rank, step): communication time, exposed tail, straggler wait, exposed share, overlap (host
        estimate; empty for a trace folder, whose ranks' clocks are not aligned: use the kernel-level overlap)."""
        if self.is_trace_folder:
            return pd.DataFrame({c: [] for c in _exposed.EXPOSURE_COLUMNS})
        return self._memo("exposure", lambda: _exposed.comm_exposure(
            self.table("collectives"), self.table("steps"), self.collective_skew()))

    def exposure_by_rank(self) -> pd.DataFrame:
        """Per rank over the analysed steps: comm / exposed / straggler-wait shares of the step, overlap."""
        return self._memo("exposure_rank", lambda: _exposed.exposure_by_rank(
            self.comm_exposure(), step_ids=self.steps_analyzed() or None))

    def trace_metrics(self):
        """Kernel-level metrics (``trace_metrics.TraceMetrics``) of a trace folder, None for a run."""
        if not self.is_trace_folder:
            return None
        from dtprobe.analysis.trace_metrics import analyze_traces

        return self._memo("trace_metrics", lambda: analyze_traces(self.source))

    def temporal_breakdown(self) -> pd.DataFrame:
        """Per rank: idle / compute / non-compute share of the GPU kernel span (HTA semantics); empty without
        kernels."""
        def build() -> pd.DataFrame:
            if self.is_trace_folder:
                return self.trace_metrics().temporal
            from dtprobe.analysis.temporal import temporal_breakdown

            k = self.table("kernels")
            return temporal_breakdown(k) if not k.empty else pd.DataFrame()
        return self._memo("temporal", build)

    def comm_comp_overlap(self) -> pd.DataFrame:
        """Per rank: share of communication-kernel time overlapped by compute kernels; empty without kernels."""
        def build() -> pd.DataFrame:
            if self.is_trace_folder:
                return self.trace_metrics().overlap
            from dtprobe.analysis.overlap import comm_comp_overlap

            k = self.table("kernels")
            return comm_comp_overlap(k) if not k.empty else pd.DataFrame()
        return self._memo("overlap", build)

    def kernel_breakdown(self) -> pd.DataFrame:
        """Exclusive time per kernel-type combination over all ranks; empty without kernels."""
        def build() -> pd.DataFrame:
            if self.is_trace_folder:
                return self.trace_metrics().kernel_types
            from dtprobe.analysis.kernel_breakdown import kernel_type_breakdown

            k = self.table("kernels")
            return kernel_type_breakdown(k) if not k.empty else pd.DataFrame()
        return self._memo("kernel_types", build)

    def exposed_comm(self) -> list[Finding]:
        """EXPOSED_COMM from kernels when known (exposed comm kernel time), else from the host collectives tail."""
        def build() -> list[Finding]:
            overlap = self.comm_comp_overlap()
            temporal = self.temporal_breakdown()
            if not overlap.empty and not temporal.empty and "exposed_comm_us" in overlap.columns:
                m = overlap.merge(temporal[["rank", "kernel_time_us"]], on="rank")
                by_rank = pd.DataFrame({
                    "rank": m["rank"], "num_steps": 0, "step_ns": m["kernel_time_us"] * 1e3,
                    "comm_frac": m["comm_us"] / m["kernel_time_us"],
                    "exposed_frac": m["exposed_comm_us"] / m["kernel_time_us"], "straggler_wait_frac": float("nan"),
                    "overlap_frac": m["overlap_frac"]})
                return _exposed.detect_exposed_comm(by_rank, min_exposed_frac=self.options.min_exposed_frac,
                                                    source="kernels (exposed comm kernel time / kernel span)")
            return _exposed.detect_exposed_comm(self.exposure_by_rank(), min_exposed_frac=self.options.min_exposed_frac)
        return self._memo("f:exposed", build)

    # ------------------------------------------------------------------------------------------ pipeline

    def pipeline_bubble(self) -> pd.DataFrame:
        """Per (rank, step): pipeline window, busy time, bubble fraction."""
        return self._memo("bubble", lambda: _bubble.pipeline_bubble(self.table("pipeline")))

    def bubble_by_rank(self) -> pd.DataFrame:
        """Mean bubble per rank over the analysed steps."""
        return self._memo("bubble_rank", lambda: _bubble.bubble_by_rank(self.pipeline_bubble(),
                                                                        step_ids=self.steps_analyzed() or None))

    def pipeline_shape(self):
        """Schedule, ranks, virtual stages, micro-batches and measured action costs (``PipelineShape``) or None."""
        return self._memo("pshape", lambda: _bubble.pipeline_shape(
            self.table("pipeline"), schedule=self.layout().get("pp_schedule")))

    def pipeline_findings(self) -> list[Finding]:
        """PIPELINE_BUBBLE with the ideal bubble and the predicted gain of doubling the micro-batches."""
        return self._memo("f:bubble", lambda: _bubble.detect_pipeline_bubble(
            self.bubble_by_rank(), self.pipeline_shape(), step_ns=self.step_time_ns(),
            min_bubble_frac=self.options.min_bubble_frac))

    # ------------------------------------------------------------------------------------------ AMP / ckpt

    def amp_steps(self) -> pd.DataFrame:
        """Per step: overflow, skipped, overflowing ranks, loss scale before/after."""
        return self._memo("amp", lambda: _amp.amp_steps(self.table("amp")))

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
        s = self.table("steps")
        if s.empty or s["end_ns"].isna().all():
            return None
        return float(s["end_ns"].max() - s["start_ns"].min())

    def checkpoint_findings(self) -> list[Finding]:
        """CHECKPOINT_STALL."""
        return self._memo("f:ckpt", lambda: _ckpt.detect_checkpoint_stall(
            self.checkpoint_events(), self.checkpoint_summary(), injected=self.injected_faults("slow-ckpt")))

    # ------------------------------------------------------------------------------------------ comm efficiency

    def collective_bandwidth(self) -> pd.DataFrame:
        """Per collective: transfer time, algbw, busbw (nccl-tests factors)."""
        return self._memo("bw", lambda: _comm.collective_bandwidth(self.table("collectives")))

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
        return self._memo("compression", lambda: _compression.compression_summary(self.table("compression")))

    def loss_gap(self) -> pd.DataFrame:
        """Loss of the last common steps vs the baseline run (empty without a baseline)."""
        def build() -> pd.DataFrame:
            if self.baseline is None:
                return pd.DataFrame({c: [] for c in _compression.LOSS_GAP_COLUMNS})
            return _compression.loss_gap(self.table("steps"), self.baseline.table("steps"))
        return self._memo("loss_gap", build)

    def compression_findings(self) -> list[Finding]:
        """COMPRESSION per method (ratio, time saved net of encoding, loss gap vs the baseline)."""
        def build() -> list[Finding]:
            bw = self.collective_bandwidth()
            ar = bw[bw["op"] == "allreduce"] if not bw.empty else bw
            algbw = float(ar["algbw_bytes_per_s"].median()) if not ar.empty else None
            base = str(self.baseline.path) if self.baseline is not None else None
            saved = None
            if self.baseline is not None and not bw.empty:
                base_bw = RunAnalysis(self.baseline, options=self.options).collective_bandwidth()
                if not base_bw.empty:
                    saved = (base_bw.groupby("step")["duration_ns"].sum().median()
                             - bw.groupby("step")["duration_ns"].sum().median())
            return _compression.detect_compression(self.compression(), self.loss_gap(), algbw_bytes_per_s=algbw,
                                                   step_ns=self.step_time_ns(), baseline=base,
                                                   measured_saved_ns=None if saved is None else float(saved))
        return self._memo("f:compression", build)

    # ------------------------------------------------------------------------------------------ devices / hangs

    def device_health(self) -> pd.DataFrame:
        """Per (rank, gpu): throttling, power cap, temperature, memory pressure, XIDs."""
        return self._memo("health", lambda: _devices.device_health(self.table("devices")))

    def device_findings(self) -> list[Finding]:
        """DEVICE_THROTTLE, DEVICE_XID, MEMORY_PRESSURE."""
        return self._memo("f:devices", lambda: _devices.detect_device_health(self.device_health()))

    def missing_arrivals(self) -> pd.DataFrame:
        """Per group and attempt: the first collective some members never reached, or every member entered and
        none finished (and how long the others waited)."""
        def build() -> pd.DataFrame:
            wait = 0 if self.status != "running" else int(self.options.hang_timeout_s * 1e9)
            return _hangs.missing_arrivals(self.collective_skew(), self.table("collectives"), now_ns=self.now_ns(),
                                           min_wait_ns=wait)
        return self._memo("missing", build)

    def last_seen(self) -> pd.DataFrame:
        """Per rank: last step and last collective recorded."""
        return self._memo("last_seen", lambda: _hangs.last_seen(self.table("steps"), self.table("collectives")))

    def p2p_stalls(self) -> pd.DataFrame:
        """Per stuck send/recv: the peer that never issued the matching op (and how long it waited)."""
        def build() -> pd.DataFrame:
            wait = 0 if self.status != "running" else int(self.options.hang_timeout_s * 1e9)
            return _hangs.p2p_stalls(self.table("collectives"), now_ns=self.now_ns(), min_wait_ns=wait)
        return self._memo("p2p_stalls", build)

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
        return self._memo("activity", lambda: _liveness.Activity(
            {t: self.table(t) for t in ("devices", "steps", "collectives", "faults", "lifecycle")}))

    def attempt_starts(self) -> list[int]:
        """Start (ns) of attempts 1, 2, ... (torchrun restarts) from the launcher or the first rows of each."""
        return self._memo("attempt_starts", lambda: _liveness.attempt_starts(
            self.attempts(), {t: self.table(t) for t in ("lifecycle", "steps", "collectives")}))

    def restarts(self) -> list[dict]:
        """The run's restarts: manifest ``restarts`` completed by the runtime's ``restart`` fault rows."""
        return self._memo("restarts", lambda: _crashes.restarts_of(self.manifest, self.table("faults")))

    def crash_events(self) -> pd.DataFrame:
        """Per failed attempt: the rank that died first, step, how, cause, what it was doing, recovery."""
        return self._memo("crash_events", lambda: _crashes.crash_events(
            self.rank_exits(), activity=self.activity(), collectives=self.table("collectives"),
            steps=self.table("steps"), devices=self.table("devices"), restarts=self.restarts(),
            status=self.status, attempts_known=bool(self.attempts()),
            stale_ns=int(self.options.hang_timeout_s * 1e9), now_ns=self.now_ns(), stalls=self.stalls()))

    def collective_mismatches(self) -> pd.DataFrame:
        """Per group and attempt: the first collective its members issued differently (or one skipped)."""
        return self._memo("mismatches", lambda: _mismatch.collective_mismatches(self.table("collectives"),
                                                                               self.table("steps")))

    def mismatch_findings(self) -> list[Finding]:
        """COLLECTIVE_MISMATCH (none for a trace folder)."""
        if self.is_trace_folder:
            return []
        return self._memo("f:mismatch", lambda: _mismatch.detect_mismatches(self.collective_mismatches(),
                                                                            axis_of_pg=self.group_axis))

    def corrupt_checkpoints(self) -> list[Finding]:
        """CHECKPOINT_CORRUPT from the ranks' observed ``corrupt-ckpt`` rows."""
        return self._memo("f:corrupt", lambda: _corrupt.detect_corrupt_checkpoints(self.table("faults")))

    def hangs(self) -> list[Finding]:
        """HANG (stuck collectives and send/recv, from collective rows; liveness of each stuck rank) and RANK_CRASH
        (from attempts/lifecycle/restarts), neither for a group a COLLECTIVE_MISMATCH explains."""
        if self.is_trace_folder:
            return []
        return self._memo("f:hangs", lambda: _hang_and_crash_findings(self))

    # ------------------------------------------------------------------------------------------ throughput

    def flops_per_token(self) -> float | None:
        """Model training FLOPs per token: config ``model_flops_per_token``, else the built-in preset's shape."""
        cfg = self.config
        if cfg.get("model_flops_per_token"):
            return float(cfg["model_flops_per_token"])
        name = (cfg.get("model") or {}).get("name")
        seq = (cfg.get("train") or {}).get("seq_len")
        return _peaks.preset_flops_per_token(name, int(seq)) if name and seq else None

    def device_peak(self) -> tuple[float | None, str]:
        """(peak FLOP/s per device, reason) for the run's device model and compute dtype."""
        dtype = (self.config.get("precision") or {}).get("dtype", "fp32")
        name = self.config.get("device_name")
        if name is None and self.manifest is not None and self.manifest.ranks:
            device = self.manifest.ranks[0].device
            name = "cpu" if device.startswith("cpu") else None
        if name is None and self.is_trace_folder:
            props = [p for m in self.source.ranks.values() for p in m.device_properties]
            name = props[0].get("name") if props else "cpu"
        return _peaks.peak_flops(name, dtype)

    def throughput(self) -> pd.DataFrame:
        """Per step: wall time, tokens (dp ranks only), tokens/s, model FLOP/s, MFU."""
        def build() -> pd.DataFrame:
            steps = self.table("steps")
            lay = self.layout()
            replicas = int(lay.get("tp") or 1) * int(lay.get("pp") or 1)
            if replicas > 1 and not steps.empty:
                steps = steps.assign(tokens=steps["tokens"].astype("float64") / replicas)
            return _throughput.throughput(steps, flops_per_token=self.flops_per_token(),
                                          peak_flops_per_device=self.device_peak()[0],
                                          num_devices=self.world_size or 0)
        return self._memo("throughput", build)

    def throughput_summary(self) -> dict:
        """Median step time, tokens/s, TFLOP/s, MFU (null with the reason, never a made-up peak)."""
        return self._memo("tp_sum", lambda: _throughput.throughput_summary(
            self.throughput(), step_ids=self.steps_analyzed(), peak_reason=self.device_peak()[1],
            flops_per_token=self.flops_per_token()))

    # ------------------------------------------------------------------------------------------ all together

    def findings(self) -> list[Finding]:
        """Every finding, worst first; a finding whose predicted gain rounds to 0% is ``info``; no STRAGGLER in
        a group a COLLECTIVE_MISMATCH explains."""
        return self._memo("findings", lambda: sort_findings(info_without_gain(_not_explained_by_mismatch(
            self.hangs() + self.mismatch_findings() + self.corrupt_checkpoints()
            + self.stragglers() + self.slow_links() + self.exposed_comm() + self.pipeline_findings() + self.amp_findings()
            + self.checkpoint_findings() + self.comm_findings() + self.compression_findings()
            + self.device_findings() + _throughput.detect_low_mfu(self.throughput_summary())))))

    def key_figures(self) -> KeyFigures:
        """Headline numbers: steps, step time, tokens/s, MFU, exposed comm, bubble, overflows, checkpoint share."""
        return self._memo("key_figures", lambda: _key_figures(self))

    def findings_table(self) -> pd.DataFrame:
        """The findings as a frame (one row each, worst first): code, severity, ranks, group, title,
        recommendation, gain_metric, gain_frac."""
        rows = [{"code": f.code, "severity": f.severity, "ranks": ",".join(map(str, f.ranks)), "group": f.group,
                 "title": f.title, "recommendation": f.recommendation,
                 "gain_metric": f.predicted_gain.metric if f.predicted_gain else None,
                 "gain_frac": f.predicted_gain.frac if f.predicted_gain else float("nan")} for f in self.findings()]
        cols = ["code", "severity", "ranks", "group", "title", "recommendation", "gain_metric", "gain_frac"]
        return pd.DataFrame(rows, columns=cols)

    def evidence_rows(self, finding: Finding) -> pd.DataFrame:
        """The rows behind ``finding`` (empty frame when it has none)."""
        return finding.rows if finding.rows is not None else pd.DataFrame()

    def metrics(self) -> dict:
        """The ``metrics`` object of the JSON document (plain JSON values)."""
        from dtprobe.analysis.report import build_metrics

        return self._memo("metrics", lambda: build_metrics(self))

    def report(self) -> dict:
        """The ``dtprobe.findings/1`` document: schema, source, metrics, findings."""
        return jsonable({"schema": SCHEMA, "source": str(self.path), "metrics": self.metrics(),
                         "findings": [f.to_json() for f in self.findings()]})


def _hang_and_crash_findings(a: RunAnalysis) -> list[Finding]:
    """HANG then RANK_CRASH: a crash whose first failure is a rank the hangs or mismatches already hold (a
    survivor's timeout error) is their consequence, not a crash."""
    mismatched = a.collective_mismatches()
    skip = frozenset(zip(mismatched["pg"], mismatched["pg_ranks"])) if not mismatched.empty else frozenset()
    nodes = {info.rank: info.node_rank for info in a.manifest.ranks} if a.manifest is not None else {}
    hangs = _hangs.detect_hangs(a.stalls(), a.table("faults"), last_seen=a.last_seen(), axis_of_pg=a.group_axis,
                                activity=a.activity(), exits=a.rank_exits(), nodes=nodes, skip_groups=skip,
                                starts=a.attempt_starts(),
                                open_since=_hangs.unfinished_since(a.table("collectives")))
    held = {r for f in hangs for r in (*f.ranks, *f.evidence["arrived_ranks"])}
    for pg_ranks in (m for _, m in skip):
        held.update(int(x) for x in str(pg_ranks).split(",") if x.strip().lstrip("-").isdigit())
    faults = a.table("faults")
    injected = frozenset(int(r) for r in faults[(faults["kind"] == "crash")
                                                & faults["injected"].fillna(False).astype(bool)]["rank"]) \
        if not faults.empty else frozenset()
    crashes = _crashes.detect_crashes(a.crash_events(), num_restarts=len(a.restarts()), missing=a.stalls(),
                                      injected_ranks=injected, explained_ranks=frozenset(held))
    return hangs + crashes


def _not_explained_by_mismatch(findings: list[Finding]) -> list[Finding]:
    """``findings`` without the STRAGGLER findings about a rank of a group a COLLECTIVE_MISMATCH names: the
    late arrivals there are the mismatch's consequence."""
    groups = [set(f.evidence["pg_ranks"]) for f in findings if f.code == "COLLECTIVE_MISMATCH"]
    return [f for f in findings if not (f.code == "STRAGGLER" and any(set(f.ranks) & g for g in groups))]


def _only_steps(df: pd.DataFrame, step_ids: list[int]) -> pd.DataFrame:
    if df.empty or not step_ids:
        return df
    return df[df["step"].isin(step_ids)].reset_index(drop=True)


def _key_figures(a: RunAnalysis) -> KeyFigures:
    steps = a.table("steps")
    summary = a.throughput_summary() or {}
    exposed = None
    overlap, temporal = a.comm_comp_overlap(), a.temporal_breakdown()
    if a.is_trace_folder and not overlap.empty and not temporal.empty and "exposed_comm_us" in overlap.columns:
        m = overlap.merge(temporal[["rank", "kernel_time_us"]], on="rank")
        exposed = float((m["exposed_comm_us"] / m["kernel_time_us"]).mean())
    elif not a.exposure_by_rank().empty:
        exposed = float(a.exposure_by_rank()["exposed_frac"].mean())
    bubble = a.bubble_by_rank()
    amp = a.amp_steps()
    step_ms = summary.get("step_time_ms")
    if step_ms is None and a.step_time_ns():
        step_ms = a.step_time_ns() / 1e6
    return KeyFigures(
        num_steps=int(steps["step"].nunique()) if not steps.empty else 0,
        step_time_ms=step_ms, tokens_per_s=summary.get("tokens_per_s"), mfu=summary.get("mfu"),
        mfu_reason=summary.get("mfu_reason"), exposed_comm_frac=exposed,
        bubble_frac=float(bubble["bubble_frac"].mean()) if not bubble.empty else None,
        num_overflows=int(amp["overflow"].sum()) if not amp.empty else None,
        checkpoint_share_frac=a.checkpoint_summary().get("blocking_share_of_wall"))
