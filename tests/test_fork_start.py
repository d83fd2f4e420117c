"""Warm worker start (``runtime.fork_start``): a forked worker gets what torchrun's Popen'd worker gets and ends
the way torchrun reads it; ``dtprobe run`` forks by default, execs on request, and a SIGTERM to its agent stops
forked workers.

The handler tests run a small agent (``AGENT``: torchrun's ``get_subprocess_handler`` after ``install``, with
``tests/fork_probe_worker.py`` standing in for the worker module) that has what torchrun's agent has when it
starts workers: Python signal handlers, an ``atexit`` function, a root log handler, a listening socket and a
thread holding a lock (as the rendezvous store's server thread may while it serves the workers already started).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest

from dtprobe.runtime import fork_start

pytestmark = pytest.mark.multiproc

TESTS_DIR = Path(__file__).resolve().parent
AGENT = """
import atexit, json, logging, os, signal, socket, sys, time
sys.path.insert(0, sys.argv[1])
from dtprobe.runtime import fork_start
fork_start.WORKER_MODULE = "fork_probe_worker"
fork_start.WARM_MODULES = ("fork_probe_warm",)
fork_start.install()
from torch.distributed.elastic.multiprocessing import api
atexit.register(print, "agent atexit ran")
logging.getLogger().addHandler(logging.StreamHandler(sys.stderr))
for sig in (signal.SIGTERM, signal.SIGHUP):
    signal.signal(sig, lambda *a: None)
listener = socket.socket(); listener.bind(("127.0.0.1", 0)); listener.listen()
import fork_probe_warm, threading
held = threading.Event()
threading.Thread(target=lambda: (fork_probe_warm.LOCK.acquire(), held.set(), time.sleep(30)), daemon=True).start()
held.wait()     # as the store's server thread may hold a lock of its own while workers start
out_dir, behaviour, agent_state = sys.argv[2], sys.argv[3], sys.argv[4]
if agent_state == "cuda":
    import torch
    torch.cuda.is_initialized = lambda: True
if agent_state == "server-gone":
    os.kill(fork_start._SERVER.pid, signal.SIGKILL)
    os.waitpid(fork_start._SERVER.pid, 0)
path = os.pathsep.join([sys.argv[1], os.environ.get("PYTHONPATH", "")])
if agent_state == "interrupted-fork":   # torchrun's SIGTERM handler raises after the fork request went out
    import select
    class InterruptOnce:
        raised = False
        def select(self, *args):
            if not self.raised:
                self.raised = True
                raise KeyboardInterrupt
            return select.select(*args)
    fork_start.select = InterruptOnce()
try:
    handler = api.get_subprocess_handler(
        entrypoint=sys.executable, args=("-u", "-m", "fork_probe_worker", behaviour, "two words"),
        env={"RANK": "3", "EXTRA": "x", "PYTHONPATH": path}, stdout=f"{out_dir}/stdout.log",
        stderr=f"{out_dir}/stderr.log", local_rank_id=0)
except KeyboardInterrupt:
    print(json.dumps({"interrupted": True}))
    sys.exit(0)
if agent_state == "stale-answer":  # a poll whose answer was never read (a signal interrupted it), after the exit
    import pickle
    time.sleep(1.0)
    fork_start._SERVER._asked += 1
    socket.send_fds(fork_start._SERVER.sock, [pickle.dumps((fork_start._SERVER._asked, "poll", handler.proc.pid))], [])
    time.sleep(0.3)
timed_out = False
zombie_until_polled = None
if behaviour == "sigkill":      # dead but not reaped before torchrun's poll (the launcher reads its exit code then)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and open(f"/proc/{handler.proc.pid}/stat").read().rsplit(")", 1)[1].split()[0] != "Z":
        time.sleep(0.01)
    time.sleep(0.3)
    zombie_until_polled = open(f"/proc/{handler.proc.pid}/stat").read().rsplit(")", 1)[1].split()[0] == "Z"
if behaviour == "sleep":
    while not os.path.getsize(f"{out_dir}/stdout.log"):
        time.sleep(0.05)
    try:
        handler.proc.wait(0.2)
    except Exception as exc:
        timed_out = type(exc).__name__ == "TimeoutExpired"
    handler.close(signal.SIGTERM)
code = handler.proc.wait(60)
print(json.dumps({"returncode": code, "pid": handler.proc.pid, "agent_pid": os.getpid(),
                  "listener_fd": listener.fileno(), "timed_out": timed_out, "kind": type(handler).__name__,
                  "zombie_until_polled": zombie_until_polled,
                  "process": type(handler.proc).__name__}))
