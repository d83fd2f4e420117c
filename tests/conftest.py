"""Shared test harness: the repository's paths, the environment of every child process, free ports, and the
``dtprobe`` CLI, a Python snippet or a torchrun job started in a subprocess.

Every helper is a fixture (most return a function, so a test calls it with its own arguments); a test asks for
it by name instead of importing from here. ``tests/chaos/harness.py`` keeps its own copies because
``benchmarks/verdicts.py`` imports it outside pytest.

A child process gets ``OMP_NUM_THREADS=1`` (the CPU tests share a few cores between several ranks), the checkout
first on ``PYTHONPATH`` (so the code under test is the code in this tree), and none of the launcher variables
of an outer torchrun or ``dtprobe run`` (``RANK``, ``MASTER_ADDR``, ``DTPROBE_*``, ``TORCHELASTIC_*``): a test
started from inside a job must not join that job.

Markers (declared in pyproject.toml): ``multiproc``, ``browser``, ``chaos``, ``exclusive``, ``gpu``; the README's
test command deselects ``gpu`` (``-m "not gpu"``) on CPU machines.

The README's test command runs the suite on two pytest-xdist workers (``-n 2 --dist loadfile``). Two rules keep
that equal to a run on one worker:
- a test whose verdict depends on how fast its ranks ran (marked ``exclusive``) runs while no other test runs: the
  other worker finishes its test and waits;
- a file's tests stay on one worker, and files that use the same run made once per session share one, so module
  and session fixtures are made once; these units are handed out longest first (``tests/file_costs.json``).
Both are hooks of ``tests/suite_rules.py``, imported here.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from suite_rules import (pytest_collection_modifyitems, pytest_configure, pytest_runtest_protocol,  # noqa: F401
                         pytest_unconfigure, pytest_xdist_make_scheduler)

REPO_ROOT = Path(__file__).resolve().parents[1]
"""The checkout: the only folder the tests read outside their temporary directories."""
LAUNCHER_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
                      "ROLE_RANK", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
"""Variables torchrun sets for its workers; dropped from a child's environment with every ``DTPROBE_*`` and
``TORCHELASTIC_*`` variable."""
CLI_TIMEOUT_S = 300.0
"""Default limit of one CLI or Python child; a test that starts a longer job passes its own."""


def child_environment(**extra: str) -> dict[str, str]:
    """This process's environment for a child: one OpenMP thread, the checkout importable, no launcher
    variables of an outer job; ``extra`` is set last (e.g. ``RANK="1"`` for a rank the test starts itself)."""
    env = {k: v for k, v in os.environ.items()
           if k not in LAUNCHER_VARIABLES and not k.startswith(("DTPROBE_", "TORCHELASTIC_"))}
    path = os.pathsep.join(p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH", "")) if p)
    return {**env, "OMP_NUM_THREADS": "1", "PYTHONPATH": path, **extra}


@pytest.fixture(scope="session")
def repo_root() -> Path:
    """The checkout's root folder."""
    return REPO_ROOT


@pytest.fixture(scope="session")
def sample_traces_dir() -> Path:
    """``sample_traces/``: the checked-in runs made by ``dtprobe run``, one folder per scenario."""
    return REPO_ROOT / "sample_traces"


@pytest.fixture(scope="session")
def child_env() -> Callable[..., dict[str, str]]:
    """``child_env(**extra)``: the environment of a child process (see the module docstring)."""
    return child_environment


@pytest.fixture(scope="session")
def free_port() -> Callable[[], int]:
    """``free_port()``: a TCP port on 127.0.0.1 that was free a moment ago (for a rendezvous or a server)."""
    def pick() -> int:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]
    return pick


