"""Kineto trace folders larger than memory: each rank's file streamed and reduced on its own (equal to decoding it
whole), reduced in a local process pool or on a Dask cluster with the same findings, errors that name the file in
every mode, and peak memory that follows the largest file, not the number of ranks."""

from __future__ import annotations

import gzip
import json
import selectors
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest

from dtprobe.cli import main
from dtprobe.store import kineto_pool
from dtprobe.store.errors import ConfigError, TraceError
from dtprobe.store.kineto import load_trace_dir
from dtprobe.store.kineto_events import parse_trace_file
from dtprobe.store.kineto_reduce import reduce_trace_file

TRACES = Path(__file__).parent / "data" / "traces"
DLRM = TRACES / "dlrm_8rank_v100"
NCCL = TRACES / "nccl_metadata_1rank_a100"
RANK_FILES = [*sorted(DLRM.iterdir()), NCCL / "nccl_data.json.gz", *sorted((TRACES / "gloo_cpu_1rank").iterdir()),
              *sorted((TRACES / "amd_mi250_1rank").iterdir())]
WHOLE = 1 << 26
"""A chunk larger than any test file (64 MiB): the whole file decoded at once."""


def _same_tables(a, b) -> None:
    assert a.meta == b.meta and a.names == b.names and a.name_kinds == b.name_kinds and a.steps == b.steps
    assert a.kernels.keys() == b.kernels.keys()
    for key in a.kernels:
        assert np.array_equal(a.kernels[key], b.kernels[key]), key
    assert a.collectives == b.collectives


@pytest.mark.parametrize("path", RANK_FILES, ids=lambda p: p.name[:24])
@pytest.mark.parametrize("chunk_bytes", [512, 8192, 1 << 20])
def test_streamed_reduction_equals_whole_file_decoding_when_chunks_are_small(path, chunk_bytes):
    whole = reduce_trace_file(str(path), single_file=True, chunk_bytes=WHOLE)
    _same_tables(reduce_trace_file(str(path), single_file=True, chunk_bytes=chunk_bytes), whole)


def test_streamed_file_keeps_the_golden_figures_of_the_nccl_trace():
    parsed = parse_trace_file(NCCL / "nccl_data.json.gz", chunk_bytes=4096)
    assert parsed.meta.num_events == 40573 and parsed.meta.rank == 0 and parsed.meta.world_size == 2
    assert len(parsed.kernels["start_ns"]) == 3774 and [s for s, _, _ in parsed.steps] == [4, 5, 6]


def _write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


_EVENT = '{"ph": "X", "cat": "kernel", "name": "%s", "ts": %d, "dur": 5, "args": {"stream": 7, "correlation": %d}}'


@pytest.mark.parametrize("layout", ["meta_first", "meta_last", "nested_key_first"])
def test_stream_finds_events_and_metadata_wherever_the_top_level_members_are(tmp_path, layout):
    # names hold '},' and ']' so that cuts inside strings are tried and rejected
    events = ",\n".join(_EVENT % (f"k{i}}},{{]x", 100 + i * 10, i) for i in range(200))
    info = '"distributedInfo": {"rank": 3, "world_size": 4, "pg_config": [{"ranks": [0, 1]}]}'
    nested = '"other": {"traceEvents": [1, 2]}, "list": [{"a": "b"}, {"c": "d"}]'
    body = {"meta_first": f'{{{info}, "traceEvents": [{events}]}}',
            "meta_last": f'{{"traceEvents": [{events}], {nested}, {info}}}',
            "nested_key_first": f'{{{nested}, "traceEvents": [{events}], {info}}}'}[layout]
    path = _write(tmp_path / "r3.json", body)
    for chunk_bytes in (64, 1000, WHOLE):
        parsed = parse_trace_file(path, chunk_bytes=chunk_bytes)
        assert parsed.meta.rank == 3 and parsed.meta.world_size == 4 and parsed.meta.num_events == 200
        assert parsed.names[:2] == ["k0},{]x", "k1},{]x"] and len(parsed.kernels["start_ns"]) == 200
        assert parsed.kernels["start_ns"][-1] == (100 + 199 * 10) * 1000


def test_stream_reads_an_empty_events_list_and_names_a_non_object_item(tmp_path):
    empty = _write(tmp_path / "e.json", '{"traceEvents": [ ], "distributedInfo": {"rank": 1}}')
    assert parse_trace_file(empty, chunk_bytes=8).meta.num_events == 0
    odd = _write(tmp_path / "odd.json", '{"traceEvents": [{"name": "a"}, 5], "distributedInfo": {"rank": 1}}')
    with pytest.raises(TraceError, match=r"odd\.json: not a Kineto trace"):
        parse_trace_file(odd, chunk_bytes=8)


