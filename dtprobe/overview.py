"""The Overview of a run as plain data (``dtprobe.overview/1`` JSON): key figures, step-time and tokens/s trends,
findings without evidence rows; drawn by the dashboard's Overview page, stored by ``dtprobe.summary_store``.

No Streamlit, and pandas only through the analysis passed in: reading an Overview from JSON needs neither.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, replace
from typing import Any

SCHEMA = "dtprobe.overview/1"
"""Value of the ``schema`` key of the JSON document."""
TREND_POINTS = 200
"""Most points a key figure's trend keeps (longer series are averaged in bins)."""
STEP_FIGURES = ("num_steps", "step_time_ms", "tokens_per_s", "mfu", "mfu_reason")
"""The key figures made of the steps table alone (``dashboard.summary.steps_overview`` gives them)."""
SUMMARY_FIGURES = ("comm_frac",)
"""The key figures made of the steps table and the ranks' own per-step summaries (``comm_steps``), which
``dashboard.summary.steps_overview`` also gives when the run has summaries."""


@dataclass(frozen=True)
class FindingLine:
    """A finding as the Overview lists it (its evidence is on the page it links to)."""

    code: str
    severity: str
    ranks: tuple[int, ...]
    group: str | None
    title: str
    recommendation: str
    clock: str | None
    """The clock its timing evidence was read on (``evidence.clock``: ``host``, ``device`` or ``mixed``); None for a
    finding judged on no timing."""


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
    clock_aligned: str
    """How the ranks' times were put on one clock (``RunAnalysis.clock_alignment()``: ``host``,
    ``device_collectives`` or ``not aligned: <why>``)."""
    arrival_clock: str | None
    """The clock collectives' arrivals were read on (``RunAnalysis.arrival_clock()``: ``host``, ``device`` or
    ``mixed``); None without collectives."""
    restarts: tuple[str, ...] = ()
    """The header's restart lines that no RANK_CRASH title tells (``report.restart_lines``), e.g. after a hang."""
    interrupted: bool = False
    """The launcher was stopped (Ctrl-C or SIGTERM) and ended its last attempt, in which no rank had failed
    (``metrics.run.interrupted``)."""

    def to_dict(self) -> dict[str, Any]:
        """The ``dtprobe.overview/1`` document as JSON-ready data."""
        return json.loads(self.to_json())

    def to_json(self) -> str:
        return json.dumps({"schema": SCHEMA, **asdict(self)}, default=_plain)

    @classmethod
    def from_json(cls, text: str | bytes) -> "Overview":
        """Raises ValueError for anything but a whole ``dtprobe.overview/1`` document."""
        return cls.from_dict(json.loads(text))

    @classmethod
    def from_dict(cls, doc: Any) -> "Overview":
        """Raises ValueError for anything but a whole ``dtprobe.overview/1`` document (``doc`` is not changed)."""
        if not isinstance(doc, dict) or doc.get("schema") != SCHEMA:
            raise ValueError(f"not a {SCHEMA} document")
        doc = {k: v for k, v in doc.items() if k != "schema"}
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


def summarize(analysis: Any, *, path: str) -> Overview:
    """The Overview of ``analysis`` (a ``RunAnalysis`` of the source at ``path``, whole or over a ``StepWindow``)."""
    from dtprobe.analysis.render import restart_lines
    from dtprobe.analysis.report import run_events
    from dtprobe.analysis.window import StepWindow

    window = analysis.source if isinstance(analysis.source, StepWindow) else None
    k = analysis.key_figures()
    events = run_events(analysis)
    return Overview(
        path=path, whole=window is None, figures=asdict(k),
        num_steps=int(window.total_steps if window is not None else k.num_steps), trends=trends(analysis),
        findings=tuple(FindingLine(code=f.code, severity=f.severity, ranks=tuple(int(r) for r in f.ranks),
                                   group=f.group, title=f.title, recommendation=f.recommendation,
                                   clock=f.evidence.get("clock"))
                       for f in analysis.findings()),
        window=window.describe() if window is not None else None, made_s=time.time(),
        clock_aligned=analysis.clock_alignment(), arrival_clock=analysis.arrival_clock(),
        restarts=tuple(restart_lines(events)), interrupted=bool(events["interrupted"]))


def with_steps_of(analyzed: Overview, steps: Overview) -> Overview:
    """``analyzed`` with the key figures of the steps table (``STEP_FIGURES``) and, where known, of the summaries
    (``SUMMARY_FIGURES``), the step count and the trends of ``steps`` (an Overview of the steps table and the
    summaries alone, made since): a live refresh's Overview while the newest rows are analyzed, its findings and
    other figures those of ``analyzed``."""
    now = {k: steps.figures.get(k) for k in STEP_FIGURES}
    now.update({k: steps.figures[k] for k in SUMMARY_FIGURES if steps.figures.get(k) is not None})
    return replace(analyzed, figures={**analyzed.figures, **now}, num_steps=steps.num_steps, trends=steps.trends,
                   window=steps.window)


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
