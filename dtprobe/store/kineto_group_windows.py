"""Windows of whole collectives over every member: how ``kineto.KinetoRun.collective_parts`` reads a part of a trace
folder's collectives that holds more rows than a part may, so that the cross-rank analyses hold a bounded slice of
it whatever the number of ranks. A process group spanning every rank (all of a pure data-parallel job's
collectives; every collective of traces that name no group, taken as world-wide) is such a part: its rows grow
with the ranks.

A window keeps together what the analyses of ``analysis.collective_groups`` compute on: each collective's rows on
every member (matching, arrivals, bandwidth). With the traces' own ``Seq`` a window is a range of sequence numbers.
By order (``seq`` is each rank's order), matching pairs the n-th collectives of a group within a ProfilerStep and
refuses a whole (group, step) block when its members disagree (counts, ops, sizes): when every member agrees on
every block (checked here: the same ops and sizes in the same order, every row a device collective), a window is a
range of (step, n-th collective); otherwise a range of steps. Either is cut only where no group's ``seq`` (each
rank's numbering over the profiler window, which the bandwidth pairs by) has rows on both sides. Send/recv rows (no
``seq``) of a ``Seq`` folder are read in blocks of ranks. A part is read whole when a rank's sequence numbers
restart in a group (``analysis.arrivals.unique_seq`` then renumbers them from the group's every row).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from itertools import pairwise

import numpy as np
import pyarrow as pa

from dtprobe.store.kineto_collective_frame import dictionary_codes, table_seq

DEVICE_TIMING = "cuda_event"
"""``timing`` of a collective timed by its kernel (the rows matching pairs)."""
POSITION_BITS = 20
"""A (step, n-th collective) window key is step * 2**POSITION_BITS + n."""


@dataclass(frozen=True)
class Window:
    """The rows of a part read together."""

    by: str
    """``seq``: rows whose ``seq`` is in [lo, hi]; ``step``: rows whose step (-1: none) is in [lo, hi];
    ``position``: rows whose (step, n-th collective of its group in the step) key is in [lo, hi]; ``ranks``: rows
    without a ``seq`` of ranks lo..hi."""
    lo: int
    hi: int


def plan_windows(tables: Iterable[pa.Table], *, seq_source: str, world_ranks: str | None, max_rows: int
                 ) -> list[Window] | None:
    """Windows of at most ``max_rows`` rows (more when one key has more, or no cut between keys keeps every
    collective whole) covering every row of ``tables`` (one rank's rows of a part each; ``world_ranks``: the
    members of a group named by none); None when the part must be read whole: a rank's sequence numbers restart in
    a group, or one window would hold it all. Holds one rank's rows at a time, a count per distinct key and, by
    order, one member's ops and sizes per block."""
    by_seq = seq_source == "trace"
    plain, positions = _Keys(), _Keys()            # by seq or step; by (step, n-th collective)
    blocks = None if by_seq else _Blocks(world_ranks)
    unkeyed: list[tuple[int, int]] = []            # (rank, its rows without a seq), in rank order
    for table in tables:
        if not table.num_rows:
            continue
        seq, no_seq = table_seq(table, source=seq_source)
        if _restarts(table, seq, no_seq):
            return None
        key, keyed = _keys(table, seq, no_seq, "seq" if by_seq else "step")
        if (~keyed).any():
            unkeyed.append((int(table["rank"][0].as_py()), int((~keyed).sum())))
        plain.add(key[keyed], None if by_seq else (table, seq, no_seq))
        position = blocks.agree(table, seq, no_seq) if blocks is not None else None
        if position is not None:
            positions.add(position, (table, seq, no_seq))
    by, keys = ("seq", plain) if by_seq else ("position", positions) if blocks.all_agree() else ("step", plain)
    windows = [Window(by, int(keys.keys[lo]), int(keys.keys[hi]))
               for lo, hi in _ranges(keys.counts, keys.cuts(by_seq), max_rows)]
    if unkeyed:                                    # after the keyed windows, in blocks of ranks
        ranks, sizes = np.array(unkeyed, dtype=np.int64).T
        windows += [Window("ranks", int(ranks[lo]), int(ranks[hi]))
                    for lo, hi in _ranges(sizes, np.ones(len(sizes) - 1, dtype=bool), max_rows)]
    return windows if len(windows) > 1 else None