def run_to_end(cmd: list[str], *, env: dict[str, str], timeout_s: float,
               cwd: str | os.PathLike | None = None) -> subprocess.CompletedProcess:
    """``cmd`` to its end, output captured as text. The child leads a process group of its own, so a child that
    outlives ``timeout_s`` is stopped with everything it started (a ``dtprobe run``'s agent and workers): SIGTERM to
    the group, so the launcher can stop its workers, then SIGKILL after 20 s; then ``TimeoutExpired`` is raised."""
    proc = subprocess.Popen(cmd, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        for sig, grace_s in ((signal.SIGTERM, 20), (signal.SIGKILL, 30)):
            try:
                os.killpg(proc.pid, sig)
                proc.communicate(timeout=grace_s)
                break
            except ProcessLookupError:
                break
            except subprocess.TimeoutExpired:
                continue
        raise
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


@pytest.fixture(scope="session")
def run_cli() -> Callable[..., subprocess.CompletedProcess]:
    """``run_cli(*args, timeout_s=300, env=None, cwd=None)``: ``python -m dtprobe.cli *args`` to its end, output
    captured as text; ``env`` defaults to ``child_env()``. The caller checks ``returncode``."""
    def run(*args: str | os.PathLike, timeout_s: float = CLI_TIMEOUT_S, env: dict[str, str] | None = None,
            cwd: str | os.PathLike | None = None) -> subprocess.CompletedProcess:
        return run_to_end([sys.executable, "-m", "dtprobe.cli", *map(str, args)], env=env or child_environment(),
                          cwd=cwd, timeout_s=timeout_s)
    return run


@pytest.fixture(scope="session")
def run_python() -> Callable[..., subprocess.CompletedProcess]:
    """``run_python(code, *args, timeout_s=300, env=None)``: ``python -c code *args`` to its end, output captured
    as text; ``env`` defaults to ``child_env()``."""
    def run(code: str, *args: str | os.PathLike, timeout_s: float = CLI_TIMEOUT_S,
            env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
        return run_to_end([sys.executable, "-c", code, *map(str, args)], env=env or child_environment(),
                          timeout_s=timeout_s)
    return run


@pytest.fixture
def start_python(request) -> Callable[..., subprocess.Popen]:
    """``start_python(code, *args, env=None, **popen_kw)``: ``python -c code *args`` started and left running;
    SIGKILLed and reaped when the test ends, also when it fails."""
    def start(code: str, *args: str | os.PathLike, env: dict[str, str] | None = None,
              **popen_kw) -> subprocess.Popen:
        proc = subprocess.Popen([sys.executable, "-c", code, *map(str, args)], env=env or child_environment(),
                                **popen_kw)
        request.addfinalizer(lambda: _kill(proc))
        return proc
    return start


@pytest.fixture
def compacted_files_read(monkeypatch) -> Callable[..., list[str]]:
    """``compacted_files_read(keep=None)``: a list, filled as the test runs, of every compacted Parquet file the
    reader opens (relative to ``tables/``), read alone (``partitions.read_compacted_file``) or with others in one
    scan (``store.file_scan``); with ``keep(table, columns)`` (``columns`` None: every column) only those it keeps."""
    from dtprobe.store import file_scan, partitions

    def spy_on(keep: Callable[[str, Any], bool] | None = None) -> list[str]:
        seen: list[str] = []
        wanted = keep or (lambda table, columns: True)
        read_one, scan = partitions.read_compacted_file, file_scan._scan

        def read_one_spy(tables_dir, rel, name, *args, **kwargs):
            if wanted(name, kwargs.get("columns")):
                seen.append(rel)
            return read_one(tables_dir, rel, name, *args, **kwargs)

        def scan_spy(tables_dir, files, name, expr, columns):
            parts = scan(tables_dir, files, name, expr, columns)
            if parts is not None and wanted(name, columns):   # None: the scan fell back to one file at a time
                seen.extend(f.path for f in files)
            return parts

        monkeypatch.setattr(partitions, "read_compacted_file", read_one_spy)
        monkeypatch.setattr(file_scan, "_scan", scan_spy)
        return seen
    return spy_on


@pytest.fixture(scope="session")
def torchrun_cmd(free_port) -> Callable[..., list[str]]:
    """``torchrun_cmd(script, *args, nproc=2)``: the command of a one-node torchrun of ``script`` on ``nproc``
    local ranks with its rendezvous on 127.0.0.1 and a free port; torchrun's agent as ``dtprobe run`` starts it
    (``dtprobe.runtime.torchrun_agent``: ``torch.distributed.run`` ending without torch's teardown on success)."""
    def cmd(script: str | os.PathLike, *args: str | os.PathLike, nproc: int = 2) -> list[str]:
        return [sys.executable, "-m", "dtprobe.runtime.torchrun_agent", "--nnodes", "1", "--nproc-per-node", str(nproc),
                "--master-addr", "127.0.0.1", "--master-port", str(free_port()), str(script), *map(str, args)]
    return cmd


def _kill(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.kill()
    proc.wait(timeout=30)
    for stream in (proc.stdout, proc.stderr):
        if stream is not None:
            stream.close()


@pytest.fixture(scope="session")
def sample_trace_analyze(run_cli) -> Callable[[str], subprocess.CompletedProcess]:
    """``sample_trace_analyze(scenario)``: ``dtprobe analyze sample_traces/<scenario> --format json`` to its end,
    output captured as text (the caller checks ``returncode``). Made once per scenario and session for the tests
    that compare against what the CLI prints for a checked-in run (the exporters' gauges, scalars and metrics, the
    straggler scenario's golden): a checked-in run does not change while the suite runs."""
    done: dict[str, subprocess.CompletedProcess] = {}

    def analyze(scenario: str) -> subprocess.CompletedProcess:
        if scenario not in done:
            done[scenario] = run_cli("analyze", REPO_ROOT / "sample_traces" / scenario, "--format", "json",
                                     timeout_s=180)
        return done[scenario]
    return analyze


@pytest.fixture(scope="session")
def hang_rank1_run(tmp_path_factory, run_cli):
    """One ``dtprobe run`` (2 ranks, tiny job, no device sampling, no restarts) in which rank 1 hangs at step 5 and
    rank 0's watchdog ends the job after ``timeout_s``, made once for the tests that read it (the watchdog's
    rows in ``test_hang``, the HANG finding in ``test_findings_on_fault_injected_runs``). A namespace:
    ``proc`` (the finished ``dtprobe run``), ``run_dir``, ``timeout_s``, ``rank`` and ``step`` of the hang."""
    from types import SimpleNamespace

    hang = SimpleNamespace(run_dir=tmp_path_factory.mktemp("hang_rank1") / "hang", timeout_s=8, rank=1, step=5)
    hang.proc = run_cli("run", "--run-dir", hang.run_dir, "--no-devices", "--timeout", "120", "--batch-size", "2",
                        "--seq-len", "16", "--nproc", "2", "--steps", "12", "--collective-timeout", str(hang.timeout_s),
                        "--inject", f"hang:rank={hang.rank},step={hang.step}", timeout_s=400)
    return hang


@pytest.fixture(scope="session")
def fp16_overflow_run(tmp_path_factory, run_cli):
    """One ``dtprobe run`` (2 ranks, tiny job, fp16 with a loss scaler, no device sampling) of ``steps`` steps in
    which rank 1's gradients overflow at step ``step``, made once for the tests that read it (the amp rows in
    ``test_precision``, the AMP_OVERFLOW finding in ``test_findings_on_fault_injected_runs``). A namespace:
    ``proc`` (the finished ``dtprobe run``), ``run_dir``, ``steps``, ``rank`` and ``step`` of the overflow."""
    from types import SimpleNamespace

    run = SimpleNamespace(run_dir=tmp_path_factory.mktemp("fp16_overflow") / "run", steps=14, rank=1, step=10)
    run.proc = run_cli("run", "--run-dir", run.run_dir, "--no-devices", "--timeout", "120", "--batch-size", "2",
                       "--seq-len", "16", "--nproc", "2", "--steps", str(run.steps), "--precision", "fp16",
                       "--inject", f"overflow:step={run.step},rank={run.rank}", timeout_s=420)
    return run


@pytest.fixture(scope="session")
def crash_restart_run(tmp_path_factory, run_cli):
    """One ``dtprobe run`` (2 ranks, tiny job, no device sampling) of ``steps`` steps with a checkpoint every
    ``ckpt_every`` steps and one restart allowed, in which rank 1 crashes at step ``step`` and the job resumes
    from the checkpoint; made once for the tests that read it (the resume in ``test_recovery``, the RANK_CRASH
    finding in ``test_findings_on_fault_injected_runs``). A namespace: ``proc`` (the finished ``dtprobe run``),
    ``run_dir``, ``steps``, ``ckpt_every``, ``rank`` and ``step`` of the crash."""
    from types import SimpleNamespace

    run = SimpleNamespace(run_dir=tmp_path_factory.mktemp("crash_restart") / "crash", steps=20, ckpt_every=5, rank=1,
                          step=15)
    run.proc = run_cli("run", "--run-dir", run.run_dir, "--no-devices", "--timeout", "120", "--batch-size", "2",
                       "--seq-len", "16", "--nproc", "2", "--steps", str(run.steps), "--ckpt-every",
                       str(run.ckpt_every), "--max-restarts", "1", "--inject", f"crash:rank={run.rank},step={run.step}",
                       timeout_s=480)
    return run


@pytest.fixture(scope="session")
def clean_dp4_run(tmp_path_factory, run_cli):
    """One clean ``dtprobe run`` of the tiny model on 4 CPU ranks (data parallel, device sampling on) of ``steps``
    steps: step 0 is the warm-up, then the 20 steps a straggler verdict judges. Made once for the tests that read
    it (no STRAGGLER in ``test_stragglers_on_dp4_runs``, the dp4 calibration in ``test_planner_calibrate_runs``).
    A namespace: ``proc`` (the finished ``dtprobe run``), ``run_dir``, ``steps`` and ``flags`` (the job's flags
    but the run directory, for runs that must differ from it by one flag only)."""
    from types import SimpleNamespace

    run = SimpleNamespace(run_dir=tmp_path_factory.mktemp("clean_dp4") / "clean_dp4", steps=21)
    run.flags = ("--nproc", "4", "--device", "cpu", "--model", "tiny", "--steps", str(run.steps), "--timeout", "120")
    run.proc = run_cli("run", *run.flags, "--run-dir", run.run_dir, timeout_s=600)
    return run

