"""Each rank's clock offset as a function of time, from its ``clock`` samples; read by the store reader to align
rows and by compaction to record what it applied.

A rank's offset (rank 0's clock minus the rank's) is measured at attach and, while the job runs, re-measured
periodically (table ``clock``). Host clocks drift, so one constant is wrong for long jobs: a row at rank-clock
time ``t`` gets the offset interpolated linearly between the samples around ``t``; before the first sample it
gets the first (the attach measurement), after the last the last. Each restart of a rank starts a new segment
(a restarted rank may run on another host): between two restarts' samples the offset steps, it is not
interpolated. Samples are ordered by (restart, time). A rank without samples keeps the constant of its
``ranks/rankNNNNN.json``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from dtprobe.store.errors import TraceError


@dataclass(frozen=True)
class RankSamples:
    """One rank's samples, sorted by (restart, time)."""

    times_ns: np.ndarray
    """Sample times on the rank's own clock (int64)."""
    offsets_ns: np.ndarray
    """Offset at each sample (int64)."""
    restarts: np.ndarray
    """The restart each sample was taken in (int64): the offset steps, not slopes, between restarts."""

    @property
    def summary(self) -> tuple[int, int, int]:
        """(number of samples, time of the last, offset of the last): what compaction records."""
        return len(self.times_ns), int(self.times_ns[-1]), int(self.offsets_ns[-1])

    def at(self, times_ns: np.ndarray) -> np.ndarray:
        """Offset (int64 ns) at each rank-clock time of ``times_ns`` (int64)."""
        t, o = self.times_ns, self.offsets_ns
        i = np.searchsorted(t, times_ns, side="right") - 1     # the last sample at or before each time
        lo = np.clip(i, 0, len(t) - 1)
        hi = np.clip(i + 1, 0, len(t) - 1)
        out = o[lo].copy()                                        # before the first / after the last: constant
        inside = (i >= 0) & (i + 1 < len(t)) & (self.restarts[lo] == self.restarts[hi])
        if inside.any():
            span = (t[hi] - t[lo])[inside].astype(np.float64)
            frac = (times_ns[inside] - t[lo][inside]).astype(np.float64) / span
            out[inside] = o[lo][inside] + np.rint(frac * (o[hi] - o[lo])[inside].astype(np.float64)).astype(np.int64)
        return out


class ClockModel:
    """Offsets of every rank of a run: the ``ranks/*.json`` constants plus the ``clock`` samples."""

    def __init__(self, constants: dict[int, int], samples: dict[int, RankSamples]) -> None:
        self.constants = constants
        """rank -> ``clock_offset_ns`` of its rank info file (ranks without samples use it)."""
        self.samples = samples
        """rank -> its samples (only ranks with at least one)."""
        self.key = (tuple(sorted(constants.items())),
                    tuple(sorted((r, s.summary) for r, s in samples.items())))
        """Equal for two models that align every row the same way (samples are only ever appended)."""

    @classmethod
    def build(cls, constants: dict[int, int], clock_rows: pa.Table | None) -> "ClockModel":
        """From the rank info offsets and the ``clock`` table's rows (rank-clock times; "failed" rows, whose
        offset is null, are not samples)."""
        samples: dict[int, RankSamples] = {}
        if clock_rows is not None and clock_rows.num_rows:
            rows = clock_rows.filter(pc.and_(pc.is_valid(clock_rows.column("offset_ns")),
                                             pc.is_valid(clock_rows.column("time_ns"))))
            rank = rows.column("rank").to_numpy(zero_copy_only=False).astype(np.int64)
            restart = pc.fill_null(rows.column("restart"), 0).to_numpy(zero_copy_only=False).astype(np.int64)
            t = rows.column("time_ns").to_numpy(zero_copy_only=False).astype(np.int64)
            o = rows.column("offset_ns").to_numpy(zero_copy_only=False).astype(np.int64)
            order = np.lexsort((t, restart, rank))
            rank, restart, t, o = rank[order], restart[order], t[order], o[order]
            for r in np.unique(rank):
                sel = rank == r
                samples[int(r)] = RankSamples(times_ns=t[sel], offsets_ns=o[sel], restarts=restart[sel])
        return cls(dict(constants), samples)

    @property
    def ranks(self) -> set[int]:
        """Ranks whose offset is known (rank info file or samples)."""
        return set(self.constants) | set(self.samples)

    def offsets_at(self, rank: int, times_ns: np.ndarray) -> np.ndarray:
        """Offset of ``rank`` at each of its rank-clock ``times_ns``."""
        rank_samples = self.samples.get(rank)
        if rank_samples is None:
            return np.full(len(times_ns), self.constants[rank], dtype=np.int64)
        return rank_samples.at(times_ns)

    def marker(self) -> dict[str, list[int]]:
        """What compaction records of the samples it applied: rank -> [num_samples, last time_ns, last offset_ns]."""
        return {str(r): list(s.summary) for r, s in sorted(self.samples.items())}


