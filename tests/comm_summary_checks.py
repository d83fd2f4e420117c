"""Checks of the ranks' per-step summaries (``comm_steps``) against the raw rows they summarize, for the test files
that read a recorded run (``test_comm_summaries``, ``test_hang``, ``test_recovery``)."""

from __future__ import annotations

import numpy as np
import pandas as pd

from dtprobe.store import RunStore
from dtprobe.store.schema import CHECKPOINT_GROUP

SUMMED = ["num_collectives", "num_completed", "num_bytes", "first_enqueue_ns", "last_enqueue_ns", "last_end_ns",
          "comm_ns", "longest_ns"]


def _union_ns(spans: list[tuple[int, int]]) -> int:
    """Length of the union of ``spans``, counted here by a walk over them (not by the project's helper)."""
    total, reach = 0, None
    for start, end in sorted(spans):
        if reach is None or start > reach:
            total, reach = total + end - start, end
        elif end > reach:
            total, reach = total + end - reach, end
    return total


def _expected(collectives: pd.DataFrame, keys: list[str]) -> pd.DataFrame:
    """The summaries computed here from a run's raw ``collectives`` rows, the slow way (one group at a time)."""
    c = collectives[collectives["step"].notna() & (collectives["step"] >= 0)]
    out = []
    for key, rows in c.groupby(keys, dropna=False):
        done = rows[rows["end_ns"].notna()]
        enq = done["enqueue_ns"].to_numpy(dtype="int64")
        end = np.maximum(done["end_ns"].to_numpy(dtype="int64"), enq)
        out.append({**dict(zip(keys, key)), "num_collectives": len(rows), "num_completed": len(done),
                    "num_bytes": int(rows["num_bytes"].fillna(0).sum()),
                    "first_enqueue_ns": rows["enqueue_ns"].min(), "last_enqueue_ns": rows["enqueue_ns"].max(),
                    "last_end_ns": end.max() if len(end) else np.nan,
                    "comm_ns": _union_ns(list(zip(enq.tolist(), end.tolist()))),
                    "longest_ns": (end - enq).max() if len(end) else np.nan})
    return pd.DataFrame(out)


def assert_summaries_equal_raw_rows(run_dir) -> pd.DataFrame:
    """Every rank's ``comm_steps`` rows equal the aggregates of its ``collectives`` rows: per step and group, and per
    step over all groups but a checkpoint group (the ``all_groups`` rows: the row over all groups of a step on two
    or more, with ``pg`` null, or a one-group step's group row); returns the summaries."""
    store = RunStore.open(run_dir)
    collectives, summaries = store.table("collectives"), store.table("comm_steps")
    assert len(summaries) and summaries["pg"].notna().any()
    step_keys = ["rank", "restart", "step"]
    groups = summaries[summaries["pg"].notna()]
    ckpt = groups["pg"] == CHECKPOINT_GROUP
    whole = summaries["all_groups"].fillna(False).astype(bool)
    num_groups = groups[~ckpt].groupby(step_keys)["pg"].nunique()
    # a null-pg row exactly for the steps on several groups, and it (or else the one group row) covers the step
    assert set(summaries[summaries["pg"].isna()].set_index(step_keys).index) == set(num_groups[num_groups > 1].index)
    assert whole[summaries["pg"].isna()].all()
    assert not whole[groups.index[ckpt]].any()
    assert (whole[groups.index[~ckpt]].to_numpy()
            == (num_groups.loc[groups[~ckpt].set_index(step_keys).index] == 1).to_numpy()).all()
    for keys, got, rows in ((step_keys + ["pg"], groups, collectives),
                            (step_keys, summaries[whole], collectives[collectives["pg"] != CHECKPOINT_GROUP])):
        got = got.groupby(keys, as_index=False).agg(                 # a late completion's second row, added
            {"num_collectives": "sum", "num_completed": "sum", "num_bytes": "sum", "first_enqueue_ns": "min",
             "last_enqueue_ns": "max", "last_end_ns": "max", "comm_ns": "sum", "longest_ns": "max"})
        m = _expected(rows, keys).merge(got, on=keys, how="outer", suffixes=("_raw", ""), indicator=True)
        assert (m["_merge"] == "both").all(), m[m["_merge"] != "both"][keys + ["_merge"]]
        for col in SUMMED:
            raw, summary = m[f"{col}_raw"].astype("float64"), m[col].astype("float64")
            assert ((raw - summary).abs().fillna(0) == 0).all() and (raw.isna() == summary.isna()).all(), col
    return summaries
