"""The cross-rank analyses of a source's collectives computed one part (a trace folder's process group) at a time:
matching, clock offsets and device arrivals (``DeviceClock``), and for a source that reads its collectives in
parts (``store.kineto.CollectiveParts``) also the bandwidth, group rows and the collectives' clock; read by the
facade, so by ``dtprobe analyze`` on Kineto trace folders, whose collectives are never held whole.

Each part holds every row of the process groups in it, or, for a group too large for a part (one spanning every
rank), every member's rows of a window of its collectives (with matching by order, of whole ProfilerSteps). What
is computed per collective comes out of a part alone as it does out of the whole table: matching
(``collective_matching``), bandwidth (``comm_efficiency``); per group, the parts' results are folded: group rows
(``arrivals.group_rows``), arrivals per (rank, group) (``_Arrivals``). Clock offsets link
ranks across groups (``clock_alignment``); they are built in three passes over the parts, each holding one part's
rows: (1) match, count the collectives each set of members shares, and place the ranks from the counts; (2) the
end differences of each placed rank and the rank it is placed from, hence the offsets; (3) residuals and arrivals
on the aligned clock. Beyond one part, memory holds per-rank, per-group and per-collective results (the bandwidth
table) and, for the exact medians, the end differences of the placed pairs, the residuals' deviations and the
arrivals' lateness: a few numbers per matched row.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import numpy as np
import pandas as pd

from dtprobe.analysis import clock_alignment as _clocks
from dtprobe.analysis import collective_matching as _matching
from dtprobe.analysis import device_arrivals as _arrivals
from dtprobe.analysis.arrivals import group_rows, unique_seq
from dtprobe.analysis.clocks import DEVICE, DEVICE_TIMING, HOST, MIXED
from dtprobe.analysis.comm_efficiency import collective_bandwidth
from dtprobe.analysis.derived_tables import BANDWIDTH, GROUPS, whole_run_frame
from dtprobe.analysis.tables import group_codes

Reader = Callable[[], pd.DataFrame]


@dataclass(frozen=True, kw_only=True)
class DeviceClock:
    """The device-clock results of a source's collectives, as the whole-table functions give them."""

    coverage: pd.DataFrame
    """``collective_matching.group_coverage``."""
    matching: dict
    """``collective_matching.matching_summary``."""
    offsets: pd.DataFrame
    """``clock_alignment.clock_offsets``."""
    arrivals: pd.DataFrame
    """``device_arrivals.arrival_summary``."""


@dataclass(frozen=True, kw_only=True)
class PartTables:
    """What the facade reads of every collectives row, from a source read in parts."""

    bandwidth: pd.DataFrame
    """``comm_efficiency.collective_bandwidth`` of the whole table."""
    group_rows: pd.DataFrame
    """``arrivals.group_rows`` of the whole table."""
    timing_clock: str
    """``clocks.clock_of_timing`` of the whole table's ``timing``."""


class _Tables:
    """``PartTables`` gathered a part at a time: each part's bandwidth rows (a row per collective, joined once at
    the end), the group rows folded into one small frame as they come, and the clocks seen."""

    def __init__(self) -> None:
        self.bandwidth: list[pd.DataFrame] = []
        self.groups: pd.DataFrame | None = None
        self.clocks: set[str] = set()

    def add(self, rows: pd.DataFrame) -> None:
        bw = collective_bandwidth(rows)
        if not bw.empty:
            self.bandwidth.append(bw)
        groups = group_rows(rows)
        self.groups = groups if self.groups is None else group_rows(pd.concat([self.groups, groups],
                                                                              ignore_index=True))
        if len(rows):
            device = (rows["timing"].fillna(HOST).astype(str) == DEVICE_TIMING).to_numpy(dtype=bool)
            self.clocks |= {DEVICE} if device.all() else {HOST} if not device.any() else {DEVICE, HOST}

    def result(self) -> PartTables:
        clocks = self.clocks
        return PartTables(
            bandwidth=whole_run_frame(BANDWIDTH, pd.concat(self.bandwidth, ignore_index=True)) if self.bandwidth
            else collective_bandwidth(pd.DataFrame({c: [] for c in _BANDWIDTH_INPUT})),
            group_rows=whole_run_frame(GROUPS, self.groups) if self.groups is not None
            else group_rows(pd.DataFrame({c: [] for c in _GROUP_INPUT})),
            timing_clock=HOST if not clocks else next(iter(clocks)) if len(clocks) == 1 else MIXED)


