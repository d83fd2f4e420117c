"""The dashboard's only caching site: run stores tailed incrementally, analyses keyed by what was read, the
stored Overview of finished runs.

A run's ``RunStore`` is opened once and refreshed on every page run: only lines appended since the last read are
parsed. While a run is running, pages analyze its newest ``live_window_steps()`` steps (``StepWindow``) unless
the user asks for the whole run, so a live refresh costs the window, not the run's length; a finished run is
always analyzed whole. An analysis is rebuilt only when the store's row counts or status changed. Trace folders
are parsed once per mtime. Planner results are cached by their inputs.

The Overview of a finished run or a trace folder is read from its stored summary (``dtprobe.summary_store``,
made when the run ended) when that is valid, so the first page needs no analysis; otherwise it is made here
and stored for the next start: for a large run (``LARGE_EVENTS_BYTES``) in the background, while its page shows the
key figures of its steps table (``finished_overview``).

While a running run is re-analyzed, a live page refresh (``live_overview``) does not wait for it when the source's
previous analysis took ``LIVE_BLOCK_S`` or longer (a 1,024-rank run): the re-analysis runs on a background thread
and the page shows the previous Overview, saying which steps it covers, until the new one is ready. Smaller runs
are re-analyzed before the refresh returns, as before. The first analysis of a large live run (``LARGE_EVENTS_BYTES``
of events) runs in the background too, while the Overview shows the key figures of the steps table alone (read
apart, so it costs the steps, not the collectives).

The caches are plain module state shared by every session (``st.cache_data`` would pickle a store on every
hit; the tests and benchmarks also call these functions without a Streamlit runtime); the few rows of a
Timeline window (``load_window``) are read from the store with the window pushed down and kept in
``st.cache_data`` per window and data version.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import streamlit as st

from dtprobe import summary_store
from dtprobe.dashboard import summary
from dtprobe.dashboard.paths import LIVE_WINDOW_ENV, Source, list_sources, live_window_steps  # noqa: F401 (re-exported)
from dtprobe.overview import Overview, summarize, with_steps_of
from dtprobe.store.errors import TraceError
from dtprobe.store.manifest import folder_bytes
from dtprobe.store.schema import STEP_BLOCK_STEPS

if TYPE_CHECKING:  # imported where used: a stored Overview is drawn before the analysis modules are imported
    import pandas as pd

    from dtprobe.analysis.facade import RunAnalysis
    from dtprobe.analysis.window import StepWindow

MAX_SOURCES = 16
"""Runs or trace folders kept open at once (least recently used ones are dropped)."""
LARGE_EVENTS_BYTES = 64 << 20
"""Events on disk from which a live run is analyzed in the background (``live_overview``): its first analysis while
the Overview shows the key figures of the steps table, a slow re-analysis while a refresh shows the previous one.
A smaller run's analysis is always waited for (on a busy machine it may take longer than ``LIVE_BLOCK_S``)."""
LIVE_BLOCK_S = 1.0
"""A live refresh waits for the re-analysis of new rows only when the source's previous analysis took less than
this; a longer one runs in the background while the page shows the previous Overview."""


@dataclass
class _Entry:
    source: Any
    """``RunStore`` or ``KinetoRun``."""
    version: tuple
    """What the source held when it was last read (row counts and status, or the trace folder's mtime)."""
    analyses: dict[bool, tuple[tuple, RunAnalysis]]
    """whole_run -> (version it was built at, analysis)."""
    lock: threading.RLock
    overviews: dict[bool, tuple[tuple, Overview]] = field(default_factory=dict)
    """whole_run (as asked) -> (version, the Overview made of the analysis at that version)."""
    build_s: float = 0.0
    """Seconds the last Overview of this source took to make (tail, analysis, key figures and findings)."""
    worker: threading.Thread | None = None
    """The background re-analysis of a live refresh, while it runs."""
    worker_error: BaseException | None = None
    """What the last background re-analysis raised, handed to the next refresh."""
    large: bool = False
    """A live run with ``LARGE_EVENTS_BYTES`` of events or more (``_is_large``)."""
    files_token: Any = None
    """``_files_token`` of a finished run when it was last read: a rerun of a page skips ``RunStore.refresh`` (which
    checks every rank's events file of every table) while it is unchanged."""