@dataclass(frozen=True)
class Basis:
    """The offsets a compacted chunk's times already hold: ``constants`` for ranks aligned without samples,
    ``samples`` (rank -> (num, last time, last offset), as ``ClockModel.marker``) for the others."""

    constants: dict[int, int]
    samples: dict[int, tuple[int, int, int]]

    @classmethod
    def from_marker(cls, offsets: dict, samples: dict | None) -> "Basis":
        return cls({int(r): int(o) for r, o in offsets.items()},
                   {int(r): (int(v[0]), int(v[1]), int(v[2])) for r, v in (samples or {}).items()})

    def matches(self, model: ClockModel) -> bool:
        """True when ``model`` aligns every row of the chunk exactly as it was aligned."""
        return all(model.samples.get(r) is not None and model.samples[r].summary == s
                   for r, s in self.samples.items()) and set(model.samples) <= set(self.samples) and all(
            model.constants.get(r) == o for r, o in self.constants.items() if r not in self.samples)

    def require_ranks(self, ranks: pa.ChunkedArray, source: str) -> None:
        """TraceError naming ``source`` when it holds rows of ranks this basis records no offset for."""
        unknown = sorted(set(pc.unique(ranks).drop_null().to_pylist()) - set(self.constants) - set(self.samples))
        if unknown:
            raise TraceError(f"{source} has rows of ranks {unknown}, but the compaction marker records no clock "
                             f"offset for them. Delete the run's tables/ folder and run `dtprobe compact` on the "
                             f"run again.")

    def shifts(self, model: ClockModel, rank: int, aligned_ns: np.ndarray, source: str) -> np.ndarray:
        """What to add to ``rank``'s ``aligned_ns`` (compacted with this basis) to align them with ``model``.

        Samples are only appended, so the basis's samples are the first ones of the model's: a row whose rank-clock
        time was at or before the basis's last sample got the same offset then as now; a later row got the last
        offset (constant), so its raw time is ``aligned - last offset``, and it gets the model's offset there. A
        rank aligned by a constant: raw = aligned - constant."""
        if rank in self.samples:
            num, last_t, last_o = self.samples[rank]
            now = model.samples.get(rank)
            if now is None or len(now.times_ns) < num or (
                    int(now.times_ns[num - 1]), int(now.offsets_ns[num - 1])) != (last_t, last_o):
                raise TraceError(
                    f"{source} was aligned with {num} clock samples of rank {rank} that the run's 'clock' "
                    f"table no longer starts with (events files replaced or edited after compaction). Delete "
                    f"the run's tables/ folder and run `dtprobe compact` on the run again.")
            raw = aligned_ns - last_o
            later = raw > last_t
            out = np.zeros(len(aligned_ns), dtype=np.int64)
            if later.any():
                out[later] = model.offsets_at(rank, raw[later]) - last_o
            return out
        base = self.constants.get(rank, 0)
        return model.offsets_at(rank, aligned_ns - base) - base


def align_rows(rows: pa.Table, columns: tuple[str, ...], model: ClockModel, basis: Basis | None, *,
               source: str) -> pa.Table:
    """``rows`` with each of ``columns`` on rank 0's clock under ``model``: raw rank-clock times (``basis`` None)
    get their rank's offset at each time; compacted times (aligned with ``basis``) get what changed since
    (``Basis.shifts``, whose errors name ``source``; a rank the basis does not know is a TraceError). Nulls stay
    null. Every rank must be in ``model.ranks``."""
    if basis is not None:
        basis.require_ranks(rows.column("rank"), source)
    if not columns or not rows.num_rows or (basis is not None and basis.matches(model)):
        return rows
    ranks = rows.column("rank").to_numpy(zero_copy_only=False).astype(np.int64)
    order = np.argsort(ranks, kind="stable")
    cuts = np.flatnonzero(np.diff(ranks[order])) + 1
    runs = [(int(ranks[idx[0]]), idx) for idx in np.split(order, cuts)]
    for col in columns:
        values = rows.column(col)
        times = pc.fill_null(values, 0).to_numpy(zero_copy_only=False).astype(np.int64)
        shift = np.empty(len(times), dtype=np.int64)
        for rank, idx in runs:
            shift[idx] = (model.offsets_at(rank, times[idx]) if basis is None
                          else basis.shifts(model, rank, times[idx], source))
        i = rows.schema.get_field_index(col)
        rows = rows.set_column(i, col, pc.add(values, pa.array(shift, type=pa.int64())))
    return rows
