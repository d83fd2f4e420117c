"""Small shared helpers of the analyzers: step durations and windows, process-group codes and axes, size labels.

The column check is ``dtprobe.store.columns.require_columns``; interval unions are in ``dtprobe.intervals``."""

from __future__ import annotations

from typing import Any, Iterable

import numpy as np
import pandas as pd

from dtprobe.store.columns import require_columns
from dtprobe.store.schema import CHECKPOINT_GROUP

P2P_OPS = frozenset({"send", "recv"})
"""Point-to-point ops: numbered per (pg, peer), never part of a collective's arrival skew."""


def step_collectives(collectives: pd.DataFrame) -> pd.DataFrame:
    """The collectives that training steps wait for: all but a checkpoint group's (``schema.CHECKPOINT_GROUP``). An
    asynchronous save runs its collectives on a thread of its own beside the steps, so a member that is late there
    (the save's coordinator, writing between its calls) holds back no step; what a save costs the steps is
    CHECKPOINT_STALL's. The same object when there are none (the arrival, skew, lateness, wait and exposure figures
    read these rows; hangs, mismatches and crashes read every group's)."""
    require_columns(collectives, ["pg"], table="collectives")
    ckpt = (collectives["pg"] == CHECKPOINT_GROUP).to_numpy(dtype=bool, na_value=False)
    return collectives[~ckpt] if ckpt.any() else collectives


def attempts_of(rows: pd.DataFrame) -> np.ndarray:
    """Per row: its torchrun attempt (``restart``; 0 when null, or for a frame without the column)."""
    if "restart" not in rows.columns:
        return np.zeros(len(rows), dtype="int64")
    return rows["restart"].to_numpy(dtype="float64", na_value=0).astype("int64")


def p2p_pairs(*, group: np.ndarray, rank: np.ndarray, peer: np.ndarray, op: np.ndarray, seq: np.ndarray,
              step: np.ndarray, restart: np.ndarray, enqueue: np.ndarray) -> pd.DataFrame:
    """The send/recv pairs among rows given as aligned arrays (``peer`` and ``seq`` as float, NaN when null; rows
    that are no send/recv or lack a peer or seq are left out): the k-th send from A to B is B's k-th recv from A,
    the same ``seq`` in the same group, attempt (``restart``) and step on both sides. Columns: ``src``, ``dst``,
    ``group``, ``seq``, ``step``, ``row_s`` and ``row_r`` (the two rows' positions), ``enq_s`` and ``enq_r``."""
    at = np.flatnonzero(np.isin(op, list(P2P_OPS)) & ~np.isnan(seq) & (np.nan_to_num(peer, nan=-1) >= 0))
    send = op[at] == "send"
    other = peer[at].astype("int64")
    sides = pd.DataFrame({"row": at, "group": group[at], "seq": seq[at].astype("int64"), "step": step[at],
                          "restart": restart[at], "src": np.where(send, rank[at], other),
                          "dst": np.where(send, other, rank[at]), "enq": enqueue[at], "send": send})
    pairs = sides[sides["send"]].merge(sides[~sides["send"]], on=["group", "seq", "step", "restart", "src", "dst"],
                                       suffixes=("_s", "_r"))
    return pairs[["src", "dst", "group", "seq", "step", "row_s", "row_r", "enq_s", "enq_r"]]


def step_durations(steps: pd.DataFrame) -> pd.DataFrame:
    """Per (rank, step): ``step_ns`` = end - start; rows without both timestamps dropped. Columns: rank, step, step_ns."""
    require_columns(steps, ["rank", "step", "start_ns", "end_ns"], table="steps")
    ok = (steps["start_ns"].notna() & steps["end_ns"].notna()).to_numpy(dtype=bool)
    return pd.DataFrame({
        "rank": steps["rank"].to_numpy()[ok].astype("int64"), "step": steps["step"].to_numpy()[ok].astype("int64"),
        "step_ns": (steps["end_ns"].to_numpy(dtype="int64", na_value=0)
                    - steps["start_ns"].to_numpy(dtype="int64", na_value=0))[ok],
    })


