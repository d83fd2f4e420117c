"""A trace folder's process group spanning every rank (pure data parallel; traces naming no group, taken as
world-wide) is read in windows of whole collectives over every member (``store.kineto_group_windows``): the
cross-rank results equal those of the whole table, and the largest part read does not grow with the ranks."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from test_kineto_groups import WholeTable

from dtprobe.analysis import device_arrivals
from dtprobe.analysis.facade import RunAnalysis
from dtprobe.store import kineto
from dtprobe.store.kineto import load_trace_dir
from dtprobe.store.kineto_collective_frame import collective_table
from dtprobe.store.kineto_collectives import rank_collectives
from dtprobe.store.kineto_group_windows import POSITION_BITS, plan_windows

MB_PER_RANK = 0.3
WINDOW_ROWS = 96
"""Rows per window in these tests: a few dozen collectives of 8 ranks, far below a world group's rows."""
FEW, MANY = 8, 32
LATE = 5
"""The rank whose compute runs slower in the sets written here: it reaches every collective last."""


def _trace_set(folder: Path, root: Path, *, ranks: int, layout: str, seq: bool) -> Path:
    sys.path.insert(0, str(root / "benchmarks"))
    try:
        from scale_data import TraceSetSpec, write_trace_set
    finally:
        sys.path.remove(str(root / "benchmarks"))
    write_trace_set(folder, TraceSetSpec(ranks=ranks, mb_per_rank=MB_PER_RANK, layout=layout, seq=seq,
                                         straggler_rank=LATE), workers=1)
    return folder


LAYOUTS = {"dp_seq": ("dp", True), "dp_order": ("dp", False), "unnamed_order": ("dp_unnamed", False),
           "tp8xdp_seq": ("tp8xdp", True)}


@pytest.fixture(scope="module", params=sorted(LAYOUTS))
def trace_set(request, tmp_path_factory, repo_root) -> tuple[str, Path]:
    layout, seq = LAYOUTS[request.param]
    ranks = 16 if layout == "tp8xdp" else FEW
    return request.param, _trace_set(tmp_path_factory.mktemp(request.param), repo_root, ranks=ranks, layout=layout,
                                     seq=seq)


class Skewed:
    """A trace folder whose collectives' times are moved: rank r's clock runs r x CLOCK_STEP_NS ahead, starts but
    rank LATE's come up to 1 ms early and ends jitter by up to 2 us (each a function of the row's rank and seq, so a
    window's rows move as they do in the whole table); its parts are the store's windows (``parts``) or none."""

    CLOCK_STEP_NS = 1_000_003

    def __init__(self, run: kineto.KinetoRun, *, parts: bool) -> None:
        self.run, self.path, self.info = run, run.path, run.info
        if parts:
            self.collective_parts = self._parts

    @classmethod
    def move(cls, c: pd.DataFrame) -> pd.DataFrame:
        c = c.copy()
        rank = c["rank"].to_numpy(dtype="int64")
        seq = c["seq"].to_numpy(dtype="int64", na_value=0)
        mix = (rank + 1) * 2_654_435_761 * (seq + 7) % 1_000_003
        c["start_ns"] = c["start_ns"] + rank * cls.CLOCK_STEP_NS - np.where(rank == LATE, 0, mix % 1_000_000)
        c["end_ns"] = c["end_ns"] + rank * cls.CLOCK_STEP_NS + mix % 4_000 - 2_000
        return c

    def table(self, name: str) -> pd.DataFrame:
        return self.move(self.run.collectives) if name == "collectives" else self.run.table(name)

    def _parts(self) -> kineto.CollectiveParts:
        parts = self.run.collective_parts(window_rows=WINDOW_ROWS)
        return kineto.CollectiveParts(readers=tuple((lambda r=r: self.move(r())) for r in parts.readers),
                                      ranks=parts.ranks)


def test_windows_hold_whole_collectives_over_every_member_and_every_row_once(trace_set):
    name, folder = trace_set
    run = load_trace_dir(folder, workers=1)
    whole = run.collectives
    frames = [read() for read in run.collective_parts(window_rows=WINDOW_ROWS).readers]
    assert len(frames) > 3 and sum(len(f) for f in frames) == len(whole)
    key = ["pg", "pg_ranks", "seq"]
    seen = pd.concat([f[key].astype(str).drop_duplicates().assign(part=i) for i, f in enumerate(frames)])
    assert not seen.duplicated(key).any(), name          # each collective in one part
    by_rows = whole.sort_values(["rank", "enqueue_ns", "pg"], kind="stable").reset_index(drop=True).astype(str)
    read = pd.concat(frames).sort_values(["rank", "enqueue_ns", "pg"], kind="stable").reset_index(drop=True)
    pd.testing.assert_frame_equal(read.astype(str), by_rows)     # the same rows, values and seq