_ENTRIES: "OrderedDict[str, _Entry]" = OrderedDict()
_LOCK = threading.Lock()


def _entry(path: str, version_now: tuple | None) -> _Entry:
    """The open source at ``path`` (opened on first use; trace folders reopened when their mtime changed)."""
    with _LOCK:
        entry = _ENTRIES.get(path)
        if entry is not None and version_now is not None and entry.version != version_now:
            entry = None  # a trace folder that changed on disk: parse it again
        if entry is None:
            entry = _ENTRIES[path] = _Entry(None, version_now or (), {}, threading.RLock())
        _ENTRIES.move_to_end(path)
        while len(_ENTRIES) > MAX_SOURCES:
            dropped, _ = _ENTRIES.popitem(last=False)
            _STEPS_ONLY.pop(dropped, None)      # (its live view's steps-only store goes with it)
        return entry


def _read(entry: _Entry, path: str, kind: str) -> None:
    """Open the source on first use; for runs, tail the lines appended since the last call (nothing to tail in a
    finished run whose files have not changed since: a widget change does not stat every events file)."""
    token = _files_token(Path(path), kind) if kind == "run" and summary_store.is_finished(Path(path)) else None
    if entry.source is None:  # a live run is read from its newest steps; the rest only if asked for
        from dtprobe.analysis.facade import open_source

        entry.source = open_source(path, live_tail_steps=live_window_steps() or None)
    elif kind == "run" and (token is None or token != entry.files_token):
        entry.source.refresh()
    if kind == "run":
        entry.files_token = token
        entry.version = _version(entry.source)


def _version(store) -> tuple:
    """What identifies a run store's content: rows per table (no frame built) and the run's status."""
    return tuple(sorted(store.num_rows().items())) + (store.manifest.status,)


def load_analysis(source: Source, *, whole_run: bool = False) -> RunAnalysis:
    """The current analysis of ``source``: for a running run its newest ``live_window_steps()`` steps unless
    ``whole_run``; reads only what was appended since the last call. Raises TraceError for unusable data."""
    path = str(source.path)
    entry = _entry(path, None if source.kind == "run" else ("traces", _mtime(source.path)))
    with entry.lock:
        _read(entry, path, source.kind)
        window = live_window_steps()
        live = source.kind == "run" and entry.source.manifest.status == "running" and window > 0
        whole = whole_run or not live
        cached = entry.analyses.get(whole)
        if cached is not None and cached[0] == entry.version:
            return cached[1]
        # the analysis computes what a page asks for; the Overview's key figures and findings under the entry's
        # lock (load_overview), so sessions never repeat that work
        analysis = summary.analyze(entry.source, source.kind, whole_run=whole, window=window)
        if source.kind == "run":
            entry.version = _version(entry.source)  # the skipped head may have been read
        if summary_store.is_finished(source.path):   # what was kept beside its stored summary is read, not computed
            analysis.use_kept(summary_store.load_kept(path, key=_summary_key(source)))
        entry.analyses[whole] = (entry.version, analysis)
        return analysis


def window_of(analysis: RunAnalysis) -> StepWindow | None:
    """The step window an analysis covers, or None when it covers the whole run."""
    from dtprobe.analysis.window import StepWindow

    return analysis.source if isinstance(analysis.source, StepWindow) else None