"""


def run_agent(run_python, tmp_path: Path, behaviour: str, *, agent_state: str = "-",
              agent_stderr: list[str] | None = None) -> tuple[dict, dict, str, str]:
    """(agent's report, worker's report, worker stdout, worker stderr) of one start (``agent_state``: ``cuda``
    with CUDA initialized in the agent, ``server-gone`` with its fork server killed, ``stale-answer`` with a poll
    whose answer the agent never read; the agent's own stderr is appended to ``agent_stderr``)."""
    proc = run_python(AGENT, TESTS_DIR, tmp_path, behaviour, agent_state, timeout_s=120)
    assert proc.returncode == 0, proc.stderr
    if agent_stderr is not None:
        agent_stderr.append(proc.stderr)
    agent = json.loads(proc.stdout.splitlines()[0])
    out = (tmp_path / "stdout.log").read_text()
    err = (tmp_path / "stderr.log").read_text()
    return agent, json.loads(out.splitlines()[0]), out, err


def test_fork_start_gives_the_worker_torchruns_env_argv_session_and_files_and_none_of_the_agents_state(
        run_python, tmp_path):
    agent, worker, out, err = run_agent(run_python, tmp_path, "return")
    assert (agent["kind"], agent["process"], agent["returncode"]) == ("ForkHandler", "ForkedWorker", 0)
    assert worker["name"] == "__main__"
    assert worker["argv"] == [str(TESTS_DIR / "fork_probe_worker.py"), "return", "two words"]
    assert (worker["rank"], worker["c_rank"], worker["extra"]) == ("3", "3", "x")
    assert worker["pid"] == agent["pid"] and worker["sid"] == worker["pgid"] == worker["pid"]   # own session
    assert worker["ppid"] != agent["agent_pid"] and worker["grandparent"] == agent["agent_pid"]  # the fork server
    assert worker["warm_lock_free"]     # forked from the server, not from the agent whose thread holds the lock
    assert worker["main_native_id"] == worker["pid"]       # not the agent's (the host sampler reads it)
    assert worker["handlers"]["SIGTERM"] == worker["handlers"]["SIGHUP"] == "<Handlers.SIG_DFL: 0>"
    assert "default_int_handler" in worker["handlers"]["SIGINT"]
    assert worker["fds"] == [0, 1, 2, 3] and agent["listener_fd"] > 2   # 3: the listing of /proc/self/fd itself
    assert worker["root_handlers"] == 0
    assert "a line on stderr" in err and "warm atexit ran" in out and "agent atexit ran" not in out + err


def test_fork_start_execs_the_worker_when_the_agent_has_initialized_cuda(run_python, tmp_path):
    agent, worker, _, _ = run_agent(run_python, tmp_path, "return", agent_state="cuda")
    assert (agent["process"], agent["returncode"]) == ("Popen", 0)
    assert worker["argv"][1:] == ["return", "two words"] and worker["rank"] == "3"


def test_fork_start_execs_the_worker_and_says_so_when_the_fork_server_is_gone(run_python, tmp_path):
    stderr: list[str] = []
    agent, worker, _, _ = run_agent(run_python, tmp_path, "return", agent_state="server-gone", agent_stderr=stderr)
    assert (agent["process"], agent["returncode"]) == ("Popen", 0)
    assert worker["argv"][1:] == ["return", "two words"] and worker["grandparent"] != agent["agent_pid"]
    assert "is gone" in stderr[0] and "workers start by exec" in stderr[0]


@pytest.mark.parametrize("behaviour,returncode,in_stderr", [
    ("exit3", 3, ""),
    ("raise", 1, "ValueError: boom"),
    ("sigkill", -signal.SIGKILL, ""),
    ("interrupt", -signal.SIGINT, "KeyboardInterrupt"),
])
def test_fork_start_reports_the_exit_code_or_signal_the_interpreter_would_end_with(
        run_python, tmp_path, behaviour, returncode, in_stderr):
    agent, _, _, err = run_agent(run_python, tmp_path, behaviour)
    assert agent["returncode"] == returncode
    assert in_stderr in err
    if behaviour == "sigkill":
        assert agent["zombie_until_polled"] is True


def test_fork_start_skips_an_unread_answer_and_keeps_the_status_the_server_reaped(run_python, tmp_path):
    agent, _, _, _ = run_agent(run_python, tmp_path, "exit3", agent_state="stale-answer")
    assert (agent["process"], agent["returncode"]) == ("ForkedWorker", 3)


def test_a_fork_request_interrupted_by_a_signal_kills_the_worker_nobody_owns(run_python, tmp_path):
    proc = run_python(AGENT, TESTS_DIR, tmp_path, "sleep", "interrupted-fork", timeout_s=120)
    assert proc.returncode == 0 and json.loads(proc.stdout.splitlines()[0]) == {"interrupted": True}, proc.stderr
    killed = re.search(r"worker (\d+) was forked for a start that a signal interrupted; it was killed", proc.stderr)
    assert killed, proc.stderr
    pid = int(killed[1])
    deadline = time.monotonic() + 10      # the agent is gone: its server ends, init reaps the killed worker
    while time.monotonic() < deadline and _alive(pid):
        time.sleep(0.05)
    assert not _alive(pid), f"worker {pid} still runs"


def test_fork_start_close_signals_the_workers_process_group_and_wait_times_out_while_it_runs(run_python, tmp_path):
    agent, _, _, _ = run_agent(run_python, tmp_path, "sleep")
    assert agent["timed_out"] and agent["returncode"] == -signal.SIGTERM


@pytest.mark.parametrize("argv,env,expected", [
    (["--standalone", "-m", "dtprobe.runtime.worker"], {}, True),
    (["--standalone", "-m", "dtprobe.runtime.worker"], {"DTPROBE_WORKER_START": "exec"}, False),
    (["--standalone", "-m", "dtprobe.runtime.launch_worker"], {}, False),
    (["--standalone", "train.py"], {}, False),
])
def test_fork_start_is_requested_only_for_dtprobes_worker_and_not_with_exec(argv, env, expected):
    assert fork_start.requested(argv, env) is expected


def test_fork_start_forks_only_python_u_m_of_the_worker_module():
    import sys

    assert fork_start.worker_args((sys.executable, "-u", "-m", fork_start.WORKER_MODULE, "a")) == ["a"]
    assert fork_start.worker_args(("numactl", "--cpunodebind=0", sys.executable, "-u", "-m",
                                   fork_start.WORKER_MODULE)) is None
    assert fork_start.worker_args((sys.executable, "-u", "train.py")) is None


# ------------------------------------------------------------------------------------------- dtprobe run

TINY = ("--nproc", "2", "--batch-size", "2", "--seq-len", "16", "--no-devices", "--timeout", "60")


def worker_files(run_dir: Path) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted((run_dir / "logs").rglob("worker.json"))]


