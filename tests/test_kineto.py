"""Kineto ingest (dtprobe.store.kineto): metadata, kernels, steps, collectives, and errors that name the file."""

from __future__ import annotations

import gzip
import json
import shutil
from pathlib import Path

import pytest

from dtprobe.analysis.trace_metrics import analyze_traces
from dtprobe.store.errors import TraceError
from dtprobe.store.kineto import is_trace_dir, load_trace_dir
from dtprobe.store.kineto_collectives import normalize_op
from dtprobe.store.kineto_events import kernel_kind
from dtprobe.store.schema import SCHEMAS

TRACES = Path(__file__).parent / "data" / "traces"
DLRM = TRACES / "dlrm_8rank_v100"
NCCL = TRACES / "nccl_metadata_1rank_a100"
GLOO = TRACES / "gloo_cpu_1rank"
AMD = TRACES / "amd_mi250_1rank"
MALFORMED = TRACES / "malformed"


def test_dlrm_loads_eight_ranks_with_metadata_kernels_and_step():
    run = load_trace_dir(DLRM, workers=2)
    assert sorted(run.ranks) == list(range(8))
    meta = run.ranks[3]
    assert meta.world_size == 8 and meta.backend == "nccl" and meta.rank_source == "distributedInfo.rank"
    assert "worker3_step_12" in meta.path
    assert len(meta.device_properties) == 8 and meta.device_properties[0]["name"] == "Tesla V100-SXM2-32GB"
    assert run.steps_found == [10]
    # 245 kernels + 16 memcpy on rank 0 (args.stream present), every kind known
    assert (run.kernels["rank"] == 0).sum() == 261
    assert set(run.kernels["kind"].unique()) == {"compute", "comm", "memory"}
    assert list(run.kernels.columns) == list(SCHEMAS["kernels"])
    # ts are epoch microseconds in this (pre-baseTimeNanoseconds) trace: 2023-09-07 23:10:01 UTC
    assert 1694128201_000_000_000 < run.kernels["start_ns"].min() < run.kernels["start_ns"].max() < 1694128202e9


def test_tables_have_every_schema_column_in_nullable_dtypes():
    run = load_trace_dir(NCCL)
    for name in ("kernels", "collectives", "steps"):
        assert list(run.table(name).columns) == list(SCHEMAS[name])
    assert str(run.kernels["launch_ns"].dtype) == "Int64"
    assert run.table("devices").empty and list(run.table("devices").columns) == list(SCHEMAS["devices"])


def test_nccl_metadata_trace_yields_collectives_with_bytes_group_and_device_timing():
    run = load_trace_dir(NCCL)
    coll = run.collectives
    assert coll["op"].value_counts().to_dict() == {"allreduce": 15, "broadcast": 6}
    assert set(coll["pg"]) == {"world"} and set(coll["pg_ranks"]) == {"0,1"} and set(coll["pg_size"]) == {2}
    assert list(coll["seq"]) == list(range(1, 22))
    # first allreduce: In msg nelems 2049000 x Float (4 bytes)
    first_ar = coll[coll["op"] == "allreduce"].iloc[0]
    assert first_ar["num_bytes"] == 2049000 * 4 and first_ar["dtype"] == "Float"
    assert (coll["timing"] == "cuda_event").all()
    assert (coll["start_ns"] >= coll["enqueue_ns"]).all() and (coll["end_ns"] > coll["start_ns"]).all()
    assert set(coll["step"]) <= {4, 5, 6}
    assert run.steps_found == [4, 5, 6]


def test_dlrm_old_style_nccl_collectives_are_identified_from_annotations():
    coll = load_trace_dir(DLRM).collectives
    # per rank: 5 SendRecv kernels under nccl:all_to_all, 3 AllReduce kernels
    assert coll["op"].value_counts().to_dict() == {"alltoall": 40, "allreduce": 24}
    first = coll[(coll["rank"] == 0) & (coll["op"] == "alltoall")].iloc[0]
    assert first["num_bytes"] == 6144 * 4 and first["dtype"] == "float"


