"""The frame every page shares: root and run picker (validated), title, live refresh, chart drawing with PNG
export, finding links; no data logic here (that is the facade's, cached in data.py)."""

from __future__ import annotations

import base64
import os
import threading
import time
from typing import Callable

import streamlit as st

from dtprobe.dashboard import clocks, data
from dtprobe.dashboard.paths import ROOT_IS_SOURCE, Source, resolve_choice, root_from_env
from dtprobe.store.errors import ConfigError, TraceError

SEVERITY_BADGE = {"critical": "red", "warning": "orange", "info": "blue"}
REFRESH_ENV = "DTPROBE_REFRESH_S"
"""Live refresh interval (seconds) handed over by `dtprobe dashboard --refresh-s`."""


def refresh_s() -> float:
    return float(os.environ.get(REFRESH_ENV, "2"))


def _age(seconds: float) -> str:
    if seconds < 90:
        return f"{seconds:.0f} s"
    return f"{seconds / 60:.0f} min" if seconds < 3600 else f"{seconds / 3600:.1f} h"


def _info(source: Source) -> tuple[str, int | None]:
    manifest = source.path / "run.json"
    mtime = manifest.stat().st_mtime_ns if manifest.exists() else 0
    try:
        return data.load_run_info(str(source.path), mtime)
    except TraceError:
        return "unreadable", None


def _status(source: Source) -> str:
    return _info(source)[0]


def _runs_table(sources: list[Source]) -> list[dict]:
    from dtprobe.store import run_mtime_ns

    now = time.time()
    rows = []
    for s in sources:
        status, created_ns = _info(s)
        updated = run_mtime_ns(s.path) / 1e9 if s.kind == "run" else s.path.stat().st_mtime
        rows.append({"run": s.path.name if s.name == ROOT_IS_SOURCE else s.name, "status": status,
                     "age": _age(now - created_ns / 1e9) if created_ns else "?",
                     "last write": _age(max(0.0, now - updated)) + " ago"})
    return rows


def _md_cell(text: str) -> str:
    """A run name as literal text in a Markdown table cell (names come from the file system)."""
    return "".join("\\" + c if c in "\\`*_{}[]()<>#+-.!|~" else c for c in text)


def _sync_run_param() -> None:
    st.query_params["run"] = st.session_state["run"]


_PICKER = threading.local()
"""The run picker waiting to be drawn by this script run (Streamlit runs each session's script in one thread)."""


