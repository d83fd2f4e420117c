"""A trace folder's cross-rank analyses (matching, clock offsets, arrivals, bandwidth) read its collectives a part
of whole process groups at a time (``KinetoRun.collective_parts``, ``analysis.collective_groups``): the results
equal those of the whole table, and what is held at a time does not grow with the number of rank files."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from dtprobe.analysis.facade import RunAnalysis
from dtprobe.store import kineto
from dtprobe.store.kineto import load_trace_dir

TRACES = Path(__file__).resolve().parent / "data" / "traces"
MB_PER_RANK = 1
FEW, MANY = 16, 64
PART_ROWS = 2_000
"""Rows per part in these tests: below one tensor-parallel group's rows at MB_PER_RANK, so every group is a part."""
HELD_GROWTH_BOUND = 0.35
"""Traced peak of the cross-rank analyses added from FEW to MANY rank files / the ``collectives`` table's bytes
added: holding the whole table and its matched rows (before the parts) measures above 2."""


class WholeTable:
    """A source giving a trace folder's tables, without reading its collectives in parts."""

    def __init__(self, run: kineto.KinetoRun) -> None:
        self.run = run
        self.path, self.info = run.path, run.info

    def table(self, name: str) -> pd.DataFrame:
        return self.run.table(name)


def _device_metrics(report: dict) -> dict:
    m = report["metrics"]
    return {k: m.get(k) for k in ("collective_matching", "clock_alignment", "arrivals", "collectives", "run")}


@pytest.fixture(scope="module")
def tp8_dp2(tmp_path_factory, repo_root) -> Path:
    folder = tmp_path_factory.mktemp("tp8_dp2")
    _trace_set(folder, FEW, repo_root)
    return folder


def _trace_set(folder: Path, ranks: int, root: Path) -> None:
    sys.path.insert(0, str(root / "benchmarks"))
    try:
        from scale_data import TraceSetSpec, write_trace_set
    finally:
        sys.path.remove(str(root / "benchmarks"))
    write_trace_set(folder, TraceSetSpec(ranks=ranks, mb_per_rank=MB_PER_RANK), workers=1)


def test_collective_parts_hold_whole_groups_and_every_row_once(tp8_dp2):
    run = load_trace_dir(tp8_dp2, workers=1)
    parts = run.collective_parts(max_rows=1)            # every group a part
    frames = [read() for read in parts.readers]
    whole = run.collectives
    groups = [set(zip(f["pg"].astype(str), f["pg_ranks"].astype(str))) for f in frames]
    assert len(frames) == 10 and sorted(len(g) for g in groups) == [1] * 10      # 8 dp + 2 tp groups, one a part
    assert sum(len(f) for f in frames) == len(whole) and parts.ranks == frozenset(range(FEW))
    key = whole["pg"].astype(str) + "|" + whole["pg_ranks"].astype(str)
    for frame, group in zip(frames, groups):
        (pg, pg_ranks), = group
        rows = whole[(key == f"{pg}|{pg_ranks}").to_numpy()].reset_index(drop=True)
        pd.testing.assert_frame_equal(frame.astype(str), rows.astype(str))    # same rows, order, values and seq
    assert max(len(f) for f in frames) < len(whole) / 3
    packed = run.collective_parts(max_rows=PART_ROWS)
    sizes = [len(read()) for read in packed.readers]
    assert sum(sizes) == len(whole) and len(sizes) < len(frames)
    assert max(sizes) <= max(PART_ROWS, max(len(f) for f in frames))


class Skewed:
    """A trace folder whose collectives' times are moved: rank r's clock runs r x CLOCK_STEP_NS ahead, every member
    but rank LATE starts each collective up to 400 us early (waiting for it), ends jitter by up to 2 us; with the
    collectives in parts of whole groups (``collective_parts``) or not (``parts=False``)."""

    CLOCK_STEP_NS, LATE = 1_000_003, 5

    def __init__(self, run: kineto.KinetoRun, *, parts: bool) -> None:
        self.run, self.path, self.info = run, run.path, run.info
        c = run.collectives.copy()
        rng = np.random.default_rng(7)
        rank = c["rank"].to_numpy(dtype="int64")
        early = np.where(rank == self.LATE, 0, rng.integers(0, 400_000, len(c)))
        for col, moved in (("start_ns", rank * self.CLOCK_STEP_NS - early),
                           ("end_ns", rank * self.CLOCK_STEP_NS + rng.integers(-2_000, 2_000, len(c)))):
            c[col] = c[col] + moved
        self.collectives = c
        if parts:
            self.collective_parts = self._parts

    def table(self, name: str) -> pd.DataFrame:
        return self.collectives if name == "collectives" else self.run.table(name)

    def _parts(self) -> kineto.CollectiveParts:
        key = self.collectives["pg"].astype(str) + "|" + self.collectives["pg_ranks"].astype(str)
        return kineto.CollectiveParts(
            readers=tuple((lambda k=k: self.collectives[(key == k).to_numpy()].reset_index(drop=True))
                          for k in sorted(key.unique())),
            ranks=frozenset(self.collectives["rank"].astype(int)))