def load_overview(source: Source, *, whole_run: bool = False) -> Overview:
    """What the Overview draws of ``source`` (see ``load_analysis``): a finished run's or trace folder's stored
    summary when it is valid for the source as it is now, else made from the analysis (and then stored)."""
    path = str(source.path)
    if summary_store.is_finished(source.path):
        stored = _stored_overview(source)
        if stored is not None:
            return stored
        entry = _entry(path, None if source.kind == "run" else ("traces", _mtime(source.path)))
        with entry.lock:   # one summary made at a time: a second session (or the background's) waits for it
            token = _stored_token(source)
            # before the source is read: a change meanwhile makes it stale (memoized while the files' token holds:
            # _stored_overview made it just now)
            key = _summary_key(source)
            stored = summary_store.load(path, key=key)   # made while this call waited for the lock
            if stored is None:
                analysis = load_analysis(source, whole_run=whole_run)
                stored = summarize(analysis, path=path)
                summary_store.store(path, stored, key=key, kept=analysis.kept_results())
            _STORED[path] = (token, stored)
            return stored
    entry = _entry(path, None if source.kind == "run" else ("traces", _mtime(source.path)))
    with entry.lock:
        started = time.perf_counter()
        analysis = load_analysis(source, whole_run=whole_run)
        cached = entry.overviews.get(whole_run)
        if cached is None or cached[0] != entry.version:  # summarized once per version, not once per session
            cached = entry.overviews[whole_run] = (entry.version, summarize(analysis, path=path))
            entry.build_s = time.perf_counter() - started
        return cached[1]


def _stored_overview(source: Source) -> Overview | None:
    """The valid stored summary of a finished ``source`` (memoized while its files are unchanged), else None."""
    path = str(source.path)
    token = _stored_token(source)
    memo = _STORED.get(path)
    if memo is not None and memo[0] == token:
        return memo[1]
    stored = summary_store.load(path, key=_summary_key(source))
    if stored is not None:
        _STORED[path] = (token, stored)
    return stored


def _summary_key(source: Source) -> dict:
    """``summary_store.key_of`` the finished ``source`` (memoized while its files are unchanged: it stats every
    file of the run), which its stored summary and the results kept beside it are read under."""
    path = str(source.path)
    token = _stored_token(source)
    memo = _KEYS.get(path)
    if memo is None or memo[0] != token:
        memo = _KEYS[path] = (token, summary_store.key_of(path))
    return memo[1]


def finished_overview(source: Source, *, whole_run: bool = False) -> Live:
    """The Overview of a finished run or trace folder for its page: ``load_overview`` (a valid stored summary, else
    made and stored before returning), except for a run of ``LARGE_EVENTS_BYTES`` or more of events and tables
    without a valid summary: its steps' key figures at once (``Live.pending``, as a large live run's first draw)
    while a background thread analyzes it and stores its summary; the next call after that shows it. What that
    thread raised is raised by the next call."""
    stored = _stored_overview(source) if source.kind == "run" else None
    if stored is not None or source.kind != "run":
        _STEPS_ONLY.pop(str(source.path), None)   # the steps-only store a live or pending view left
        return Live(stored or load_overview(source, whole_run=whole_run), updating=False)
    entry = _entry(str(source.path), None)
    if not _is_large(entry, source.path):
        return Live(load_overview(source, whole_run=whole_run), updating=False)
    quick = _steps_overview(source, whole_run)   # before the analysis starts, which would slow it down
    if not _refresh_behind(entry, source, whole_run):   # it ended between the two checks: its summary is stored
        _STEPS_ONLY.pop(str(source.path), None)
        return Live(load_overview(source, whole_run=whole_run), updating=False)
    return Live(quick, updating=True, pending=True)


def overview_pending(source: Source) -> bool:
    """A finished run's Overview is being made in the background (``finished_overview``)."""
    entry = _ENTRIES.get(str(source.path))
    return entry is not None and entry.worker is not None and entry.worker.is_alive()


_STORED: dict[str, tuple[Any, Overview]] = {}
"""path -> (``_stored_token`` when read or made, the valid stored summary): a rerun skips ``summary_store.key_of``,
which stats every file of the run."""
_KEYS: dict[str, tuple[Any, dict]] = {}
"""path -> (``_stored_token`` when made, ``summary_store.key_of`` the source then)."""


