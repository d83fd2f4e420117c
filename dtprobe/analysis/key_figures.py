"""``KeyFigures``: the headline numbers of a run (the dashboard's Overview), from the facade's metrics; read by
``RunAnalysis.key_figures``."""

from __future__ import annotations

from dataclasses import dataclass

import pandas as pd


@dataclass(frozen=True, kw_only=True)
class KeyFigures:
    """The headline numbers of a run (the dashboard's Overview); None when a figure is unknown for this run."""

    num_steps: int
    """Distinct steps recorded so far."""
    step_time_ms: float | None
    """Median step time over ranks and analysed steps."""
    tokens_per_s: float | None
    """Median tokens per second of the whole job."""
    mfu: float | None
    """Model FLOPs utilisation (None on CPU or with no known peak; ``mfu_reason`` says why)."""
    mfu_reason: str | None
    """Why MFU is (not) known: the peak used or the reason there is none."""
    comm_frac: float | None
    """Mean over ranks of the share of the step time spent in collectives (the union of their spans); a live page
    reads the same figure from the ranks' own per-step summaries (``comm_steps``)."""
    exposed_comm_frac: float | None
    """Mean over ranks of the exposed communication share of the step (kernel-level for trace folders)."""
    bubble_frac: float | None
    """Mean measured pipeline bubble over ranks (None without pipeline parallelism)."""
    num_overflows: int | None
    """AMP overflow steps (None without AMP telemetry)."""
    checkpoint_share_frac: float | None
    """Blocking checkpoint time as a share of the wall time (None without saves)."""


def key_figures(*, steps: pd.DataFrame, throughput_summary: dict, step_ns: float | None,
                comm_frac: float | None, exposed_comm_frac: float | None, bubble_by_rank: pd.DataFrame,
                amp_steps: pd.DataFrame, checkpoint_summary: dict) -> KeyFigures:
    """The figures from the ``steps`` table and the facade's metrics of the same names; the step time falls back
    to ``step_ns`` when the throughput summary has none."""
    summary = throughput_summary or {}
    step_ms = summary.get("step_time_ms")
    if step_ms is None and step_ns:
        step_ms = step_ns / 1e6
    return KeyFigures(
        num_steps=int(steps["step"].nunique()) if not steps.empty else 0,
        step_time_ms=step_ms, tokens_per_s=summary.get("tokens_per_s"), mfu=summary.get("mfu"),
        mfu_reason=summary.get("mfu_reason"), comm_frac=comm_frac, exposed_comm_frac=exposed_comm_frac,
        bubble_frac=float(bubble_by_rank["bubble_frac"].mean()) if not bubble_by_rank.empty else None,
        num_overflows=int(amp_steps["overflow"].sum()) if not amp_steps.empty else None,
        checkpoint_share_frac=checkpoint_summary.get("blocking_share_of_wall"))
