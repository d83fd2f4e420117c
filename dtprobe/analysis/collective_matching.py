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
from dtprobe.analysis.tables import coded_text, group_codes, group_members, text_or
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
    ``pg_ranks`` (the ``world_size`` ranks when the trace names no group); ``pg``, ``pg_ranks``, ``op`` and
    ``timing`` as ``category`` columns (a small code per row). Columns: MATCH_INPUT_COLUMNS."""
    require_columns(collectives, MATCH_INPUT_COLUMNS, table="collectives")
    c = collectives
    keep = ((c["timing"] == DEVICE_TIMING).fillna(False) & c["start_ns"].notna() & c["end_ns"].notna()
            & c["seq"].notna() & c["op"].notna() & ~c["op"].isin(["send", "recv"]).fillna(False))
    c = c.loc[keep.to_numpy(dtype=bool), list(MATCH_INPUT_COLUMNS)].reset_index(drop=True)
    world = ",".join(str(r) for r in range(world_size)) if world_size else pd.NA
    for col in ("pg", "pg_ranks", "op", "timing"):
        if not isinstance(c[col].dtype, pd.CategoricalDtype):
            c[col] = c[col].astype("category")
    c["pg"] = text_or(c["pg"], "world")
    c["pg_ranks"] = text_or(c["pg_ranks"], world)
    return c


def group_coverage(device: pd.DataFrame, *, ranks_present: set[int]) -> pd.DataFrame:
    """Per group of ``device_collectives``: members, how many are in the source, and whether it is matched;
    ``reason`` says why not (members missing from the folder, membership unknown). Columns: COVERAGE_COLUMNS."""
    rows = []
    groups = device[["pg", "pg_ranks"]].drop_duplicates().astype(object)
    for pg, pg_ranks in groups.sort_values(["pg", "pg_ranks"], na_position="last").itertuples(index=False):
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
    the collectives in the order of (pg, pg_ranks[, step], key); ``status`` is ``matched`` or why the collective
    was refused (``STATUSES``). Groups are integer codes while matching and ``pg``, ``pg_ranks``, ``op`` and
    ``status`` come back as ``category`` columns: no string is copied per row. Columns: MATCHED_COLUMNS."""
    if by not in ("seq", "order"):
        raise ValueError(f"by={by!r}: expected 'seq' or 'order'")
    require_columns(device, MATCH_INPUT_COLUMNS, table="device_collectives")
    group, pg_names, pr_names = group_codes(device["pg"], device["pg_ranks"])
    keep = _in_full_group(device["rank"].to_numpy(dtype="int64", na_value=-1), group, pg_names, pr_names,
                          coverage)
    op_codes, op_names = pd.factorize(device["op"], sort=True)
    d = pd.DataFrame({
        "group": group[keep], "rank": device["rank"].to_numpy(dtype="int64", na_value=-1)[keep],
        "step": device["step"].to_numpy(dtype="int64", na_value=-1)[keep], "op": op_codes[keep],
        "num_bytes": device["num_bytes"].array[keep], "seq": device["seq"].to_numpy(dtype="int64")[keep],
        "start_ns": device["start_ns"].to_numpy(dtype="int64")[keep],
        "end_ns": device["end_ns"].to_numpy(dtype="int64")[keep]})
    if d.empty:
        return pd.DataFrame(columns=MATCHED_COLUMNS)
    if by == "seq":
        d["key"] = d["seq"]
        coll_cols = ["group", "key"]
        d["step"] = d.groupby(coll_cols)["step"].transform("max")    # one step per collective: the one most
    else:                                                               # members launched it in
        d = d.sort_values(["group", "rank", "step", "start_ns"], kind="stable")
        d["key"] = d.groupby(["group", "rank", "step"], sort=False).cumcount().astype("int64")
        coll_cols = ["group", "step", "key"]
    d = d.sort_values(coll_cols + ["rank"], kind="stable").reset_index(drop=True)
    d["coll_id"] = d.groupby(coll_cols, sort=False).ngroup().astype("int64")
    sizes = _group_sizes(pr_names)[d["group"].to_numpy()]
    same_size = np.isin(d["op"].to_numpy(), [i for i, op in enumerate(op_names) if op in SAME_SIZE_OPS])
    status = _status(d, sizes, same_size, by=by)
    return pd.DataFrame({
        "coll_id": d["coll_id"], "pg": coded_text(pg_names, d["group"].to_numpy()),
        "pg_ranks": coded_text(pr_names, d["group"].to_numpy()),
        "group_size": sizes, "key": d["key"], "step": d["step"],
        "op": pd.Categorical.from_codes(d["op"].to_numpy(), categories=pd.Index(op_names)),
        "num_bytes": d["num_bytes"].astype("Int64"), "rank": d["rank"], "start_ns": d["start_ns"],
        "end_ns": d["end_ns"], "status": pd.Categorical.from_codes(status, categories=pd.Index(STATUSES))},
        columns=MATCHED_COLUMNS)


