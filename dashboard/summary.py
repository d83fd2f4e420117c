"""What the Overview draws of a run, as plain data that crosses a process boundary as JSON: key figures, the trends
of step time and tokens/s, the findings (without evidence rows) and which steps were analyzed.

``dtprobe.dashboard.serve`` starts ``python -m dtprobe.dashboard.summary`` before it imports Streamlit: the child opens and
analyzes the newest run under the root on the machine's other core while the server starts and the browser
loads the page, and the first Overview is drawn from the JSON it prints. The server analyzes the run itself
right after that page (``dtprobe.dashboard.data``), for the other pages and the next live refresh.

No Streamlit here (the child would pay for its import), and the analysis modules (pandas) are imported inside
the functions: the server reads a summary without them.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

SCHEMA = "dtprobe.overview/1"
TREND_POINTS = 200
"""Most points a key figure's trend keeps (longer series are averaged in bins)."""


@dataclass(frozen=True)
class FindingLine:
    """A finding as the Overview lists it (its evidence is on the page it links to)."""

    code: str
    severity: str
    ranks: tuple[int, ...]
    group: str | None
    title: str
    recommendation: str


@dataclass(frozen=True)
class Overview:
    """The Overview of one source (a run or a trace folder) at one moment."""

    path: str
    """The source's folder (resolved)."""
    whole: bool
    """Every step was analyzed (False: only the newest steps of a running run)."""
    figures: dict[str, Any]
    """``RunAnalysis.key_figures()`` as a dict (None for an unknown figure)."""
    num_steps: int
    """Steps in the run (all of them, also when only the newest were analyzed)."""
    trends: dict[str, list[float]]
    """Per-step series of ``step time`` (ms) and ``tokens/s``, at most ``TREND_POINTS`` points each."""
    findings: tuple[FindingLine, ...]
    """Worst first, as ``RunAnalysis.findings()``."""
    window: str | None
    """Which steps were analyzed when not the whole run (``StepWindow.describe()``)."""
    made_s: float
    """``time.time()`` when it was made."""
    restarts: tuple[str, ...] = ()
    """The header's restart lines that no RANK_CRASH title tells (``report.restart_lines``), e.g. after a hang."""

    def to_json(self) -> str:
        return json.dumps({"schema": SCHEMA, **asdict(self)}, default=_plain)

    @classmethod
    def from_json(cls, text: str | bytes) -> "Overview":
        """Raises ValueError for anything but a whole ``dtprobe.overview/1`` document."""
        doc = json.loads(text)
        if not isinstance(doc, dict) or doc.pop("schema", None) != SCHEMA:
            raise ValueError(f"not a {SCHEMA} document")
        try:
            doc["findings"] = tuple(FindingLine(**{**f, "ranks": tuple(f["ranks"])}) for f in doc["findings"])
            doc["restarts"] = tuple(doc.get("restarts", ()))
            return cls(**doc)
        except (KeyError, TypeError) as exc:
            raise ValueError(f"incomplete {SCHEMA} document ({exc})") from None


def _plain(value: Any) -> Any:
    """numpy scalars -> Python numbers (json.dumps' fallback)."""
    if hasattr(value, "item"):
        return value.item()
    raise TypeError(f"{type(value).__name__} is not JSON serializable")


def analyze(store: Any, kind: str, *, whole_run: bool, window: int):
    """The ``RunAnalysis`` the dashboard shows of an opened source: a running run's newest ``window`` steps unless
    ``whole_run`` (or ``window`` is 0), anything else whole; key figures and findings computed. Reads a tail-opened
    run's skipped head when more than the tail is needed."""
    from dtprobe.analysis.facade import RunAnalysis
    from dtprobe.analysis.window import StepWindow

    live = kind == "run" and store.manifest.status == "running" and window > 0
    src = store
    if live and not whole_run:
        newest = StepWindow(store, window)
        if not newest.is_whole_run:  # older steps exist: analyze the window only
            src = newest
    needed = src.first_step if isinstance(src, StepWindow) else 0
    tail = store.tail_from_step if kind == "run" else None
    if tail is not None and needed < tail:
        store.load_head()  # the whole run (or a wider window) was asked for: read the skipped part
    analysis = RunAnalysis(src)
    analysis.key_figures()
    analysis.findings()
    return analysis


def summarize(analysis: Any, *, path: str) -> Overview:
    """The Overview of ``analysis`` (of the source at ``path``)."""
    from dtprobe.analysis.report import restart_lines, run_events
    from dtprobe.analysis.window import StepWindow

    window = analysis.source if isinstance(analysis.source, StepWindow) else None
    k = analysis.key_figures()
    return Overview(
        path=path, whole=window is None, figures=asdict(k),
        num_steps=int(window.total_steps if window is not None else k.num_steps), trends=trends(analysis),
        findings=tuple(FindingLine(code=f.code, severity=f.severity, ranks=tuple(int(r) for r in f.ranks),
                                   group=f.group, title=f.title, recommendation=f.recommendation)
                       for f in analysis.findings()),
        window=window.describe() if window is not None else None, made_s=time.time(),
        restarts=tuple(restart_lines(run_events(analysis))))


def trends(analysis: Any) -> dict[str, list[float]]:
    """Per-step series behind the step time and tokens/s figures (``RunAnalysis.throughput``), at most
    ``TREND_POINTS`` points each (bin means beyond that); a series with fewer than 2 points is left out."""
    per_step = analysis.throughput()
    if per_step.empty:
        return {}
    per_step = per_step.sort_values("step")
    series_of = {"step time": per_step["step_ns"].astype("float64") / 1e6,
                 "tokens/s": per_step["tokens_per_s"].astype("float64")}
    out = {}
    for label, series in series_of.items():
        series = series.dropna().reset_index(drop=True)
        if len(series) > TREND_POINTS:
            series = series.groupby(series.index * TREND_POINTS // len(series)).mean()
        if len(series) >= 2:
            out[label] = [round(float(v), 3) for v in series]
    return out


def main(argv: list[str] | None = None) -> int:
    from dtprobe.dashboard.paths import list_sources, live_window_steps, root_from_env, source_kind
    from dtprobe.store.errors import ConfigError, TraceError

    ap = argparse.ArgumentParser(
        prog="python -m dtprobe.dashboard.summary",
        description=f"Print the dashboard Overview of a run or trace folder as one {SCHEMA} JSON document; the "
                    f"dashboard's server runs it at its start. Exit 0 (nothing printed when the root holds no run), "
                    f"2 unusable input (message on stderr).")
    ap.add_argument("path", nargs="?", help="run or trace folder (default: the newest under the dashboard's root, "
                                            "DTPROBE_DASHBOARD_ROOT)")
    args = ap.parse_args(argv)
    try:
        if args.path is None:
            sources = list_sources(root_from_env())
            if not sources:
                return 0
            path = sources[0].path
        else:
            path = Path(args.path).resolve()
        kind = source_kind(path) if path.is_dir() else None
        if kind is None:
            raise ConfigError(f"'{path}' is neither a run (no run.json) nor a folder of Kineto traces.")
        from dtprobe.analysis.facade import open_source

        window = live_window_steps()
        store = open_source(path, live_tail_steps=window or None)
        analysis = analyze(store, kind, whole_run=False, window=window)
        sys.stdout.write(summarize(analysis, path=str(path)).to_json())
    except (ConfigError, TraceError) as exc:
        print(f"dtprobe dashboard: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    os._exit(code)  # skips the interpreter's teardown (~0.15 s of freeing frames): the server waits for this exit
