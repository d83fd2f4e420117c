"""dtprobe.intervals: the one interval union (overlapping and touching spans count once) and measured bubble."""

from __future__ import annotations

import numpy as np
import pytest

from dtprobe.intervals import bubble_frac, merge_intervals, union_length, union_length_by_group

T0 = 1_700_000_000_000_000_000   # epoch nanoseconds: the union must stay exact in int64


def _reference_union(spans: list[tuple[int, int]]) -> int:
    """Length of the union, one span at a time (the obvious loop the vectorised code must equal)."""
    total, cur = 0, None
    for s, e in sorted(spans):
        if cur is None or s > cur[1]:
            total += 0 if cur is None else cur[1] - cur[0]
            cur = [s, e]
        else:
            cur[1] = max(cur[1], e)
    return total + (0 if cur is None else cur[1] - cur[0])


@pytest.mark.parametrize("spans,length", [
    ([], 0),
    ([(0, 10)], 10),
    ([(0, 10), (10, 20)], 20),          # touching
    ([(0, 10), (5, 8)], 10),            # nested
    ([(0, 10), (5, 15), (20, 30)], 25),  # overlapping, then a gap
    ([(20, 30), (0, 10), (5, 15)], 25),  # any order
])
def test_union_length_counts_overlaps_once(spans, length):
    s = np.array([a for a, _ in spans], dtype=np.int64) + T0
    e = np.array([b for _, b in spans], dtype=np.int64) + T0
    assert union_length(s, e) == length
    ms, me = merge_intervals(s, e)
    assert int((me - ms).sum()) == length and (ms[1:] > me[:-1]).all()


def test_union_length_by_group_equals_the_one_span_at_a_time_union_of_each_group():
    rng = np.random.default_rng(7)
    for _ in range(200):
        n = int(rng.integers(0, 40))
        group = rng.integers(0, 5, n)
        start = rng.integers(0, 200, n) + T0
        end = start + rng.integers(0, 40, n)
        got = union_length_by_group(group, start, end, num_groups=5)
        want = [_reference_union([(int(a), int(b)) for a, b, g in zip(start, end, group) if g == k]) for k in range(5)]
        assert got.tolist() == want


@pytest.mark.parametrize("spans,window,busy,frac", [
    ([(0, 10), (20, 30)], 40, 20, 0.5),
    ([(0, 10), (5, 15)], 20, 15, 0.25),   # overlapping actions: union, not the sum (20)
    ([], 10, 0, 1.0),
])
def test_bubble_frac_is_the_idle_share_of_the_window_outside_the_union(spans, window, busy, frac):
    s = np.array([a for a, _ in spans], dtype=np.int64)
    e = np.array([b for _, b in spans], dtype=np.int64)
    assert bubble_frac(s, e, window_ns=window) == (busy, pytest.approx(frac))


def test_bubble_frac_is_nan_for_an_empty_window():
    assert np.isnan(bubble_frac(np.array([5]), np.array([5]), window_ns=0)[1])