def page_setup(title: str) -> Source:
    """Sidebar run picker + page title; stops the page with a readable message when there is nothing to show.

    The choice comes from the picker or the ``run`` URL parameter and is always re-validated against the root.
    The picker keeps its place at the top of the sidebar but is sent to the browser after the page's content
    (``render`` draws it last): the select box's script bundle, loaded when the box first appears, would
    otherwise hold up the whole first page.
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
            names.append(requested)  # valid but not listed yet (created after the listing was cached)
        except ConfigError as exc:
            st.sidebar.error(str(exc))
            requested = None
    if requested is not None:
        st.session_state["run"] = requested
    elif st.session_state.get("run") not in names:
        st.session_state["run"] = names[0]
    choice = st.session_state["run"]  # what the picker shows when render() draws it
    _PICKER.pending = (st.sidebar.empty(), names)
    runs = _runs_table(sources)
    chosen = next((r for r in runs if r["run"] == (root.name if choice == ROOT_IS_SOURCE else choice)), None)
    if chosen is not None:
        st.sidebar.caption(f"{chosen['status']} · started {chosen['age']} ago · last write {chosen['last write']}")
    with st.sidebar.expander(f"Runs under the root ({len(sources)})", expanded=len(sources) > 1):
        # a Markdown table: the interactive grid's script bundle would delay the first page
        st.markdown("| run | status | age | last write |\n|---|---|---|---|\n" + "\n".join(
            f"| {_md_cell(r['run'])} | {r['status']} | {r['age']} | {r['last write']} |" for r in runs))
    try:
        source = resolve_choice(root, choice)
    except ConfigError as exc:
        st.error(str(exc))
        _stop()
    st.query_params["run"] = choice
    _whole_run_toggle(source)
    st.title(title)
    return source


def _draw_picker() -> None:
    """Draw the run picker ``page_setup`` left pending (once per script run)."""
    pending, _PICKER.pending = getattr(_PICKER, "pending", None), None
    if pending is not None:
        slot, names = pending
        # option labels stay the bare names: a label that changes (status, age) would reset the widget's state
        slot.selectbox("Run", names, key="run", on_change=_sync_run_param)


def _stop() -> None:
    """``st.stop()`` the page, with the run picker drawn first (nothing can be drawn once a stop is asked for)."""
    _draw_picker()
    st.stop()


def is_live(source: Source) -> bool:
    return source.kind == "run" and _status(source) == "running"


def _whole_run_toggle(source: Source) -> None:
    if is_live(source) and data.live_window_steps() > 0:
        st.sidebar.toggle("Whole run", key=WHOLE_RUN_KEY,
                          help=f"While a run is running, pages analyze its newest {data.live_window_steps()} "
                               f"steps so that every refresh stays fast; switch on to analyze every step.")


def render(source: Source, body: Callable[[Source], None], *, live: bool = True,
           pending: Callable[[Source], bool] | None = None) -> None:
    """Draw ``body``, then the run picker; while the run is running (and ``live``), redraw ``body`` every
    ``refresh_s`` seconds (only new events are read). A finished run's page whose ``pending(source)`` holds (what
    it draws is being made in the background) is redrawn the same way until it no longer holds, then once whole.
    When ``body`` fails, the picker is drawn all the same."""
    try:
        if live and is_live(source):
            st.caption(f":green[● live] refreshing every {refresh_s():g} s")
            st.fragment(run_every=refresh_s())(body)(source)
        elif pending is not None and pending(source):
            st.fragment(run_every=refresh_s())(_until_done(body, pending))(source)
        else:
            body(source)
    finally:
        _draw_picker()


def _until_done(body: Callable[[Source], None], pending: Callable[[Source], bool]) -> Callable[[Source], None]:
    """``body`` for a polling fragment: once ``pending`` no longer holds, the whole page is run again (drawn
    without polling)."""
    def run(source: Source) -> None:
        if not pending(source):
            st.rerun()
        body(source)
    return run


def preload_chart_library() -> None:
    """An empty chart 10 px high at the end of the page, drawn after everything else: the browser fetches and
    compiles Streamlit's plotly bundle (megabytes of script, loaded when a page first draws a chart) while the user
    reads the Overview, not when a finding's link opens a page of charts."""
    import plotly.graph_objects as go

    fig = go.Figure(layout=dict(height=10, template="none", margin=dict(l=0, r=0, t=0, b=0),
                                paper_bgcolor="rgba(0,0,0,0)", plot_bgcolor="rgba(0,0,0,0)",
                                xaxis=dict(visible=False), yaxis=dict(visible=False)))
    st.plotly_chart(fig, key=CHART_LIBRARY_KEY, config={"displayModeBar": False, "staticPlot": True})


CHART_LIBRARY_KEY = "chart_library"
"""Key of the Overview's empty chart (``preload_chart_library``)."""


def overview_pending(source: Source) -> bool:
    """A finished run's Overview is being made in the background (``data.finished_overview``, which this starts
    when the run has no valid stored summary): its page shows the steps' key figures meanwhile."""
    return not is_live(source) and _loaded(source, data.finished_overview).pending


WHOLE_RUN_KEY = "whole_run"
"""Session key of the sidebar toggle that analyzes a live run whole instead of its newest steps."""


def load(source: Source):
    """The analysis of the chosen source (a live run: its newest steps unless the sidebar asks for the whole
    run, said in a caption; ``data.live_analysis``, which may give the previous analysis while new rows are
    analyzed, also said), or a readable stop when its data is unusable."""
    if is_live(source):
        live = _loaded(source, data.live_analysis)
        analysis = live.value
        if live.updating:
            window = data.window_of(analysis)
            _updating_caption(window.total_steps if window is not None else analysis.table("steps")["step"].nunique())
    else:
        analysis = _loaded(source, data.load_analysis)
    window = data.window_of(analysis)
    if window is not None:
        _window_caption(window.describe(), window.total_steps)
    return analysis


def load_overview(source: Source):
    """(Overview, pending): what the Overview draws of the chosen source (``data.finished_overview``, or while the
    run is running ``data.live_overview``, which may show the previous analysis while new rows are analyzed; before
    the first analysis of a large run ended, either gives the steps' key figures alone, ``pending``, said in a
    caption), with the same caption and the same readable stop as ``load``."""
    live = _loaded(source, data.live_overview if is_live(source) else data.finished_overview)
    overview, pending = live.value, live.pending
    if pending:
        st.caption(FINDINGS_PENDING)
    elif live.updating:
        _updating_caption(overview.num_steps if live.analyzed_steps is None else live.analyzed_steps,
                          current_steps=live.analyzed_steps is not None)
    if overview.window is not None:
        _window_caption(overview.window, overview.num_steps)
    return overview, pending


def _loaded(source: Source, loader: Callable):
    """``loader(source, whole_run=<the sidebar switch>)`` under a spinner; a readable stop when the data is
    unusable."""
    try:
        with st.spinner("Analyzing ...", show_time=True):
            return loader(source, whole_run=bool(st.session_state.get(WHOLE_RUN_KEY)))
    except (TraceError, ConfigError) as exc:
        st.error(f"Cannot read {source.name}: {exc}")
        _stop()


