"""Each torchrun attempt's per-rank exits in run.json (``attempts``): faults caused from outside the job (a worker
SIGKILLed, a worker whose rank file cannot be written), and the error-file / log parsing they rest on."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

import pytest
from background_run import background_run, wait_for

from dtprobe.runtime.attempts import glog_time_ns, read_attempts, read_error_file, stderr_excerpt
from dtprobe.store.manifest import create_manifest, read_manifest, record_attempt


def run_args(run_dir: Path, *flags: str) -> list[str]:
    return ["run", "--run-dir", str(run_dir), "--no-devices", "--timeout", "60", "--batch-size", "2", "--seq-len",
            "16", "--nproc", "2", *flags]


def _has_step_row(path: Path) -> bool:
    return path.is_file() and path.read_bytes().count(b"\n") >= 2


@pytest.mark.multiproc
def test_attempts_name_the_rank_killed_from_outside_and_the_attempt_that_recovered(tmp_path, child_env):
    run_dir = tmp_path / "killed"
    cmd = [sys.executable, "-m", "dtprobe.cli", *run_args(run_dir, "--steps", "40", "--max-restarts", "1")]
    with background_run(cmd, env=child_env()) as proc:
        rank_file = run_dir / "ranks" / "rank00001.json"
        wait_for(lambda: _has_step_row(run_dir / "events" / "steps" / "rank00001.jsonl") and rank_file.is_file(),
                 timeout=240, proc=proc, what="rank 1's second step row")
        pid = json.loads(rank_file.read_text())["pid"]
        os.kill(pid, signal.SIGKILL)
        killed_ns = time.time_ns()
        _, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-3000:]
    attempts = read_manifest(run_dir).attempts
    assert [(a["attempt"], a["node_rank"], a["result"]) for a in attempts] == [(0, 0, "failed"), (1, 0, "succeeded")]
    first, second = attempts
    killed = [r for r in first["ranks"] if r["first_failure"]]
    assert len(killed) == 1 and killed[0]["rank"] == 1 and killed[0]["local_rank"] == 1
    assert killed[0]["pid"] == pid and killed[0]["exit_code"] == -9 and killed[0]["signal"] == "SIGKILL"
    assert killed[0]["error"] is None
    assert killed_ns - 1e9 < killed[0]["time_ns"] < killed_ns + 30e9        # the agent saw it after the kill
    assert first["started_ns"] < killed_ns <= first["ended_ns"] <= second["started_ns"]
    survivor = [r for r in first["ranks"] if r["rank"] == 0]
    assert [r["first_failure"] for r in survivor] in ([], [False])
    assert sorted(r["rank"] for r in second["ranks"]) == [0, 1]
    assert all(r["exit_code"] == 0 and r["signal"] is None and not r["first_failure"] and r["error"] is None
               for r in second["ranks"])
    assert {r["pid"] for r in second["ranks"]}.isdisjoint({pid}) and second["ended_ns"] > second["started_ns"]


@pytest.mark.multiproc
def test_attempts_carry_the_python_exception_of_a_worker_that_raised(tmp_path, run_cli):
    run_dir = tmp_path / "raised"
    # From outside the job: a file where the checkpoint directory goes, so the leader's checkpointer raises at
    # setup (no --inject).
    run_dir.mkdir()
    (run_dir / "checkpoints").write_text("not a directory\n")
    proc = run_cli(*run_args(run_dir, "--steps", "4", "--ckpt-every", "2"))
    assert proc.returncode == 1, proc.stderr[-3000:]
    (attempt,) = read_manifest(run_dir).attempts
    assert attempt["result"] == "failed" and attempt["node_rank"] == 0
    (failed,) = [r for r in attempt["ranks"] if r["first_failure"]]
    assert failed["rank"] == 0 and failed["exit_code"] == 1 and failed["signal"] is None
    assert failed["error"]["type"] == "FileExistsError"
    assert str(run_dir / "checkpoints") in failed["error"]["message"]
    assert "checkpoint.py" in failed["error"]["traceback"] and "Traceback" in failed["error"]["traceback"]
    assert failed["pid"] is not None and attempt["started_ns"] <= failed["time_ns"] <= attempt["ended_ns"]
    assert sorted(r["rank"] for r in attempt["ranks"]) == [0, 1]      # both exits reported in the final summary


def test_error_file_written_by_torchelastic_is_read_into_type_message_and_traceback(tmp_path, monkeypatch):
    from torch.distributed.elastic.multiprocessing.errors import record

    error_file = tmp_path / "error.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(error_file))

    @record
    def entry() -> None:
        raise ValueError("batch of 3 does not split into 2 micro-batches")

    with pytest.raises(ValueError):
        entry()
    assert read_error_file(error_file) == {
        "type": "ValueError", "message": "batch of 3 does not split into 2 micro-batches",
        "traceback": json.loads(error_file.read_text())["message"]["extraInfo"]["py_callstack"]}
    assert "in entry" in read_error_file(error_file)["traceback"]
    assert read_error_file(tmp_path / "absent.json") is None


def _attempt_dir(log_dir: Path, n: int, local_rank: int, **worker) -> Path:
    d = log_dir / "run_abc" / f"attempt_{n}" / str(local_rank)
    d.mkdir(parents=True)
    if worker:
        (d / "worker.json").write_text(json.dumps(worker))
    return d


def _glog(t_ns: int, level: str = "E") -> str:
    lt = time.localtime(t_ns / 1e9)
    return f"{level}{lt.tm_mon:02d}{lt.tm_mday:02d} {time.strftime('%H:%M:%S', lt)}.{(t_ns // 1000) % 1_000_000:06d}"


def test_read_attempts_assigns_log_lines_to_attempts_by_time_and_reads_the_final_summary(tmp_path):
    log_dir, t0 = tmp_path / "node0", 1_790_000_000_000_000_000
    _attempt_dir(log_dir, 0, 0, rank=2, pid=100, started_ns=t0)
    _attempt_dir(log_dir, 0, 1, rank=3, pid=101, started_ns=t0)
    _attempt_dir(log_dir, 1, 0, rank=2, pid=200, started_ns=t0 + 10e9)
    _attempt_dir(log_dir, 1, 1, rank=3, pid=201, started_ns=t0 + 10e9)
    log = tmp_path / "torchrun.log"
    log.write_text("\n".join([
        f"{_glog(t0 + int(5e9), 'W')} 9 api.py:1028] Sending process 100 closing signal SIGTERM",
        f"{_glog(t0 + int(5e9))} 9 api.py:1002] failed (exitcode: -9) local_rank: 1 (pid: 101) of binary: py",
        f"{_glog(t0 + int(15e9), 'W')} 9 api.py:1028] Sending process 201 closing signal SIGTERM",
        f"{_glog(t0 + int(15e9))} 9 api.py:1002] failed (exitcode: 1) local_rank: 0 (pid: 200) of binary: py",
        "Failures:", "[1]:", "  time      : x", "  host      : h", "  rank      : 3 (local_rank: 1)",
        "  exitcode  : -15 (pid: 201) (SIGTERM)", "  error_file: <N/A>", "  traceback : Signal 15",
        "Root Cause (first observed failure):", "[0]:", "  time      : x", "  host      : h",
        "  rank      : 2 (local_rank: 0)", "  exitcode  : 1 (pid: 200)", "  error_file: e", "  traceback : t", ""]))
    got = read_attempts(log_dir, log, node_rank=1, nproc=2, final=True, exit_code=1, ended_ns=t0 + int(16e9))
    assert [(a["attempt"], a["node_rank"], a["result"]) for a in got] == [(0, 1, "failed"), (1, 1, "failed")]
    a0 = {r["rank"]: r for r in got[0]["ranks"]}
    assert (a0[3]["exit_code"], a0[3]["signal"], a0[3]["first_failure"]) == (-9, "SIGKILL", True)
    assert (a0[2]["exit_code"], a0[2]["signal"], a0[2]["first_failure"]) == (None, "SIGTERM", False)
    assert abs(a0[3]["time_ns"] - (t0 + 5e9)) < 1e6 and got[0]["ended_ns"] == a0[3]["time_ns"]
    a1 = {r["rank"]: r for r in got[1]["ranks"]}
    assert (a1[2]["exit_code"], a1[2]["signal"], a1[2]["first_failure"]) == (1, None, True)
    assert (a1[3]["exit_code"], a1[3]["signal"], a1[3]["first_failure"]) == (-15, "SIGTERM", False)
    assert got[1]["ended_ns"] == t0 + int(16e9)
    # while torchrun still runs, the last attempt is left out
    assert [a["attempt"] for a in read_attempts(log_dir, log, node_rank=1, nproc=2, final=False)] == [0]



def test_a_rank_that_failed_without_an_error_file_carries_the_end_of_its_stderr(tmp_path):
    # rank 1 exits 2 in argparse (no error file); rank 0, stopped by the agent, and a rank that raised (error file)
    # carry none; the entries with a tail are still valid run.json attempts
    log_dir, t0 = tmp_path / "node0", 1_790_000_000_000_000_000
    for local_rank, pid in ((0, 100), (1, 101), (2, 102)):
        d = _attempt_dir(log_dir, 0, local_rank, rank=local_rank, pid=pid, started_ns=t0)
        (d / "stderr.log").write_text("usage: train.py [-h] [--epochs EPOCHS]\n\n" * 20
                                      + f"train.py: error: unrecognized arguments: --steps {local_rank}\n\n")
    (log_dir / "run_abc" / "attempt_0" / "2" / "error.json").write_text(json.dumps(
        {"message": {"message": "ValueError: bad", "extraInfo": {"py_callstack": "Traceback ...", "timestamp": "1"}}}))
    log = tmp_path / "torchrun.log"
    log.write_text("\n".join([
        f"{_glog(t0 + int(5e9), 'W')} 9 api.py:1028] Sending process 100 closing signal SIGTERM",
        f"{_glog(t0 + int(5e9))} 9 api.py:1002] failed (exitcode: 2) local_rank: 1 (pid: 101) of binary: py", ""]))
    [a] = read_attempts(log_dir, log, node_rank=0, nproc=3, final=True, exit_code=2, ended_ns=t0 + int(6e9),
                        observed={102: (t0 + int(5e9), 1)})
    by_rank = {r["rank"]: r for r in a["ranks"]}
    assert by_rank[1]["exit_code"] == 2 and by_rank[1]["error"] is None
    tail = by_rank[1]["stderr_tail"].splitlines()
    assert len(tail) == 5 and tail[-1] == "train.py: error: unrecognized arguments: --steps 1"
    assert "stderr_tail" not in by_rank[0] and "stderr_tail" not in by_rank[2]
    create_manifest(tmp_path / "run", run_id="r", command=["x"], config={}, world_size=3)
    record_attempt(tmp_path / "run", a)
    assert read_manifest(tmp_path / "run").attempts[0]["ranks"][1]["stderr_tail"] == by_rank[1]["stderr_tail"]

def test_the_stderr_excerpt_of_a_native_abort_keeps_its_message_and_the_scripts_frame_not_the_backtraces():
    # NCCL's watchdog ends a process this way: a C++ exception escapes its thread, libstdc++ prints it with c10's
    # backtrace and aborts; faulthandler then dumps every thread (the failing one with library frames innermost)
    stdlib = sysconfig.get_paths()["stdlib"]
    text = "\n".join(
        ["step 41 loss 2.31"] * 50
        + ["terminate called after throwing an instance of 'c10::DistBackendError'",
           "  what():  [PG ID 0 Rank 1] Process group watchdog thread terminated with exception: [Rank 1] Watchdog "
           "caught collective operation timeout: WorkNCCL(SeqNum=7, OpType=ALLREDUCE) ran for 600042 milliseconds "
           "before timing out.",
           "Exception raised from checkTimeout at ../torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp:616 (most "
           "recent call first):"]
        + [f"frame #{i}: <unknown function> + 0x{i:x}" for i in range(12)]
        + ["", "Fatal Python error: Aborted", "",
           "Thread 0x00007f6b6ae9d6c0 (most recent call first):",
           f'  File "{stdlib}/threading.py", line 331 in wait', "",
           "Current thread 0x00007f6b9f609b80 (most recent call first):",
           f'  File "{stdlib}/selectors.py", line 415 in select',
           '  File "/home/u/proj/train.py", line 88 in train_step',
           '  File "/home/u/proj/train.py", line 120 in main',
           f'  File "{stdlib}/runpy.py", line 88 in _run_code', "",
           "Extension modules: numpy._core._multiarray_umath, torch._C (total: 2)", ""])
    assert stderr_excerpt(text).splitlines() == [
        "terminate called after throwing an instance of 'c10::DistBackendError'",
        "  what():  [PG ID 0 Rank 1] Process group watchdog thread terminated with exception: [Rank 1] Watchdog "
        "caught collective operation timeout: WorkNCCL(SeqNum=7, OpType=ALLREDUCE) ran for 600042 milliseconds "
        "before timing out.",
        "Fatal Python error: Aborted",
        f'File "{stdlib}/selectors.py", line 415 in select',
        'File "/home/u/proj/train.py", line 88 in train_step']
    # a segfault without a message: the lines before the dump are kept as they are, and a frame of the script
    # innermost is given once
    segv = "\n".join(["epoch 3", "Fatal Python error: Segmentation fault", "Current thread 0x1 (most recent call "
                      "first):", '  File "/home/u/proj/ext.py", line 9 in call', "Extension modules: torch._C"])
    assert stderr_excerpt(segv).splitlines() == ["epoch 3", "Fatal Python error: Segmentation fault",
                                                 'File "/home/u/proj/ext.py", line 9 in call']
    assert stderr_excerpt("\n\n") is None


def test_the_stderr_excerpt_of_an_abort_in_a_native_thread_gives_the_main_threads_frame():
    # gloo's size check throws in its own I/O thread, which has no Python frames: faulthandler marks no thread
    # current, and the main thread (listed last) is where the script waits in the collective
    stdlib = sysconfig.get_paths()["stdlib"]
    site = sysconfig.get_paths()["purelib"]
    text = "\n".join(
        ["terminate called after throwing an instance of 'gloo::EnforceNotMet'",
         "  what():  [enforce fail at gloo/transport/tcp/pair.cc:456] op.preamble.length <= op.nbytes. 270864 vs 4.",
         "Fatal Python error: Aborted", "",
         "Thread 0x00007f91d4e036c0 (most recent call first):",
         f'  File "{stdlib}/threading.py", line 331 in wait',
         '  File "/home/u/proj/logger.py", line 12 in run', "",
         "Thread 0x00007f92045f6b80 (most recent call first):",
         f'  File "{site}/torch/distributed/distributed_c10d.py", line 3252 in all_reduce',
         '  File "/home/u/proj/train.py", line 45 in <module>',
         f'  File "{stdlib}/runpy.py", line 88 in _run_code', "",
         "Extension modules: torch._C (total: 1)"])
    assert stderr_excerpt(text).splitlines()[2:] == [
        "Fatal Python error: Aborted",
        f'File "{site}/torch/distributed/distributed_c10d.py", line 3252 in all_reduce',
        'File "/home/u/proj/train.py", line 45 in <module>']


def test_glog_time_reads_the_local_time_prefix_and_rejects_other_lines():
    t = 1_790_000_000_123_456_000
    assert glog_time_ns(_glog(t) + " 1 x.py:1] failed", now_ns=t + 10**9) == t
    assert glog_time_ns("Failures:", now_ns=t) is None


def test_record_attempt_replaces_the_same_attempt_and_node_and_old_runs_read_without_attempts(tmp_path):
    create_manifest(tmp_path, run_id="r", command=["x"], config={}, world_size=4, nnodes=2)
    data = json.loads((tmp_path / "run.json").read_text())
    del data["attempts"]
    (tmp_path / "run.json").write_text(json.dumps(data))
    assert read_manifest(tmp_path).attempts == ()
    entry = {"attempt": 0, "node_rank": 1, "started_ns": 1, "ended_ns": None, "result": "failed", "ranks": []}
    record_attempt(tmp_path, entry)
    record_attempt(tmp_path, {**entry, "node_rank": 0})
    record_attempt(tmp_path, {**entry, "ended_ns": 5})
    got = read_manifest(tmp_path).attempts
    assert [(a["attempt"], a["node_rank"], a["ended_ns"]) for a in got] == [(0, 0, None), (0, 1, 5)]
    with pytest.raises(ValueError, match="result"):
        record_attempt(tmp_path, {**entry, "result": "exploded"})


def test_proc_exit_reads_a_zombies_exit_status_before_it_is_reaped(start_python):
    from dtprobe.runtime.attempts import proc_exit

    killed = start_python("import time; time.sleep(60)")
    exited = start_python("import sys; sys.exit(3)")
    try:
        assert proc_exit(killed.pid) == (False, None)
        os.kill(killed.pid, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while not (proc_exit(killed.pid)[0] and proc_exit(exited.pid)[0]) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert proc_exit(killed.pid) == (True, -9) and proc_exit(exited.pid) == (True, 3)   # zombies, not reaped
    finally:
        killed.kill()
        killed.wait(timeout=30)
        exited.wait(timeout=30)
    assert proc_exit(killed.pid) == (True, None)                                            # reaped: gone


def test_first_failure_moves_to_the_rank_the_launcher_saw_exit_first_when_torchrun_tied_them(tmp_path):
    log_dir, t0 = tmp_path / "node0", 1_790_000_000_000_000_000
    survivor = _attempt_dir(log_dir, 0, 0, rank=0, pid=100, started_ns=t0)
    _attempt_dir(log_dir, 0, 1, rank=1, pid=101, started_ns=t0)
    (survivor / "error.json").write_text(json.dumps({"message": {
        "message": "RuntimeError: Connection closed by peer", "extraInfo": {"py_callstack": "tb", "timestamp": "1"}}}))
    log = tmp_path / "torchrun.log"
    # torchrun's one-second ordering (and local rank 0 first within it) named the survivor
    log.write_text(f"{_glog(t0 + int(5e9))} 9 api.py:1002] failed (exitcode: 1) local_rank: 0 (pid: 100) of b\n")
    observed = {101: (t0 + int(4.5e9), -9), 100: (t0 + int(4.8e9), 1)}
    (a0,) = read_attempts(log_dir, log, node_rank=0, nproc=2, final=True, exit_code=1, ended_ns=t0 + int(6e9),
                          observed=observed)
    ranks = {r["rank"]: r for r in a0["ranks"]}
    assert (ranks[1]["first_failure"], ranks[1]["exit_code"], ranks[1]["signal"]) == (True, -9, "SIGKILL")
    assert ranks[1]["time_ns"] == t0 + int(4.5e9)
    assert (ranks[0]["first_failure"], ranks[0]["exit_code"], ranks[0]["error"]["type"]) == (False, 1, "RuntimeError")
    # seen exiting in the same tick (or not seen at all): torchrun's report stands
    (tied,) = read_attempts(log_dir, log, node_rank=0, nproc=2, final=True, exit_code=1, ended_ns=t0 + int(6e9),
                            observed={101: (t0 + int(4.8e9), -9), 100: (t0 + int(4.8e9), 1)})
    assert [r["rank"] for r in tied["ranks"] if r["first_failure"]] == [0]


def _wait(condition, what: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"waited {timeout_s:.0f} s for {what}"
        time.sleep(0.01)


@pytest.mark.parametrize("pidfds", [True, False], ids=["pidfd", "proc-polling"])
def test_exit_watcher_sees_each_worker_exit_with_its_code_and_follows_a_restart(tmp_path, start_python, monkeypatch,
                                                                                pidfds):
    from dtprobe.runtime import attempts

    if not pidfds:
        monkeypatch.setattr(attempts, "open_pidfd", lambda pid: None)
    killed = start_python("import time; time.sleep(60)")
    raised = start_python("import sys; sys.stdin.readline(); sys.exit(3)", stdin=subprocess.PIPE)
    log_dir = tmp_path / "node0"
    _attempt_dir(log_dir, 0, 0, rank=0, pid=killed.pid)
    _attempt_dir(log_dir, 0, 1, rank=1, pid=raised.pid)
    watcher = attempts.ExitWatcher(log_dir, interval_s=0.02, scan_interval_s=0.02)
    scans = []
    scan = watcher.scan
    monkeypatch.setattr(watcher, "scan", lambda: scans.append(time.monotonic()) or scan())
    watcher.start()
    try:
        _wait(lambda: len(watcher._known) == 2, "the watcher to read both workers' pids")
        time.sleep(0.5)
        seen_alive = len(scans)
        assert watcher.observed() == {}
        os.kill(killed.pid, signal.SIGKILL)
        killed_ns = time.time_ns()
        raised.stdin.write(b"go\n")
        raised.stdin.flush()
        _wait(lambda: len(watcher.observed()) == 2, "both exits")
        observed = watcher.observed()
        assert observed[killed.pid][1] == -9 and observed[raised.pid][1] == 3       # zombies: the test reaps them
        assert observed[killed.pid][0] >= killed_ns
        # every local rank had its pid and both lived: no scan for new workers until they exited
        assert seen_alive == 1, scans
        # a restart: the next attempt's worker is watched once the last one has exited
        restarted = start_python("import sys; sys.exit(7)")
        _attempt_dir(log_dir, 1, 0, rank=0, pid=restarted.pid)
        _wait(lambda: restarted.pid in watcher.observed(), "the restarted worker's exit")
        assert watcher.observed()[restarted.pid][1] == 7
    finally:
        watcher.stop()
    assert not watcher._thread.is_alive()