def test_stream_names_a_file_truncated_inside_its_events(tmp_path):
    text = gzip.decompress((NCCL / "nccl_data.json.gz").read_bytes())
    bad = tmp_path / "rank0.pt.trace.json"
    bad.write_bytes(text[: len(text) * 2 // 3])
    for chunk_bytes in (4096, WHOLE):
        with pytest.raises(TraceError, match=r"rank0\.pt\.trace\.json: invalid JSON.*truncated"):
            parse_trace_file(bad, chunk_bytes=chunk_bytes)


# ---- the same findings whichever way the ranks are reduced ----

def _analyze_json(capsys, *args: str) -> dict:
    assert main(["analyze", *args, "--format", "json"]) in (0, 1)
    return json.loads(capsys.readouterr().out)


def test_analyze_with_two_workers_prints_the_findings_of_one_worker(capsys):
    one = _analyze_json(capsys, str(DLRM), "--workers", "1")
    two = _analyze_json(capsys, str(DLRM), "--workers", "2")
    assert two == one
    assert len(one["findings"]) > 0
    temporal = {row["rank"]: row for row in one["metrics"]["temporal_breakdown"]}
    assert temporal[0]["kernel_time_us"] == 13009 and temporal[7]["kernel_time_us"] == 10967   # HTA's figures


def _damaged_folder(tmp_path: Path) -> Path:
    folder = tmp_path / "traces"
    folder.mkdir()
    for f in sorted(DLRM.iterdir())[:3]:
        shutil.copy(f, folder)
    text = gzip.decompress((DLRM / "worker5_step_12.1694128201549.pt.trace.json.gz").read_bytes())
    (folder / "worker5_cut.pt.trace.json").write_bytes(text[: len(text) // 2])
    return folder


@pytest.mark.parametrize("workers", [1, 2])
def test_truncated_rank_file_is_named_by_local_workers(tmp_path, workers):
    folder = _damaged_folder(tmp_path)
    with pytest.raises(TraceError, match=r"worker5_cut\.pt\.trace\.json: invalid JSON.*truncated") as info:
        load_trace_dir(folder, workers=workers)
    assert info.value.__cause__ is None and "Traceback" not in str(info.value)


def test_cli_names_the_truncated_file_without_a_traceback_when_workers_run_it(tmp_path, capsys):
    assert main(["analyze", str(_damaged_folder(tmp_path)), "--workers", "2"]) == 2
    err = capsys.readouterr().err
    assert "worker5_cut.pt.trace.json: invalid JSON" in err and "Traceback" not in err


def test_dask_address_that_does_not_answer_says_how_to_start_a_scheduler(free_port, monkeypatch):
    pytest.importorskip("dask.distributed", reason="dtprobe[dask] is in the dev extra")
    monkeypatch.setattr(kineto_pool, "DASK_CONNECT_TIMEOUT_S", 2.0)
    address = f"tcp://127.0.0.1:{free_port()}"
    with pytest.raises(ConfigError, match=rf"--dask {address}: no Dask scheduler answers there.*dask scheduler"):
        load_trace_dir(DLRM, dask_address=address)


def test_dask_missing_is_a_config_error_naming_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "dask.distributed", None)   # import fails as if not installed
    with pytest.raises(ConfigError, match=r"pip install 'dtprobe\[dask\]'"):
        load_trace_dir(DLRM, dask_address="tcp://127.0.0.1:8786")


_CLUSTER = """
import sys, threading
from dask.distributed import LocalCluster

if __name__ == "__main__":
    cluster = LocalCluster(n_workers=2, threads_per_worker=1, processes=True, host="127.0.0.1", scheduler_port=0,
                           dashboard_address=None)
    try:
        print(cluster.scheduler_address, flush=True)
        waiter = threading.Thread(target=sys.stdin.read, daemon=True)   # until the test closes stdin
        waiter.start()
        waiter.join(timeout=float(sys.argv[1]))
    finally:
        cluster.close()
"""


@pytest.mark.multiproc
def test_dask_cluster_gives_the_findings_of_local_workers_and_names_a_bad_file(tmp_path, start_python, run_cli,
                                                                               child_env):
    pytest.importorskip("dask.distributed", reason="dtprobe[dask] is in the dev extra")
    import subprocess

    cluster = start_python(_CLUSTER, "240", stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        with selectors.DefaultSelector() as sel:
            sel.register(cluster.stdout, selectors.EVENT_READ)
            assert sel.select(timeout=120), "the local Dask cluster did not start within 120 s"
        address = cluster.stdout.readline().strip()
        assert address.startswith("tcp://127.0.0.1:")
        on_dask = run_cli("analyze", DLRM, "--dask", address, "--format", "json", timeout_s=240)
        local = run_cli("analyze", DLRM, "--workers", "1", "--format", "json", timeout_s=240)
        assert on_dask.returncode == local.returncode and on_dask.returncode in (0, 1), on_dask.stderr
        assert json.loads(on_dask.stdout) == json.loads(local.stdout)
        bad = run_cli("analyze", _damaged_folder(tmp_path), "--dask", address, timeout_s=240)
        assert bad.returncode == 2
        assert "worker5_cut.pt.trace.json: invalid JSON" in bad.stderr and "Traceback" not in bad.stderr
    finally:
        cluster.stdin.close()           # the cluster script closes the cluster and exits
        try:
            cluster.wait(timeout=60)
        except subprocess.TimeoutExpired:
            pass                        # start_python's finalizer kills it


# ---- peak memory follows the largest file, not the number of ranks ----

_PEAK = """
import sys
from pathlib import Path
from dtprobe.store.kineto import find_trace_files, load_trace_dir
from dtprobe.store.kineto_pool import ReduceConfig, reduce_files

def status_kb(key):
    line = next(l for l in Path("/proc/self/status").read_text().splitlines() if l.startswith(key + ":"))
    return int(line.split()[1])

if __name__ == "__main__":
    load_trace_dir(sys.argv[3], workers=1)               # once, so that lazily imported libraries are loaded
    Path("/proc/self/clear_refs").write_text("5")      # peak RSS (VmHWM) := current RSS
    before = status_kb("VmRSS")
    reduced = reduce_files(find_trace_files(sys.argv[1]), ReduceConfig(workers=1))
    assert sorted(r.meta.rank for r in reduced) == list(range(int(sys.argv[2])))
    print((status_kb("VmHWM") - before) * 1024)
"""


def _scaled_rank_folder(folder: Path, *, num_ranks: int, repeat: int) -> int:
    """``num_ranks`` copies of dlrm rank 0 with its events repeated ``repeat`` times (times shifted, correlation
    ids offset); returns one file's size in bytes."""
    doc = json.loads(gzip.decompress((DLRM / "worker0_step_12.1694128201545.pt.trace.json.gz").read_bytes()))
    events = doc["traceEvents"]
    span = max(e["ts"] for e in events if "ts" in e) - min(e["ts"] for e in events if "ts" in e) + 1000
    lines = []
    for k in range(repeat):
        for e in events:
            e = dict(e)
            if "ts" in e:
                e["ts"] += k * span
            if isinstance(e.get("args"), dict) and "correlation" in e["args"]:
                e["args"] = {**e["args"], "correlation": e["args"]["correlation"] + k * 1_000_000}
            lines.append(json.dumps(e))
    head = {k: v for k, v in doc.items() if k != "traceEvents"}
    folder.mkdir()
    for rank in range(num_ranks):
        head["distributedInfo"] = {**doc["distributedInfo"], "rank": rank, "world_size": num_ranks}
        text = json.dumps(head)[:-1] + ', "traceEvents": [\n' + ",\n".join(lines) + "\n]}"
        (folder / f"rank{rank}.pt.trace.json").write_text(text)
    return (folder / "rank0.pt.trace.json").stat().st_size


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="resets the peak RSS through Linux's /proc")
def test_reduction_peak_memory_follows_the_largest_file_not_the_number_of_ranks(tmp_path, run_python):
    file_bytes = _scaled_rank_folder(tmp_path / "eight", num_ranks=8, repeat=24)
    (tmp_path / "two").mkdir()
    for name in ("rank0.pt.trace.json", "rank1.pt.trace.json"):
        shutil.copy(tmp_path / "eight" / name, tmp_path / "two")
    peaks = {}
    for folder, ranks in (("two", 2), ("eight", 8)):
        done = run_python(_PEAK, tmp_path / folder, str(ranks), DLRM, timeout_s=240)
        assert done.returncode == 0, done.stderr
        peaks[ranks] = int(done.stdout.split()[-1])
    # decoding a file whole takes ~3x its text; streamed, the reduction of two files stays under one file's size
    assert peaks[2] < file_bytes, (peaks, file_bytes)
    # six more ranks add only their reduced tables (GPU events and collectives), under a tenth of their JSON
    assert peaks[8] - peaks[2] < 0.1 * 6 * file_bytes, (peaks, file_bytes)
