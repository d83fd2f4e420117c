"""``dtprobe.lexsort.lexsort`` orders rows exactly as ``numpy.lexsort`` does, whatever its keys."""

from __future__ import annotations

import numpy as np
import pytest

from dtprobe.lexsort import lexsort


def _random_key(rng: np.random.Generator, n: int) -> np.ndarray:
    kind = int(rng.integers(0, 6))
    if kind == 0:
        return rng.integers(0, 4, n)                                   # a few codes: many ties
    if kind == 1:
        return rng.integers(-5, 5, n).astype(np.int32)                 # negative values
    if kind == 2:
        return rng.integers(0, 2**40, n) + 1_796_302_201_703_201_848   # Unix-epoch nanoseconds
    if kind == 3:
        return rng.random(n).round(1)                                  # a float key stops the packing
    if kind == 4:
        return rng.integers(0, 2, n).astype(bool)
    return rng.integers(0, 2**30, n).astype(np.uint32)


@pytest.mark.parametrize("seed", range(5))
def test_the_order_is_numpys_for_random_keys_of_every_kind(seed):
    rng = np.random.default_rng(seed)
    for _ in range(200):
        n = int(rng.integers(0, 80))
        keys = [_random_key(rng, n) for _ in range(int(rng.integers(1, 6)))]
        np.testing.assert_array_equal(lexsort(keys), np.lexsort(keys))


def test_keys_whose_ranges_do_not_fit_one_int64_are_sorted_apart():
    wide = np.array([-2**63, 2**63 - 1, 0, 5, 0], dtype=np.int64)      # a range of 64 bits: not packed
    code = np.array([1, 0, 1, 0, 1])
    np.testing.assert_array_equal(lexsort((wide, code)), np.lexsort((wide, code)))
    np.testing.assert_array_equal(lexsort((code, wide)), np.lexsort((code, wide)))
    big = np.array([2**64 - 1, 2**63, 2**63 + 7, 2**63], dtype=np.uint64)  # beyond int64, a small range
    np.testing.assert_array_equal(lexsort((big, np.array([0, 1, 0, 1]))), [2, 0, 1, 3])
    narrow = np.array([2**31 - 1, -2**31, 0, -2**31], dtype=np.int32)       # a range wider than int32 holds
    np.testing.assert_array_equal(lexsort((narrow, np.array([1, 1, 0, 0]))), [3, 2, 1, 0])
    times = np.array([0, 2**62, 5, 2**62 - 1], dtype=np.int64)            # 62 bits of range: the code's bit is one more
    np.testing.assert_array_equal(lexsort((times, np.array([1, 1, 0, 0]))), [2, 3, 0, 1])


def test_rows_equal_in_every_key_keep_their_order():
    code = np.array([2, 1, 2, 1, 2])
    step = np.array([7, 7, 7, 7, 7])
    np.testing.assert_array_equal(lexsort((step, code)), [1, 3, 0, 2, 4])