_BANDWIDTH_INPUT = ["rank", "pg", "pg_ranks", "pg_size", "seq", "op", "num_bytes", "enqueue_ns", "start_ns",
                    "end_ns", "step", "timing"]
_GROUP_INPUT = ["pg", "pg_ranks", "op", "rank", "peer", "arrive_ns"]


def device_clock(readers: Iterable[Reader], *, world_size: int | None, ranks_present: set[int], by: str,
                 with_tables: bool = False) -> tuple[DeviceClock, PartTables | None]:
    """``DeviceClock`` of the collectives ``readers`` give in parts (every process group's rows in one part; the
    whole table is one part), and with ``with_tables`` their ``PartTables``: three passes over the parts (see the
    module docstring), the part read last in a pass the first of the next (one part is read once)."""
    parts = _Parts(list(readers), world_size=world_size, ranks_present=ranks_present, by=by)
    tables = _Tables() if with_tables else None
    coverage, counts, member_sets, rank_rows, part_sets = [], {}, {}, {}, []
    for matched, part_coverage in parts.each(on_rows=tables.add if tables is not None else None):
        coverage.extend(part_coverage.to_dict("records"))
        for status, n in _matching.status_counts(matched).items():
            counts[status] = counts.get(status, 0) + n
        ranks, ri, coll, _ = _clocks.member_ends(matched)
        part_sets.append([])
        for member_set, n in _clocks.member_set_counts(ri, coll).items():
            key = tuple(int(ranks[i]) for i in member_set)
            member_sets[key] = member_sets.get(key, 0) + n
            part_sets[-1].append(frozenset(key))
        for rank, n in zip(ranks.tolist(), np.bincount(ri, minlength=len(ranks)).tolist()):
            rank_rows[rank] = rank_rows.get(rank, 0) + n
        del matched
    coverage = _coverage_frame(coverage)
    matching = _matching.matching_summary(pd.DataFrame(), coverage, by=by, counts=counts)
    tables = tables.result() if tables is not None else None
    ranks = np.array(sorted(rank_rows), dtype=np.int64)
    n = len(ranks)
    if n == 0:
        return DeviceClock(coverage=coverage, matching=matching, offsets=pd.DataFrame(columns=_clocks.OFFSET_COLUMNS),
                           arrivals=_no_arrivals()), tables
    index = {int(r): i for i, r in enumerate(ranks)}
    order = _clocks.placement(_clocks.shared_counts(
        {tuple(index[r] for r in key): count for key, count in member_sets.items()}, n))
    diffs: dict[tuple[int, int], list[np.ndarray]] = {edge: [] for edge in order}
    pairs = [(int(ranks[u]), int(ranks[p])) for u, p in order]
    with_pairs = {i for i, sets in enumerate(part_sets) if any(u in s and p in s for s in sets for u, p in pairs)}
    for matched, _ in parts.each(only=with_pairs):         # the parts where a placed pair shares collectives
        part_ranks, ri, coll, end = _clocks.member_ends(matched)
        local = {int(r): i for i, r in enumerate(part_ranks)}
        bounds = np.searchsorted(ri, np.arange(len(part_ranks) + 1))
        for u, p in order:
            if int(ranks[u]) in local and int(ranks[p]) in local:
                diffs[u, p].append(_clocks.edge_diffs(coll, end, bounds, local[int(ranks[u])], local[int(ranks[p])]))
        del matched
    offset, placed = _clocks.chained_offsets(order, {e: np.median(np.concatenate(d)) for e, d in diffs.items()}, n)
    num_collectives = np.array([rank_rows[r] for r in ranks.tolist()], dtype=np.int64)
    offsets = _clocks.offset_frame(ranks, offset, placed, np.full(n, np.nan), num_collectives)
    deviations, arrivals = [], _Arrivals()
    for matched, _ in parts.each():
        part_ranks, ri, coll, end = _clocks.member_ends(matched)
        at = np.searchsorted(ranks, part_ranks)[ri]
        deviations.append(_clocks.deviations(at, coll, end + offset[at], placed[at]))
        arrivals.add(_arrivals.member_arrivals(_clocks.corrected(matched, offsets)))
        del matched
    offsets = _clocks.offset_frame(ranks, offset, placed, _clocks.median_deviation(deviations, n), num_collectives)
    return DeviceClock(coverage=coverage, matching=matching, offsets=offsets, arrivals=arrivals.summary()), tables


