"""Prometheus metrics of the runs under a folder, read at scrape time: ``RunsCollector`` (a ``prometheus_client``
custom collector) and ``serve`` (its HTTP endpoint); used by ``dtprobe serve-metrics``.

Each scrape tails every exported run's event files (only the lines appended since the last scrape are parsed)
and analyses a running run's newest ``window_steps`` steps (``StepWindow``), so a scrape costs the window, not
the run's length; a run whose rows did not change is not analysed again. A finished or crashed run (exported
with ``include_finished``) is analysed whole, so its figures are those of ``dtprobe analyze --format json``.
The gauges (``gauges.METRICS``; label ``run`` is the run directory's name):

- ``dtprobe_step_time_seconds{run,rank}``: the rank's newest finished step, start to end;
- ``dtprobe_last_step{run,rank}``: that step's number;
- ``dtprobe_tokens_per_second{run}``: median tokens/s of the job over the analysed steps (key figure
  ``tokens_per_s``; absent when the run records no tokens);
- ``dtprobe_lateness_ratio{run,rank,pg}``: the rank's median arrival lateness at group ``pg``'s collectives as a
  share of the step, in its worst window of ``AnalysisOptions.window_steps`` steps (``straggler_scores``, the
  STRAGGLER metric);
- ``dtprobe_exposed_comm_ratio{run,rank}``: exposed communication net of straggler wait, share of the step
  (``RunAnalysis.exposure_by_rank``);
- ``dtprobe_findings{run,code,severity}``: number of findings of that code and severity (codes with none are
  absent).
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dtprobe.analysis.facade import RunAnalysis
from dtprobe.analysis.window import StepWindow
from dtprobe.export.extras import require
from dtprobe.export.gauges import DEFAULT_WINDOW_STEPS, METRICS
from dtprobe.store.errors import ConfigError, TraceError
from dtprobe.store.manifest import read_manifest
from dtprobe.store.reader import RunStore
from dtprobe.store.runs import is_run_dir


@dataclass(frozen=True, kw_only=True)
class RunSample:
    """The figures of one run at one read, keyed by the gauges' labels (``run`` aside)."""

    run: str
    """The run directory's name (label ``run``)."""
    step_time_s: dict[int, float]
    """rank -> duration of its newest finished step."""
    last_step: dict[int, int]
    """rank -> that step's number."""
    tokens_per_s: float | None
    """Key figure ``tokens_per_s`` (None when unknown)."""
    lateness: dict[tuple[str, int], float]
    """(group, rank) -> ``median_lateness_frac`` of ``straggler_scores``."""
    exposed_comm: dict[int, float]
    """rank -> ``exposed_frac`` of ``exposure_by_rank``."""
    findings: dict[tuple[str, str], int]
    """(code, severity) -> number of findings."""

    def values(self) -> dict[str, list[tuple[tuple[str, ...], float]]]:
        """Gauge name -> [(label values after ``run``, value)]."""
        return {
            "dtprobe_step_time_seconds": [((str(r),), v) for r, v in sorted(self.step_time_s.items())],
            "dtprobe_tokens_per_second": [((), self.tokens_per_s)] if self.tokens_per_s is not None else [],
            "dtprobe_lateness_ratio": [((str(r), pg), v) for (pg, r), v in sorted(self.lateness.items())],
            "dtprobe_exposed_comm_ratio": [((str(r),), v) for r, v in sorted(self.exposed_comm.items())],
            "dtprobe_findings": [((code, sev), float(n)) for (code, sev), n in sorted(self.findings.items())],
            "dtprobe_last_step": [((str(r),), float(v)) for r, v in sorted(self.last_step.items())],
        }


def run_sample(analysis: RunAnalysis, *, run: str) -> RunSample:
    """The figures of ``analysis`` (a run or a window of it) for the gauges."""
    steps = analysis.table("steps").dropna(subset=["start_ns", "end_ns"])
    newest = steps.sort_values("end_ns", kind="stable").groupby("rank").tail(1)
    exposure = analysis.exposure_by_rank().dropna(subset=["exposed_frac"])
    scores = analysis.straggler_scores().dropna(subset=["median_lateness_frac"])
    return RunSample(
        run=run,
        step_time_s={int(r.rank): (int(r.end_ns) - int(r.start_ns)) / 1e9 for r in newest.itertuples()},
        last_step={int(r.rank): int(r.step) for r in newest.itertuples()},
        tokens_per_s=analysis.key_figures().tokens_per_s,
        lateness={(str(r.pg), int(r.rank)): float(r.median_lateness_frac) for r in scores.itertuples()},
        exposed_comm={int(r.rank): float(r.exposed_frac) for r in exposure.itertuples()},
        findings=dict(Counter((f.code, f.severity) for f in analysis.findings())))


def live_analysis(store: RunStore, *, window_steps: int) -> RunAnalysis:
    """A running run's newest ``window_steps`` steps (the whole run while it is shorter), anything else whole;
    reads the part of a tail-opened store that the analysis needs."""
    src: Any = store
    if store.manifest.status == "running":
        window = StepWindow(store, window_steps)
        src = store if window.is_whole_run else window
    needed = src.first_step if isinstance(src, StepWindow) else 0
    if store.tail_from_step is not None and needed < store.tail_from_step:
        store.load_head()
    return RunAnalysis(src)


