"""Match each collective's device kernels across the members of its process group; read by ``clock_alignment``,
``device_arrivals`` and, through the facade, by ``dtprobe analyze`` on Kineto trace folders.

Each rank's NCCL kernels are timed on its own device clock, so matching uses no time across ranks: a collective
is the same on every member when it has the same group and sequence number (``seq`` from the recorder or the
trace's own ``Seq`` arg), or, for older traces, the same position in the order of the group's collectives
within the same ProfilerStep (each rank's own order is clock-free). Members must agree on the op and, for ops
whose every member moves the same bytes, on the size; a disagreement is refused, never paired: with sequence
numbers only that collective, by order the whole (group, step) block, since every later position is suspect.

A group whose members are not all in the source (2 ranks sampled from a 128-rank job) is not matched at all:
``group_coverage`` says so and why.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from dtprobe.analysis.clocks import DEVICE_TIMING
from dtprobe.analysis.tables import group_members, text_or
from dtprobe.store.columns import require_columns

MATCH_INPUT_COLUMNS = ("rank", "pg", "pg_ranks", "seq", "op", "num_bytes", "start_ns", "end_ns", "step", "timing")

SAME_SIZE_OPS = frozenset({"allreduce", "allgather", "reduce_scatter", "broadcast", "reduce", "barrier"})
"""Ops whose logical size is the same on every member; all-to-all may split unevenly, so its size is not
compared."""

MATCHED_COLUMNS = ["coll_id", "pg", "pg_ranks", "group_size", "key", "step", "op", "num_bytes", "rank",
                   "start_ns", "end_ns", "status"]
COVERAGE_COLUMNS = ["pg", "pg_ranks", "group_size", "num_present", "matched", "reason"]

STATUSES = ("matched", "duplicate", "op_mismatch", "size_mismatch", "count_mismatch", "missing_member")
"""``status`` of a matched row: paired, or why it was refused."""


def device_collectives(collectives: pd.DataFrame, *, world_size: int | None) -> pd.DataFrame:
    """Group collectives timed on the device, with each row's group members spelled out: rows of ``collectives``
    (``timing`` ``cuda_event``, start and end known, not send/recv) with ``pg`` (``world`` when unknown) and
    ``pg_ranks`` (the ``world_size`` ranks when the trace names no group). Columns: MATCH_INPUT_COLUMNS."""
    require_columns(collectives, MATCH_INPUT_COLUMNS, table="collectives")
    c = collectives
    keep = ((c["timing"] == DEVICE_TIMING).fillna(False) & c["start_ns"].notna() & c["end_ns"].notna()
            & c["seq"].notna() & c["op"].notna() & ~c["op"].isin(["send", "recv"]).fillna(False))
    c = c.loc[keep.to_numpy(dtype=bool), list(MATCH_INPUT_COLUMNS)].copy()
    world = ",".join(str(r) for r in range(world_size)) if world_size else pd.NA
    c["pg"] = c["pg"].fillna("world")
    c["pg_ranks"] = text_or(c["pg_ranks"], world)
    return c.reset_index(drop=True)[list(MATCH_INPUT_COLUMNS)]


def group_coverage(device: pd.DataFrame, *, ranks_present: set[int]) -> pd.DataFrame:
    """Per group of ``device_collectives``: members, how many are in the source, and whether it is matched;
    ``reason`` says why not (members missing from the folder, membership unknown). Columns: COVERAGE_COLUMNS."""
    rows = []
    for (pg, pg_ranks), _ in device.groupby(["pg", "pg_ranks"], dropna=False, sort=True):
        members = group_members(None if pd.isna(pg_ranks) else pg_ranks)
        present = [m for m in members if m in ranks_present]
        if not members:
            reason = ("membership unknown: the traces name no process group ranks and no world size; "
                      "re-record with a PyTorch whose traces carry 'Process Group Ranks'")
        elif len(present) < len(members):
            reason = (f"only {len(present)} of the group's {len(members)} members are in this folder "
                      f"(ranks {present}); arrival needs every member's kernels: add the others' traces")
        elif len(members) < 2:
            reason = "a one-member group has no arrival to compare"
        else:
            reason = None
        rows.append({"pg": pg, "pg_ranks": None if pd.isna(pg_ranks) else pg_ranks, "group_size": len(members),
                     "num_present": len(present), "matched": reason is None, "reason": reason})
    return pd.DataFrame(rows, columns=COVERAGE_COLUMNS)


def match_collectives(device: pd.DataFrame, coverage: pd.DataFrame, *, by: str) -> pd.DataFrame:
    """One row per (collective, member) of the fully present groups: ``key`` is the sequence number (``by``
    ``seq``) or the position within the group's collectives of the step (``by`` ``order``); ``coll_id`` numbers
    the collectives; ``status`` is ``matched`` or why the collective was refused (``STATUSES``).
    Columns: MATCHED_COLUMNS."""
    if by not in ("seq", "order"):
        raise ValueError(f"by={by!r}: expected 'seq' or 'order'")
    require_columns(device, MATCH_INPUT_COLUMNS, table="device_collectives")
    full = coverage.loc[coverage["matched"], ["pg", "pg_ranks", "group_size"]]
    d = device.merge(full, on=["pg", "pg_ranks"], how="inner")
    members = {g: frozenset(group_members(g)) for g in d["pg_ranks"].unique()}
    d = d.loc[[r in members[g] for r, g in zip(d["rank"], d["pg_ranks"])]]   # a rank outside its listed group
    if d.empty:
        return pd.DataFrame(columns=MATCHED_COLUMNS)
    d["step"] = d["step"].fillna(-1).astype("int64")
    if by == "seq":
        d["key"] = d["seq"].astype("int64")
    else:
        d = d.sort_values(["pg", "pg_ranks", "rank", "step", "start_ns"], kind="stable")
        d["key"] = d.groupby(["pg", "pg_ranks", "rank", "step"], sort=False).cumcount().astype("int64")
    coll_cols = ["pg", "pg_ranks", "key"] if by == "seq" else ["pg", "pg_ranks", "step", "key"]
    if by == "seq":   # one step per collective: the one most members launched it in
        d["step"] = d.groupby(coll_cols)["step"].transform("max")
    d = d.sort_values(coll_cols + ["rank"], kind="stable").reset_index(drop=True)
    d["coll_id"] = d.groupby(coll_cols, sort=False).ngroup().astype("int64")

    g = d.groupby("coll_id", sort=False)
    num_members = g["rank"].transform("nunique").to_numpy()
    op_differs = (g["op"].transform("nunique") > 1).to_numpy()
    size_n = g["num_bytes"].transform("nunique").to_numpy()
    same_size = d["op"].isin(list(SAME_SIZE_OPS)).to_numpy(dtype=bool)
    size_differs = same_size & (size_n > 1)
    missing = num_members < d["group_size"].to_numpy()
    duplicate = g["rank"].transform("size").to_numpy() > num_members     # one rank twice under one number
    status = np.where(duplicate, "duplicate", np.where(op_differs, "op_mismatch", np.where(
        size_differs, "size_mismatch", np.where(missing, "missing_member", "matched"))))
    if by == "order":
        # Members with different counts in a (group, step), or any refused position, make every position of that
        # block suspect: the whole block is refused with the first reason.
        block = [d["pg"], d["pg_ranks"], d["step"]]
        counts = d.groupby(["pg", "pg_ranks", "step", "rank"])["key"].transform("size")
        uneven = counts.groupby(block).transform("nunique").to_numpy() > 1
        reason = pd.Series(np.where(status == "matched", None, status), index=d.index, dtype=object)
        block_reason = reason.groupby(block).transform("first").to_numpy()
        status = np.where(uneven, "count_mismatch",
                          np.where(pd.notna(block_reason) & (status == "matched"), block_reason, status))
    d["status"] = status
    d["num_bytes"] = d["num_bytes"].astype("Int64")
    return d[MATCHED_COLUMNS]


def matching_summary(matched: pd.DataFrame, coverage: pd.DataFrame, *, by: str) -> dict:
    """``method`` (``seq``/``order``), collectives matched and refused (by reason), groups not judged and why:
    ``metrics.collective_matching`` of the findings document."""
    per_coll = matched.drop_duplicates("coll_id")
    refused = per_coll.loc[per_coll["status"] != "matched", "status"].value_counts().sort_index()
    return {
        "method": by,
        "num_matched": int((per_coll["status"] == "matched").sum()),
        "num_refused": int(refused.sum()),
        "refused_by_reason": {str(k): int(v) for k, v in refused.items()},
        "groups_not_judged": [{"pg": r.pg, "pg_ranks": list(group_members(r.pg_ranks)), "reason": r.reason}
                              for r in coverage.itertuples(index=False) if not r.matched],
    }
