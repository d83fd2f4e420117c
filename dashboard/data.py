"""The dashboard's only caching site: run stores tailed incrementally, analyses keyed by what was read.

A run's ``RunStore`` is kept (``cache_resource``) and refreshed on every page run: only lines appended since
the last read are parsed, so reading a live run costs the new events, not the run's length. The ``RunAnalysis``
over it is rebuilt only when the store's row counts (``RunStore.num_rows``, no frame built) or its status
changed. Trace folders are parsed once per mtime. Planner results are cached by their inputs.
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
    """One incremental reader per run directory (or parsed trace folder), shared by sessions."""
    return open_source(path)


@st.cache_resource(max_entries=64, show_spinner="Analyzing ...")
def _analysis(path: str, version: tuple) -> RunAnalysis:
    """The analysis of ``path`` as of ``version`` (row counts per table and status, or the folder's mtime)."""
    return RunAnalysis(_run_store(path))


def store_version(source: Source) -> tuple:
    """Tail the run's new lines and return what identifies its content now (cheap for a live run)."""
    with _LOCK:
        store = _run_store(str(source.path))
        store.refresh()
        return tuple(sorted(store.num_rows().items())) + (store.manifest.status,)


def load_analysis(source: Source) -> RunAnalysis:
    """The current analysis of ``source``; for runs, reads only what was appended since the last call."""
    key = str(source.path)
    if source.kind != "run":
        return _analysis(key, ("traces", _mtime(source.path)))
    return _analysis(key, store_version(source))


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
