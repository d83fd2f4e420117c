"""What the ranks' own per-step summaries (the ``comm_steps`` table, written by ``collectors.comm_summaries``) give
the Overview without reading a raw collective row: each rank's share of the step time spent in collectives. A live
page's first draw and refreshes read it so (``dashboard.summary.steps_overview``); the analysis, which derives the
exposure from the raw rows anyway, takes the same figure from ``exposure_by_rank``.

A (rank, step)'s time in collectives is the union of its collectives' spans: its summary row over the whole step
(``all_groups``: the row over all its groups, or a one-group step's group row). It is ``comm_exposure``'s
``comm_ns`` of the same (rank, step), so ``comm_by_rank`` equals ``exposure_by_rank``'s ``comm_frac`` on the same
steps (a test holds them equal on recorded runs).
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from dtprobe.analysis.tables import completing_attempts, require_columns, step_durations

COMM_BY_RANK_COLUMNS = ["rank", "num_steps", "comm_ns", "step_ns", "comm_frac"]
"""Columns of ``comm_by_rank``: steps counted, time in collectives and step time summed over them, their ratio."""
SUMMARY_COLUMNS = ["rank", "restart", "step", "all_groups", "comm_ns"]
"""The ``comm_steps`` columns ``comm_by_rank`` reads (a caller may read only these, or only its ``all_groups``
rows)."""


def comm_by_rank(comm_steps: pd.DataFrame, steps: pd.DataFrame, *, step_ids: list[int] | None = None
                 ) -> pd.DataFrame:
    """Per rank, over the steps ``step_ids`` (all when None) that have both a summary and a timed steps row: the
    time in collectives and the step time summed, and their ratio (``comm_frac``). ``comm_steps``: at least
    ``SUMMARY_COLUMNS``. Columns: ``COMM_BY_RANK_COLUMNS``; empty without summaries. A step redone after a torchrun
    restart is read from the attempt that redid it (``completing_attempts``)."""
    require_columns(comm_steps, SUMMARY_COLUMNS, table="comm_steps")
    comm_steps, steps = completing_attempts(comm_steps), completing_attempts(steps)
    ok = (comm_steps["all_groups"].to_numpy(dtype=bool, na_value=False)
          & comm_steps["step"].notna().to_numpy(dtype=bool))
    if not ok.any():
        return pd.DataFrame({col: [] for col in COMM_BY_RANK_COLUMNS})
    rank = comm_steps["rank"].to_numpy(dtype="int64", na_value=0)[ok]
    step = comm_steps["step"].to_numpy(dtype="int64", na_value=0)[ok]
    comm = comm_steps["comm_ns"].to_numpy(dtype="float64", na_value=0.0)[ok]
    timed = step_durations(steps)
    t_rank, t_step = timed["rank"].to_numpy(dtype="int64"), timed["step"].to_numpy(dtype="int64")
    t_ns = timed["step_ns"].to_numpy(dtype="float64")
    if step_ids:
        keep = np.isin(t_step, step_ids)
        t_rank, t_step, t_ns = t_rank[keep], t_step[keep], t_ns[keep]
    # one key per rank-step; several rows of one rank-step add up (a late completion's second row)
    span = int(max(step.max(), t_step.max(initial=0))) + 1
    keys, where = np.unique(rank * span + step, return_inverse=True)
    sums = np.bincount(where, weights=comm)
    at = np.minimum(np.searchsorted(keys, t_rank * span + t_step), len(keys) - 1)
    found = keys[at] == t_rank * span + t_step
    if not found.any():
        return pd.DataFrame({col: [] for col in COMM_BY_RANK_COLUMNS})
    ranks, per_rank = np.unique(t_rank[found], return_inverse=True)
    out = pd.DataFrame({"rank": ranks, "num_steps": np.bincount(per_rank),
                        "comm_ns": np.bincount(per_rank, weights=sums[at[found]]),
                        "step_ns": np.bincount(per_rank, weights=t_ns[found])})
    out["comm_frac"] = out["comm_ns"] / out["step_ns"].where(out["step_ns"] > 0)
    return out[COMM_BY_RANK_COLUMNS]


def mean_comm_frac(by_rank: pd.DataFrame) -> float | None:
    """The Overview's communication share: the mean of ``comm_frac`` over ranks (of ``comm_by_rank`` or
    ``exposure_by_rank``); None when unknown."""
    fracs = by_rank["comm_frac"].dropna() if not by_rank.empty else by_rank
    return float(fracs.mean()) if len(fracs) else None
