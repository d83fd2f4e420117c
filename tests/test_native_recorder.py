"""The native recorder (``collectors/native_recorder.cpp``) records what the Python recorder records: the same rows,
field by field, for every collective of a gloo group; the watchdog's ``progress()`` and ``pending()``, the drain
tick's spill to ``pending``, ``flush_in_flight`` at close, a paused thread, a renamed group and enqueue timing keep
their meaning; without a build the group records in Python and says so once on stderr, and a build without a
compiler fails softly.

In one process: 1-rank gloo groups, and a 2-rank gloo group whose two ranks are two threads (so that a collective
stays in flight until the other rank issues it)."""

from __future__ import annotations

import datetime
import subprocess
import sys
import textwrap
import threading

import pytest
import torch
import torch.distributed as dist

from dtprobe.collectors import native_recorder
from dtprobe.collectors.collective_recorder import CollectiveRecorder
from dtprobe.collectors.pg_wrapper import GLOO_BACKEND, RecordingProcessGroup, _NativeGlooGroup

from collector_fakes import ListWriter

STEP, RESTART = 7, 2
TIMES = ("enqueue_ns", "end_ns")
TIMEOUT = datetime.timedelta(seconds=30)


@pytest.fixture(scope="module", autouse=True)
def native_built():
    """The native recorder, built if this checkout has none yet (scripts/install.sh builds it)."""
    module, why = native_recorder.build()
    assert module is not None, f"{why}; build it with `{native_recorder.BUILD_COMMAND}`"
    return module


def _gloo(store: dist.Store, rank: int, size: int) -> dist.ProcessGroup:
    """A gloo process group as ``_make_gloo`` builds the inner one, on 127.0.0.1."""
    opts = dist.ProcessGroupGloo._Options()
    opts._timeout = TIMEOUT
    opts._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
    backend = dist.ProcessGroupGloo(store, rank, size, opts)
    group = dist.ProcessGroup(store, rank, size)
    group._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.GLOO, backend)
    group._set_default_backend(dist.ProcessGroup.BackendType.GLOO)
    return group


def _recording(inner: dist.ProcessGroup, *, native: bool, name: str = "tp",
               recorder: CollectiveRecorder | None = None) -> tuple[RecordingProcessGroup, CollectiveRecorder,
                                                                     ListWriter]:
    writer = ListWriter()
    if recorder is None:
        recorder = CollectiveRecorder()
        recorder.start(writer, flush_interval_s=3600, restart=RESTART)
        recorder.step = STEP
    pg = RecordingProcessGroup(inner, inner.rank(), inner.size(), backend_name=GLOO_BACKEND, recorder=recorder,
                               native=native)
    pg.dtprobe_name = name
    pg._ranks_str = ",".join(str(r) for r in range(inner.size()))   # members of a group torch does not know
    return pg, recorder, writer


def _every_collective(pg: RecordingProcessGroup) -> None:
    """Each collective of a gloo group once (some twice: dtypes, ways of waiting), each waited; and one the backend
    refuses."""
    f32, bf16, i64 = torch.ones(6), torch.ones(4, dtype=torch.bfloat16), torch.arange(3)
    opts = dist.AllreduceOptions()
    opts.asyncOp = False
    calls = [
        lambda: pg.allreduce([f32]),
        lambda: pg.allreduce([bf16], opts),
        lambda: pg.allreduce_coalesced([f32, torch.ones(2)]),
        lambda: pg.broadcast([i64]),
        lambda: pg.reduce([f32]),
        lambda: pg.allgather([[torch.empty(6)]], [f32]),
        lambda: pg._allgather_base(torch.empty(4, dtype=torch.bfloat16), bf16),
        lambda: pg.allgather_coalesced([[torch.empty(6)]], [f32]),
        lambda: pg.allgather_into_tensor_coalesced([torch.empty(6)], [f32]),
        lambda: pg.reduce_scatter([torch.empty(6)], [[f32]]),
        lambda: pg._reduce_scatter_base(torch.empty(3, dtype=torch.int64), i64),
        lambda: pg.reduce_scatter_tensor_coalesced([torch.empty(6)], [f32]),
        lambda: pg.alltoall_base(torch.empty(6), f32, [], []),
        lambda: pg.alltoall([torch.empty(6)], [f32]),
        lambda: pg.gather([[torch.empty(6)]], [f32]),
        lambda: pg.scatter([torch.empty(6)], [[f32]]),
        lambda: pg.barrier(),
    ]
    for call in calls:
        call().wait()
    with pytest.raises(RuntimeError, match="same type"):  # refused at the issue: numbered, never recorded
        pg.allreduce_coalesced([f32, i64])
    pg.allreduce([f32]).get_future().wait()                   # the future waited from Python
    torch.futures.wait_all([pg.allreduce([i64]).get_future()])   # and in C++


def _rows(writer: ListWriter) -> list[dict]:
    return sorted(writer.table("collectives"), key=lambda r: r["seq"])


def test_native_rows_are_those_of_the_python_recorder_for_every_collective():
    inner = _gloo(dist.HashStore(), 0, 1)
    tables = {}
    for native in (False, True):
        pg, recorder, writer = _recording(inner, native=native)
        assert isinstance(pg, _NativeGlooGroup) is native
        _every_collective(pg)
        recorder.stop()
        tables[native] = _rows(writer)
    python, native = tables[False], tables[True]
    assert len(native) == 19 and [r["seq"] for r in native] == [*range(1, 18), 19, 20]
    assert [list(r) for r in native] == [list(r) for r in python]          # same columns, in the same order
    assert [{k: v for k, v in r.items() if k not in TIMES} for r in native] == [
        {k: v for k, v in r.items() if k not in TIMES} for r in python]
    assert all(r["end_ns"] >= r["enqueue_ns"] > 0 for r in native)
    assert {r["dtype"] for r in native} == {"float32", "bfloat16", "int64", None}


