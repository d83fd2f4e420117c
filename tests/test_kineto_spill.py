"""Loading a Kineto trace folder holds one rank's reduced tables at a time (``kineto_spill``): what the loading
process holds does not grow with the number of rank files, and the spilled tables leave with the run."""

from __future__ import annotations

import gc
import json
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

from dtprobe.store.kineto import load_trace_dir

MB_PER_RANK = 2
FEW, MANY = 8, 32
FLAT_TOLERANCE = 1.25
"""Peak of loading MANY files / peak of loading FEW (``benchmarks/scale.py``'s tolerance for "flat")."""
HELD_PER_RANK_BOUND = 0.1
"""Traced memory added per extra rank file / one rank's reduced GPU-event columns: holding every rank's columns
until the end (the loading before the spill) measures 1.0 and more."""
NCCL_TRACE = Path(__file__).resolve().parent / "data" / "traces" / "nccl_metadata_1rank_a100"

_LOAD = """
import json, sys, tracemalloc
import pyarrow as pa
from dtprobe.store.kineto import find_trace_files, load_trace_dir
from dtprobe.store.kineto_reduce import reduce_trace_file

if __name__ == "__main__":
    files = find_trace_files(sys.argv[1])
    one = reduce_trace_file(str(files[0]))          # also loads every lazily imported library before measuring
    one_rank_bytes = sum(a.nbytes for a in one.kernels.values())
    del one
    tracemalloc.start()
    run = load_trace_dir(sys.argv[1], workers=1)
    current, peak = tracemalloc.get_traced_memory()
    print(json.dumps({"peak": peak, "held": current, "arrow_held": pa.total_allocated_bytes(),
                      "one_rank_bytes": one_rank_bytes, "ranks": sorted(run.ranks),
                      "num_kernels": len(run.kernels)}))
"""


def _trace_set(folder: Path, ranks: int, root: Path, env: dict[str, str]) -> None:
    proc = subprocess.run([sys.executable, str(root / "benchmarks" / "scale_data.py"), "traces", str(folder),
                           "--ranks", str(ranks), "--mb-per-rank", str(MB_PER_RANK)],
                          env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def _load(folder: Path, tmp_path: Path, env: dict[str, str]) -> dict:
    script = tmp_path / "load.py"
    script.write_text(_LOAD)
    proc = subprocess.run([sys.executable, str(script), str(folder)], env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_load_trace_dir_peak_does_not_grow_when_the_folder_has_four_times_the_rank_files(tmp_path, repo_root,
                                                                                         child_env):
    env = child_env()
    _trace_set(tmp_path / "few", FEW, repo_root, env)
    _trace_set(tmp_path / "many", MANY, repo_root, env)
    few, many = _load(tmp_path / "few", tmp_path, env), _load(tmp_path / "many", tmp_path, env)
    assert few["ranks"] == list(range(FEW)) and many["ranks"] == list(range(MANY))
    assert many["num_kernels"] > 3 * few["num_kernels"] > 0       # the tables are built, from every rank
    assert many["peak"] <= FLAT_TOLERANCE * few["peak"], (few, many)
    added_per_rank = (many["held"] - few["held"]) / (MANY - FEW)
    assert added_per_rank <= HELD_PER_RANK_BOUND * many["one_rank_bytes"], (few, many)
    assert many["arrow_held"] <= few["arrow_held"] + 1_000_000, (few, many)   # no rank's collectives kept


def test_spilled_tables_are_removed_when_the_run_is_dropped():
    run = load_trace_dir(NCCL_TRACE, workers=1)
    folder = run.spill.folder
    assert sorted(p.suffix for p in folder.iterdir()) == [".arrow", ".arrow"]
    assert len(run.collectives) > 0 and len(run.kernels) > 0
    del run
    gc.collect()
    assert not folder.exists()


@pytest.mark.parametrize("damage", ["duplicate_rank", "truncated_file"])
def test_spilled_tables_are_removed_when_loading_fails(tmp_path, monkeypatch, damage):
    import gzip
    import tempfile

    from dtprobe.store.errors import TraceError

    text = gzip.decompress(next(NCCL_TRACE.iterdir()).read_bytes())
    (tmp_path / "a.pt.trace.json").write_bytes(text)
    (tmp_path / "b.pt.trace.json").write_bytes(text if damage == "duplicate_rank" else text[:len(text) // 2])
    spill_root = tmp_path / "spill"
    spill_root.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(spill_root))
    expected = "rank 0 appears in two files" if damage == "duplicate_rank" else "b.pt.trace.json: invalid JSON"
    with pytest.raises(TraceError, match=expected):
        load_trace_dir(tmp_path, workers=1)
    assert list(spill_root.iterdir()) == []


def test_worker_side_modules_import_neither_pandas_pyarrow_nor_the_analysis(run_python):
    """Each reducing worker (and the forkserver that forks them) holds only what reducing one file needs: pandas
    and pyarrow would add tens of MB to every one of those processes."""
    proc = run_python("import sys, dtprobe.store.kineto_reduce\n"
                      "print(sorted(m for m in sys.modules if m.split('.')[0] in ('pandas', 'pyarrow') "
                      "or m.startswith('dtprobe.analysis')))")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"


def _rank_trace(folder: Path, rank: int, *, late: list[int]) -> None:
    """Two ProfilerSteps [0, 1000) and [1000, 2000); a kernel launched at each time of ``late`` (after the last
    step: left out of the analysed kernels), between kernels launched inside the steps."""
    events = [{"ph": "X", "cat": "user_annotation", "name": f"ProfilerStep#{s}", "pid": 1, "tid": 1,
               "ts": 1000 * (s - 1), "dur": 1000} for s in (1, 2)]
    launches = sorted([100, 900, 1100 + rank] + late)
    for corr, launch in enumerate(launches, 1):
        name = "ncclDevKernel_AllReduce_Sum_f32_RING_LL(x)" if corr % 2 else f"gemm_kernel_{rank}"
        events.append({"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "pid": 1, "tid": 1,
                       "ts": launch, "dur": 5, "args": {"correlation": corr}})
        events.append({"ph": "X", "cat": "kernel", "name": name, "pid": 0, "tid": 7, "ts": launch + 20, "dur": 50,
                       "args": {"stream": 7, "correlation": corr, "device": 0}})
    doc = {"schemaVersion": 1, "distributedInfo": {"backend": "nccl", "rank": rank, "world_size": 3},
           "deviceProperties": [], "traceEvents": events}
    (folder / f"rank{rank}.pt.trace.json").write_text(json.dumps(doc, indent=1))


def test_analysed_kernels_built_rank_by_rank_equal_the_window_filter_of_every_event_when_ranks_drop_some(
        tmp_path):
    from dtprobe.store.kineto_window import kernels_in_steps

    for rank, late in ((0, [2500, 3000]), (1, []), (2, [2100])):
        _rank_trace(tmp_path, rank, late=late)
    run = load_trace_dir(tmp_path, workers=1)
    every = run.kernels
    assert len(every) == 3 * 3 + 3 and every["rank"].tolist() == [0] * 5 + [1] * 3 + [2] * 4
    expected = kernels_in_steps(every, run.steps).reset_index(drop=True)
    analysed = run.table("kernels")
    assert len(analysed) == 9 and analysed["launch_ns"].max() < 2_000_000       # the late launches are left out
    pd.testing.assert_frame_equal(analysed, expected)
    assert analysed["name"].cat.categories.tolist() == every["name"].cat.categories.tolist()