def completing_attempts(df: pd.DataFrame) -> pd.DataFrame:
    """The rows of a per-rank table (``rank``, ``step``, ``restart``) from the last torchrun attempt that recorded
    each (rank, step): a step redone after a restart is judged on the attempt that redid it, not on a mix of both
    (the earlier attempt's rows stay in the store for the crash and hang verdicts). Rows outside steps (null or
    negative ``step``) are kept; a null ``restart`` is attempt 0. ``df`` itself when no (rank, step) has rows of
    two attempts, or when it has no ``restart`` column (one attempt)."""
    if df.empty or "restart" not in df.columns:
        return df
    column = df["restart"]
    kind = getattr(column.dtype, "numpy_dtype", np.dtype("float64"))    # its own width: no copy on 20 M rows
    restart = column.to_numpy(dtype=kind if kind.kind in "iu" else "float64", na_value=0)
    if restart.min() == restart.max():
        return df
    require_columns(df, ["rank", "step"], table="a per-rank table")
    rank = df["rank"].to_numpy(dtype="int64")
    step = df["step"].to_numpy(dtype="float64", na_value=-1.0).astype("int64")
    latest = pd.Series(restart).groupby([rank, step]).transform("max").to_numpy()
    keep = (restart == latest) | (step < 0)
    return df if keep.all() else df[keep].reset_index(drop=True)


def analyzed_steps(steps: pd.DataFrame, *, skip_first: int = 1) -> list[int]:
    """Steps analysed: every step some rank finished, minus the first ``skip_first`` (warm-up: DDP rebuilds
    its buckets and allocators warm up on the first step), unless that would leave nothing."""
    if steps.empty:
        return []
    done = sorted(int(s) for s in steps.dropna(subset=["end_ns"])["step"].unique())
    return done[skip_first:] if len(done) > skip_first else done


def only_steps(df: pd.DataFrame, step_ids: list[int]) -> pd.DataFrame:
    """The rows of ``df`` whose ``step`` is in ``step_ids``; ``df`` itself when either is empty. Rows kept in one
    stretch (all of them, or a frame in step order) are a slice, not a copy of every row (long group strings)."""
    if df.empty or not step_ids:
        return df
    keep = df["step"].isin(step_ids).to_numpy(dtype=bool, na_value=False)
    kept = np.flatnonzero(keep)
    if len(kept) and kept[-1] - kept[0] + 1 == len(kept):
        return df.iloc[kept[0]:kept[-1] + 1].reset_index(drop=True)
    return df[keep].reset_index(drop=True)


def wall_ns(steps: pd.DataFrame) -> float | None:
    """First step start to last step end over all ranks; None without a finished step."""
    if steps.empty or steps["end_ns"].isna().all():
        return None
    return float(steps["end_ns"].max() - steps["start_ns"].min())


def median_step_ns(steps: pd.DataFrame, step_ids: Iterable[int] | None = None) -> float | None:
    """Median step time over ranks and ``step_ids`` (all finished steps when None); None without steps."""
    durations = step_durations(steps)
    if step_ids is not None:
        durations = durations[durations["step"].isin(list(step_ids))]
    if durations.empty:
        return None
    return float(durations["step_ns"].median())


def group_members(pg_ranks: str | None) -> tuple[int, ...]:
    """``"0,2"`` -> (0, 2); empty or null -> ()."""
    if pg_ranks is None or pg_ranks is pd.NA or not str(pg_ranks).strip():
        return ()
    return tuple(int(r) for r in str(pg_ranks).split(",") if r.strip())


LISTED_MEMBERS_MAX = 8
"""A group of at most this many ranks is named with its member list in titles; a larger one by its size."""


def group_phrase(name: str, members: Any) -> str:
    """How a title names a group: ``"dp group [0, 2]"``, or ``"dp group of 128 ranks"`` above
    ``LISTED_MEMBERS_MAX`` members (a title never lists a large group's members: evidence does)."""
    members = list(members)
    if not members:
        return f"{name} group"
    if len(members) <= LISTED_MEMBERS_MAX:
        return f"{name} group {members}"
    return f"{name} group of {len(members)} ranks"


def in_no_step(step: Any) -> bool:
    """True for a row's ``step`` that names no step (null or -1): a call made before the first step, between
    steps or after the last one."""
    return step is None or pd.isna(step) or int(step) < 0