def test_a_paused_thread_a_renamed_group_and_enqueue_timing_on_the_native_path():
    pg, recorder, writer = _recording(_gloo(dist.HashStore(), 0, 1), native=True)
    t = torch.ones(2)
    pg.allreduce([t]).wait()
    with recorder.paused():                     # clock sync: not recorded, not numbered
        pg.allreduce([t]).wait()
    pg.dtprobe_name = "dp"                      # the next row names the group anew
    pg.allreduce([t]).wait()
    recorder.timing = "enqueue"
    pg.allreduce([t]).wait()
    recorder.stop()
    rows = _rows(writer)
    assert [(r["pg"], r["seq"]) for r in rows] == [("tp", 1), ("dp", 2), ("dp", 3)]
    assert [r.get("end_ns") is None for r in rows] == [False, False, True]
    assert [g["name"] for g in writer.table("groups")] == ["tp", "dp"]


def test_a_collective_in_flight_is_in_progress_pending_spilled_once_and_flushed_at_close():
    store = dist.HashStore()
    groups: dict[int, dist.ProcessGroup] = {}
    threads = [threading.Thread(target=lambda r=r: groups.__setitem__(r, _gloo(store, r, 2))) for r in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    pg, recorder, writer = _recording(groups[0], native=True)
    t0, t1 = torch.ones(5), torch.ones(5)

    def rank1_issues() -> None:
        groups[1].allreduce([t1]).wait()

    first = pg.allreduce([t0])
    rank1_issues()
    first.wait()
    late = pg.allreduce([t0])                   # in flight until rank 1 issues it
    progress = recorder.progress()["tp"]
    assert (progress["last_issued_seq"], progress["last_completed_seq"], progress["last_issued_op"],
            progress["last_issued_step"], progress["pg_ranks"]) == (2, 1, "allreduce", STEP, "0,1")
    assert [(r["pg"], r["seq"], r["pg_ranks"], r["pg_size"], r["num_bytes"]) for r in recorder.pending()] == [
        ("tp", 2, "0,1", 2, 20)]
    assert recorder.tick() == 0                 # first seen in flight
    assert recorder.tick() == 1                 # in flight since the previous tick: spilled
    assert recorder.tick() == 0                 # once
    assert [(r["seq"], r["op"]) for r in writer.table("pending")] == [(2, "allreduce")]

    rank1_issues()
    late.wait()
    assert recorder.pending() == [] and recorder.progress()["tp"]["last_completed_seq"] == 2

    hung = pg.allreduce([t0])                   # rank 1 does not issue it before the close
    recorder.stop()                             # written without an end (a hang)
    rows = _rows(writer)
    assert [(r["seq"], r.get("end_ns") is None) for r in rows] == [(1, False), (2, False), (3, True)]
    rank1_issues()                              # completes after the close: written once, not again
    hung.wait()
    assert len(writer.table("collectives")) == 3


WORKER = textwrap.dedent("""
    import datetime, sys
    import torch, torch.distributed as dist
    from dtprobe.collectors.collective_recorder import CollectiveRecorder
    from dtprobe.collectors.pg_wrapper import GLOO_BACKEND, RecordingProcessGroup
    sys.path.insert(0, sys.argv[1])
    from collector_fakes import ListWriter

    recorder, writer = CollectiveRecorder(), ListWriter()
    recorder.start(writer, flush_interval_s=3600)
    kinds = []
    for _ in range(2):                          # the message is printed once, at the first gloo group
        store = dist.HashStore()
        opts = dist.ProcessGroupGloo._Options()
        opts._timeout = datetime.timedelta(seconds=30)
        opts._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
        inner = dist.ProcessGroup(store, 0, 1)
        inner._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.GLOO,
                                dist.ProcessGroupGloo(store, 0, 1, opts))
        pg = RecordingProcessGroup(inner, 0, 1, backend_name=GLOO_BACKEND, recorder=recorder)
        pg.dtprobe_name, pg._ranks_str = "tp", "0"
        pg.allreduce([torch.ones(3)]).wait()
        kinds.append(type(pg).__name__)
    recorder.stop()
    print(kinds, [(r["op"], r["num_bytes"], r["end_ns"] is not None) for r in writer.table("collectives")],
          flush=True)
    # as dtprobe's workers end (runtime.quick_exit): the interpreter's teardown of live gloo groups can abort
    # ("terminate called without an active exception"), which is torch's, not what this test checks
    import os
    os._exit(0)
""")


def test_without_a_build_the_group_records_in_python_and_says_so_once(tmp_path, child_env, repo_root):
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    proc = subprocess.run([sys.executable, str(script), str(repo_root / "tests")], capture_output=True, text=True,
                          env=child_env(DTPROBE_NATIVE_CACHE=str(tmp_path / "empty")), timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip() == ("['RecordingProcessGroup', 'RecordingProcessGroup'] "
                                   "[('allreduce', 12, True), ('allreduce', 12, True)]")
    said = [line for line in proc.stderr.splitlines() if "native recorder" in line]
    assert len(said) == 1 and "recorded in Python" in said[0] and native_recorder.BUILD_COMMAND in said[0]


def test_a_build_without_a_compiler_fails_softly_and_says_why(tmp_path, child_env):
    proc = subprocess.run([sys.executable, "-m", "dtprobe.collectors.native_recorder"], capture_output=True, text=True,
                          env=child_env(DTPROBE_NATIVE_CACHE=str(tmp_path / "cache"), CXX=str(tmp_path / "no-c++")),
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "[native recorder] not built, collectives will be recorded in Python: the build failed" in proc.stderr
    assert not list((tmp_path / "cache").rglob("*.so"))
