"""The ``Source`` protocol: what analysis reads from a dtprobe run, a folder of Kineto traces or any later source;
read by ``dtprobe.analysis.RunAnalysis`` (and through it by ``dtprobe analyze``, the dashboard and the benchmarks).
``dtprobe.store.resolve.open_source(path)`` picks the reader of a path.

Every source yields the same tables (``schema.SCHEMAS``: every column, in its dtype; a table the source cannot
fill comes back empty) and one ``SourceInfo`` record. What differs between kinds of source is data in that record
(are the ranks' clocks aligned, is each rank's record whole, do the first steps include the job's warm-up, which
device ran it) or a table's content (a trace folder's ``kernels`` are those of its profiled steps), never a
question an analyzer asks. Implementations: ``RunStore`` (``dtprobe.store.reader``), ``KinetoRun``
(``dtprobe.store.kineto``) and ``StepWindow`` (``dtprobe.analysis.window``, the newest steps of a run).

Where a columnar, out-of-core engine plugs in: here, as one more ``Source`` whose ``table(name)`` hands analysis
a frame the engine computed (e.g. scanning the compacted Parquet of ``tables/`` with predicates such as a step
range pushed down) instead of a frame held whole in memory. Analyzers take the tables as arguments and never
open files, so they stay as they are; the facade's one-line methods stay too.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Protocol, runtime_checkable

import pandas as pd

from dtprobe.store.manifest import Manifest, RankInfo


SourceKind = Literal["dtprobe_run", "kineto_traces"]
SeqSource = Literal["recorder", "trace", "order"]


@dataclass(frozen=True, kw_only=True)
class SourceInfo:
    """Facts of a source beyond its tables. Fields a source cannot know are None, empty, or the safe default."""

    kind: SourceKind
    """What was read (``metrics.run.kind`` and labels); no analysis depends on it."""
    status: str
    """``running``, ``finished`` or ``crashed`` for a run; ``trace`` for a profiler trace (a closed window)."""
    world_size: int | None
    """Ranks in the job (None when the source does not say)."""
    manifest: Manifest | None = None
    """The run's ``Manifest`` (config, ranks and nodes, attempts, restarts); None when the source has none."""
    run_id: str | None = None
    """The run's id (None without a manifest)."""
    config: Mapping[str, Any] = field(default_factory=dict)
    """The job's config (``run.json`` ``config``); empty when unknown."""
    ranks: tuple[RankInfo, ...] = ()
    """Per-rank facts (rank, node, host, device: the manifest's ``RankInfo``); empty when unknown, so node-level
    analyses (SLOW_LINK) find nothing to compare."""
    ended_ns: int | None = None
    """When the run ended (None while running or when unknown)."""
    device_name: str | None = None
    """Device model the peak FLOP/s is looked up by (``cpu`` on CPU); None when unknown."""
    clock_aligned: bool = True
    """All ranks' timestamps on one clock, so cross-rank timing (arrival skew, stragglers, the host estimate of
    exposed communication) means something. False for Kineto traces: each rank keeps its own clock."""
    collective_seq: SeqSource = "recorder"
    """What the ``collectives`` table's ``seq`` numbers are: ``recorder`` (dtprobe's per-group count, the same
    collective has the same number on every member), ``trace`` (the trace's own per-group ``Seq`` arg: the same),
    ``order`` (each rank's order within its own profiler window: members are matched by order within a group and
    step, checking op and size)."""
    whole_record: bool = True
    """Each rank's record runs from its start alike, so a collective one rank lacks or numbers differently is one
    it never reached or issued differently (hangs, crashes, mismatches are judged). False for profiler windows,
    which each rank cuts on its own."""
    warmup_recorded: bool = True
    """The first steps recorded are the job's own warm-up (left out by ``AnalysisOptions.skip_first_steps``).
    False for a profiler window, which starts after its own warm-up: every step counts."""


@runtime_checkable
class Source(Protocol):
    """Anything analysis can read: a path, the facts, and the tables by name."""

    @property
    def path(self) -> Path:
        """The run directory, trace folder or file."""

    @property
    def info(self) -> SourceInfo:
        """The source's facts as of now (a run's status changes as it is refreshed)."""

    def table(self, name: str) -> pd.DataFrame:
        """Table ``name`` of ``schema.SCHEMAS`` with every column; empty when the source has no such rows."""


def run_info(manifest: Manifest) -> SourceInfo:
    """The facts of a dtprobe run from its ``Manifest``: clocks aligned by the store, whole records, warm-up
    recorded; the device is the config's ``device_name``, else the model rank 0 recorded (``device_name`` of its
    rank info), else ``cpu`` when rank 0 ran on the CPU."""
    config = dict(manifest.config)
    device = config.get("device_name")
    if device is None and manifest.ranks:
        leader = manifest.ranks[0]
        device = leader.device_name or ("cpu" if leader.device.startswith("cpu") else None)
    return SourceInfo(kind="dtprobe_run", status=manifest.status, world_size=manifest.world_size, manifest=manifest,
                      run_id=manifest.run_id, config=config, ranks=tuple(manifest.ranks), ended_ns=manifest.ended_ns,
                      device_name=device, clock_aligned=True, whole_record=True, warmup_recorded=True)