class _Keys:
    """Rows per distinct window key over the ranks added and, by order, each group's (min, max) ``seq`` per key."""

    def __init__(self) -> None:
        self.keys, self.counts = np.empty(0, np.int64), np.empty(0, np.int64)
        self.spans: dict[tuple[str, str], dict[int, tuple[int, int]]] = {}

    def add(self, key: np.ndarray, rows: tuple[pa.Table, np.ndarray, np.ndarray] | None) -> None:
        """One rank's keys (of its rows with one); ``rows``: (table, seq, nulls) whose ``seq`` spans to fold in."""
        rank_keys, rank_counts = np.unique(key, return_counts=True)
        self.keys, at = np.unique(np.concatenate([self.keys, rank_keys]), return_inverse=True)
        self.counts = np.bincount(at, weights=np.concatenate([self.counts, rank_counts]),
                                  minlength=len(self.keys)).astype(np.int64)
        if rows is not None:
            _add_spans(self.spans, *rows, key)

    def cuts(self, by_seq: bool) -> np.ndarray:
        """Per gap between consecutive keys: whether a window may end there."""
        return np.ones(max(len(self.keys) - 1, 0), dtype=bool) if by_seq else _key_cuts(self.spans, self.keys)


class _Blocks:
    """Whether every (group, step) block of a part is one that matching by order pairs in full, so that windows may
    cut between its collectives: every row a device collective (``DEVICE_TIMING``, start and end known, not
    send/recv) of a group whose members are known, each member of a block with the same ops and sizes in the same
    order (the first member's kept to compare), and every member in every block of its group."""

    def __init__(self, world_ranks: str | None) -> None:
        self.world_ranks = world_ranks
        self.ok = True
        self.first: dict[tuple[tuple[str, str], int], tuple[np.ndarray, np.ndarray]] = {}
        self.seen: dict[tuple[tuple[str, str], int], int] = {}          # members with rows in the block
        self.members: dict[tuple[str, str], frozenset[int]] = {}

    def agree(self, table: pa.Table, seq: np.ndarray, no_seq: np.ndarray) -> np.ndarray | None:
        """Fold in one rank's rows: their (step, n-th collective) keys, or None (for good) once a row or a block
        disagrees."""
        self.ok = self.ok and _all_device(table, no_seq)
        if not self.ok:
            return None
        code, pairs = _groups(table, pg_null="world", ranks_null=self.world_ranks)
        step = _keys(table, seq, no_seq, "step")[0]
        position = _position_keys(table, seq, no_seq, self.world_ranks)
        ops, op_names = dictionary_codes(table["op"])
        size = table["num_bytes"].fill_null(-1).to_numpy().astype(np.int64)
        rank = int(table["rank"][0].as_py())
        order = np.lexsort((position, code))
        for c, at in zip(*_runs(code[order])):
            rows = order[at]
            group = pairs[c]
            if group[1] is None:             # no member list: matching leaves the group out
                self.ok = False
                return None
            members = self.members.setdefault(group, frozenset(int(m) for m in group[1].split(",") if m.strip()))
            if rank not in members:
                self.ok = False
                return None
            for s, at_step in zip(*_runs(step[rows])):
                block, held = (group, int(s)), rows[at_step]
                signature = (np.asarray(op_names, dtype=object)[ops[held]], size[held])
                first = self.first.setdefault(block, signature)
                if first is not signature and not (np.array_equal(first[0], signature[0])
                                                   and np.array_equal(first[1], signature[1])):
                    self.ok = False
                    return None
                self.seen[block] = self.seen.get(block, 0) + 1
        return position

    def all_agree(self) -> bool:
        """Every rank added agreed, and each block has every member of its group."""
        return self.ok and all(n == len(self.members[group]) for (group, _), n in self.seen.items())


def _all_device(table: pa.Table, no_seq: np.ndarray) -> bool:
    codes, values = dictionary_codes(table["timing"])
    ops = dictionary_codes(table["op"])[0]
    return bool(not no_seq.any() and (codes >= 0).all() and all(values[c] == DEVICE_TIMING for c in np.unique(codes))
                and (ops >= 0).all() and table["start_ns"].null_count == 0 and table["end_ns"].null_count == 0)


def _runs(values: np.ndarray) -> tuple[list, list[np.ndarray]]:
    """The distinct values of a sorted array and the index range of each."""
    starts = np.flatnonzero(np.r_[True, values[1:] != values[:-1]]) if len(values) else np.empty(0, np.int64)
    bounds = np.r_[starts, len(values)]
    return values[starts].tolist(), [np.arange(a, b) for a, b in pairwise(bounds)]