def test_gloo_cpu_trace_yields_host_timed_collectives_of_rank_34():
    run = load_trace_dir(GLOO)
    assert list(run.ranks) == [34] and run.ranks[34].world_size == 300 and run.ranks[34].backend == "gloo"
    assert run.kernels.empty
    coll = run.collectives
    assert len(coll) == 10 and set(coll["op"]) == {"allreduce"} and set(coll["rank"]) == {34}
    assert set(coll["num_bytes"]) == {321271 * 4, 2082411 * 4}
    assert (coll["timing"] == "host").all() and coll["start_ns"].isna().all()
    assert (coll["end_ns"] > coll["enqueue_ns"]).all()
    metrics = analyze_traces(run)   # analysed on its collectives, not rejected
    assert not metrics.has_gpu_kernels and metrics.num_collectives == 10 and metrics.temporal.empty


def test_rocm_trace_yields_hip_kernels_and_memcpy():
    run = load_trace_dir(AMD)
    assert list(run.ranks) == [0] and run.ranks[0].rank_source == "single-process"
    assert run.kernels["kind"].value_counts().to_dict() == {"compute": 14, "memory": 2}
    assert run.kernels["name"].str.startswith("Cijk_").sum() == 2   # hipBLASLt GEMMs
    assert run.ranks[0].device_properties[0]["name"] == "AMD Radeon Graphics"
    # runtime calls carry stream "0x0", which int() rejects: they stay CPU events as in HTA
    assert not run.kernels["name"].str.startswith("hip").any()
    assert analyze_traces(run).has_gpu_kernels


@pytest.mark.parametrize("name,kind", [
    ("ncclKernel_AllReduce_RING_LL_Sum_float(ncclDevComm*, unsigned long, ncclWork*)", "comm"),
    ("ncclDevKernel_AllGather_RING_LL(ncclDevComm*, unsigned long, ncclWork*)", "comm"),
    ("ncclDevKernel_Generic_4(ncclDevKernelArgsStorage<4096ul>)", "comm"),
    ("Memcpy HtoD (Pageable -> Device)", "memory"),
    ("Memset (Device)", "memory"),
    ("Stream Sync", "other"),
    ("void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float> >", "compute"),
    ("Cijk_Alik_Bljk_SB_Bias_AS_SAV", "compute"),
])
def test_kernel_kind_follows_hta_name_rules(name, kind):
    assert kernel_kind(name) == kind


@pytest.mark.parametrize("raw,op", [
    ("allreduce", "allreduce"), ("allreduce_coalesced", "allreduce"), ("nccl:all_reduce", "allreduce"),
    ("gloo:all_gather", "allgather"), ("_allgather_base", "allgather"),
    ("all_gather_into_tensor_coalesced", "allgather"), ("_reduce_scatter_base", "reduce_scatter"),
    ("reduce_scatter_tensor_coalesced", "reduce_scatter"), ("nccl:all_to_all", "alltoall"),
    ("alltoall_base", "alltoall"), ("c10d::broadcast_", "broadcast"), ("barrier", "barrier"),
    ("reduce", "reduce"), ("send", "send"), ("recv_any_source", "recv"), ("SendRecv", None), ("wait", None),
])
def test_normalize_op_maps_to_store_vocabulary(raw, op):
    assert normalize_op(raw) == op


def test_is_trace_dir_tells_trace_folders_from_runs(tmp_path):
    assert is_trace_dir(DLRM) and is_trace_dir(next(DLRM.iterdir()))
    (tmp_path / "run.json").write_text("{}")
    (tmp_path / "x.json").write_text("{}")
    assert not is_trace_dir(tmp_path)
    assert not is_trace_dir(tmp_path / "missing")


# ---- errors: each names the file, what is wrong and the fix; never a silent rank 0 ----

def _analyze(path: Path):
    return analyze_traces(load_trace_dir(path))


@pytest.mark.parametrize("name,message", [
    ("rank_not_found.json.gz", r"distributedInfo has no 'rank'.*add \"rank\": N"),
    ("distributed_info_not_found.json.gz", r"no distributedInfo.*no GPU events"),
    ("rank_non_gpu.json.gz", r"no GPU events .*no collectives"),
])
def test_each_malformed_trace_raises_trace_error_naming_the_file(name, message):
    with pytest.raises(TraceError, match=message) as info:
        _analyze(MALFORMED / name)
    assert name in str(info.value)


def test_malformed_folder_raises_naming_a_file():
    with pytest.raises(TraceError, match=r"malformed/\w+\.json\.gz"):
        _analyze(MALFORMED)


