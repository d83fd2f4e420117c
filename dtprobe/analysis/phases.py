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
    outside the phases. The phases may not fill the step (hook-timed ones leave out e.g. the wait for DDP's
    gradient all-reduces after the last gradient hook): a finished step's ``opt`` is then its last ``opt_ns``, and
    the time between the end of ``bwd`` and that is ``bwd``'s (what finishes the backward)."""
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
    if any(pd.isna(r[f"{phase}_ns"]) for phase in PHASES):
        return None
    end = r["end_ns"] if not row.empty else None
    if end is not None and not pd.isna(end) and int(end) - int(r["opt_ns"]) <= int(t_ns) < int(end):
        return "opt"
    edge = 0
    for phase in PHASES[:-1]:
        edge += int(r[f"{phase}_ns"])
        if offset < edge:
            return phase
    if end is not None and not pd.isna(end):
        return "bwd" if int(t_ns) < int(end) else None
    return "opt" if offset < edge + int(r["opt_ns"]) else None
