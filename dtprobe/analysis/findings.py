"""The ``Finding`` record every detector returns; serialized by ``dtprobe analyze`` and shown by the dashboard.

A finding is one diagnosis: a code (``STRAGGLER``, ``HANG`` ...), a severity, the ranks and parallel group
involved, a one-line title, the evidence (plain JSON numbers, plus optional evidence rows for the dashboard), a
recommendation and, where one can be computed, the predicted gain of following it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any, Mapping

import pandas as pd

SEVERITIES = ("critical", "warning", "info")
"""Severities, worst first. ``dtprobe analyze`` exits 1 when any finding is ``critical``."""

GROUPS = ("dp", "tp", "pp")
"""Parallel groups a finding may name (``None`` when the finding is not about one group)."""

CODES = (
    "STRAGGLER", "EXPOSED_COMM", "PIPELINE_BUBBLE", "AMP_OVERFLOW", "CHECKPOINT_STALL", "COMM_INEFFICIENT",
    "HANG", "DEVICE_THROTTLE", "DEVICE_XID", "MEMORY_PRESSURE", "COMPRESSION", "LOW_MFU", "RANK_CRASH",
    "SLOW_LINK", "COLLECTIVE_MISMATCH", "CHECKPOINT_CORRUPT", "RANK_STALL",
)
"""Every finding code the detectors emit (documented one by one in docs/findings.md)."""


@dataclass(frozen=True, kw_only=True)
class PredictedGain:
    """What following the recommendation should save."""

    metric: str
    """The quantity that improves, e.g. ``step_time`` or ``wall_time``."""
    frac: float
    """Predicted relative reduction of that quantity (0.2 = 20% shorter)."""

    def to_json(self) -> dict[str, Any]:
        return {"metric": self.metric, "frac": round(float(self.frac), 4)}


@dataclass(frozen=True, kw_only=True)
class Finding:
    """One diagnosis with its evidence."""

    code: str
    """Finding code, one of ``CODES``."""
    severity: str
    """``critical``, ``warning`` or ``info``."""
    ranks: tuple[int, ...]
    """Global ranks the finding is about (the culprits, not the victims), sorted."""
    group: str | None
    """Parallel group the finding is about (``dp``, ``tp``, ``pp``) or None."""
    title: str
    """One line a human reads first."""
    evidence: Mapping[str, Any]
    """The numbers behind the verdict: plain JSON values, keys documented per code in docs/findings.md."""
    recommendation: str
    """What to change."""
    predicted_gain: PredictedGain | None = None
    """Predicted gain of following the recommendation, when it can be computed."""
    rows: pd.DataFrame | None = field(default=None, compare=False, repr=False)
    """The rows behind the evidence (for the dashboard); not serialized."""

    def __post_init__(self) -> None:
        assert self.code in CODES, f"unknown finding code {self.code!r}"
        assert self.severity in SEVERITIES, f"unknown severity {self.severity!r}"
        assert self.group is None or self.group in GROUPS or isinstance(self.group, str), self.group
        object.__setattr__(self, "ranks", tuple(sorted(int(r) for r in self.ranks)))

    @property
    def severity_rank(self) -> int:
        """0 for critical, 1 for warning, 2 for info (sort key)."""
        return SEVERITIES.index(self.severity)

    def to_json(self) -> dict[str, Any]:
        """The finding as the JSON object of the ``dtprobe.findings/1`` schema."""
        return {
            "code": self.code,
            "severity": self.severity,
            "ranks": list(self.ranks),
            "group": self.group,
            "title": self.title,
            "evidence": jsonable(dict(self.evidence)),
            "recommendation": self.recommendation,
            "predicted_gain": self.predicted_gain.to_json() if self.predicted_gain else None,
        }

    @classmethod
    def from_json(cls, doc: Mapping[str, Any], *, rows: pd.DataFrame | None = None) -> "Finding":
        """The finding of a ``to_json`` object (its evidence as JSON gives it back: plain values, floats to 6
        digits), with ``rows``. Raises ValueError for an object that is not one."""
        try:
            gain = doc["predicted_gain"]
            return cls(code=doc["code"], severity=doc["severity"], ranks=tuple(doc["ranks"]), group=doc["group"],
                       title=doc["title"], evidence=dict(doc["evidence"]), recommendation=doc["recommendation"],
                       predicted_gain=PredictedGain(metric=gain["metric"], frac=gain["frac"]) if gain else None,
                       rows=rows)
        except (KeyError, TypeError, AssertionError) as exc:
            raise ValueError(f"not a finding object ({exc!r})") from None


def sort_findings(findings: list[Finding]) -> list[Finding]:
    """Worst first, then by code and ranks (stable, so reports are reproducible)."""
    return sorted(findings, key=lambda f: (f.severity_rank, f.code, f.ranks))


MIN_GAIN_FRAC = 0.005
"""A predicted gain below this (it rounds to 0%) leaves nothing to gain: the finding is ``info``."""


def info_without_gain(findings: list[Finding]) -> list[Finding]:
    """``findings`` with every one whose predicted gain rounds to 0% (``|frac| < MIN_GAIN_FRAC``) made ``info``:
    following its recommendation would change nothing measurable."""
    return [replace(f, severity="info") if f.predicted_gain is not None and abs(f.predicted_gain.frac) < MIN_GAIN_FRAC
            and f.severity != "info" else f for f in findings]


FINDINGS_COLUMNS = ["code", "severity", "ranks", "group", "title", "recommendation", "gain_metric", "gain_frac"]


def findings_frame(findings: list[Finding]) -> pd.DataFrame:
    """The findings as a frame, one row each in the order given. Columns: ``FINDINGS_COLUMNS`` (``ranks`` as
    ``"0,3"``, ``gain_frac`` NaN without a predicted gain)."""
    rows = [{"code": f.code, "severity": f.severity, "ranks": ",".join(map(str, f.ranks)), "group": f.group,
             "title": f.title, "recommendation": f.recommendation,
             "gain_metric": f.predicted_gain.metric if f.predicted_gain else None,
             "gain_frac": f.predicted_gain.frac if f.predicted_gain else float("nan")} for f in findings]
    return pd.DataFrame(rows, columns=FINDINGS_COLUMNS)


def jsonable(value: Any) -> Any:
    """``value`` with numpy/pandas scalars turned into Python ones, NaN/NA into None, floats rounded to 6 digits."""
    if isinstance(value, Mapping):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set)):
        return [jsonable(v) for v in value]
    if isinstance(value, pd.DataFrame):
        return [jsonable(r) for r in value.to_dict(orient="records")]
    if value is None or value is pd.NA or value is pd.NaT:
        return None
    if isinstance(value, bool):
        return value
    if hasattr(value, "item") and not isinstance(value, (str, bytes)):
        value = value.item()
    if isinstance(value, float):
        return None if math.isnan(value) or math.isinf(value) else round(value, 6)
    return value