def step_phrase(step: Any) -> str:
    """How a title names the step of a call: ``"step 60"``, or ``"outside any step"`` (``in_no_step``)."""
    return "outside any step" if in_no_step(step) else f"step {int(step)}"


def ranks_phrase(ranks: Any) -> str:
    """A list of ranks in a title: ``"[0, 2]"``, or ``"(128 ranks)"`` above ``LISTED_MEMBERS_MAX``."""
    ranks = list(ranks)
    return str(ranks) if len(ranks) <= LISTED_MEMBERS_MAX else f"({len(ranks)} ranks)"


def text_or(values: pd.Series, null: Any = "") -> pd.Series:
    """``values`` (strings; the store's ``pg_ranks`` is a ``category`` column) with nulls as ``null``: a category
    column stays one (``null`` added to its categories: no string copied per row), others as they are."""
    if isinstance(values.dtype, pd.CategoricalDtype):
        if pd.isna(null) or not values.isna().any():
            return values
        if null not in values.cat.categories:
            values = values.cat.add_categories([null])
    return values.fillna(null)


def text_codes(values: pd.Series, *, sort: bool = True) -> tuple[np.ndarray, pd.Index]:
    """Per row, an int64 code of its string (nulls as ""), and the string of each code (a ``str`` index, sorted
    when ``sort``): ``pd.factorize`` of the strings, but a ``category`` column is coded from its codes, without
    hashing or copying its strings."""
    if not isinstance(values.dtype, pd.CategoricalDtype):
        codes, names = pd.factorize(values.fillna("").astype(str), sort=sort)
        return codes.astype("int64"), pd.Index(names)
    names = pd.Index(values.cat.categories.astype(str))
    codes = values.cat.codes.to_numpy().astype("int64")
    if len(codes) and codes.min() < 0:
        empty = names.get_indexer([""])[0]
        if empty < 0:
            names, empty = names.append(pd.Index([""], dtype=names.dtype)), len(names)
        codes[codes < 0] = empty
    held = np.bincount(codes, minlength=len(names)) > 0
    names = names[held]
    codes = (np.cumsum(held) - 1)[codes]
    if sort and not names.is_monotonic_increasing:
        order = names.argsort()
        position = np.empty(len(order), dtype="int64")
        position[order] = np.arange(len(order))
        names, codes = names[order], position[codes]
    return codes, names


def coded_text(names: pd.Index, codes: np.ndarray) -> pd.Categorical:
    """The strings ``names[codes]`` as a category column (each string once, categories sorted): a per-row output
    column of a group's ``pg_ranks`` without a copy of the list on every row."""
    unique_codes, unique = pd.factorize(names, sort=True)
    return pd.Categorical.from_codes(unique_codes[codes], categories=unique)


