"""A ``faults`` row's JSON ``detail`` as a dict, which rows the fault injector wrote, and the injected faults of a
kind per rank; read by the analyzers that read fault rows (hangs, crashes, ckpt_corrupt, liveness) and the facade
(cross-checks of STRAGGLER, CHECKPOINT_STALL). No verdict reads an injected row: it is a cross-check only."""

from __future__ import annotations

import json
from typing import Any

import pandas as pd


def fault_detail(raw: Any) -> dict:
    """The detail object: {} when missing, ``{"raw": text}`` when it is not JSON (a stack stays readable),
    ``{"value": v}`` when it is JSON but not an object."""
    if raw is None or raw is pd.NA:
        return {}
    try:
        value = json.loads(str(raw))
    except ValueError:
        return {"raw": str(raw)}
    return value if isinstance(value, dict) else {"value": value}


def is_injected(faults: pd.DataFrame) -> pd.Series:
    """Per row of ``faults``: written by the fault injector (``injected`` true; a missing value is false)."""
    return faults["injected"].fillna(False).astype(bool)


def split_injected(faults: pd.DataFrame) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(observed, injected) rows of ``faults``: what the runtime and the watchdog saw, and what the injector wrote."""
    injected = is_injected(faults)
    return faults[~injected], faults[injected]


def injected_faults(faults: pd.DataFrame, kind: str) -> dict[int, dict]:
    """rank -> detail of the first injected fault of ``kind`` (cross-check of a verdict); {} without any."""
    if faults.empty:
        return {}
    f = faults[(faults["kind"] == kind) & is_injected(faults)]
    return {int(r.rank): fault_detail(r.detail) for r in f.drop_duplicates("rank").itertuples(index=False)}


def injected_ranks(faults: pd.DataFrame, kind: str) -> frozenset[int]:
    """Every rank with an injected fault of ``kind``."""
    if faults.empty:
        return frozenset()
    return frozenset(int(r) for r in faults[(faults["kind"] == kind) & is_injected(faults)]["rank"])
