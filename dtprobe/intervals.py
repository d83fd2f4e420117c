"""Interval arithmetic over [start, end) spans: union, covered length, per-group union, and the measured pipeline
bubble built on them; read by ``dtprobe.analysis`` (temporal breakdown, overlap, exposed communication, pipeline
bubble) and ``dtprobe.runtime.parallel.bubble``.

A leaf module (numpy; pandas for the grouped union) so the runtime, which may not import ``dtprobe.analysis``,
shares the one definition.
Overlapping and touching spans count once everywhere: the busy time of a rank is the length of the union of its
spans, never their sum.
"""

from __future__ import annotations

import numpy as np

from dtprobe.lexsort import lexsort


def merge_intervals(start: np.ndarray, end: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Union of [start, end) intervals as sorted disjoint (start, end) arrays; touching intervals merge."""
    start, end = np.asarray(start), np.asarray(end)
    if not len(start):
        return start, end
    order = np.argsort(start, kind="stable")
    s, e = start[order], end[order]
    reach = np.maximum.accumulate(e)
    new = np.empty(len(s), dtype=bool)
    new[0] = True
    new[1:] = s[1:] > reach[:-1]
    first = np.flatnonzero(new)
    return s[first], np.maximum.reduceat(e, first)


def covered(start: np.ndarray, end: np.ndarray) -> int:
    """Total length of already merged (disjoint) intervals."""
    return int(np.asarray(end).sum() - np.asarray(start).sum())


def union_length(start: np.ndarray, end: np.ndarray) -> int:
    """Total length covered by the intervals [start, end) (overlaps counted once)."""
    return covered(*merge_intervals(start, end))


def union_of_spans(spans: list[tuple[int, int]]) -> int:
    """``union_length`` of a few (start, end) pairs (end >= start), in plain Python: the collective recorder's drain
    thread sums a step's spans on every tick, waking with cold caches, where numpy's per-call cost is the larger
    one."""
    total = 0
    first = last = None
    for start, end in sorted(spans):
        if last is None or start > last:
            if last is not None:
                total += last - first
            first, last = start, end
        elif end > last:
            last = end
    return total if last is None else total + last - first


def merge_intervals_by_group(group: np.ndarray, start: np.ndarray, end: np.ndarray
                             ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``merge_intervals`` within each group: the union of each group's [start, end) intervals as disjoint
    (group, start, end) arrays, sorted by group, then start; touching intervals merge. ``group``: integer codes;
    rows may come in any order."""
    group, start, end = np.asarray(group, dtype=np.int64), np.asarray(start), np.asarray(end)
    if not len(group):
        return group, start, end
    order = lexsort((start, group))
    g, s, e = group[order], start[order], end[order]
    new_group = np.empty(len(g), dtype=bool)
    new_group[0] = True
    new_group[1:] = g[1:] != g[:-1]
    # reach of the spans before each row within its group: a row past it starts a new merged segment
    reach = _group_cummax(e, np.cumsum(new_group) - 1)
    seg = new_group.copy()
    seg[1:] |= s[1:] > reach[:-1]
    seg_first = np.flatnonzero(seg)
    return g[seg_first], s[seg_first], np.maximum.reduceat(e, seg_first)


def union_length_by_group(group: np.ndarray, start: np.ndarray, end: np.ndarray, *, num_groups: int) -> np.ndarray:
    """Per group code ``0 .. num_groups - 1``: the length of the union of its intervals (int64; 0 without any).

    ``group`` holds dense integer codes; rows may come in any order.
    """
    out = np.zeros(num_groups, dtype=np.int64)
    g, s, e = merge_intervals_by_group(group, start, end)
    np.add.at(out, g, (e - s).astype(np.int64))
    return out


def _group_cummax(values: np.ndarray, group_id: np.ndarray) -> np.ndarray:
    """Running maximum of ``values`` restarted at each new ``group_id`` (rows sorted by group), exact in int64."""
    import pandas as pd   # imported here: the runtime imports this module for the scalar helpers only

    return pd.Series(values).groupby(group_id).cummax().to_numpy()


def bubble_frac(start: np.ndarray, end: np.ndarray, *, window_ns: float) -> tuple[int, float]:
    """(busy ns, bubble fraction) of one pipeline rank in one step: busy is the union of its action spans (F, B,
    I, W), the bubble its idle share of the step's pipeline window, ``1 - busy / window_ns`` (NaN for an empty
    window). The one definition of a measured pipeline bubble."""
    busy = union_length(start, end)
    return busy, (1.0 - busy / window_ns if window_ns > 0 else float("nan"))
