"""Temporal breakdown, comm/comp overlap and kernel-type split: equal to HTA 0.5.0, every ProfilerStep analysed."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from dtprobe.analysis import RunAnalysis
from dtprobe.analysis.kernel_breakdown import kernel_type_breakdown, top_kernels
from dtprobe.analysis.overlap import comm_comp_overlap
from dtprobe.analysis.temporal import temporal_breakdown
from dtprobe.analysis.trace_metrics import analyze_traces
from dtprobe.intervals import merge_intervals
from dtprobe.store.errors import TraceError
from dtprobe.store.kineto import load_trace_dir
from dtprobe.store.kineto_window import kernels_in_steps

TRACES = Path(__file__).parent / "data" / "traces"
POINTS = 0.1   # tolerance in percentage points
pytestmark = pytest.mark.filterwarnings("ignore::Warning:hta.*")   # HTA 0.5.0's pandas deprecations


def _hta(trace_dir: Path, *, include_last: bool = True):
    logging.disable(logging.WARNING)
    try:
        from hta.trace_analysis import TraceAnalysis
        return TraceAnalysis(trace_dir=str(trace_dir), include_last_profiler_step=include_last)
    finally:
        logging.disable(logging.NOTSET)


def _ours(trace_dir: Path):
    run = load_trace_dir(trace_dir)
    kernels = kernels_in_steps(run.kernels, run.steps)
    return run, kernels


@pytest.fixture(scope="module")
def dlrm():
    path = TRACES / "dlrm_8rank_v100"
    return _ours(path), _hta(path)


def test_dlrm_temporal_breakdown_equals_hta_per_rank(dlrm):
    (_, kernels), hta = dlrm
    ours = temporal_breakdown(kernels).set_index("rank")
    ref = hta.get_temporal_breakdown(visualize=False).set_index("rank")
    assert list(ours.index) == list(range(8)) == sorted(ref.index)
    for col, ref_col in [("idle_frac", "idle_time_pctg"), ("compute_frac", "compute_time_pctg"),
                         ("non_compute_frac", "non_compute_time_pctg")]:
        diff = (ours[col] * 100 - ref[ref_col]).abs()
        assert diff.max() <= POINTS, (col, diff.to_dict())
    assert (ours["kernel_time_us"] == ref["kernel_time(us)"]).all()
    # the shared README's reference values (HTA 0.5.0 defaults), rank 0 and rank 7
    assert ours.loc[0, "kernel_time_us"] == 13009 and round(ours.loc[0, "idle_frac"] * 100, 2) == 49.34
    assert round(ours.loc[7, "compute_frac"] * 100, 2) == 9.66
    assert np.allclose(ours[["idle_frac", "compute_frac", "non_compute_frac"]].sum(axis=1), 1.0)


def test_dlrm_comm_comp_overlap_equals_hta_per_rank(dlrm):
    (_, kernels), hta = dlrm
    ours = comm_comp_overlap(kernels).set_index("rank")
    ref = hta.get_comm_comp_overlap(visualize=False).set_index("rank")
    diff = (ours["overlap_frac"] * 100 - ref["comp_comm_overlap_pctg"]).abs()
    assert diff.max() <= POINTS, diff.to_dict()
    assert round(ours.loc[7, "overlap_frac"] * 100, 2) == 9.51
    assert (ours["exposed_comm_us"] == ours["comm_us"] - ours["overlap_us"]).all()


def test_dlrm_kernel_type_split_equals_hta(dlrm):
    (_, kernels), hta = dlrm
    ours = kernel_type_breakdown(kernels).set_index("kernel_type")
    ref = hta.get_gpu_kernel_breakdown(visualize=False)[0].set_index("kernel_type")
    assert set(ours.index) == set(ref.index)
    assert (ours["sum_us"] == ref.loc[ours.index, "sum"]).all()
    diff = (ours["frac"] * 100 - ref.loc[ours.index, "percentage"]).abs()
    assert diff.max() <= POINTS, diff.to_dict()
    assert ours["frac"].sum() == pytest.approx(1.0)


@pytest.mark.parametrize("folder", ["nccl_metadata_1rank_a100", "amd_mi250_1rank"])
def test_multi_step_traces_equal_hta_with_last_step_included(folder):
    run, kernels = _ours(TRACES / folder)
    hta = _hta(TRACES / folder, include_last=True)
    ours = temporal_breakdown(kernels).set_index("rank")
    ref = hta.get_temporal_breakdown(visualize=False).set_index("rank")
    assert (ours["kernel_time_us"] == ref["kernel_time(us)"]).all()
    assert (ours["idle_frac"] * 100 - ref["idle_time_pctg"]).abs().max() <= POINTS
    assert (ours["compute_frac"] * 100 - ref["compute_time_pctg"]).abs().max() <= POINTS
    ours_types = kernel_type_breakdown(kernels).set_index("kernel_type")["sum_us"].sort_index()
    ref_types = hta.get_gpu_kernel_breakdown(visualize=False)[0].set_index("kernel_type")["sum"].sort_index()
    assert ours_types.to_dict() == ref_types.to_dict()


def test_nccl_trace_names_all_three_steps_and_breaks_each_down():
    metrics = analyze_traces(load_trace_dir(TRACES / "nccl_metadata_1rank_a100"))
    assert metrics.steps_analyzed == (4, 5, 6)     # HTA by default analyses 4 and 5 only
    assert list(metrics.temporal_by_step["step"]) == [4, 5, 6]
    assert list(metrics.overlap_by_step["step"]) == [4, 5, 6]
    out = metrics.to_dict()
    assert out["steps_analyzed"] == [4, 5, 6]
    assert set(out["temporal_breakdown"][0]) == {"rank", "idle_frac", "compute_frac", "non_compute_frac",
                                                 "kernel_time_us"}
    assert set(out["comm_comp_overlap"][0]) == {"rank", "overlap_frac"}


# ---- a hand-made 2-step trace: known answers, and HTA's dropped last step (its issue #76) ----

def _two_step_trace(path: Path) -> Path:
    """Step 1 [0, 1000): gemm 100-300, AllReduce 250-550. Step 2 [1000, 2000): gemm 1100-1200, AllGather 1300-1500."""
    events = [
        {"ph": "X", "cat": "user_annotation", "name": "ProfilerStep#1", "pid": 1, "tid": 1, "ts": 0, "dur": 1000},
        {"ph": "X", "cat": "user_annotation", "name": "ProfilerStep#2", "pid": 1, "tid": 1, "ts": 1000,
         "dur": 1000},
    ]
    kernels = [(10, 100, 200, "gemm_kernel"), (500, 250, 300, "ncclDevKernel_AllReduce_Sum_f32_RING_LL(x)"),
               (1010, 1100, 100, "gemm_kernel"), (1500, 1300, 200, "ncclKernel_AllGather_RING_LL_Sum_int8_t(x)")]
    for corr, (launch, start, dur, name) in enumerate(kernels, 1):
        events.append({"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "pid": 1, "tid": 1,
                       "ts": launch, "dur": 5, "args": {"correlation": corr}})
        events.append({"ph": "X", "cat": "kernel", "name": name, "pid": 0, "tid": 7, "ts": start, "dur": dur,
                       "args": {"stream": 7, "correlation": corr, "device": 0}})
        events.append({"ph": "f", "id": corr, "pid": 0, "tid": 7, "ts": start, "cat": "ac2g", "name": "ac2g"})
    doc = {"schemaVersion": 1, "distributedInfo": {"backend": "nccl", "rank": 0, "world_size": 1},
           "deviceProperties": [], "traceEvents": events}
    path.mkdir()
    # HTA finds the rank with the regex '"rank":\s+(\d+)': keep json.dumps' default spacing
    (path / "rank0.pt.trace.json").write_text(json.dumps(doc, indent=1))
    return path


def test_two_step_trace_analyses_both_steps_with_known_values(tmp_path):
    metrics = analyze_traces(load_trace_dir(_two_step_trace(tmp_path / "t")))
    assert metrics.steps_analyzed == (1, 2)
    whole = metrics.temporal.iloc[0]
    assert whole["kernel_time_us"] == 1400 and whole["idle_us"] == 650 and whole["compute_us"] == 300
    assert whole["non_compute_us"] == 450
    by_step = metrics.temporal_by_step.set_index("step")
    assert by_step.loc[1, "kernel_time_us"] == 450 and by_step.loc[1, "idle_us"] == 0
    assert by_step.loc[2, "kernel_time_us"] == 400 and by_step.loc[2, "idle_us"] == 100
    assert metrics.overlap.iloc[0]["overlap_frac"] == pytest.approx(50 / 500)
    assert metrics.overlap_by_step.set_index("step").loc[2, "overlap_frac"] == 0.0


def test_two_step_trace_equals_hta_with_last_step_and_differs_from_its_default(tmp_path):
    path = _two_step_trace(tmp_path / "t")
    ours = analyze_traces(load_trace_dir(path)).temporal.iloc[0]
    with_last = _hta(path, include_last=True).get_temporal_breakdown(visualize=False).iloc[0]
    default = _hta(path, include_last=False).get_temporal_breakdown(visualize=False).iloc[0]
    assert ours["kernel_time_us"] == with_last["kernel_time(us)"] == 1400
    assert abs(ours["idle_frac"] * 100 - with_last["idle_time_pctg"]) <= POINTS
    assert default["kernel_time(us)"] == 450     # HTA's default silently dropped step 2


# ---- units on tiny tables ----

def _kernels(rows):
    return pd.DataFrame(rows, columns=["rank", "kind", "start_ns", "dur_ns", "step", "name"])


def test_temporal_rounds_start_up_and_end_down_to_microseconds():
    k = _kernels([(0, "compute", 1_500, 2_000, 1, "a"), (0, "comm", 10_000, 1_000, 1, "b")])
    row = temporal_breakdown(k).iloc[0]
    # [1.5, 3.5) us -> [2, 3); [10, 11) us stays
    assert row["kernel_time_us"] == 9 and row["compute_us"] == 1 and row["idle_us"] == 7
    assert row["non_compute_us"] == 1


def test_overlap_is_nan_without_communication_and_breakdown_labels_combinations():
    k = _kernels([(0, "compute", 0, 10_000, 1, "a"), (0, "memory", 5_000, 10_000, 1, "Memcpy HtoD"),
                  (1, "comm", 0, 4_000, 1, "nccl"), (1, "compute", 2_000, 4_000, 1, "a")])
    ov = comm_comp_overlap(k).set_index("rank")
    assert np.isnan(ov.loc[0, "overlap_frac"]) and ov.loc[1, "overlap_frac"] == 0.5
    types = kernel_type_breakdown(k).set_index("kernel_type")["sum_us"].to_dict()
    assert types == {"COMPUTATION": 5 + 2, "COMPUTATION overlapping MEMORY": 5, "MEMORY": 5,
                     "COMMUNICATION": 2, "COMPUTATION overlapping COMMUNICATION": 2}


def test_merge_intervals_joins_touching_and_nested():
    s, e = merge_intervals(np.array([5, 0, 2, 10]), np.array([7, 2, 4, 12]))
    assert s.tolist() == [0, 5, 10] and e.tolist() == [4, 7, 12]


def test_top_kernels_groups_the_tail_as_others():
    rows = [(0, "compute", i * 100_000, (20 - i) * 1_000, 1, f"k{i}") for i in range(15)]
    top = top_kernels(_kernels(rows), num_kernels=10)
    assert "others" in set(top["name"]) and len(top) <= 11
    assert top["sum_us"].sum() == sum(20 - i for i in range(15))


def test_analyses_name_missing_columns():
    with pytest.raises(TraceError, match=r"table 'kernels' lacks the columns \['dur_ns'\]"):
        temporal_breakdown(pd.DataFrame({"rank": [0], "kind": ["compute"], "start_ns": [0]}))


def test_kernels_in_steps_keeps_launches_up_to_the_last_step_end_and_ranks_without_steps():
    k = pd.DataFrame({"rank": [0, 0, 0, 1], "kind": ["compute"] * 4, "start_ns": [0, 0, 0, 0],
                      "dur_ns": [1000] * 4, "launch_ns": pd.array([500_000, 2_000_000, None, 9_000_000],
                                                                  dtype="Int64")})
    steps = pd.DataFrame({"rank": [0, 0], "step": [1, 2], "start_ns": [0, 1_000_000],
                          "end_ns": [1_000_000, 2_000_000]})
    kept = kernels_in_steps(k, steps)
    # rank 0: launched at 0.5 ms and exactly at the last step's end kept; unknown launch dropped; rank 1 kept
    assert kept["launch_ns"].tolist() == [500_000, 2_000_000, 9_000_000]
    assert kernels_in_steps(k, steps[steps["step"] == 1]).equals(k)   # one step: everything kept (as HTA)


def test_trace_folder_kernels_table_holds_the_profiled_steps_events_the_facade_reads(tmp_path):
    path = _two_step_trace(tmp_path / "t")
    trace = path / "rank0.pt.trace.json"
    doc = json.loads(trace.read_text())
    doc["traceEvents"] += [   # launched after the last step's end: the next window's warm-up, not analysed
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "pid": 1, "tid": 1, "ts": 2500, "dur": 5,
         "args": {"correlation": 9}},
        {"ph": "X", "cat": "kernel", "name": "gemm_kernel", "pid": 0, "tid": 7, "ts": 2600, "dur": 100,
         "args": {"stream": 7, "correlation": 9, "device": 0}}]
    trace.write_text(json.dumps(doc, indent=1))
    run = load_trace_dir(path)
    assert len(run.kernels) == 5 and len(run.table("kernels")) == 4
    assert run.table("kernels").equals(kernels_in_steps(run.kernels, run.steps))
    ours = RunAnalysis(run).temporal_breakdown()
    assert ours.equals(analyze_traces(run).temporal) and ours.iloc[0]["kernel_time_us"] == 1400