def _stored_token(source: Source) -> tuple:
    """What a memoized stored summary of ``source`` depends on: its files (``_files_token``) and the summary cache
    it was read from or stored in (``summary_store.cache_dir``: another cache holds another summary, or none)."""
    return _files_token(source.path, source.kind), str(summary_store.cache_dir())


def _files_token(path: Path, kind: str):
    """What changes when a finished source's files do: the newest mtime of a run's manifest, rank infos, events and
    compaction marker (a few directory scans), or a trace folder's files."""
    from dtprobe.store import run_mtime_ns

    return run_mtime_ns(path) if kind == "run" else _mtime(path)


def finding_lines(source: Source, analysis: RunAnalysis) -> list:
    """Every finding of ``source``, worst first, as the Overview lists them: of a finished run or trace folder its
    (stored) Overview's lines, so a page that shows a few findings does not make the analysis find them all; else
    ``analysis.findings()``."""
    if summary_store.is_finished(source.path):
        return list(load_overview(source).findings)
    return analysis.findings()


def finding_lines_known(source: Source, analysis: RunAnalysis) -> list | None:
    """``finding_lines`` when they are known without analyzing the run: a finished run's or trace folder's stored
    (or already made) Overview's lines, None while that Overview is still to be made (a page draws what it can
    first); of a running run ``analysis.findings()``."""
    if not summary_store.is_finished(source.path):
        return analysis.findings()
    stored = _stored_overview(source)
    return None if stored is None else list(stored.findings)


def findings_with_evidence(source: Source, analysis: RunAnalysis, detectors: dict[str, str]) -> list:
    """The findings of ``source`` whose code is a key of ``detectors`` (worst first), each with its evidence rows:
    the facade method ``detectors[code]`` finds them, and ``finding_lines`` says which of them the run reports and
    at which severity. A line its detector does not give back (e.g. a stored summary of other options) is shown as
    the line alone."""
    lines = [line for line in finding_lines(source, analysis) if line.code in detectors]
    if not lines or all(hasattr(line, "rows") for line in lines):
        return lines
    found = {}
    for method in dict.fromkeys(detectors[line.code] for line in lines):
        for finding in getattr(analysis, method)():
            found.setdefault((finding.code, tuple(int(r) for r in finding.ranks), finding.group), finding)
    out = []
    for line in lines:
        finding = found.get((line.code, tuple(line.ranks), line.group))
        out.append(line if finding is None else finding if finding.severity == line.severity
                   else dataclasses.replace(finding, severity=line.severity))
    return out


@dataclass(frozen=True)
class Live:
    """What a live refresh shows: an Overview or a ``RunAnalysis``."""

    value: Any
    updating: bool
    """Rows read since are being analyzed in the background; ``value`` is of the previous analysis (an Overview:
    with the steps table's key figures and trends of now, ``overview.with_steps_of``)."""
    pending: bool = False
    """The first analysis is still running: ``value`` holds the key figures of the steps table alone, no findings."""
    analyzed_steps: int | None = None
    """While ``updating``: the steps of the analysis whose findings and other figures ``value`` shows."""


def live_overview(source: Source, *, whole_run: bool = False) -> Live:
    """The Overview of a running run for a live refresh: ``load_overview`` when the run's events hold less than
    ``LARGE_EVENTS_BYTES`` or its previous analysis took less than ``LIVE_BLOCK_S``; else, at once, the previous
    Overview with the steps table's key figures and trends of now (its own steps-only store tails the steps alone),
    while a background thread reads the new rows and re-analyzes (one at a time per source). The first analysis of
    a large run runs on that thread too, while the page shows the key figures of the steps table alone
    (``Live.pending``). What that thread raised (TraceError for damaged rows) is raised by the next call."""
    entry = _entry(str(source.path), None)
    if not _is_large(entry, source.path):
        return Live(load_overview(source, whole_run=whole_run), updating=False)
    if entry.overviews.get(whole_run) is None:
        quick = _steps_overview(source, whole_run)   # before the analysis starts, which would slow it down
        _refresh_behind(entry, source, whole_run)
        return Live(quick, updating=True, pending=True)
    if entry.build_s < LIVE_BLOCK_S:
        _STEPS_ONLY.pop(str(source.path), None)   # every refresh analyzes its rows: no steps-only store needed
        return Live(load_overview(source, whole_run=whole_run), updating=False)
    steps = _steps_overview(source, whole_run)
    updating = _refresh_behind(entry, source, whole_run)
    analyzed = entry.overviews[whole_run][1]
    if not updating or steps.num_steps < analyzed.num_steps:
        return Live(analyzed, updating=updating)
    return Live(with_steps_of(analyzed, steps), updating=True, analyzed_steps=analyzed.num_steps)


