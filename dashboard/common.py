"""The frame every page shares: root and run picker (validated), title, live refresh; no data logic here."""

from __future__ import annotations

import os
import time
from typing import Callable

import streamlit as st

from dashboard import data
from dashboard.paths import ROOT_IS_SOURCE, Source, resolve_choice, root_from_env
from dtprobe.store.errors import ConfigError, TraceError


SEVERITY_BADGE = {"critical": "red", "warning": "orange", "info": "blue"}


def refresh_s() -> float:
    return float(os.environ.get("DTPROBE_REFRESH_S", "2"))


def _label(source: Source) -> str:
    status = _status(source)
    age_s = time.time() - source.path.stat().st_mtime
    age = f"{age_s / 60:.0f} min" if age_s < 3600 else f"{age_s / 3600:.1f} h"
    name = source.path.name if source.name == ROOT_IS_SOURCE else source.name
    return f"{name} · {status} · {age} ago"


def _status(source: Source) -> str:
    manifest = source.path / "run.json"
    mtime = manifest.stat().st_mtime_ns if manifest.exists() else 0
    try:
        return data.load_status(str(source.path), mtime)
    except TraceError:
        return "unreadable"


def page_setup(title: str) -> Source:
    """Sidebar run picker + page title; stops the page with a readable message when there is nothing to show.

    The choice comes from the picker or the ``run`` URL parameter and is always re-validated against the root.
    """
    try:
        root = root_from_env()
    except ConfigError as exc:
        st.error(str(exc))
        st.stop()
    sources = data.load_sources(root)
    if not sources:
        st.title(title)
        st.info(f"No runs under {root} yet. Start one with `dtprobe run --run-dir {root}/my-run`.")
        st.stop()
    names = [s.name for s in sources]
    requested = st.query_params.get("run")
    if requested is not None and requested not in names:
        try:
            resolve_choice(root, requested)
        except ConfigError as exc:
            st.sidebar.error(str(exc))
        requested = None
    if "run" not in st.session_state or st.session_state["run"] not in names:
        st.session_state["run"] = requested or names[0]
    by_name = {s.name: s for s in sources}
    choice = st.sidebar.selectbox("Run", names, key="run", format_func=lambda n: _label(by_name[n]))
    try:
        source = resolve_choice(root, choice)
    except ConfigError as exc:
        st.error(str(exc))
        st.stop()
    st.query_params["run"] = choice
    st.title(title)
    return source


def is_live(source: Source) -> bool:
    return source.kind == "run" and _status(source) == "running"


def render(source: Source, body: Callable[[Source], None]) -> None:
    """Draw ``body``; while the run is running, redraw it every ``refresh_s`` seconds (only new events are read)."""
    if is_live(source):
        st.caption(f"Live: refreshing every {refresh_s():g} s")
        st.fragment(run_every=refresh_s())(body)(source)
    else:
        body(source)


def load(source: Source):
    """The analysis of the chosen source, or a readable stop when its data is unusable."""
    try:
        return data.load_analysis(source)
    except (TraceError, ConfigError) as exc:
        st.error(f"Cannot read {source.name}: {exc}")
        st.stop()


def finding_params(source: Source, finding) -> dict[str, str]:
    """URL parameters that carry a finding to its page: the run, the code and the ranks to mark."""
    return {"run": source.name, "finding": finding.code, "ranks": ",".join(str(r) for r in finding.ranks)}


def marked_ranks() -> list[int]:
    """Ranks a finding link asked the page to mark (``ranks`` URL parameter), ignoring anything malformed."""
    raw = st.query_params.get("ranks", "")
    return [int(part) for part in raw.split(",") if part.strip().isdigit()]


def key_figures(analysis) -> dict[str, str]:
    """The Overview's headline numbers, formatted; '-' when a figure is unknown for this run."""
    summary = analysis.throughput_summary()
    metrics = analysis.metrics()

    def fmt(value, pattern: str) -> str:
        return "-" if value is None else pattern.format(value)

    steps = analysis.table("steps")
    return {
        "steps": str(int(steps["step"].max()) + 1) if not steps.empty else "0",
        "step time": fmt(summary.get("step_time_ms"), "{:.1f} ms"),
        "tokens/s": fmt(summary.get("tokens_per_s"), "{:,.0f}"),
        "MFU": fmt(summary.get("mfu"), "{:.1%}"),
        "exposed comm": fmt(metrics.get("exposed_comm_frac"), "{:.1%}"),
        "bubble": fmt(metrics.get("bubble_frac"), "{:.1%}"),
        "overflows": fmt(metrics.get("amp_overflows"), "{:d}"),
        "checkpoint share": fmt(metrics.get("checkpoint_share_frac"), "{:.1%}"),
    }