def test_run_forks_workers_by_default_and_execs_them_when_asked_with_the_same_losses(run_cli, tmp_path):
    from dtprobe.store import RunStore

    losses = {}
    for start in ("fork", "exec"):
        run_dir = tmp_path / start
        flags = () if start == "fork" else ("--worker-start", "exec")
        proc = run_cli("run", "--run-dir", run_dir, *TINY, "--steps", "3", *flags, timeout_s=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert [w["start"] for w in worker_files(run_dir)] == [start, start]
        assert all(w["exit_code"] == 0 for w in worker_files(run_dir))
        steps = RunStore.open(run_dir, tables=["steps"]).table("steps")
        losses[start] = steps[steps["rank"] == 0].sort_values("step")["loss"].tolist()
    assert losses["fork"] == losses["exec"]


def _ppid(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


def test_sigterm_to_the_agent_stops_its_forked_workers(start_python, child_env, tmp_path):
    run_dir = tmp_path / "run"
    launcher = start_python("import sys, dtprobe.cli as c; sys.exit(c.main(sys.argv[1:]))", "run", "--run-dir",
                            run_dir, *TINY, "--steps", "100000", env=child_env(),
                            stdout=open(tmp_path / "out.log", "w"), stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 120
    workers: list[dict] = []
    while time.monotonic() < deadline and len(workers) < 2:
        assert launcher.poll() is None, (tmp_path / "out.log").read_text()[-3000:]
        try:
            workers = worker_files(run_dir) if (run_dir / "logs").is_dir() else []
        except ValueError:          # a file being replaced
            workers = []
        time.sleep(0.2)
    pids = [w["pid"] for w in workers]
    assert len(pids) == 2 and all(w["start"] == "fork" for w in workers)
    agent = _ppid(_ppid(pids[0]))        # a worker's parent is the agent's fork server
    try:
        os.kill(agent, signal.SIGTERM)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and any(_alive(p) for p in pids):
            time.sleep(0.1)
        assert not any(_alive(p) for p in pids)
        assert launcher.wait(timeout=120) == 1      # the run is recorded as crashed
    finally:
        for pid in pids:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)


def test_a_torch_without_the_handler_surfaces_leaves_workers_to_start_by_exec(monkeypatch, capsys):
    from torch.distributed.elastic.multiprocessing import api

    before = api.get_subprocess_handler
    monkeypatch.setattr(fork_start.torch_internals, "subprocess_handler_class", lambda: None)
    assert fork_start.install() is False
    assert api.get_subprocess_handler is before
    assert "start by exec" in capsys.readouterr().err
