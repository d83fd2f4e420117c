"""``lexsort``: ``numpy.lexsort`` with fewer keys to sort. The analysis sorts its rows by a few integer keys at a
time (group code, step, rank, seq, then a time); numpy sorts once per key, so a million rows by five keys cost five
sorts. Integer keys whose value ranges fit in 62 bits together are packed into one int64 key first (each key minus
its minimum, shifted past the keys after it), which orders the rows exactly as the keys did.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

_BITS = 62
"""Bits the packed key may use (an int64 key stays positive)."""


def lexsort(keys: Sequence[np.ndarray]) -> np.ndarray:
    """The order ``np.lexsort(keys)`` gives (the last key sorts first; stable: rows equal in every key keep their
    order): the primary keys, from the last one, packed into one int64 while they are integers and their ranges fit
    in ``_BITS`` bits, and the rest sorted after them by ``np.lexsort``."""
    keys = [np.asarray(k) for k in keys]
    if not keys or len(keys[-1]) < 2:
        return np.lexsort(keys)
    packed, used, rest = None, 0, len(keys)
    while rest:
        key = keys[rest - 1]
        if key.dtype.kind not in "biu":
            break
        low, high = int(key.min()), int(key.max())
        bits = (high - low).bit_length()
        if used + bits > _BITS:
            break
        # minus the minimum without wrapping: a uint64 in its own type (it may exceed int64), the rest as int64
        part = (key - np.uint64(low)).astype(np.int64) if key.dtype == np.uint64 else key.astype(np.int64) - low
        packed = part if packed is None else (packed << bits) | part
        used += bits
        rest -= 1
    if packed is None or rest == len(keys) - 1:      # nothing packed, or one key alone: no sort saved
        return np.lexsort(keys)
    if not rest:
        return np.argsort(packed, kind="stable")
    return np.lexsort((*keys[:rest], packed))