def _no_arrivals() -> pd.DataFrame:
    return _arrivals.arrival_summary(pd.DataFrame(columns=_arrivals.MEMBER_COLUMNS), pd.DataFrame())


class _Arrivals:
    """``device_arrivals.arrival_summary`` of the parts' member arrivals, gathered a part at a time and equal to it
    on all of them at once, also when a group's collectives come in several parts (windows of a large group): per
    (rank, group) its counts and its lateness values (for the exact median), per collective its last arriver and
    mean wait (summed at the end in collective order, as ``arrival_summary`` sums them), per group its span."""

    def __init__(self) -> None:
        self.counts: dict[tuple[int, str, str], np.ndarray] = {}      # collectives, started last, after its peers
        self.lateness: dict[tuple[int, str, str], list[np.ndarray]] = {}
        self.waits: list[pd.DataFrame] = []
        self.spans: dict[tuple[str, str], tuple[int, int]] = {}

    def add(self, members: pd.DataFrame) -> None:
        if members.empty:
            return
        code, pg_names, pr_names = group_codes(members["pg"], members["pg_ranks"])
        rank = members["rank"].to_numpy(dtype="int64")
        key, first = pd.factorize(pd.MultiIndex.from_arrays([rank, code]), sort=True)
        lateness = members["lateness_us"].to_numpy(dtype="float64")
        flags = np.stack([np.ones(len(key)), members["is_last"].to_numpy(dtype=bool), lateness > 0])
        counts = np.stack([np.bincount(key, weights=f, minlength=len(first)) for f in flags], axis=1)
        order = np.argsort(key, kind="stable")
        values = np.split(lateness[order], np.flatnonzero(np.diff(key[order])) + 1)
        for (r, c), n, late in zip(first, counts.astype(np.int64), values):
            k = (int(r), str(pg_names[c]), str(pr_names[c]))
            self.counts[k] = self.counts[k] + n if k in self.counts else n
            self.lateness.setdefault(k, []).append(late)
        last = _arrivals.last_arrivers(members)
        self.waits.append(pd.DataFrame({
            "coll_id": last["coll_id"].to_numpy(dtype="int64"), "last_rank": last["last_rank"].to_numpy(),
            "pg": last["pg"].astype(str).to_numpy(dtype=object), "pg_ranks": last["pg_ranks"].astype(str)
            .to_numpy(dtype=object), "w": last["coll_id"].map(members.groupby("coll_id")["wait_us"].mean())
            .to_numpy(dtype="float64")}))
        start, end = members["start_ns"].to_numpy(dtype="int64"), members["end_ns"].to_numpy(dtype="int64")
        for c in np.unique(code).tolist():
            k, at = (str(pg_names[c]), str(pr_names[c])), code == c
            lo, hi = int(start[at].min()), int(end[at].max())
            old = self.spans.get(k)
            self.spans[k] = (lo, hi) if old is None else (min(old[0], lo), max(old[1], hi))

    def summary(self) -> pd.DataFrame:
        """``arrival_summary`` of every part's members, rows sorted by (rank, pg, pg_ranks)."""
        if not self.counts:
            return _no_arrivals()
        keys = sorted(self.counts)
        counts = np.array([self.counts[k] for k in keys], dtype=np.int64)
        waits = pd.concat(self.waits, ignore_index=True).sort_values("coll_id", kind="stable")
        caused = waits.groupby(["last_rank", "pg", "pg_ranks"])["w"].sum()
        out = pd.DataFrame({
            "rank": np.array([k[0] for k in keys], dtype=np.int64), "pg": [k[1] for k in keys],
            "pg_ranks": [k[2] for k in keys], "num_collectives": counts[:, 0],
            "last_frac": counts[:, 1] / counts[:, 0],
            "median_lateness_us": [float(np.median(np.concatenate(self.lateness[k]))) for k in keys],
            "positive_frac": counts[:, 2] / counts[:, 0],
            "caused_wait_us": [float(caused.get(k, 0.0)) for k in keys],
            "group_span_us": [(self.spans[k[1:]][1] - self.spans[k[1:]][0]) / 1e3 for k in keys]})
        return out.astype({"pg": object, "pg_ranks": object}).sort_values(
            ["rank", "pg", "pg_ranks"], kind="stable").reset_index(drop=True)[_arrivals.SUMMARY_COLUMNS]


