"""The dashboard's only caching site: run stores tailed incrementally, analyses keyed by what was read.

A run's ``RunStore`` is opened once and refreshed on every page run: only lines appended since the last read are
parsed. While a run is running, pages analyze its newest ``live_window_steps()`` steps (``StepWindow``) unless
the user asks for the whole run, so a live refresh costs the window, not the run's length; a finished run is
always analyzed whole. An analysis is rebuilt only when the store's row counts or status changed. Trace folders
are parsed once per mtime. Planner results are cached by their inputs.

The first Overview after the server starts can come from ``dtprobe.dashboard.summary``'s child process instead
(``put_summary``): the server then analyzes that run itself shortly after the page is sent.

The caches are plain module state (not ``st.cache_resource``) so that ``dtprobe.dashboard.serve`` can fill them before
any browser session exists.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import streamlit as st

from dtprobe.dashboard import summary
from dtprobe.dashboard.paths import LIVE_WINDOW_ENV, Source, list_sources, live_window_steps  # noqa: F401 (re-exported)

if TYPE_CHECKING:  # imported where used: the first Overview can be drawn before pandas is imported
    from dtprobe.analysis.facade import RunAnalysis
    from dtprobe.analysis.window import StepWindow

MAX_SOURCES = 16
"""Runs or trace folders kept open at once (least recently used ones are dropped)."""


@dataclass
class _Entry:
    source: Any
    """``RunStore`` or ``KinetoRun``."""
    version: tuple
    """What the source held when it was last read (row counts and status, or the trace folder's mtime)."""
    analyses: dict[bool, tuple[tuple, RunAnalysis]]
    """whole_run -> (version it was built at, analysis)."""
    lock: threading.RLock


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
            _ENTRIES.popitem(last=False)
        return entry


def _read(entry: _Entry, path: str, kind: str) -> None:
    """Open the source on first use; for runs, tail the lines appended since the last call."""
    if entry.source is None:  # a live run is read from its newest steps; the rest only if asked for
        from dtprobe.analysis.facade import open_source

        entry.source = open_source(path, live_tail_steps=live_window_steps() or None)
    elif kind == "run":
        entry.source.refresh()
    if kind == "run":
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
        # key figures and findings are computed here, under the entry's lock, so sessions never repeat the work
        analysis = summary.analyze(entry.source, source.kind, whole_run=whole, window=window)
        if source.kind == "run":
            entry.version = _version(entry.source)  # the skipped head may have been read
        entry.analyses[whole] = (entry.version, analysis)
        return analysis


def window_of(analysis: RunAnalysis) -> StepWindow | None:
    """The step window an analysis covers, or None when it covers the whole run."""
    from dtprobe.analysis.window import StepWindow

    return analysis.source if isinstance(analysis.source, StepWindow) else None


SUMMARY_WAIT_S = 60.0
"""Longest a page waits for the summary child before analyzing in the server itself."""
SUMMARY_MAX_AGE_S = 30.0
"""A child's summary older than this is not shown (the run has moved on): the page analyzes it afresh."""
ANALYZE_AFTER_S = 1.0
"""Delay between a page drawn from a child's summary and the server's own analysis of that run: the browser is
still fetching the page's scripts from this server meanwhile."""

_SUMMARIES: dict[str, summary.Overview] = {}
_SUMMARY_DONE: dict[str, threading.Event] = {}
"""Path of a source a summary child works on -> set when it is done."""
_TIMERS: list[threading.Timer] = []
"""The server's own analyses scheduled after pages drawn from a summary (``clear`` cancels those not started)."""


def expect_summary(path: str) -> None:
    """A summary child is analyzing the source at ``path``: its Overview waits for ``put_summary`` (at most
    ``SUMMARY_WAIT_S``) rather than analyzing it a second time."""
    _SUMMARY_DONE[path] = threading.Event()


def put_summary(path: str, overview: summary.Overview | None) -> None:
    """Hand over the child's summary of ``path`` (None: the child printed none); pages stop waiting for it."""
    if overview is not None:
        _SUMMARIES[path] = overview
    done = _SUMMARY_DONE.get(path)
    if done is not None:
        done.set()


def load_overview(source: Source, *, whole_run: bool = False) -> summary.Overview:
    """What the Overview draws of ``source`` (see ``load_analysis``). Before the server has analyzed it, the
    summary a child made at the server's start is used once, if it covers what was asked for and is recent; the
    server's own analysis then starts ``ANALYZE_AFTER_S`` later."""
    path = str(source.path)
    entry = _ENTRIES.get(path)
    if entry is None or not entry.analyses:
        done = _SUMMARY_DONE.get(path)
        if done is not None:
            done.wait(SUMMARY_WAIT_S)
        made = _SUMMARIES.pop(path, None)
        if made is not None and (made.whole or not whole_run) and time.time() - made.made_s < SUMMARY_MAX_AGE_S:
            timer = threading.Timer(ANALYZE_AFTER_S, _analyze_quietly, (source, whole_run))
            timer.daemon = True
            _TIMERS[:] = [t for t in _TIMERS if t.is_alive()] + [timer]
            timer.start()
            return made
    return summary.summarize(load_analysis(source, whole_run=whole_run), path=path)


def _analyze_quietly(source: Source, whole_run: bool) -> None:
    try:
        load_analysis(source, whole_run=whole_run)
    except Exception:  # noqa: BLE001 - a page asking for it reports the same error where the user can act
        pass


def clear() -> None:
    """Drop every open source, analysis and summary (tests)."""
    with _LOCK:
        _ENTRIES.clear()
    _SUMMARIES.clear()
    _SUMMARY_DONE.clear()
    while _TIMERS:
        _TIMERS.pop().cancel()


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