def test_file_without_distributed_info_among_several_is_rejected(tmp_path):
    shutil.copy(DLRM / "worker0_step_12.1694128201545.pt.trace.json.gz", tmp_path)
    shutil.copy(MALFORMED / "distributed_info_not_found.json.gz", tmp_path)
    with pytest.raises(TraceError, match=r"distributed_info_not_found\.json\.gz: the trace has no 'distributedInfo'"):
        load_trace_dir(tmp_path)


def test_duplicate_rank_names_both_files(tmp_path):
    src = DLRM / "worker2_step_12.1694128201554.pt.trace.json.gz"
    shutil.copy(src, tmp_path / "a.pt.trace.json.gz")
    shutil.copy(src, tmp_path / "b.pt.trace.json.gz")
    with pytest.raises(TraceError, match=r"rank 2 appears in two files: .*a\.pt\.trace\.json\.gz and .*b\.pt"):
        load_trace_dir(tmp_path)


def test_rank_without_gpu_events_next_to_gpu_ranks_is_named(tmp_path):
    for f in DLRM.iterdir():
        if not f.name.startswith("worker0"):
            shutil.copy(f, tmp_path)
    shutil.copy(MALFORMED / "rank_non_gpu.json.gz", tmp_path)   # rank 0, CPU events only
    with pytest.raises(TraceError, match=r"no GPU events .*rank_non_gpu\.json\.gz.*ranks \[1, 2"):
        _analyze(tmp_path)


def test_truncated_json_names_the_file(tmp_path):
    text = gzip.decompress((NCCL / "nccl_data.json.gz").read_bytes())
    bad = tmp_path / "rank0.pt.trace.json"
    bad.write_bytes(text[: len(text) // 2])
    with pytest.raises(TraceError, match=r"rank0\.pt\.trace\.json: invalid JSON.*truncated"):
        load_trace_dir(tmp_path)


def test_corrupt_gzip_names_the_file(tmp_path):
    data = (NCCL / "nccl_data.json.gz").read_bytes()
    bad = tmp_path / "rank0.pt.trace.json.gz"
    bad.write_bytes(data[: len(data) // 3])
    with pytest.raises(TraceError, match=r"rank0\.pt\.trace\.json\.gz: corrupt or truncated gzip"):
        load_trace_dir(tmp_path)
    bad.write_bytes(b"not gzip at all")
    with pytest.raises(TraceError, match=r"rank0\.pt\.trace\.json\.gz: corrupt or truncated gzip"):
        load_trace_dir(tmp_path)


@pytest.mark.parametrize("content,message", [
    ("[1, 2, 3]", "not a Kineto trace"),
    ('{"schemaVersion": 1}', "no 'traceEvents' list"),
    ('{"traceEvents": [1]}', "not a Kineto trace"),
])
def test_non_kineto_json_names_the_file(tmp_path, content, message):
    (tmp_path / "odd.json").write_text(content)
    with pytest.raises(TraceError, match=rf"odd\.json: {message}"):
        load_trace_dir(tmp_path)


def test_non_numeric_timestamp_names_the_file(tmp_path):
    doc = {"distributedInfo": {"rank": 0}, "traceEvents": [
        {"ph": "X", "cat": "kernel", "name": "k", "ts": "soon", "dur": 3, "args": {"stream": 7}}]}
    (tmp_path / "r0.json").write_text(json.dumps(doc))
    with pytest.raises(TraceError, match=r"r0\.json: non-numeric timestamp or duration 'soon'"):
        load_trace_dir(tmp_path)


def test_empty_folder_and_missing_path_raise(tmp_path):
    with pytest.raises(TraceError, match="no trace files"):
        load_trace_dir(tmp_path)
    with pytest.raises(TraceError, match="no such file or folder"):
        load_trace_dir(tmp_path / "nope")


def test_compact_json_with_rank_is_read_by_dtprobe(tmp_path):
    # HTA's regex needs '"rank": N' with a space; dtprobe reads distributedInfo, so compact files work
    doc = json.loads(gzip.decompress((DLRM / "worker5_step_12.1694128201549.pt.trace.json.gz").read_bytes()))
    (tmp_path / "w5.json").write_text(json.dumps(doc, separators=(",", ":")))
    assert list(load_trace_dir(tmp_path).ranks) == [5]