class _Parts:
    """The parts' matched rows, pass after pass: each pass goes through the parts in the other direction, starting
    with the part the previous pass ended with, which is kept (``coll_id`` numbered on from the parts before it, as
    in the first pass)."""

    def __init__(self, readers: list[Reader], *, world_size: int | None, ranks_present: set[int], by: str) -> None:
        self.readers, self.world_size, self.ranks_present, self.by = readers, world_size, ranks_present, by
        self.first_ids: list[int] = []
        self.next_id = 0
        self.held: tuple[int, tuple[pd.DataFrame, pd.DataFrame]] | None = None
        self.forward = True

    def each(self, *, on_rows: Callable[[pd.DataFrame], None] | None = None, only: set[int] | None = None):
        """(matched rows, group coverage) of every part (of the parts ``only`` names); ``on_rows`` sees each part's
        rows (first pass only)."""
        order = range(len(self.readers)) if self.forward else range(len(self.readers) - 1, -1, -1)
        self.forward = not self.forward
        for i in (i for i in order if only is None or i in only):
            if self.held is not None and self.held[0] == i:
                item = self.held[1]
            else:
                self.held = None
                item = self._match(i, on_rows)
            self.held = (i, item)
            yield item
            del item

    def _match(self, i: int, on_rows: Callable[[pd.DataFrame], None] | None) -> tuple[pd.DataFrame, pd.DataFrame]:
        rows = unique_seq(self.readers[i]())
        if on_rows is not None:
            on_rows(rows)
        device = _matching.device_collectives(rows, world_size=self.world_size)
        del rows
        coverage = _matching.group_coverage(device, ranks_present=self.ranks_present)
        matched = _matching.match_collectives(device, coverage, by=self.by)
        del device
        if i == len(self.first_ids):           # the first pass, in order: number on from the parts before
            self.first_ids.append(self.next_id)
        if len(matched):
            matched["coll_id"] = matched["coll_id"].to_numpy(dtype="int64") + self.first_ids[i]
            self.next_id = max(self.next_id, int(matched["coll_id"].max()) + 1)
        return matched, coverage


def _coverage_frame(rows: list[dict]) -> pd.DataFrame:
    """The parts' ``group_coverage`` rows as its frame, in its row order (by pg, then pg_ranks)."""
    out = pd.DataFrame(rows, columns=_matching.COVERAGE_COLUMNS)     # a group read in windows: its row once
    return out.drop_duplicates(["pg", "pg_ranks"]).sort_values(["pg", "pg_ranks"], na_position="last",
                                                               kind="stable").reset_index(drop=True) \
        if rows else out