def group_codes(pg: pd.Series, pg_ranks: pd.Series) -> tuple[np.ndarray, pd.Index, pd.Index]:
    """Per row, an integer code of its (pg, pg_ranks) pair (nulls as ""), numbered in the sorted order of the pairs,
    and the pg and pg_ranks of each code: sorting and grouping by the code is sorting and grouping by the two
    strings, without hashing long ``pg_ranks`` strings again."""
    pg_codes, pg_names = text_codes(pg)
    pr_codes, pr_names = text_codes(pg_ranks)
    width = max(len(pr_names), 1)
    codes, pairs = pd.factorize(pg_codes.astype("int64") * width + pr_codes, sort=True)
    return codes.astype("int64"), pd.Index(pg_names).take(pairs // width), pd.Index(pr_names).take(pairs % width)


_GROUP_CODES = "_dtprobe_group_codes"
"""Attribute of a collectives frame holding its ``group_codes`` (set with ``object.__setattr__``: not a column)."""


def coded_rows(collectives: pd.DataFrame, mask: pd.Series, columns: list[str]
               ) -> tuple[pd.DataFrame, np.ndarray, pd.Index, pd.Index]:
    """The ``columns`` of the collectives rows where ``mask`` holds and their ``group_codes`` (pg, pg_ranks code,
    pg names, pg_ranks names): the long ``pg_ranks`` strings are coded once per frame (six analyses code the
    same collectives table; a copy or a slice of it is coded again) and never copied."""
    code, pg_names, pr_names = frame_group_codes(collectives)
    keep = mask.to_numpy(dtype=bool, na_value=False)
    return collectives.loc[keep, columns], code[keep], pg_names, pr_names


def frame_group_codes(collectives: pd.DataFrame) -> tuple[np.ndarray, pd.Index, pd.Index]:
    """``group_codes`` of every row of the collectives frame, computed once per frame object."""
    coded = collectives.__dict__.get(_GROUP_CODES)
    if coded is None or len(coded[0]) != len(collectives):
        coded = group_codes(collectives["pg"], collectives["pg_ranks"])
        object.__setattr__(collectives, _GROUP_CODES, coded)
    return coded


def lookup_group_codes(pg: pd.Series, pg_ranks: pd.Series, pg_names: pd.Index, pr_names: pd.Index) -> np.ndarray:
    """Per row, the code ``group_codes`` gave its (pg, pg_ranks) pair (``pg_names``/``pr_names``), -1 if none."""
    pg_codes, pg_u = text_codes(pg, sort=False)
    pr_codes, pr_u = text_codes(pg_ranks, sort=False)
    width = max(len(pr_u), 1)
    pairs, pair_u = pd.factorize(pg_codes.astype("int64") * width + pr_codes)
    known = pd.MultiIndex.from_arrays([pg_names, pr_names]).get_indexer(
        pd.MultiIndex.from_arrays([pd.Index(pg_u).take(pair_u // width), pd.Index(pr_u).take(pair_u % width)]))
    return known[pairs].astype("int64")


def run_starts(*keys: np.ndarray) -> np.ndarray:
    """For arrays sorted by ``keys``: True where a run of equal keys begins."""
    n = len(keys[0])
    new = np.zeros(n, dtype=bool)
    if n:
        new[0] = True
        for k in keys:
            new[1:] |= k[1:] != k[:-1]
    return new


def axis_of(pg: str | None) -> str | None:
    """The parallel axis a process-group name denotes: ``dp``, ``tp``, ``pp`` (``dp_shard`` -> dp), else None."""
    if pg is None or pg is pd.NA:
        return None
    name = str(pg).lower()
    for axis in ("dp", "tp", "pp"):
        if name == axis or name.startswith(axis + "_") or name.endswith("_" + axis):
            return axis
    return None


def axis_of_group(pg: str | None, *, layout: dict, world_is_dp: bool | None = None) -> str | None:
    """``axis_of(pg)``; the default group (``world``) is ``dp`` when ``world_is_dp``, by default when ``layout`` is
    purely data-parallel (tp = pp = 1)."""
    axis = axis_of(pg)
    if world_is_dp is None:
        world_is_dp = int(layout.get("tp") or 1) * int(layout.get("pp") or 1) == 1
    if axis is None and pg in WORLD_NAMES and world_is_dp:
        return "dp"
    return axis


WORLD_NAMES = ("world", "default", "0")
"""Names the default group goes by (the recorder's, a trace's)."""


def world_is_dp(layout: dict, group_names: Iterable[Any], *, pipelined: bool) -> bool:
    """Whether the default group is the data-parallel one: the ``layout`` says so (tp = pp = 1); without a layout (a
    launched script, a trace folder), unless the run says otherwise: pipeline stages timed (``pipelined``; their
    point-to-point ops may run on the default group), or another of its groups (``group_names``: the ``groups``
    table's) named for an axis (a DeviceMesh dimension spanning every rank reuses the default group, and it may be
    any of them: tp in a 1 x 4 dp x tp mesh)."""
    if layout:
        return int(layout.get("tp") or 1) * int(layout.get("pp") or 1) == 1
    return not pipelined and not any(axis_of(pg) is not None for pg in set(map(str, group_names)) - set(WORLD_NAMES))


def size_label(num_bytes: float) -> str:
    """Human size of a power-of-two bucket: 512 -> '512 B', 65536 -> '64 KiB'."""
    value = float(num_bytes)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{value:.0f} {unit}" if value == int(value) else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.0f} GiB"


def ms(ns: float | None) -> float | None:
    """Nanoseconds -> milliseconds rounded to 3 decimals (None stays None)."""
    if ns is None or pd.isna(ns):
        return None
    return round(float(ns) / 1e6, 3)
