"""``ScoreMemo``: the per-window figures of ``straggler_scores.straggler_scores`` kept between its calls on one live
run, so that scoring a step window again after a refresh computes the windows of the steps it added, not every window.

Every figure of a window (its medians, shares, standard errors, the largest of its peers' over the same steps, the
peers' noise) depends on its group's lateness rows in its steps alone. A window of the previous call is reused
when it has the same group, rank, first and last step and length, and none of its group's steps in between
changed: each (group, step) is fingerprinted by the hashes of its rows (``pandas.util.hash_pandas_object``). What
a call does with the figures (which windows qualify, which one is chosen) is judged again every time; the peers'
noise is taken from the memo only where the call would compute it, so the result is the one computed from the rows.
Built by the facade for running runs (one per store).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import numpy as np
import pandas as pd

FINGERPRINT_COLUMNS = ["rank", "step", "lateness_ns", "victims_wait_ns", "is_last", "step_ns", "lateness_frac",
                       "pre_excess_frac", "cpu_throttled_frac", "cpu_wait_frac", "cpu_busy_frac"]
"""The lateness columns a window's figures read (those present)."""
_STEP_BITS = 32
"""Bits of a step in a (group, step) key."""


@dataclass
class ScoreMemo:
    """What ``straggler_scores`` computed per window in its last call (see the module docstring)."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    """Held by the caller around a call that uses the memo."""
    settings: tuple = ()
    """What the figures depend on besides the rows (window length, whether throttle and wait columns were given)."""
    codes: dict[tuple[str, str], int] = field(default_factory=dict)
    """(pg, pg_ranks) -> group code."""
    step_keys: np.ndarray = field(default_factory=lambda: np.empty(0, dtype=np.int64))
    """Sorted (group code << 32 | step) of the last call's rows."""
    step_prints: np.ndarray = field(default_factory=lambda: np.empty(0, dtype=np.uint64))
    """The fingerprint of each of ``step_keys``."""
    windows: pd.MultiIndex | None = None
    """The last call's windows (``window_keys``)."""
    figures: dict[str, np.ndarray] = field(default_factory=dict)
    """Figure -> its value per window of ``windows``."""
    noise: dict[str, tuple[np.ndarray, np.ndarray]] = field(default_factory=dict)
    """Noise figure -> (value, whether computed) per window of ``windows``."""

    def group_codes(self, pg: pd.Series, pg_ranks: pd.Series) -> np.ndarray:
        """The code of each (pg, pg_ranks) pair (new pairs get new codes)."""
        return np.array([self.codes.setdefault((str(a), str(b)), len(self.codes)) for a, b in zip(pg, pg_ranks)],
                        dtype=np.int64)

    def reuse(self, settings: tuple, rows: pd.DataFrame, order: np.ndarray, row_code: np.ndarray,
              row_step: np.ndarray, keys: pd.MultiIndex, win_code: np.ndarray, first_step: np.ndarray,
              last_step: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Per window (``keys``, in the call's order): the index of the same window in the memo when its figures
        still hold, else -1; and this call's (group, step) keys and fingerprints (for ``keep``). ``rows``: the
        lateness rows, taken in the call's ``order``, where they have the group code and step ``row_code``,
        ``row_step``."""
        columns = [c for c in FINGERPRINT_COLUMNS if c in rows.columns]
        hashes = pd.util.hash_pandas_object(rows[columns], index=False).to_numpy(dtype=np.uint64)[order]
        step_key = (row_code << _STEP_BITS) | row_step
        by = np.argsort(step_key, kind="stable")
        step_keys, first = np.unique(step_key[by], return_index=True)
        prints = np.add.reduceat(hashes[by], first) if len(by) else np.empty(0, dtype=np.uint64)
        index = np.full(len(keys), -1, dtype=np.int64)
        if settings != self.settings or self.windows is None or not len(keys):
            return index, step_keys, prints
        if len(self.step_keys):
            at = np.minimum(np.searchsorted(self.step_keys, step_keys), len(self.step_keys) - 1)
            changed = step_keys[(self.step_keys[at] != step_keys) | (self.step_prints[at] != prints)]
        else:
            changed = step_keys
        base = win_code << _STEP_BITS
        touched = (np.searchsorted(changed, base | last_step, side="right")
                   - np.searchsorted(changed, base | first_step, side="left"))
        found = self.windows.get_indexer(keys)
        return np.where((touched == 0) & (found >= 0), found, -1), step_keys, prints

    def keep(self, settings: tuple, step_keys: np.ndarray, prints: np.ndarray, keys: pd.MultiIndex,
             figures: dict[str, np.ndarray], noise: dict[str, tuple[np.ndarray, np.ndarray]]) -> None:
        """Remember this call's windows and figures."""
        self.settings, self.step_keys, self.step_prints = settings, step_keys, prints
        self.windows, self.figures, self.noise = keys, figures, noise


def window_keys(win_code: np.ndarray, rank: np.ndarray, first_step: np.ndarray, last_step: np.ndarray,
                length: np.ndarray) -> pd.MultiIndex | None:
    """A key per window: (group code, rank) and (first step, span, length); None when a number does not fit."""
    span = last_step - first_step
    if len(rank) and (rank.max() >= 1 << 21 or first_step.max() >= 1 << 31 or span.max() >= 1 << 16
                      or length.max() >= 1 << 16 or first_step.min() < 0):
        return None
    return pd.MultiIndex.from_arrays([(win_code << 21) | rank, (first_step << 32) | (span << 16) | length])
