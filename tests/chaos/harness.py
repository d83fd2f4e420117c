"""Chaos harness: start a real job, find its workers, hurt them from outside, read the verdict.

Used by the chaos tests beside it (through ``conftest.py``'s fixtures and imports) and by
``benchmarks/verdicts.py``. Every fault here is caused from outside the training processes (a signal, CPU
pinning and a busy process, a CPU quota, bytes changed on disk): nothing is injected with ``--inject``, so a
verdict can only come from telemetry.

Every process a helper starts is stopped by its PID when the helper ends (``Job.stop``, ``BusyLoop.stop``,
``V1Cgroup.remove``); the callers register those in finalizers so a failing test cleans up too.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import psutil

ROOT = Path(__file__).resolve().parents[2]
CGROUP_CPU = Path("/sys/fs/cgroup/cpu")
CGROUP_MEMORY = Path("/sys/fs/cgroup/memory")
RUNS_ENV = "DTPROBE_CHAOS_RUNS"
"""When set, each scenario's run directory is kept as ``$DTPROBE_CHAOS_RUNS/<scenario>`` (for inspection)."""
TINY = ("--batch-size", "2", "--seq-len", "16")
"""The tiny-job flags every chaos run uses."""


class ChaosError(RuntimeError):
    """The job did not reach the state a fault needs (it ended early, or took too long)."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def job_env(**extra: str) -> dict[str, str]:
    """The environment of every job: one OpenMP thread per rank, the checkout importable."""
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": path, "MASTER_ADDR": "127.0.0.1", **extra}


def scenario_dir(scenario: str, fallback: Path) -> Path:
    """``$DTPROBE_CHAOS_RUNS/<scenario>`` (emptied) when that variable is set, else ``fallback/<scenario>``."""
    keep = os.environ.get(RUNS_ENV)
    run_dir = Path(keep) / scenario if keep else Path(fallback) / scenario
    if run_dir.exists():
        shutil.rmtree(run_dir)
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    return run_dir


def dtprobe_run_cmd(run_dir: Path, *flags: str, devices: bool = False, pg_timeout_s: int = 60) -> list[str]:
    """``dtprobe run`` of the tiny job into ``run_dir`` with ``flags`` (device sampling off unless ``devices``)."""
    return [sys.executable, "-m", "dtprobe.cli", "run", "--run-dir", str(run_dir), "--timeout", str(pg_timeout_s),
            *TINY, *(() if devices else ("--no-devices",)), *flags]


def torchrun_cmd(script: Path, *args: str, nproc: int) -> list[str]:
    """torchrun (no ``dtprobe run``) of ``script`` on ``nproc`` local ranks, rendezvous on a free port; its agent
    as ``dtprobe run`` starts it (``dtprobe.runtime.torchrun_agent``: ``torch.distributed.run``'s arguments, logs
    and exit codes, ending without torch's teardown when every worker succeeded)."""
    return [sys.executable, "-m", "dtprobe.runtime.torchrun_agent", "--nnodes", "1", "--nproc-per-node", str(nproc),
            "--master-addr", "127.0.0.1", "--master-port", str(free_port()), "--monitor-interval", "0.5",
            str(script), *args]


# ---------------------------------------------------------------------------------------------- the job


def rank_file(run_dir: Path, rank: int) -> Path:
    return Path(run_dir) / "ranks" / f"rank{rank:05d}.json"


def read_rank(run_dir: Path, rank: int) -> dict | None:
    """The rank's ``ranks/rankNNNNN.json`` (pid, restart, ...), or None while it is absent or half-written."""
    try:
        return json.loads(rank_file(run_dir, rank).read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def steps_done(run_dir: Path, rank: int, *, restart: int = 0) -> int:
    """How many step rows of ``restart`` the rank has written to ``events/steps/rankNNNNN.jsonl`` so far."""
    path = Path(run_dir) / "events" / "steps" / f"rank{rank:05d}.jsonl"
    try:
        lines = path.read_bytes().splitlines()
    except FileNotFoundError:
        return 0
    count = 0
    for line in lines:
        try:
            row = json.loads(line)
        except json.JSONDecodeError:        # a torn last line
            continue
        count += int(row.get("restart", 0) == restart and row.get("end_ns") is not None)
    return count


def is_alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie counts as dead)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False


def pending_signals(pid: int) -> set[int]:
    """Signals sent to ``pid`` and not delivered yet (a stopped process keeps its SIGTERM pending)."""
    mask = 0
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(("SigPnd:", "ShdPnd:")):
                mask |= int(line.split()[1], 16)
    except FileNotFoundError:
        return set()
    return {sig for sig in range(1, 65) if mask >> (sig - 1) & 1}


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


@dataclass
class Job:
    """One launched job (``dtprobe run`` or torchrun) and the worker pids it reported; ``stop`` ends them all.

    torchrun starts each worker in its own session (and ``dtprobe run`` its agent), so stopping the launcher's
    process group does not reach them: ``stop`` also kills the launcher's descendants and every worker pid seen in
    ``ranks/*.json`` that still runs a Python process.
    """

    cmd: list[str]
    run_dir: Path
    timeout_s: float
    env: dict[str, str] = field(default_factory=job_env)
    proc: subprocess.Popen | None = None
    worker_pids: set[int] = field(default_factory=set)
    stopped_pids: set[int] = field(default_factory=set)
    started: float = 0.0

    def start(self) -> "Job":
        self.run_dir.parent.mkdir(parents=True, exist_ok=True)
        self.log = open(self.run_dir.parent / f"{self.run_dir.name}.launcher.log", "w")
        self.proc = subprocess.Popen(self.cmd, env=self.env, stdout=self.log, stderr=subprocess.STDOUT,
                                     start_new_session=True, cwd=str(ROOT))
        self.started = time.monotonic()
        return self

    @property
    def remaining_s(self) -> float:
        return self.timeout_s - (time.monotonic() - self.started)

    def output(self) -> str:
        self.log.flush()
        return (self.run_dir.parent / f"{self.run_dir.name}.launcher.log").read_text(errors="replace")

    def worker_pid(self, rank: int, *, restart: int = 0) -> int:
        """The pid of ``rank`` in attempt ``restart`` (waits for its ``ranks/`` file)."""
        def current():
            info = read_rank(self.run_dir, rank)
            return info if info and info.get("restart", 0) == restart and info.get("pid") else None
        self.wait_for(lambda: current() is not None, what=f"rank {rank}'s ranks/ file (restart {restart})")
        pid = int(current()["pid"])
        self.worker_pids.add(pid)
        return pid

    def wait_for(self, predicate: Callable[[], bool], *, what: str, timeout_s: float | None = None,
                 poll_s: float = 0.05) -> None:
        """Poll ``predicate`` until true; ChaosError if the job ends first or the time runs out."""
        deadline = time.monotonic() + (self.remaining_s if timeout_s is None else min(timeout_s, self.remaining_s))
        while not predicate():
            if self.proc.poll() is not None:
                raise ChaosError(f"the job ended (exit {self.proc.returncode}) before {what}:\n{self.output()[-3000:]}")
            if time.monotonic() > deadline:
                raise ChaosError(f"timed out waiting for {what}:\n{self.output()[-3000:]}")
            time.sleep(poll_s)

    def wait_steps(self, rank: int, num_steps: int, *, restart: int = 0) -> None:
        self.wait_for(lambda: steps_done(self.run_dir, rank, restart=restart) >= num_steps,
                      what=f"rank {rank} to finish {num_steps} steps (restart {restart})")

    def signal(self, rank: int, sig: signal.Signals, *, restart: int = 0) -> int:
        """Send ``sig`` to ``rank``'s worker process; returns its pid."""
        pid = self.worker_pid(rank, restart=restart)
        if sig == signal.SIGSTOP:
            self.stopped_pids.add(pid)
        os.kill(pid, sig)
        if sig == signal.SIGCONT:
            self.stopped_pids.discard(pid)
        return pid

    def end_stopped(self, rank: int, *, restart: int = 0) -> None:
        """End a SIGSTOPped rank the way torchrun does once the job failed, without its grace period: wait for
        torchrun's SIGTERM to be pending on it (a stopped process cannot act on it), then SIGKILL it."""
        pid = self.worker_pid(rank, restart=restart)
        self.wait_for(lambda: signal.SIGTERM in pending_signals(pid) or not is_alive(pid),
                      what=f"torchrun to SIGTERM the stopped rank {rank}")
        self.signal(rank, signal.SIGKILL, restart=restart)

    def wait(self) -> int:
        """Wait for the launcher to exit within the job's time; its exit code."""
        try:
            return self.proc.wait(timeout=max(1.0, self.remaining_s))
        except subprocess.TimeoutExpired:
            raise ChaosError(f"the job ran past {self.timeout_s:.0f} s:\n{self.output()[-3000:]}") from None

    def stop(self) -> None:
        """Kill what is left: the stopped workers first (SIGKILL reaches a stopped process), then the launcher's
        process group and every worker pid the job reported that is still a live Python process."""
        for rank in range(64):
            info = read_rank(self.run_dir, rank)
            if info is None:
                if not rank_file(self.run_dir, rank).exists():
                    break
                continue
            if info.get("pid"):
                self.worker_pids.add(int(info["pid"]))
        tree: set[int] = set()
        if self.proc is not None and self.proc.poll() is None:
            try:                          # the launcher's descendants: torchrun's agent runs in its own session
                tree = {p.pid for p in psutil.Process(self.proc.pid).children(recursive=True)}
            except psutil.NoSuchProcess:
                pass
        for pid in sorted(self.stopped_pids | self.worker_pids | tree):
            if is_alive(pid) and "python" in _cmdline(pid):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        if self.proc is not None and self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait(timeout=30)
        if getattr(self, "log", None):
            self.log.close()


# -------------------------------------------------------------------------------------------- CPU faults


HOG_SOURCE = """
import sys, time
busy_s, idle_s = float(sys.argv[1]), float(sys.argv[2])
while True:
    end = time.perf_counter() + busy_s
    while time.perf_counter() < end:
        pass
    time.sleep(idle_s)
"""


@dataclass
class BusyLoop:
    """A busy process pinned to ``core``: it spins ``duty`` of every 10 ms and sleeps the rest. At real-time
    priority (SCHED_FIFO 1, the default) it takes that share of the core before any ordinary process. A rank
    pinned there keeps the rest; on a machine busy with other (unpinned) work the scheduler moves that work to
    the other cores, which slows their ranks too, so the hog singles a rank out only when the rest of the
    machine is quiet (a CPU quota, ``cpu_quota_cgroup``, does regardless). ``stop`` kills it by PID."""

    core: int
    duty: float = 0.6
    realtime: bool = True
    proc: subprocess.Popen | None = None

    def start(self) -> "BusyLoop":
        period_s = 0.010
        prio = ["chrt", "-f", "1"] if self.realtime else []
        self.proc = subprocess.Popen([*prio, "taskset", "-c", str(self.core), sys.executable, "-c", HOG_SOURCE,
                                      str(self.duty * period_s), str((1 - self.duty) * period_s)],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        try:
            err = self.proc.communicate(timeout=0.3)[1].decode(errors="replace")
        except subprocess.TimeoutExpired:
            return self                  # spinning
        raise ChaosError(f"the busy process on core {self.core} exited ({self.proc.returncode}): {err.strip()} "
                         f"(real-time priority needs root or CAP_SYS_NICE; pass realtime=False without them)")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)


def cpu_seconds(pid: int) -> float:
    """CPU time (user + system) ``pid`` has used so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def pin(pid: int, core: int) -> None:
    """Pin every thread of ``pid`` to ``core`` (threads it starts later inherit the mask)."""
    subprocess.run(["taskset", "-a", "-p", "-c", str(core), str(pid)], check=True, capture_output=True, timeout=10)


def cgroup_v1_cpu_available() -> bool:
    return (CGROUP_CPU / "cpu.cfs_quota_us").is_file() and os.access(CGROUP_CPU, os.W_OK)


def cgroup_v1_memory_available() -> bool:
    return (CGROUP_MEMORY / "memory.limit_in_bytes").is_file() and os.access(CGROUP_MEMORY, os.W_OK)


@dataclass
class V1Cgroup:
    """A cgroup of one cgroup v1 controller (``root``, e.g. /sys/fs/cgroup/cpu) whose ``settings`` (file name ->
    value) are written when it is made. ``add`` moves a process (all its threads) in; ``remove`` moves them back to
    the cgroup each came from and deletes the cgroup."""

    root: Path
    settings: dict[str, int]
    name: str = ""
    path: Path | None = None
    origins: dict[int, Path] = field(default_factory=dict)

    def create(self) -> "V1Cgroup":
        self.name = self.name or f"dtprobe-chaos-{os.getpid()}-{time.monotonic_ns()}"
        self.path = self.root / self.name
        self.path.mkdir()
        for name, value in self.settings.items():
            (self.path / name).write_text(str(value))
        return self

    def add(self, pid: int) -> None:
        self.origins[pid] = self.root / _cgroup_of(pid, self.root.name).lstrip("/")
        (self.path / "cgroup.procs").write_text(str(pid))

    def remove(self) -> None:
        if self.path is None or not self.path.exists():
            return
        for pid in (self.path / "cgroup.procs").read_text().split():
            origin = self.origins.get(int(pid), self.root)
            try:
                (origin / "cgroup.procs").write_text(pid)
            except OSError:          # exited meanwhile, or the origin is gone: the root always takes it
                try:
                    (self.root / "cgroup.procs").write_text(pid)
                except OSError:
                    pass
        for _ in range(50):          # rmdir fails while the kernel still counts an exiting task
            try:
                self.path.rmdir()
                return
            except OSError:
                time.sleep(0.1)
        self.path.rmdir()


def cpu_quota_cgroup(frac: float, *, period_us: int = 100_000) -> V1Cgroup:
    """A cpu cgroup limiting its processes to ``frac`` of one core (``cpu.cfs_quota_us`` / ``cpu.cfs_period_us``)."""
    return V1Cgroup(CGROUP_CPU, {"cpu.cfs_period_us": period_us,
                                 "cpu.cfs_quota_us": max(1000, int(frac * period_us))})


def memory_limit_cgroup(limit_bytes: int) -> V1Cgroup:
    """A memory cgroup whose processes may charge at most ``limit_bytes`` (memory and swap): the kernel's OOM
    killer ends the one that goes over. Only pages charged after a process moves in count."""
    settings = {"memory.limit_in_bytes": limit_bytes}
    if (CGROUP_MEMORY / "memory.memsw.limit_in_bytes").is_file():
        settings["memory.memsw.limit_in_bytes"] = limit_bytes   # after the memory limit: never below it
    return V1Cgroup(CGROUP_MEMORY, settings)


def _cgroup_of(pid: int, controller: str) -> str:
    for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if controller in controllers.split(","):
            return path
    return "/"


# ---------------------------------------------------------------------------------------- files on disk


def committed_checkpoints(run_dir: Path) -> list[Path]:
    """Committed checkpoint dirs (with COMMIT.json), oldest first."""
    root = Path(run_dir) / "checkpoints"
    return sorted(p for p in root.glob("step*") if (p / "COMMIT.json").is_file())


def largest_data_file(ckpt: Path) -> Path:
    """The biggest file a checkpoint's COMMIT.json lists (a rank's DCP shard)."""
    files = json.loads((ckpt / "COMMIT.json").read_text())["files"]
    return ckpt / max(files, key=lambda name: (files[name]["num_bytes"], name))


def truncate(path: Path, *, keep_frac: float = 0.5) -> None:
    size = path.stat().st_size
    with open(path, "r+b") as f:
        f.truncate(int(size * keep_frac))


def flip_bit(path: Path, *, offset: int | None = None, bit: int = 3) -> int:
    """Flip one bit of ``path`` (in the middle by default); returns the byte offset."""
    offset = path.stat().st_size // 2 if offset is None else offset
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([byte ^ (1 << bit)]))
    return offset


# -------------------------------------------------------------------------------------------- verdicts


def analyze(run_dir: Path, *, timeout_s: float = 180) -> dict:
    """``dtprobe analyze RUN --format json``: the dtprobe.findings/1 document (exit 0 or 1, else ChaosError)."""
    proc = subprocess.run([sys.executable, "-m", "dtprobe.cli", "analyze", str(run_dir), "--format", "json"],
                          env=job_env(), capture_output=True, text=True, timeout=timeout_s, cwd=str(ROOT))
    try:                                 # exit 1 is also Python's for an uncaught error: parse to tell
        doc = json.loads(proc.stdout) if proc.returncode in (0, 1) else None
    except json.JSONDecodeError:
        doc = None
    if doc is None:
        raise ChaosError(f"dtprobe analyze {run_dir} exited {proc.returncode} without a report:\n"
                         f"{proc.stderr[-3000:]}")
    return doc


def _jsonl_rows(run_dir: Path, kind: str):
    """Every parseable row of ``events/<kind>/rank*.jsonl`` (a torn last line is skipped)."""
    for path in sorted((Path(run_dir) / "events" / kind).glob("rank*.jsonl")):
        for line in path.read_bytes().splitlines():
            try:
                yield json.loads(line)
            except json.JSONDecodeError:
                continue


def own_compute_ms(run_dir: Path, first_step: int, last_step: int) -> dict[int, float]:
    """Per rank, the median per step of its own compute over steps ``first_step``..``last_step``, read from the raw
    events (not from dtprobe's analysis), in ms, for a slowdown's size (``benchmarks/verdicts.py``): fwd + opt of
    its ``events/steps`` rows; for a pipeline rank the summed length of its ``events/pipeline`` actions instead (its
    fwd also holds the waits for the previous stage's activations, an action's span does not). Rows of every
    restart in the range count alike; ranks without such rows are left out."""
    per_step: dict[tuple[int, int, int], float] = {}
    for row in _jsonl_rows(run_dir, "pipeline"):
        if first_step <= row.get("step", -1) <= last_step and row.get("start_ns") is not None \
                and row.get("end_ns") is not None:
            key = (int(row["rank"]), row.get("restart", 0), row["step"])
            per_step[key] = per_step.get(key, 0.0) + (row["end_ns"] - row["start_ns"]) / 1e6
    pipelined = {rank for rank, _, _ in per_step}
    for row in _jsonl_rows(run_dir, "steps"):
        if first_step <= row.get("step", -1) <= last_step and row.get("fwd_ns") is not None \
                and row.get("opt_ns") is not None and int(row["rank"]) not in pipelined:
            per_step[(int(row["rank"]), row.get("restart", 0), row["step"])] = (row["fwd_ns"] + row["opt_ns"]) / 1e6
    own: dict[int, list[float]] = {}
    for (rank, _, _), ms in per_step.items():
        own.setdefault(rank, []).append(ms)
    return {r: sorted(v)[len(v) // 2] for r, v in own.items()}


def job_step_ms(run_dir: Path, first_step: int, last_step: int) -> float | None:
    """The job's step time over steps ``first_step``..``last_step``, read from the raw ``events/steps`` rows (not
    from dtprobe's analysis), in ms: the median over steps of the median over ranks of a step row's length. Of a
    step run twice (a restart), the last attempt's rows; None without rows in the range."""
    rows: dict[tuple[int, int], tuple[int, float]] = {}
    for row in _jsonl_rows(run_dir, "steps"):
        step, restart = row.get("step", -1), row.get("restart", 0) or 0
        if first_step <= step <= last_step and row.get("start_ns") is not None and row.get("end_ns") is not None:
            key = (int(row["rank"]), step)
            if key not in rows or restart >= rows[key][0]:
                rows[key] = (restart, (row["end_ns"] - row["start_ns"]) / 1e6)
    per_step: dict[int, list[float]] = {}
    for (_, step), (_, ms) in rows.items():
        per_step.setdefault(step, []).append(ms)
    if not per_step:
        return None
    return statistics.median(statistics.median(v) for v in per_step.values())


def own_work_ms(run_dir: Path, first_step: int, last_step: int) -> dict[int, float]:
    """Per rank, the median over steps ``first_step``..``last_step`` of the time it spent on its own between two
    synchronization points, read from the raw ``events/steps`` and ``events/collectives`` rows (not from dtprobe's
    analysis), in ms: from the end of its backward in step s-1 (under data parallelism that is where it last waited
    for its peers: the gradient all-reduce is waited for inside backward) to its first collective's enqueue in step
    s. That span holds opt, the step's bookkeeping, data, fwd and backward up to the first gradient bucket: all the
    work that makes a rank arrive late, and no waiting on others, so a victim's is no longer than its peers'.
    The median of the per-step sums, not a sum of per-phase medians: a CPU quota throttles a rank in whichever
    phase the period runs out. Steps pair within one restart."""
    backward_end: dict[tuple[int, int, int], int] = {}
    for row in _jsonl_rows(run_dir, "steps"):
        if all(row.get(k) is not None for k in ("start_ns", "data_ns", "fwd_ns", "bwd_ns")):
            key = (int(row["rank"]), row.get("restart", 0), row["step"])
            backward_end[key] = row["start_ns"] + row["data_ns"] + row["fwd_ns"] + row["bwd_ns"]
    first_enqueue: dict[tuple[int, int, int], int] = {}
    for row in _jsonl_rows(run_dir, "collectives"):
        step = row.get("step", -1)
        if first_step <= step <= last_step and row.get("enqueue_ns") is not None:
            key = (int(row["rank"]), row.get("restart", 0), step)
            first_enqueue[key] = min(first_enqueue.get(key, row["enqueue_ns"]), row["enqueue_ns"])
    own: dict[int, list[float]] = {}
    for (rank, restart, step), enqueue_ns in first_enqueue.items():
        left_ns = backward_end.get((rank, restart, step - 1))
        if left_ns is not None and enqueue_ns > left_ns:
            own.setdefault(rank, []).append((enqueue_ns - left_ns) / 1e6)
    return {r: sorted(v)[len(v) // 2] for r, v in own.items()}


def own_work_excess_ms(run_dir: Path, rank: int, first_step: int, last_step: int,
                       peers: list[int] | None = None) -> float:
    """How much longer ``rank``'s own work was than its slowest peer's (``peers``, default every other rank) over
    steps ``first_step``..``last_step``, in ms: the time between synchronization points (``own_work_ms``), or for
    a pipeline rank (one with ``events/pipeline`` actions) its summed action lengths (``own_compute_ms``): its
    first collective of a step is a send/recv, whose wait for the other stage that span would hold."""
    median = (own_compute_ms if _has_rows(run_dir, "pipeline", rank) else own_work_ms)(run_dir, first_step, last_step)
    peers = [r for r in (median if peers is None else peers) if r != rank and r in median]
    if rank not in median or not peers:
        raise ChaosError(f"{run_dir}: no step and collective rows of rank {rank} and a peer in steps "
                         f"{first_step}-{last_step}")
    return median[rank] - max(median[r] for r in peers)


def _has_rows(run_dir: Path, kind: str, rank: int) -> bool:
    """Whether ``rank`` wrote any row of the events table ``kind``."""
    path = run_dir / "events" / kind / f"rank{rank:05d}.jsonl"
    return path.is_file() and path.stat().st_size > 0


def straggler_confirmed(run_dir: Path, finding: dict) -> bool:
    """Whether the raw rows confirm a STRAGGLER finding: its rank's own work (``own_work_excess_ms``) over the
    finding's window is longer than every other member's of its group by at least half its lateness
    (``mean_lateness_ms``, the figure its title gives). A rank that arrives late because it is slow spends about
    its lateness there (a slowed core, a CPU quota, a busy neighbour in every run measured); a verdict made of
    waiting (a victim, a slow link) has no excess of its own."""
    ev = finding["evidence"]
    excess_ms = own_work_excess_ms(run_dir, finding["ranks"][0], *ev["window"], peers=ev.get("pg_ranks"))
    return excess_ms >= ev["mean_lateness_ms"] / 2


def findings_of(doc: dict, code: str) -> list[dict]:
    return [f for f in doc["findings"] if f["code"] == code]


def summary(doc: dict) -> str:
    """One line per finding (code, severity, ranks, title): what an assertion message shows."""
    return "\n".join(f"{f['code']} {f['severity']} ranks={f['ranks']} {f['title']}" for f in doc["findings"])


VERDICT_SEVERITIES = ("warning", "critical")


def verdicts_on(doc: dict, codes: tuple[str, ...], rank: int | None = None) -> list[dict]:
    """Warning/critical findings of ``codes`` (naming ``rank`` when given)."""
    return [f for f in doc["findings"] if f["code"] in codes and f["severity"] in VERDICT_SEVERITIES
            and (rank is None or rank in f["ranks"])]


def assert_only_confirmed_stragglers(run_dir: Path, doc: dict, codes: tuple[str, ...]) -> None:
    """No warning/critical finding of ``codes`` except a STRAGGLER that the raw step rows confirm
    (``straggler_confirmed``). The vCPUs of a shared VM run at different speeds for stretches (the host runs other
    guests' work beside them), so a job with one rank pinned per vCPU has real stragglers no fault caused: true
    verdicts, not what a fault test is about. A verdict made of the fault's aftermath (a survivor that waited on a
    killed, stopped or cut-off rank, a link's slowness blamed on compute) has no compute excess of its own and
    fails."""
    for f in verdicts_on(doc, codes):
        assert f["code"] == "STRAGGLER", summary(doc)
        if not straggler_confirmed(run_dir, f):
            excess = own_work_excess_ms(run_dir, f["ranks"][0], *f["evidence"]["window"])
            raise AssertionError(f"{f['title']}: its own work between syncs is only {excess:.2f} ms longer than its "
                                 f"peers'\n"
                                 f"{summary(doc)}")