def live_analysis(source: Source, *, whole_run: bool = False) -> Live:
    """``live_overview`` for the pages that draw from the analysis: the previous analysis at once while a slow
    re-analysis runs in the background, else ``load_analysis``."""
    entry = _entry(str(source.path), None)
    if entry.analyses.get(whole_run) is None or entry.build_s < LIVE_BLOCK_S or not _is_large(entry, source.path):
        return Live(load_analysis(source, whole_run=whole_run), updating=False)
    updating = _refresh_behind(entry, source, whole_run)
    return Live(entry.analyses[whole_run][1], updating=updating)


def _refresh_behind(entry: _Entry, source: Source, whole_run: bool) -> bool:
    """Start the background re-analysis of ``source`` unless one runs; True while it runs. Raises what the last
    one raised."""
    with _LOCK:
        error, entry.worker_error = entry.worker_error, None
        if error is not None:
            raise error
        if entry.worker is None or not entry.worker.is_alive():
            entry.worker = threading.Thread(target=_refresh_in_background, args=(entry, source, whole_run),
                                            name=f"dtprobe-refresh-{source.name}", daemon=True)
            entry.worker.start()
        return entry.worker.is_alive()


def _is_large(entry: _Entry, run_dir: Path) -> bool:
    """The run's events and compacted tables hold ``LARGE_EVENTS_BYTES`` or more (once large, a run stays so: not
    checked again)."""
    if not entry.large:
        entry.large = sum(folder_bytes(run_dir / part) for part in ("events", "tables")) >= LARGE_EVENTS_BYTES
    return entry.large


def _steps_overview(source: Source, whole_run: bool) -> Overview:
    """``summary.steps_overview`` of ``source``, its steps table and the ranks' per-step summaries (``comm_steps``)
    opened apart (and tailed on later calls), so the first analysis' lock and reads are not waited for."""
    from dtprobe.store import RunStore

    path = str(source.path)
    with _LOCK:
        store = _STEPS_ONLY.get(path)
    window = live_window_steps()
    if store is None:
        finished = summary_store.is_finished(source.path)   # analyzed whole: no tail to read first
        store = RunStore.open(path, tables=("steps", "comm_steps"), tail_steps=None if finished else window or None)
        with _LOCK:
            _STEPS_ONLY[path] = store
    else:
        store.refresh()
    return summary.steps_overview(store, whole_run=whole_run, window=window, path=path)


_STEPS_ONLY: dict[str, Any] = {}
"""path -> the ``RunStore`` of a live run's steps and comm_steps tables alone (``_steps_overview``)."""


def _refresh_in_background(entry: _Entry, source: Source, whole_run: bool) -> None:
    try:
        load_overview(source, whole_run=whole_run)
    except BaseException as exc:  # not swallowed: live_overview raises it in the page's next refresh
        entry.worker_error = exc


def wait_for_refresh(source: Source, timeout_s: float | None = None) -> None:
    """Wait for the background re-analysis of ``source`` started by ``live_overview`` (tests, benchmarks)."""
    entry = _ENTRIES.get(str(source.path))
    worker = entry.worker if entry is not None else None
    if worker is not None:
        worker.join(timeout_s)