def test_findings_and_device_clock_metrics_equal_the_whole_tables_when_read_in_parts(tp8_dp2):
    run = load_trace_dir(tp8_dp2, workers=1)
    parts, whole = RunAnalysis(Skewed(run, parts=True)), RunAnalysis(Skewed(run, parts=False))
    got, want = parts.report(), whole.report()
    assert got["findings"] == want["findings"]
    assert _device_metrics(got) == _device_metrics(want)
    offsets = parts.clock_offsets()
    expected = -offsets["rank"] * Skewed.CLOCK_STEP_NS
    assert (offsets["offset_ns"].astype("int64") - expected).abs().max() <= 2_000      # the moved clocks, found
    late = parts.arrival_summary().query("pg == 'tp' and rank == @Skewed.LATE")
    assert late["last_frac"].tolist() == [1.0] and late["median_lateness_us"].iloc[0] > 100
    pd.testing.assert_frame_equal(parts.collective_bandwidth(), whole.collective_bandwidth())
    pd.testing.assert_frame_equal(offsets, whole.clock_offsets())
    pd.testing.assert_frame_equal(parts.arrival_summary().astype({"pg": str, "pg_ranks": str}),
                                  whole.arrival_summary().astype({"pg": str, "pg_ranks": str}))
    assert parts.collective_matching() == whole.collective_matching()
    assert got["metrics"]["collective_matching"]["num_matched"] == whole.matched_collectives()["coll_id"].nunique() > 0


def test_report_of_a_trace_folder_is_the_same_whatever_the_part_size(tp8_dp2, monkeypatch):
    reports = []
    for part_rows in (1, PART_ROWS, 10**9):
        monkeypatch.setattr(kineto, "COLLECTIVE_PART_ROWS", part_rows)
        reports.append(RunAnalysis(load_trace_dir(tp8_dp2, workers=1)).report())
    assert reports[0] == reports[1] == reports[2]
    assert reports[0] == RunAnalysis(WholeTable(load_trace_dir(tp8_dp2, workers=1))).report()


@pytest.mark.parametrize("folder", ["dlrm_8rank_v100", "nccl_metadata_1rank_a100", "gloo_cpu_1rank"])
def test_shared_traces_report_equal_the_whole_tables_when_read_in_parts(folder):
    run = load_trace_dir(TRACES / folder, workers=1)
    assert RunAnalysis(run).report() == RunAnalysis(WholeTable(run)).report()


_HELD = """
import json, sys, tracemalloc
from dtprobe.analysis.facade import RunAnalysis
from dtprobe.store import kineto

if __name__ == "__main__":
    kineto.COLLECTIVE_PART_ROWS = int(sys.argv[2])
    run = kineto.load_trace_dir(sys.argv[1], workers=1)
    RunAnalysis(kineto.load_trace_dir(sys.argv[3], workers=1)).report()     # imports and caches before measuring
    read, parts = [], run.collective_parts()
    object.__setattr__(run, "collective_parts", lambda: kineto.CollectiveParts(    # counts the rows of each read
        readers=tuple((lambda r=r: read.append(len(f := r())) or f) for r in parts.readers), ranks=parts.ranks))
    analysis = RunAnalysis(run)
    tracemalloc.start()
    analysis.clock_offsets(); analysis.arrival_summary(); analysis.collective_bandwidth(); analysis.arrival_clock()
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    whole = run.collectives
    print(json.dumps({"peak": peak, "largest_part": max(read), "reads": len(read), "parts": len(parts.readers),
                      "largest_group": int(whole.groupby(["pg", "pg_ranks"], observed=True).size().max()),
                      "table_bytes": int(whole.memory_usage(deep=True).sum()), "rows": len(whole),
                      "matched": int(analysis.arrival_summary()["num_collectives"].sum())}))
"""


def _held(folder: Path, tmp_path: Path, env: dict[str, str]) -> dict:
    script = tmp_path / "held.py"      # a file, not -c: the forkserver pool re-imports the main module
    script.write_text(_HELD)
    proc = subprocess.run([sys.executable, str(script), str(folder), str(PART_ROWS),
                           str(TRACES / "dlrm_8rank_v100")], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_cross_rank_analyses_hold_one_group_at_a_time_whatever_the_number_of_rank_files(tp8_dp2, tmp_path,
                                                                                          repo_root, child_env):
    _trace_set(tmp_path / "many", MANY, repo_root)
    env = child_env()
    few, many = _held(tp8_dp2, tmp_path, env), _held(tmp_path / "many", tmp_path, env)
    assert many["rows"] > 3.5 * few["rows"] and many["matched"] == many["rows"] and few["matched"] == few["rows"]
    # a part holds at most PART_ROWS rows, or one group's (a tensor-parallel group, about as many rows at both sizes)
    assert max(few["largest_group"], many["largest_group"]) < PART_ROWS < many["rows"] / 10, (few, many)
    assert few["largest_part"] <= PART_ROWS and many["largest_part"] <= PART_ROWS, (few, many)
    # 8 tp + 8 dp groups, a part each; three passes, the part a pass ends with kept for the next, and the second pass
    # reads only the parts where placed ranks share collectives (every tp group, rank 0's dp group)
    assert many["parts"] == 16 and many["reads"] == 16 + 8 + 15, many
    growth = (many["peak"] - few["peak"]) / (many["table_bytes"] - few["table_bytes"])
    assert growth <= HELD_GROWTH_BOUND, (few, many, growth)