def _group_sizes(pr_names: pd.Index) -> np.ndarray:
    """Members listed in each group code's ``pg_ranks``."""
    return np.array([len(group_members(g)) for g in pr_names], dtype=np.int64)


def _in_full_group(rank: np.ndarray, group: np.ndarray, pg_names: pd.Index, pr_names: pd.Index,
                   coverage: pd.DataFrame) -> np.ndarray:
    """Rows of a group ``coverage`` matches, from a rank its ``pg_ranks`` lists."""
    full = {(pg, pr) for pg, pr in coverage.loc[coverage["matched"].astype(bool), ["pg", "pg_ranks"]]
            .itertuples(index=False)}
    width = int(rank.max(initial=0)) + 2
    allowed = [code * width + m + 1 for code, (pg, pr) in enumerate(zip(pg_names, pr_names)) if (pg, pr) in full
               for m in group_members(pr) if m + 1 < width]
    return np.isin(group * width + rank + 1, np.asarray(allowed, dtype=np.int64))


def _status(d: pd.DataFrame, group_size: np.ndarray, same_size: np.ndarray, *, by: str) -> np.ndarray:
    """Per row of ``d`` (sorted by collective, then rank), the index in ``STATUSES`` of its collective's status;
    ``same_size``: the row's op moves the same bytes on every member."""
    g = d.groupby("coll_id", sort=False)
    num_members = g["rank"].transform("nunique").to_numpy()
    op_differs = (g["op"].transform("nunique") > 1).to_numpy()
    size_differs = same_size & (g["num_bytes"].transform("nunique").to_numpy() > 1)
    missing = num_members < group_size
    duplicate = g["rank"].transform("size").to_numpy() > num_members     # one rank twice under one number
    code = {s: i for i, s in enumerate(STATUSES)}
    status = np.select([duplicate, op_differs, size_differs, missing],
                       [code["duplicate"], code["op_mismatch"], code["size_mismatch"], code["missing_member"]],
                       code["matched"])
    if by == "order":
        # Members with different counts in a (group, step), or any refused position, make every position of that
        # block suspect: the whole block is refused with the first reason.
        block = [d["group"], d["step"]]
        counts = d.groupby(["group", "step", "rank"])["key"].transform("size")
        uneven = counts.groupby(block).transform("nunique").to_numpy() > 1
        reason = pd.Series(np.where(status == code["matched"], np.nan, status), index=d.index)
        block_reason = reason.groupby(block).transform("first").to_numpy()
        inherit = ~np.isnan(block_reason) & (status == code["matched"])
        status = np.where(uneven, code["count_mismatch"],
                          np.where(inherit, np.nan_to_num(block_reason).astype(np.int64), status))
    return status.astype(np.int64)


def status_counts(matched: pd.DataFrame) -> dict[str, int]:
    """Collectives of ``matched`` per ``status`` (each collective counted once)."""
    per_coll = matched.drop_duplicates("coll_id")
    return {str(k): int(v) for k, v in per_coll["status"].astype(str).value_counts().items()}


def matching_summary(matched: pd.DataFrame, coverage: pd.DataFrame, *, by: str,
                     counts: dict[str, int] | None = None) -> dict:
    """``method`` (``seq``/``order``), collectives matched and refused (by reason), groups not judged and why:
    ``metrics.collective_matching`` of the findings document. ``counts``: ``status_counts`` of the matched rows
    summed over parts of them, instead of ``matched``."""
    counts = status_counts(matched) if counts is None else counts
    refused = {s: n for s, n in sorted(counts.items()) if s != "matched" and n}
    return {
        "method": by,
        "num_matched": int(counts.get("matched", 0)),
        "num_refused": int(sum(refused.values())),
        "refused_by_reason": refused,
        "groups_not_judged": [{"pg": r.pg, "pg_ranks": list(group_members(r.pg_ranks)), "reason": r.reason}
                              for r in coverage.itertuples(index=False) if not r.matched],
    }