def _position_keys(table: pa.Table, seq: np.ndarray, no_seq: np.ndarray, world_ranks: str | None) -> np.ndarray:
    """Each row's (step, n-th collective of its group in the step) key, n counted as matching by order counts it:
    by start time, ties in the order of the collectives table (enqueue time, then ``seq``); the group with a null
    ``pg`` read as ``world`` and null ``pg_ranks`` as ``world_ranks``."""
    n = table.num_rows
    enqueue = table["enqueue_ns"]
    enq_null = enqueue.is_null().to_numpy(zero_copy_only=False) if enqueue.null_count else np.zeros(n, dtype=bool)
    in_table = np.empty(n, dtype=np.int64)
    in_table[np.lexsort((seq, no_seq, enqueue.fill_null(0).to_numpy().astype(np.int64), enq_null))] = np.arange(n)
    code = _groups(table, pg_null="world", ranks_null=world_ranks)[0]
    step = _keys(table, seq, no_seq, "step")[0]
    order = np.lexsort((in_table, table["start_ns"].fill_null(0).to_numpy().astype(np.int64), step, code))
    first = np.r_[True, (code[order][1:] != code[order][:-1]) | (step[order][1:] != step[order][:-1])] if n \
        else np.empty(0, dtype=bool)
    starts = np.flatnonzero(first)
    place = np.arange(n) - np.repeat(starts, np.diff(np.r_[starts, n]))
    if n and place.max() >= 1 << POSITION_BITS:
        raise ValueError(f"{place.max() + 1} collectives of one group in one step: above 2**{POSITION_BITS}")
    out = np.empty(n, dtype=np.int64)
    out[order] = step[order] * (1 << POSITION_BITS) + place
    return out


ROW_KEYS = np.dtype([("seq", "<i8"), ("key", "<i8"), ("no_seq", "?"), ("in_part", "?")])
"""A rank's window keys, a record per row of its spilled table (``row_keys``): its ``seq`` (numbered on the rank's
rows of the part), whether it has none, its window key, whether it is a row of the part."""


def row_keys(table: pa.Table, in_part: np.ndarray, windows: list[Window], *, seq_source: str,
             world_ranks: str | None) -> np.ndarray:
    """``ROW_KEYS`` of every row of one rank's spilled ``table`` (``in_part``: its rows of the part), for
    ``windows`` (``plan_windows``): what reading a window takes of its rows, computed once (numbering ``seq`` by
    order needs the rank's every row of the part, a window holds a few)."""
    rows = table.filter(in_part)
    seq, no_seq = table_seq(rows, source=seq_source)
    by = windows[0].by
    key = _position_keys(rows, seq, no_seq, world_ranks) if by == "position" else \
        _keys(rows, seq, no_seq, by)[0] if by in ("seq", "step") else np.zeros(len(seq), np.int64)
    out = np.zeros(table.num_rows, dtype=ROW_KEYS)
    out["seq"][in_part], out["key"][in_part], out["no_seq"][in_part] = seq, key, no_seq
    out["in_part"] = in_part
    return out


def window_ranges(keys: np.ndarray, windows: list[Window], rank: int) -> np.ndarray:
    """Per window, [start, stop) of the rows of one rank's table (its ``row_keys``) holding the window's rows
    ([0, 0) for none): a window is read from there alone (a rank's rows of a group come in ``seq`` and step order,
    so a window is a short stretch of its table)."""
    at = np.full(len(keys), -1, dtype=np.int64)
    for i, window in enumerate(windows):
        at[window_mask(keys, window, rank)] = i
    held = at >= 0
    first = np.full(len(windows), np.iinfo(np.int64).max)
    last = np.full(len(windows), -1)
    rows = np.flatnonzero(held)
    np.minimum.at(first, at[held], rows)
    np.maximum.at(last, at[held], rows)
    return np.stack([np.where(last >= 0, first, 0), last + 1], axis=1)


def window_mask(keys: np.ndarray, window: Window, rank: int) -> np.ndarray:
    """Which rows of one rank's ``row_keys`` (or a stretch of them) are rows of ``window``."""
    if window.by == "ranks":
        return keys["in_part"] & keys["no_seq"] & (window.lo <= rank) & (rank <= window.hi)
    keyed = keys["in_part"] & (~keys["no_seq"] if window.by != "step" else True)
    return keyed & (window.lo <= keys["key"]) & (keys["key"] <= window.hi)


def _keys(table: pa.Table, seq: np.ndarray, no_seq: np.ndarray, by: str) -> tuple[np.ndarray, np.ndarray]:
    """Each row's window key (its ``seq``, or its step with -1 for none) and whether it has one."""
    if by == "seq":
        return seq, ~no_seq
    step = table["step"].fill_null(-1).to_numpy().astype(np.int64, copy=False)
    return step, np.ones(len(step), dtype=bool)