def load_window(source: Source, analysis: RunAnalysis, names: tuple[str, ...], *, steps: tuple[int, int],
                ranks: list[int]) -> dict[str, "pd.DataFrame"]:
    """Rows of tables ``names`` in ``steps`` (inclusive) and ``ranks``, for a view of a few steps and ranks. Of a
    run, read from its store with the window pushed down (``RunStore.table(name, steps=..., ranks=...)``: of a
    compacted run only the partitions holding them; collectives keep ``seq`` as each rank numbered it) and cached
    per window and data version; of a trace folder, cut from the analysis' tables."""
    if source.kind != "run":
        out = {}
        for name in names:
            df = analysis.table(name)
            df = df[df["rank"].isin(ranks)]
            out[name] = df[df["step"].between(*steps)] if "step" in df.columns else df
        return out
    path = str(source.path)
    version = _ENTRIES[path].version if path in _ENTRIES else ()
    # read whole step blocks (the partitions' steps: the same files as the window alone), so that moving the window
    # within them is a cache hit cut in memory
    first, last = int(steps[0]), int(steps[1])
    blocks = (first - first % STEP_BLOCK_STEPS, last - last % STEP_BLOCK_STEPS + STEP_BLOCK_STEPS - 1)
    out = {}
    for name in names:
        rows = _window_rows(path, version, name, blocks, tuple(sorted(map(int, ranks))))
        out[name] = rows[rows["step"].between(first, last)].reset_index(drop=True) if "step" in rows.columns else rows
    return out


@st.cache_data(max_entries=64, show_spinner=False)
def _window_rows(path: str, version: tuple, name: str, steps: tuple[int, int], ranks: tuple[int, ...]):
    """``load_window``'s read of one table of a run (``version`` keys the cache: new rows make a new entry)."""
    with _LOCK:
        entry = _ENTRIES.get(path)
    if entry is None or entry.source is None:
        raise TraceError(f"'{path}' is not open: load its analysis (load_analysis) before a window of it.")
    return entry.source.table(name, steps=steps, ranks=ranks)  # the store has its own lock; not the entry's,
    # which a background re-analysis holds


def clear() -> None:
    """Drop every open source and analysis (tests)."""
    with _LOCK:
        _ENTRIES.clear()
        _STORED.clear()
        _KEYS.clear()
        _STEPS_ONLY.clear()


def open_store(source: Source):
    """The open ``RunStore`` (or ``KinetoRun``) behind ``source``, as last read (tests, diagnostics)."""
    entry = _ENTRIES.get(str(source.path))
    return entry.source if entry is not None else None


def load_sources(root: Path) -> list[Source]:
    return list_sources(root)


@st.cache_data(max_entries=256, show_spinner=False)
def load_run_info(path: str, mtime_ns: int) -> tuple[str, int | None]:
    """(status, created Unix ns) of a run from its manifest, re-read when run.json changes; trace folders:
    ("traces", folder mtime)."""
    from dtprobe.store import read_manifest

    if not (Path(path) / "run.json").is_file():
        return "traces", Path(path).stat().st_mtime_ns
    manifest = read_manifest(path)
    return manifest.status, manifest.created_ns


@st.cache_data(max_entries=32, show_spinner="Searching layouts ...")
def load_plan(model: str, gpu: str, num_gpus: int, gpus_per_node: int, seq_len: int, global_batch: int,
              precision: str, top_k: int):
    """Planner result for these inputs: (best layouts, rejected layouts) DataFrames."""
    from dtprobe.planner import TrainingSpec, make_cluster, model_preset, plan

    result = plan(model_preset(model), make_cluster(gpu=gpu, num_gpus=num_gpus, gpus_per_node=gpus_per_node),
                  TrainingSpec(global_batch=global_batch, seq_len=seq_len, precision=precision), top_k=top_k)
    return result.layouts, result.rejected


def _mtime(path: Path) -> float:
    return max((p.stat().st_mtime for p in path.iterdir()), default=path.stat().st_mtime)