def test_report_and_device_clock_results_equal_the_whole_tables_when_read_in_windows(trace_set):
    _, folder = trace_set
    run = load_trace_dir(folder, workers=1)
    windows, whole = RunAnalysis(Skewed(run, parts=True)), RunAnalysis(Skewed(run, parts=False))
    got, want = windows.report(), whole.report()
    assert got == want
    assert [f["code"] for f in got["findings"] if f["code"] == "STRAGGLER"] and \
        any(f["ranks"] == [LATE] for f in got["findings"] if f["code"] == "STRAGGLER"), got["findings"]
    offsets = windows.clock_offsets()
    assert (offsets["offset_ns"].astype("int64") + offsets["rank"] * Skewed.CLOCK_STEP_NS).abs().max() <= 2_000
    pd.testing.assert_frame_equal(offsets, whole.clock_offsets(), check_exact=True)
    members = whole.device_arrivals()            # every member's arrivals at once, summarized in one call
    at_once = device_arrivals.arrival_summary(members, device_arrivals.last_arrivers(members))
    for summary in (windows.arrival_summary(), whole.arrival_summary()):
        pd.testing.assert_frame_equal(summary.astype({"pg": str, "pg_ranks": str}),
                                      at_once.astype({"pg": str, "pg_ranks": str}), check_exact=True)
    pd.testing.assert_frame_equal(windows.collective_bandwidth(), whole.collective_bandwidth(), check_exact=True)
    pd.testing.assert_frame_equal(windows.group_coverage(), whole.group_coverage())
    assert windows.collective_matching() == whole.collective_matching()
    assert windows.collective_matching()["num_matched"] == whole.matched_collectives()["coll_id"].nunique() > 0


def test_report_is_the_same_whatever_the_window_size(trace_set, monkeypatch):
    _, folder = trace_set
    reports = []
    for rows in (WINDOW_ROWS // 2, 10**9):
        monkeypatch.setattr(kineto, "COLLECTIVE_WINDOW_ROWS", rows)
        reports.append(RunAnalysis(load_trace_dir(folder, workers=1)).report())
    assert reports[0] == reports[1] == RunAnalysis(WholeTable(load_trace_dir(folder, workers=1))).report()


@pytest.mark.parametrize("layout,seq", [("dp", True), ("dp", False), ("dp_unnamed", False)],
                         ids=["seq", "order", "unnamed_order"])
def test_largest_part_of_a_world_group_does_not_grow_with_the_ranks(tmp_path, repo_root, layout, seq):
    largest, rows = {}, {}
    for ranks in (FEW, MANY):
        run = load_trace_dir(_trace_set(tmp_path / f"dp{ranks}", repo_root, ranks=ranks, layout=layout, seq=seq),
                             workers=1)
        sizes = [len(read()) for read in run.collective_parts(window_rows=WINDOW_ROWS).readers]
        largest[ranks], rows[ranks] = max(sizes), sum(sizes)
        assert sum(sizes) == len(run.collectives) > 3 * WINDOW_ROWS
        assert run.collectives.groupby("step").size().max() > WINDOW_ROWS     # a step of every rank is larger
    assert rows[MANY] >= 3.5 * rows[FEW]
    assert largest[FEW] <= WINDOW_ROWS and largest[MANY] <= WINDOW_ROWS, largest


def _table(rank: int, steps: list[int], *, seq: list[int] | None = None, sends: int = 0, num_bytes: int = 1024):
    """One rank's spilled collectives: an all-reduce of ``num_bytes`` per entry of ``steps`` (with ``seq`` as the
    traces' Seq), then ``sends`` sends."""
    n = len(steps) + sends
    steps, seq = steps + [0] * sends, None if seq is None else seq + [None] * sends
    enqueue = [1_000 * (i + 1) for i in range(n)]
    rows = [{"rank": rank, "pg": "0", "pg_ranks": "0,1", "pg_size": 2, "op": "allreduce" if i < n - sends else "send",
             "num_bytes": num_bytes, "enqueue_ns": enqueue[i], "start_ns": enqueue[i] + 10, "end_ns": enqueue[i] + 20,
             "step": steps[i], "timing": "cuda_event", "trace_seq": None if seq is None else seq[i]} for i in range(n)]
    return collective_table(rank_collectives(rows))


PLAN_CASES = [
    ("by seq, a window per few numbers", [_table(0, [0] * 6, seq=list(range(1, 7))),
                                          _table(1, [0] * 6, seq=list(range(1, 7)))], "trace",
     [("seq", 1, 2), ("seq", 3, 4), ("seq", 5, 6)]),
    ("by order, members agree: windows of (step, n-th collective)", [_table(0, [0, 0, 1, 1]),
                                                                      _table(1, [0, 0, 1, 1])], "order",
     [("position", 0, 1), ("position", 1 << POSITION_BITS, (1 << POSITION_BITS) + 1)]),
    ("by order, sizes differ: windows of steps", [_table(0, [0, 0, 1, 1]), _table(1, [0, 0, 1, 1], num_bytes=8)],
     "order", [("step", 0, 0), ("step", 1, 1)]),
    ("by order, rank 1's third collective falls in the next step: no cut keeps it whole",
     [_table(0, [0, 0, 0, 1, 1]), _table(1, [0, 0, 1, 1, 1])], "order", None),
    ("by seq, sends (no seq) after in blocks of ranks", [_table(0, [0] * 4, seq=[1, 2, 3, 4], sends=3),
                                                          _table(1, [0] * 4, seq=[1, 2, 3, 4], sends=3)], "trace",
     [("seq", 1, 2), ("seq", 3, 4), ("ranks", 0, 0), ("ranks", 1, 1)]),
    ("a seq that restarts on a rank: read whole", [_table(0, [0] * 4, seq=[1, 2, 1, 2]),
                                                    _table(1, [0] * 4, seq=[1, 2, 1, 2])], "trace", None),
]


@pytest.mark.parametrize("case,tables,source,expected", PLAN_CASES, ids=[c[0] for c in PLAN_CASES])
def test_plan_windows_cuts_only_between_whole_collectives(case, tables, source, expected):
    windows = plan_windows(tables, seq_source=source, world_ranks="0,1", max_rows=4)
    assert (None if windows is None else [(w.by, w.lo, w.hi) for w in windows]) == expected, case
