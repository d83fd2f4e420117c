"""The dashboard's only caching site: run stores tailed incrementally, analyses keyed by what was read.

A run's ``RunStore`` is kept (``cache_resource``) and refreshed on every page run: only lines appended since
the last read are parsed, so a live refresh costs the new events, not the run's length. The ``RunAnalysis``
over it is rebuilt only when the store's row counts changed. Trace folders are parsed once per mtime.
"""

from __future__ import annotations

import threading
from pathlib import Path

import streamlit as st

from dashboard.paths import Source, list_sources
from dtprobe.analysis.facade import RunAnalysis, open_source

_LOCK = threading.Lock()


@st.cache_resource(max_entries=64, show_spinner=False)
def _run_store(path: str):
    """One incremental reader per run directory, shared by sessions (guarded by ``_LOCK``)."""
    return open_source(path)


@st.cache_resource(max_entries=64, show_spinner="Analyzing ...")
def _analysis(path: str, version: tuple) -> RunAnalysis:
    """The analysis of ``path`` as of ``version`` (row counts per table, or the trace folder's mtime)."""
    return RunAnalysis(_run_store(path))


def load_analysis(source: Source) -> RunAnalysis:
    """The current analysis of ``source``; for runs, reads only what was appended since the last call."""
    key = str(source.path)
    if source.kind != "run":
        return _analysis(key, ("traces", _mtime(source.path)))
    with _LOCK:
        store = _run_store(key)
        store.refresh()
        version = tuple(sorted((name, len(store.table(name))) for name in store.tables()))
        version += (store.manifest.status,)
    return _analysis(key, version)


def load_sources(root: Path) -> list[Source]:
    return list_sources(root)


@st.cache_data(max_entries=256, show_spinner=False)
def load_status(path: str, mtime_ns: int) -> str:
    """A run's status from its manifest (re-read when run.json changes); ``traces`` for trace folders."""
    from dtprobe.store.manifest import read_manifest

    if not (Path(path) / "run.json").is_file():
        return "traces"
    return read_manifest(path).status


def _mtime(path: Path) -> float:
    return max((p.stat().st_mtime for p in path.iterdir()), default=path.stat().st_mtime)