FINDINGS_PENDING = ("Analyzing the run in the background: the key figures of its steps are shown meanwhile; "
                    "findings and communication figures appear when the analysis is done.")
"""Caption of an Overview drawn before its first analysis ended (``data.Live.pending``)."""


def _updating_caption(num_steps: int, *, current_steps: bool = False) -> None:
    if current_steps:   # (data.live_overview: the steps' figures of now beside the previous analysis)
        st.caption(f"Analyzing the newest rows in the background; the steps, step time, tokens/s and MFU are "
                   f"current, the findings and other figures meanwhile those of the analysis of {num_steps} steps.")
    else:
        st.caption(f"Analyzing the newest rows in the background; shown meanwhile: the analysis of {num_steps} "
                   f"steps.")


def _window_caption(window: str, total_steps: int) -> None:
    st.caption(f"Live view of {window} of {total_steps} steps; switch on **Whole run** in the sidebar to analyze "
               f"every step.")


def chart(fig, *, key: str) -> None:
    """Draw a plotly figure with a PNG download button (the PNG is rendered only when clicked)."""
    from dtprobe.dashboard import export

    st.plotly_chart(fig, key=key)
    st.download_button("PNG", data=lambda: export.figure_png(fig), file_name=f"{key}.png", mime="image/png",
                       key=f"{key}_png", on_click="ignore", icon=":material/download:")


def finding_params(source: Source, finding) -> dict[str, str]:
    """URL parameters that carry a finding to its page: the run, the code and the ranks to mark."""
    return {"run": source.name, "finding": finding.code, "ranks": ",".join(str(r) for r in finding.ranks)}


def marked_ranks() -> list[int]:
    """Ranks a finding link asked the page to mark (``ranks`` URL parameter), ignoring anything malformed."""
    raw = st.query_params.get("ranks", "")
    return [int(part) for part in raw.split(",") if part.strip().isdigit()]


def findings_for(source: Source, analysis, codes: tuple[str, ...]) -> list:
    """The findings whose code is one of ``codes`` (worst first) as the Overview lists them
    (``data.finding_lines``: of a finished run its stored Overview's, so the analysis need not find them all), for
    a code no facade method detects alone (else ``findings_with_evidence``)."""
    return [f for f in data.finding_lines(source, analysis) if f.code in codes]


def findings_with_evidence(source: Source, analysis, detectors: dict[str, str]) -> list:
    """The findings of the codes in ``detectors`` (code -> the facade method that finds them) with their evidence
    rows, without making the analysis find every other finding (``data.findings_with_evidence``)."""
    return data.findings_with_evidence(source, analysis, detectors)


def show_findings(findings: list, *, key: str) -> None:
    """Each finding as a bordered box: severity, ranks, title, the clock of its timing evidence, recommendation,
    evidence rows on demand; the first ``MAX_FINDING_CARDS`` (worst first), said in a caption when there are more
    (e.g. a finding per rank of a 1,024-rank run)."""
    if len(findings) > MAX_FINDING_CARDS:
        st.caption(f"The first {MAX_FINDING_CARDS} of {len(findings):,} findings (worst first).")
    for index, finding in enumerate(findings[:MAX_FINDING_CARDS]):
        with st.container(border=True):
            st.markdown(f"**:{SEVERITY_BADGE[finding.severity]}[{finding.severity.upper()}] {finding.code}** · "
                        f"ranks {ranks_text(finding.ranks)} · group {finding.group or '-'}  \n{finding.title}")
            # a finding, or an Overview line (no evidence rows, its clock as an attribute)
            evidence_clock(finding.evidence.get("clock") if hasattr(finding, "evidence") else finding.clock)
            st.caption(finding.recommendation)
            gain = getattr(finding, "predicted_gain", None)
            if gain is not None:
                st.caption(f"Predicted gain: {gain.frac:.0%} shorter {gain.metric.replace('_', ' ')}")
            rows = getattr(finding, "rows", None)
            if rows is not None and not rows.empty:
                with st.expander(f"Evidence rows ({len(rows):,})"):
                    from dtprobe.dashboard.charts import named_groups  # plotly: not on the Overview's path

                    if len(rows) > MAX_TABLE_ROWS:
                        rows = _finding_ranks_first(rows, finding.ranks)
                        st.caption(f"The first {MAX_TABLE_ROWS:,} of {len(rows):,} rows (the finding's ranks first).")
                    st.dataframe(named_groups(rows.head(MAX_TABLE_ROWS)), hide_index=True)


