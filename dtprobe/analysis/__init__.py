"""Analysis: pure functions from run-store tables to metrics (DataFrames) and findings; ``RunAnalysis`` is the facade.

``from dtprobe.analysis import RunAnalysis``; ``RunAnalysis.open(path)`` accepts a dtprobe run or a Kineto trace
folder (any ``dtprobe.store.source.Source``). Imported lazily so ``import dtprobe.analysis.findings`` stays light.
"""

from __future__ import annotations

import importlib
from typing import Any

_LAZY = {
    "RunAnalysis": "dtprobe.analysis.facade",
    "AnalysisOptions": "dtprobe.analysis.facade",
    "KeyFigures": "dtprobe.analysis.facade",
    "open_source": "dtprobe.analysis.facade",
    "SCHEMA": "dtprobe.analysis.facade",
    "Source": "dtprobe.store.source",
    "SourceInfo": "dtprobe.store.source",
    "Finding": "dtprobe.analysis.findings",
    "PredictedGain": "dtprobe.analysis.findings",
    "CODES": "dtprobe.analysis.findings",
    "SEVERITIES": "dtprobe.analysis.findings",
}

__all__ = list(_LAZY)


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'dtprobe.analysis' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
