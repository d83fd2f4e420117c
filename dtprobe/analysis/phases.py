"""Which phase of its step (data, fwd, bwd, opt) a rank was in at a moment, from the ``steps`` table's phase
durations; read by RANK_CRASH and COLLECTIVE_MISMATCH for "what it was doing"."""

from __future__ import annotations

import pandas as pd

PHASES = ("data", "fwd", "bwd", "opt")
"""Phases of a step in the order the train loop runs them (``steps`` columns ``<phase>_ns``)."""


def phase_at(steps: pd.DataFrame, rank: int, step: int, t_ns: int) -> str | None:
    """The phase ``rank`` was in at ``t_ns`` during ``step``: from that step's row (start + cumulative phase
    durations), or, for a step the rank never finished (no row), from the end of its previous step and that
    step's durations (an estimate). None when neither row is there, the durations are unknown or ``t_ns`` falls
    outside the phases."""
    if steps is None or steps.empty:
        return None
    mine = steps[(steps["rank"] == rank) & steps["step"].notna()]
    row = mine[mine["step"] == step]
    if not row.empty:
        r = row.iloc[-1]
        start = r["start_ns"]
    else:
        prev = mine[(mine["step"] == step - 1) & mine["end_ns"].notna()]
        if prev.empty:
            return None
        r = prev.iloc[-1]
        start = r["end_ns"]
    if pd.isna(start):
        return None
    offset = int(t_ns) - int(start)
    if offset < 0:
        return None
    edge = 0
    for phase in PHASES:
        d = r[f"{phase}_ns"]
        if pd.isna(d):
            return None
        edge += int(d)
        if offset < edge:
            return phase
    return None