def _filled_codes(column: pa.ChunkedArray, null: str | None = "") -> tuple[np.ndarray, list[str | None]]:
    """A dictionary column's codes into its distinct values with null read as ``null`` (so a null and ``null``
    share a code): codes, and the value of each (decoded once per distinct value, never per row)."""
    codes, values = dictionary_codes(column)
    filled = [null if v is None else v for v in values] + [null]          # the last: a null row
    names = sorted(set(filled), key=lambda v: (v is None, v or ""))
    at = np.array([names.index(v) for v in filled], dtype=np.int64)
    return at[np.where(codes >= 0, codes, len(values))], names


def _groups(table: pa.Table, *, pg_null: str = "", ranks_null: str | None = "") -> tuple[np.ndarray, list[tuple]]:
    """Each row's (pg, pg_ranks) code, nulls read as ``pg_null`` / ``ranks_null``, and the pair of each code."""
    pg, pg_names = _filled_codes(table["pg"], pg_null)
    pr, pr_names = _filled_codes(table["pg_ranks"], ranks_null)
    width = max(len(pr_names), 1)
    code, pairs = np.unique(pg * width + pr, return_inverse=True)
    return pairs.astype(np.int64), [(pg_names[c // width], pr_names[c % width]) for c in code.tolist()]


def _restarts(table: pa.Table, seq: np.ndarray, no_seq: np.ndarray) -> bool:
    """Whether a group's ``seq`` fails to increase along the rank's enqueue order (ties by ``seq``), as
    ``unique_seq`` reads a restart."""
    enqueue = table["enqueue_ns"]
    keep = ~no_seq & ~(enqueue.is_null().to_numpy(zero_copy_only=False) if enqueue.null_count
                       else np.zeros(len(seq), dtype=bool))
    if keep.sum() < 2:
        return False
    code = _groups(table)[0][keep]
    s = seq[keep]
    order = np.lexsort((s, enqueue.fill_null(0).to_numpy().astype(np.int64)[keep], code))
    s, code = s[order], code[order]
    return bool(((code[1:] == code[:-1]) & (s[1:] <= s[:-1])).any())


def _add_spans(spans: dict, table: pa.Table, seq: np.ndarray, no_seq: np.ndarray, key: np.ndarray) -> None:
    """Fold one rank's (group, key) -> (min, max) ``seq`` of its rows with one into ``spans`` (groups as the
    bandwidth pairs collectives: nulls read as "")."""
    keep = ~no_seq
    if not keep.any():
        return
    code, pairs = _groups(table)
    keys, at_key = np.unique(key[keep], return_inverse=True)
    pair_key = code[keep] * len(keys) + at_key
    unique, at = np.unique(pair_key, return_inverse=True)
    lo = np.full(len(unique), np.iinfo(np.int64).max)
    hi = np.full(len(unique), np.iinfo(np.int64).min)
    np.minimum.at(lo, at, seq[keep])
    np.maximum.at(hi, at, seq[keep])
    for u, a, b in zip(unique.tolist(), lo.tolist(), hi.tolist()):
        by_key = spans.setdefault(pairs[u // len(keys)], {})
        k = int(keys[u % len(keys)])
        old = by_key.get(k)
        by_key[k] = (a, b) if old is None else (min(old[0], a), max(old[1], b))


def _key_cuts(spans: dict[tuple[str, str], dict[int, tuple[int, int]]], keys: np.ndarray) -> np.ndarray:
    """Per gap between consecutive ``keys``: whether cutting there keeps every group's numbers on one side (each
    group's largest ``seq`` up to the gap is below its smallest after it)."""
    cuts = np.ones(max(len(keys) - 1, 0), dtype=bool)
    if not len(cuts):
        return cuts
    at = {int(k): i for i, k in enumerate(keys.tolist())}
    for by_key in spans.values():
        lo = np.full(len(keys), np.inf)
        hi = np.full(len(keys), -np.inf)
        for k, (a, b) in by_key.items():
            lo[at[k]], hi[at[k]] = a, b
        before = np.maximum.accumulate(hi)[:-1]
        after = np.minimum.accumulate(lo[::-1])[::-1][1:]
        cuts &= before < after
    return cuts


def _ranges(counts: np.ndarray, cuts: np.ndarray, max_rows: int) -> list[tuple[int, int]]:
    """Consecutive index ranges over ``counts`` of at most ``max_rows`` rows each (larger when a single key, or a
    run without an allowed cut, has more), cut only where ``cuts`` allows."""
    ranges, lo, rows = [], 0, 0
    for i, n in enumerate(counts.tolist()):
        if rows and rows + n > max_rows and cuts[i - 1]:
            ranges.append((lo, i - 1))
            lo, rows = i, 0
        rows += n
    if len(counts):
        ranges.append((lo, len(counts) - 1))
    return ranges
