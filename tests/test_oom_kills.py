"""The launcher's evidence that the kernel's OOM killer ended a worker (``dtprobe.runtime.oom_kills``): the kernel
log's line naming its pid, else its memory cgroup's OOM kill count grown while it ran; carried into run.json's
attempts and read by RANK_CRASH as the cause ``out_of_memory``."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

from dtprobe.runtime import attempts, oom_kills
from dtprobe.runtime.attempts import read_attempts
from dtprobe.store.manifest import create_manifest, read_manifest, record_attempt


def _record(at_ns: int, message: str, seq: int) -> str:
    """One /dev/kmsg record logged at wall time ``at_ns``: "<prio>,<seq>,<usec since boot>,<flags>;<message>"."""
    boot_ns = time.time_ns() - time.monotonic_ns()
    return f"3,{seq},{(at_ns - boot_ns) // 1000},-;{message}\n"


def _kill_line(pid: int) -> str:
    return (f"Memory cgroup out of memory: Killed process {pid} (python) total-vm:3518248kB, anon-rss:1250848kB, "
            f"file-rss:127548kB, shmem-rss:0kB, UID:0 pgtables:3248kB oom_score_adj:0")


def test_the_kernel_log_line_naming_the_pid_is_found_and_an_older_kill_of_a_reused_pid_is_not(tmp_path):
    now = time.time_ns()
    kmsg = tmp_path / "kmsg"
    kmsg.write_text("".join([
        _record(now - 600 * 10**9, _kill_line(4321), 1),          # the pid's previous owner, before the worker ran
        _record(now - 2 * 10**9, "oom-kill:constraint=CONSTRAINT_MEMCG,task=python,pid=4321,uid=0", 2),
        " SUBSYSTEM=memory\n",                                      # a record's continuation line
        _record(now - 2 * 10**9, _kill_line(43210), 3),             # another process
        _record(now - 10**9, _kill_line(4321), 4),
    ]))
    since = now - 60 * 10**9
    line = oom_kills.kernel_oom_kill(4321, since_ns=since, kmsg=kmsg)
    assert line == _kill_line(4321)
    assert oom_kills.kernel_oom_kill(4321, since_ns=now, kmsg=kmsg) is None       # only the old ones before it
    assert oom_kills.kernel_oom_kill(432, since_ns=since, kmsg=kmsg) is None
    assert oom_kills.kernel_oom_kill(4321, since_ns=since, kmsg=tmp_path / "unreadable") is None


def _fake_cgroup(root: Path, pid: int, count: int) -> Path:
    """The memory cgroup ``pid`` is in, made under ``root`` (v1 layout where the process has a memory controller
    line, else v2) with an ``oom_kill`` count of ``count``."""
    lines = Path(f"/proc/{pid}/cgroup").read_text().splitlines()
    v1 = [path for _, ctl, path in (x.split(":", 2) for x in lines) if "memory" in ctl.split(",")]
    if v1:
        d = root / "memory" / v1[0].lstrip("/")
        d.mkdir(parents=True, exist_ok=True)
        (d / "memory.oom_control").write_text(f"oom_kill_disable 0\nunder_oom 0\noom_kill {count}\n")
    else:
        path = [path for _, ctl, path in (x.split(":", 2) for x in lines) if ctl == ""][0]
        d = root / path.lstrip("/")
        d.mkdir(parents=True, exist_ok=True)
        (d / "memory.events").write_text(f"low 0\nhigh 0\nmax 3\noom 1\noom_kill {count}\noom_group_kill 0\n")
    return d


def test_a_memory_cgroup_whose_oom_kill_count_grew_while_the_worker_ran_is_the_evidence_without_the_log(tmp_path):
    d = _fake_cgroup(tmp_path / "cg", os.getpid(), 2)
    assert oom_kills.memory_cgroup(os.getpid(), root=tmp_path / "cg") == d
    assert oom_kills.oom_kill_count(d) == 2
    no_log = tmp_path / "no-kmsg"
    assert oom_kills.oom_evidence(999_999, since_ns=None, cgroup=(d, 2), kmsg=no_log) is None   # no kill since
    _fake_cgroup(tmp_path / "cg", os.getpid(), 3)
    said = oom_kills.oom_evidence(999_999, since_ns=None, cgroup=(d, 2), kmsg=no_log)
    assert said == f"its memory cgroup {d} counted 1 OOM kill(s) while it ran (oom_kill 3)"
    assert oom_kills.oom_evidence(999_999, since_ns=None, cgroup=None, kmsg=no_log) is None
    assert oom_kills.memory_cgroup(os.getpid(), root=tmp_path / "none") is None     # no such controller files


def test_the_exit_watcher_keeps_the_oom_evidence_of_the_workers_that_failed(tmp_path, start_python, monkeypatch):
    log_dir = tmp_path / "node0"
    cgroups = {}

    def cgroup_of(pid: int) -> Path:       # each worker's own cgroup, found with no kill counted
        cgroups[pid] = tmp_path / "cg" / str(pid)
        cgroups[pid].mkdir(parents=True)
        (cgroups[pid] / "memory.events").write_text("oom_kill 0\n")
        return cgroups[pid]

    monkeypatch.setattr(attempts, "memory_cgroup", cgroup_of)
    monkeypatch.setattr(oom_kills, "KMSG", str(tmp_path / "no-kmsg"))
    killed = start_python("import time; time.sleep(60)")
    exited = start_python("import sys; sys.stdin.readline(); sys.exit(3)", stdin=subprocess.PIPE)
    clean = start_python("import sys; sys.stdin.readline()", stdin=subprocess.PIPE)
    for local_rank, proc in enumerate((killed, exited, clean)):
        d = log_dir / "run_abc" / "attempt_0" / str(local_rank)
        d.mkdir(parents=True)
        (d / "worker.json").write_text(json.dumps({"rank": local_rank, "pid": proc.pid, "started_ns": time.time_ns()}))
    watcher = attempts.ExitWatcher(log_dir, interval_s=0.02, scan_interval_s=0.02).start()
    try:
        deadline = time.monotonic() + 30
        while len(cgroups) < 3:
            assert time.monotonic() < deadline, "the watcher did not find the workers"
            time.sleep(0.01)
        for pid in cgroups:                 # the kernel counted a kill in each cgroup while its worker ran
            (cgroups[pid] / "memory.events").write_text("oom_kill 1\n")
        os.kill(killed.pid, signal.SIGKILL)
        for proc in (exited, clean):
            proc.stdin.write(b"go\n")
            proc.stdin.flush()
        while len(watcher.observed()) < 3:
            assert time.monotonic() < deadline, "the watcher did not see the exits"
            time.sleep(0.01)
    finally:
        watcher.stop()
    # a SIGKILL, and an error exit (a rank raising over a DataLoader worker the OOM killer ended); not a clean exit
    assert watcher.oom_kills() == {
        proc.pid: f"its memory cgroup {cgroups[proc.pid]} counted 1 OOM kill(s) while it ran (oom_kill 1)"
        for proc in (killed, exited)}


def test_attempts_carry_the_oom_kill_of_a_sigkilled_rank_but_not_of_one_the_agent_stopped(tmp_path, monkeypatch):
    log_dir, t0 = tmp_path / "node0", 1_790_000_000_000_000_000
    for local_rank, pid in ((0, 100), (1, 101)):
        d = log_dir / "run_abc" / "attempt_0" / str(local_rank)
        d.mkdir(parents=True)
        (d / "worker.json").write_text(json.dumps({"rank": local_rank, "pid": pid, "started_ns": t0}))
    log = tmp_path / "torchrun.log"
    lt = time.localtime((t0 + 5 * 10**9) / 1e9)
    stamp = f"{lt.tm_mon:02d}{lt.tm_mday:02d} {time.strftime('%H:%M:%S', lt)}.000000"
    log.write_text(f"W{stamp} 9 api.py:1028] Sending process 100 closing signal SIGKILL\n"
                   f"E{stamp} 9 api.py:1002] failed (exitcode: -9) local_rank: 1 (pid: 101) of binary: py\n")
    monkeypatch.setattr(oom_kills, "KMSG", str(tmp_path / "no-kmsg"))
    said = {101: _kill_line(101), 100: _kill_line(100)}
    [a] = read_attempts(log_dir, log, node_rank=0, nproc=2, final=True, exit_code=1, ended_ns=t0 + 6 * 10**9,
                        oom_kills=said)
    by_rank = {r["rank"]: r for r in a["ranks"]}
    assert (by_rank[1]["signal"], by_rank[1]["oom_kill"]) == ("SIGKILL", _kill_line(101))
    assert by_rank[0]["signal"] == "SIGKILL" and "oom_kill" not in by_rank[0]     # the agent's own SIGKILL
    create_manifest(tmp_path / "run", run_id="r", command=["x"], config={}, world_size=2)
    record_attempt(tmp_path / "run", a)
    assert read_manifest(tmp_path / "run").attempts[0]["ranks"][1]["oom_kill"] == _kill_line(101)
    # without the watcher's evidence, the kernel log is read when the attempt is recorded
    kmsg = tmp_path / "kmsg"
    kmsg.write_text(_record(time.time_ns(), _kill_line(101), 1))
    monkeypatch.setattr(oom_kills, "KMSG", str(kmsg))
    [a] = read_attempts(log_dir, log, node_rank=0, nproc=2, final=True, exit_code=1, ended_ns=t0 + 6 * 10**9)
    assert {r["rank"]: r.get("oom_kill") for r in a["ranks"]} == {0: None, 1: _kill_line(101)}


def test_a_rank_that_raised_because_the_oom_killer_ended_its_dataloader_worker_carries_that_kill(tmp_path,
                                                                                                 monkeypatch):
    log_dir, t0 = tmp_path / "node0", 1_790_000_000_000_000_000
    d = log_dir / "run_abc" / "attempt_0" / "0"
    d.mkdir(parents=True)
    (d / "worker.json").write_text(json.dumps({"rank": 0, "pid": 100, "started_ns": t0}))
    (d / "error.json").write_text(json.dumps({"message": {
        "message": "RuntimeError: DataLoader worker (pid 4444) is killed by signal: Killed. ",
        "extraInfo": {"py_callstack": "Traceback ...", "timestamp": "1"}}}))
    log = tmp_path / "torchrun.log"
    log.write_text("")
    kmsg = tmp_path / "kmsg"
    kmsg.write_text(_record(time.time_ns(), _kill_line(4444), 1))
    monkeypatch.setattr(oom_kills, "KMSG", str(kmsg))
    [a] = read_attempts(log_dir, log, node_rank=0, nproc=1, final=True, exit_code=1, ended_ns=t0 + 6 * 10**9,
                        observed={100: (t0 + 5 * 10**9, 1)})
    [entry] = a["ranks"]
    assert (entry["exit_code"], entry["oom_kill"]) == (1, f"its DataLoader worker 4444: {_kill_line(4444)}")
    # the kernel log unreadable: the rank's memory cgroup counted the kill while it ran
    monkeypatch.setattr(oom_kills, "KMSG", str(tmp_path / "no-kmsg"))
    cgroup_said = "its memory cgroup /sys/fs/cgroup/memory/job counted 1 OOM kill(s) while it ran (oom_kill 1)"
    [a] = read_attempts(log_dir, log, node_rank=0, nproc=1, final=True, exit_code=1, ended_ns=t0 + 6 * 10**9,
                        observed={100: (t0 + 5 * 10**9, 1)}, oom_kills={100: cgroup_said})
    assert a["ranks"][0]["oom_kill"] == f"its DataLoader worker(s) 4444 died, and {cgroup_said}"
    # neither: nothing is claimed
    [a] = read_attempts(log_dir, log, node_rank=0, nproc=1, final=True, exit_code=1, ended_ns=t0 + 6 * 10**9,
                        observed={100: (t0 + 5 * 10**9, 1)})
    assert "oom_kill" not in a["ranks"][0]


def test_the_dataloader_worker_message_gives_its_pids_and_signal():
    from dtprobe.stack_frames import DATALOADER_WORKER_DIED, dataloader_worker_pids

    assert dataloader_worker_pids("RuntimeError: DataLoader worker (pid 31667) is killed by signal: Killed. ") == [
        31667]
    assert dataloader_worker_pids("DataLoader worker (pid(s) 12, 13) exited unexpectedly") == [12, 13]
    assert dataloader_worker_pids("DataLoader worker (pid 5) exited unexpectedly with exit code 1. Details") == [5]
    assert dataloader_worker_pids("RuntimeError: CUDA error") == [] and dataloader_worker_pids(None) == []
    said = DATALOADER_WORKER_DIED.search("DataLoader worker (pid 9) is killed by signal: Bus error. ")
    assert said.group("signal") == "Bus error"


def test_the_kernel_log_is_read_once_for_several_pids(tmp_path):
    now = time.time_ns()
    kmsg = tmp_path / "kmsg"
    kmsg.write_text(_record(now - 10**9, _kill_line(11), 1) + _record(now - 10**9, _kill_line(12), 2))
    assert oom_kills.kernel_oom_kills([11, 12, 13], since_ns=now - 60 * 10**9, kmsg=kmsg) == {
        11: _kill_line(11), 12: _kill_line(12)}
    assert oom_kills.kernel_oom_kills([11], kmsg=tmp_path / "unreadable") == {}