def worst_rows(table, columns: list[str], *, what: str):
    """A per-rank table as drawn: whole up to ``charts.MAX_RANK_BARS`` rows; beyond, its ``MAX_WORST_ROWS`` rows
    highest in ``columns`` (in that order), said in a caption naming ``what`` they are."""
    from dtprobe.dashboard.charts import MAX_RANK_BARS  # plotly: not on the Overview's path

    if len(table) <= MAX_RANK_BARS:
        return table
    st.caption(f"The {MAX_WORST_ROWS} of {len(table):,} {what}.")
    return table.sort_values(columns, ascending=False, kind="stable", na_position="last").head(MAX_WORST_ROWS)


MAX_FINDING_CARDS = 20
"""Finding cards a page draws at most (``show_findings``)."""
MAX_WORST_ROWS = 50
"""Rows of a per-rank table (``worst_rows``) above ``charts.MAX_RANK_BARS`` ranks."""
def _finding_ranks_first(rows, ranks):
    """Evidence ``rows`` with those of the finding's ``ranks`` first (e.g. the culprit's among its whole group's),
    the order kept otherwise."""
    if "rank" not in rows.columns or not ranks:
        return rows
    later = ~rows["rank"].isin([int(r) for r in ranks])
    return rows.iloc[later.to_numpy().argsort(kind="stable")]


MAX_TABLE_ROWS = 1_000
"""Rows a page's table sends to the browser at most (a 1,024-rank run's evidence can hold hundreds of thousands)."""
MAX_LISTED_RANKS = 16
"""A finding's ranks listed one by one up to this many; more are named by their count and range."""


def ranks_text(ranks) -> str:
    """A finding's ranks on a card: ``"2, 5"``, or ``"512 ranks (0-1023)"`` above ``MAX_LISTED_RANKS``."""
    ranks = [int(r) for r in ranks]
    if not ranks:
        return "-"
    if len(ranks) <= MAX_LISTED_RANKS:
        return ", ".join(str(r) for r in ranks)
    return f"{len(ranks)} ranks ({min(ranks)}-{max(ranks)})"


def evidence_clock(clock: str | None) -> None:
    """A finding card's line naming the clock of its timing evidence (nothing for a finding judged on no timing)."""
    line = clocks.evidence_line(clock)
    if line is not None:
        st.caption(line)


def fmt(value, pattern: str) -> str:
    return "-" if value is None else pattern.format(value)


def key_figures(overview) -> dict[str, str]:
    """The Overview's headline numbers (``RunAnalysis.key_figures`` via ``Overview``), formatted; '-' when
    unknown."""
    k = overview.figures
    return {
        "steps": str(overview.num_steps),
        "step time": fmt(k["step_time_ms"], "{:.1f} ms"),
        "tokens/s": fmt(k["tokens_per_s"], "{:,.0f}"),
        "MFU": fmt(k["mfu"], "{:.1%}"),
        "comm": fmt(k.get("comm_frac"), "{:.1%}"),    # absent from Overviews stored before it was a key figure
        "exposed comm": fmt(k["exposed_comm_frac"], "{:.1%}"),
        "bubble": fmt(k["bubble_frac"], "{:.1%}"),
        "overflows": fmt(k["num_overflows"], "{:d}"),
        "checkpoint share": fmt(k["checkpoint_share_frac"], "{:.1%}"),
    }


SPARK_SIZE = (240, 36)
"""Width and height (px) of a key figure's sparkline; it shrinks with its card."""
SPARK_COLOR = "#4c78a8"


def sparkline(label: str, values: list[float]) -> str:
    """A key figure's trend as a Markdown image: an inline SVG polyline drawn by the browser itself, so the
    Overview needs no chart library (Streamlit's metric charts load a large script bundle before they draw)."""
    width, height = SPARK_SIZE
    lo, hi = min(values), max(values)
    dx = width / max(1, len(values) - 1)

    def y(v: float) -> float:  # the highest value at the top, 2 px from the edge; a flat series across the middle
        return height / 2 if hi == lo else height - 2 - (v - lo) / (hi - lo) * (height - 4)

    points = " ".join(f"{i * dx:.1f},{y(v):.1f}" for i, v in enumerate(values))
    svg = (f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
           f'viewBox="0 0 {width} {height}" preserveAspectRatio="none"><polyline fill="none" '
           f'stroke="{SPARK_COLOR}" stroke-width="1.5" points="{points}"/></svg>')
    alt = f"{label} over {len(values)} points, {lo:,.3g} to {hi:,.3g}"
    return f"![{alt}](data:image/svg+xml;base64,{base64.b64encode(svg.encode()).decode()})"


def other_sources(source: Source) -> list[Source]:
    """Every other run or trace folder under the root, re-validated (for the Compare page)."""
    root = root_from_env()
    return [resolve_choice(root, s.name) for s in data.load_sources(root) if s.name != source.name]