@dataclass
class _OpenRun:
    store: RunStore
    version: tuple = ()
    sample: RunSample | None = None


@dataclass(eq=False)   # hashable by identity: prometheus_client keys its registry by collector
class RunsCollector:
    """The runs under ``root`` (``root`` itself if it is a run, else its subdirectories that are) as Prometheus
    gauges, read at every ``collect()``: the running ones, and the finished and crashed ones too with
    ``include_finished``. A run that cannot be read is left out and named once through ``on_event``."""

    root: Path
    """The folder of runs."""
    window_steps: int = DEFAULT_WINDOW_STEPS
    """Newest steps of a running run analysed at each scrape."""
    include_finished: bool = False
    """Also export finished and crashed runs (analysed whole)."""
    on_event: Callable[[str], None] = lambda message: None
    """Called with one line when a run starts or stops being exported, or cannot be read."""
    _open: dict[Path, _OpenRun] = field(default_factory=dict, init=False)
    _told: set[tuple[Path, str]] = field(default_factory=set, init=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, init=False)

    def __post_init__(self) -> None:
        self.root = Path(self.root)
        if not self.root.is_dir():
            raise TraceError(f"ROOT '{self.root}' is not a directory. Pass the folder that holds your runs "
                             f"(`dtprobe run` writes them under ./runs by default).")
        if self.window_steps < 1:
            raise ConfigError(f"--window-steps must be at least 1, got {self.window_steps}.")

    def run_dirs(self) -> list[Path]:
        """The run directories under ``root`` now."""
        if is_run_dir(self.root):
            return [self.root]
        return sorted(p for p in self.root.iterdir() if p.is_dir() and not p.is_symlink() and is_run_dir(p))

    def samples(self) -> list[RunSample]:
        """The figures of every exported run as of now (one read of what was appended since the last call)."""
        with self._lock:
            out = []
            present = set(self.run_dirs())
            for path in sorted(set(self._open) - present):
                del self._open[path]
                self.on_event(f"{path.name}: removed, no longer exported")
            for path in sorted(present):
                try:
                    sample = self._sample(path)
                except TraceError as exc:
                    self._open.pop(path, None)
                    self._tell(path, f"{path.name}: left out, cannot be read: {exc}")
                    continue
                if sample is not None:
                    out.append(sample)
            return out

    def _sample(self, path: Path) -> RunSample | None:
        run = self._open.get(path)
        if run is None:
            status = read_manifest(path).status
            if not self._exported(status):
                return None
            run = self._open[path] = _OpenRun(RunStore.open(
                path, tail_steps=self.window_steps if status == "running" else None))
            self.on_event(f"{path.name}: exported ({status}, world size {run.store.manifest.world_size})")
        else:
            run.store.refresh()
        status = run.store.manifest.status
        if not self._exported(status):
            del self._open[path]
            self.on_event(f"{path.name}: {status}, no longer exported")
            return None
        version = tuple(sorted(run.store.num_rows().items())) + (status,)
        if run.sample is None or version != run.version:
            run.sample = run_sample(live_analysis(run.store, window_steps=self.window_steps), run=path.name)
            run.version = version
        return run.sample

    def _exported(self, status: str) -> bool:
        return status == "running" or self.include_finished

    def _tell(self, path: Path, message: str) -> None:
        if (path, message) not in self._told:
            self._told.add((path, message))
            self.on_event(message)

    def describe(self) -> list:
        """The gauges without samples (``prometheus_client`` registers their names with this)."""
        return list(_families([]))

    def collect(self) -> Iterator:
        """The gauges with the samples of every exported run (``prometheus_client`` calls this per scrape)."""
        return _families(self.samples())


def _families(samples: list[RunSample]) -> Iterator:
    from prometheus_client.core import GaugeMetricFamily

    values = [(s.run, s.values()) for s in samples]
    for name, (doc, labels) in METRICS.items():
        family = GaugeMetricFamily(name, doc, labels=list(labels))
        for run, by_name in values:
            for label_values, value in by_name[name]:
                family.add_metric([run, *label_values], value)
        yield family


def serve(collector: RunsCollector, *, host: str, port: int):
    """Serve ``collector`` at ``http://host:port/metrics`` from a daemon thread; returns the server (its
    ``server_port`` is the bound port; ``shutdown()`` then ``server_close()`` stop it). ConfigError when
    prometheus_client is missing or the address cannot be bound."""
    prom = require("prometheus_client", extra="prometheus", what="dtprobe serve-metrics")
    registry = prom.CollectorRegistry()
    registry.register(collector)
    try:
        server, _thread = prom.start_http_server(port, addr=host, registry=registry)
    except OSError as exc:
        raise ConfigError(f"cannot listen on {host}:{port}: {exc.strerror or exc}. Pass a free --port (or stop "
                          f"what listens there), and a --host this machine has.") from None
    return server

