"""The launcher of ``dtprobe run``: validates the job, prepares the run directory, runs torchrun, shows progress,
and finalizes the store (status, compaction). Called by ``dtprobe.commands.run``.

One launcher per node. Node 0 creates ``<run>/job.json`` (the resolved ``JobConfig``) and the manifest; other
nodes wait for both (the run dir must be on a shared filesystem) and pass the same job to their workers.
torchrun's agent (``runtime.torchrun_agent``) starts the workers as forks of its warm fork server once it imported
torch and the worker (``--worker-start fork``, ``runtime.fork_start``) or by exec (``--worker-start exec``,
torchrun's own start).
torchrun runs in its own session; its log goes to ``<run>/logs/torchrun.node<K>.log`` and each worker's
stdout/stderr to ``<run>/logs/node<K>/<rdzv id>/attempt_<n>/<local rank>/``. Progress is read from the steps rows
of the rank that reports the loss (rank 0, or with pipeline parallelism the first rank holding the last stage:
``parallel.mesh.loss_rank``) by tailing its ``events/steps/rankNNNNN.jsonl`` (nothing in the workers' loop).
When torchrun exits, node 0 sets the status (``finished`` on exit code 0, else ``crashed``), compacts the store
and prints a summary. Exit code: 0 finished, 1 crashed, 130 interrupted (Ctrl-C or SIGTERM terminates the
torchrun process group; so does any error of the launcher itself).

Attempts: every node's launcher records each torchrun attempt of its own node in run.json's ``attempts``
(``store.manifest.record_attempt``, under the manifest lock): an attempt once the next one has started (seen while
following), the last one when torchrun exits. Per rank: pid, exit code, signal, whether torchrun reported it as
the attempt's first observed failure, when, and its Python exception. Sources (``runtime.attempts``, most robust
first): the per-attempt, per-local-rank directories of torchrun's ``--log-dir`` holding torchelastic's error file
(the worker's ``@record`` writes the exception's type, message and traceback) and the worker's ``worker.json``
(rank, pid, clean exit); torchrun's ``failed (exitcode: X) local_rank: L (pid: P)`` and ``Sending process P
closing signal S`` log lines (exit code of the first failure; workers the agent stopped); and the ``Root Cause``
summary torchrun prints when it gives up (exit codes of every failed worker of the last attempt); and the
launcher's own sight of the workers (a thread checking their pids in ``/proc`` every 50 ms: when each exited, and
its exit status while it waits to be reaped), which also corrects torchrun's first failure when torchrun's
one-second ordering picked a rank that exited later.
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Callable

import orjson

from dtprobe.runtime.attempts import ExitWatcher, attempt_dirs, open_pidfd, read_attempts
from dtprobe.runtime.config import WORKER_START_ENV, JobConfig
from dtprobe.runtime.parallel.mesh import loss_rank
from dtprobe.store import manifest as store_manifest
from dtprobe.store.errors import ConfigError
from dtprobe.store.schema import EVENTS_FILE, MANIFEST_FILE

JOB_FILE = "job.json"
LOGS_DIR = "logs"
PACKAGE_ROOT = Path(__file__).resolve().parents[2]
"""The directory holding the ``dtprobe`` package (put first on the workers' PYTHONPATH, so they run this copy)."""
_POLL_S = 0.5


def default_run_dir(job: JobConfig, *, dp: int, root: str = "runs") -> Path:
    """``runs/<YYYYmmdd-HHMMSS>-<model>-dp<N>`` (with a numeric suffix if taken)."""
    return timestamped_dir(f"{job.model.name}-dp{dp}", root=root)


def timestamped_dir(label: str, *, root: str = "runs") -> Path:
    """``<root>/<YYYYmmdd-HHMMSS>-<label>``, with a numeric suffix if that exists (not created)."""
    base = Path(root) / f"{time.strftime('%Y%m%d-%H%M%S')}-{label}"
    path, n = base, 1
    while path.exists():
        n += 1
        path = base.with_name(f"{base.name}-{n}")
    return path


def prepare(job: JobConfig, *, command: list[str]) -> JobConfig:
    """Validate everything that can be checked before launch; on node 0 create the run dir, job.json and the
    manifest; on other nodes wait for them. Returns the job with an absolute ``run_dir``."""
    layout = job.resolve_layout()
    if job.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise ConfigError("--device cuda but torch sees no CUDA device here; use --device cpu or auto.")
    run_dir = Path(job.run_dir) if job.run_dir else default_run_dir(job, dp=layout.dp)
    job = replace(job, run_dir=str(run_dir.resolve()))
    run_dir = Path(job.run_dir)
    if job.node_rank != 0:
        _wait_for(run_dir / MANIFEST_FILE, timeout_s=job.timeout_s,
                  hint="node 0's launcher creates it; is --run-dir on a filesystem shared by every node?")
        return replace(load_job_json(run_dir), node_rank=job.node_rank)
    if (run_dir / MANIFEST_FILE).exists():
        raise ConfigError(f"--run-dir {run_dir} already holds a run ({MANIFEST_FILE}); choose a new directory "
                          f"or remove that one.")
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / JOB_FILE).write_text(json.dumps(job.to_dict(), indent=1) + "\n")
    store_manifest.create_manifest(run_dir, run_id=run_dir.name, command=command, config=job.to_dict(),
                                   world_size=job.world_size, nnodes=job.nnodes)
    return job


def load_job_json(run_dir: Path) -> JobConfig:
    from dtprobe.runtime.config import load_job

    return load_job(run_dir / JOB_FILE)


def torchrun_command(job: JobConfig) -> list[str]:
    """``python -m dtprobe.runtime.torchrun_agent ... -m dtprobe.runtime.worker`` for this node (torchrun's own
    agent, ``torch.distributed.run``, ending without torch's teardown on success)."""
    run_dir = Path(job.run_dir)
    cmd = [sys.executable, "-m", "dtprobe.runtime.torchrun_agent", "--nnodes", str(job.nnodes),
           "--nproc-per-node", str(job.nproc), "--max-restarts", str(job.max_restarts),
           "--monitor-interval", "0.5", "--log-dir", str(run_dir / LOGS_DIR / f"node{job.node_rank}"),
           "--redirects", "3"]
    if job.nnodes == 1 and not job.rdzv_endpoint:
        cmd.append("--standalone")
    else:
        cmd += ["--node-rank", str(job.node_rank), "--rdzv-backend", "c10d", "--rdzv-endpoint", job.rdzv_endpoint,
                "--rdzv-id", run_dir.name]
    return cmd + ["-m", "dtprobe.runtime.worker"]


def worker_env(job: JobConfig) -> dict[str, str]:
    env = dict(os.environ)
    env["DTPROBE_JOB"] = str(Path(job.run_dir) / JOB_FILE)
    env[WORKER_START_ENV] = job.worker_start     # read by the agent (runtime.torchrun_agent)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(PACKAGE_ROOT), env.get("PYTHONPATH")]))
    if job.device != "cuda":
        env.setdefault("OMP_NUM_THREADS", "1")
    return env


def launch(job: JobConfig, *, command: list[str], console: object | None = None) -> int:
    """Run the job on this node; returns the exit code (0 finished, 1 crashed, 130 interrupted)."""
    from rich.console import Console

    console = console or Console(stderr=True)
    job = prepare(job, command=command)
    run_dir = Path(job.run_dir)
    layout = job.layout.resolve(job.world_size)
    console.print(f"dtprobe run: {job.model.name} on {job.world_size} ranks (dp {layout.dp} tp {layout.tp} "
                  f"pp {layout.pp}), {job.train.steps} steps, global batch {job.train.global_batch(layout.dp)} "
                  f"x {job.train.seq_len} tokens, peak lr {job.train.peak_lr(layout.dp):.3g} -> {run_dir}")
    log_path = run_dir / LOGS_DIR / f"torchrun.node{job.node_rank}.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    attempts = AttemptRecorder(job, log_path)
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(torchrun_command(job), env=worker_env(job), stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
        previous = _interrupt_on_sigterm()
        try:
            _follow(proc, job, console, rank=loss_rank(layout), on_poll=attempts.poll)
            rc = proc.wait()
        except KeyboardInterrupt:
            console.print("dtprobe run: interrupted; stopping the workers ...")
            _terminate(proc)
            rc = 130
        except BaseException:
            _terminate(proc)            # torchrun runs in its own session: never leave it training on
            raise
        finally:
            if previous is not None:
                signal.signal(signal.SIGTERM, previous)
    attempts.finish(exit_code=rc, interrupted=rc == 130)
    status = "finished" if rc == 0 else "crashed"
    if job.node_rank == 0:
        store_manifest.set_status(run_dir, status, exit_code=rc)
        from dtprobe.store import compact
        from dtprobe.store.errors import TraceError

        try:
            compact(run_dir)
        except (TraceError, OSError) as exc:      # the run's exit code stays what the job did
            console.print(f"dtprobe run: {run_dir} was not compacted ({exc}); its events files are kept whole: "
                          f"`dtprobe compact {run_dir}` tries again.", highlight=False)
    if rc not in (0, 130):
        _print_failure(console, run_dir, log_path)
    _print_summary(console, run_dir, status, loss_rank=loss_rank(layout))
    return 0 if rc == 0 else (130 if rc == 130 else 1)


class AttemptRecorder:
    """Records this node's torchrun attempts in run.json: each ended one while following, all at the end."""

    def __init__(self, job: JobConfig, torchrun_log: Path) -> None:
        self.job = job
        self.run_dir = Path(job.run_dir)
        self.log_dir = self.run_dir / LOGS_DIR / f"node{job.node_rank}"
        self.torchrun_log = torchrun_log
        self._num_seen = 0
        self.watcher = ExitWatcher(self.log_dir).start()

    def poll(self) -> None:
        """Record the attempts that ended since the last call (one ended when the next one's directory appears)."""
        num = len(attempt_dirs(self.log_dir))
        if num > max(self._num_seen, 1):
            self._record(final=False)
        self._num_seen = num

    def finish(self, *, exit_code: int, interrupted: bool) -> None:
        """torchrun has exited with ``exit_code``: record every attempt, the last one included."""
        ended_ns = time.time_ns()
        self.watcher.stop()
        self._record(final=True, exit_code=exit_code, ended_ns=ended_ns, interrupted=interrupted)

    def _record(self, **kw: object) -> None:
        for attempt in read_attempts(self.log_dir, self.torchrun_log, node_rank=self.job.node_rank,
                                     nproc=self.job.nproc, observed=self.watcher.observed(),
                                     oom_kills=self.watcher.oom_kills(), **kw):
            store_manifest.record_attempt(self.run_dir, attempt)


def _follow(proc: subprocess.Popen, job: JobConfig, console: object, *, rank: int = 0,
            on_poll: Callable[[], None] | None = None) -> None:
    """Progress bar fed by ``rank``'s steps rows (tailed by byte offset) until torchrun exits; ``rank`` is the
    one that reports the loss (a pipeline rank without the last stage has none). ``on_poll`` runs at every
    poll (the attempt recorder)."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    steps_file = Path(job.run_dir) / EVENTS_FILE.format(table="steps", rank=rank)
    offset, done, loss = 0, 0, float("nan")
    columns = (TextColumn("[progress.description]{task.description}"), BarColumn(), MofNCompleteColumn(),
               TimeElapsedColumn(), TextColumn("{task.fields[info]}"))
    # Redrawn at each poll, not by rich's refresh thread (10 a second), which would wake on the ranks' cores.
    with Progress(*columns, console=console, transient=False, auto_refresh=False) as progress:
        task = progress.add_task("steps", total=job.train.steps, info="starting workers")
        exited = False
        while not exited:
            exited = wait_exit(proc, _POLL_S)
            if on_poll is not None:
                on_poll()
            rows, offset = new_rows(steps_file, offset)
            for row in rows:
                done = max(done, int(row["step"]) + 1)
                loss = row["loss"] if row.get("loss") is not None else loss
                step_ms = (row["end_ns"] - row["start_ns"]) / 1e6
                progress.update(task, completed=done, info=f"loss {loss:.3f}  {step_ms:.0f} ms/step")
            progress.refresh()


def wait_exit(proc: subprocess.Popen, wait_s: float) -> bool:
    """Whether ``proc`` has exited, waiting up to ``wait_s`` for it: returns as soon as it exits. Sleeps on a
    pidfd where there is one: ``Popen.wait(timeout)`` polls, sleeping at most 50 ms at a time, and each wake-up
    can take a rank's core."""
    if proc.poll() is not None:
        return True
    fd = open_pidfd(proc.pid)
    if fd is None:                             # no pidfds (not Linux >= 5.3), or it has just exited
        try:
            proc.wait(timeout=wait_s)
            return True
        except subprocess.TimeoutExpired:
            return False
    try:
        select.select([fd], [], [], wait_s)
    finally:
        os.close(fd)
    return proc.poll() is not None


def new_rows(path: Path, offset: int) -> tuple[list[dict], int]:
    """The complete rows an events file gained past byte ``offset`` (a line still being written waits for the next
    call), and the offset after them; none while the file does not exist."""
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            chunk = f.read()
    except FileNotFoundError:
        return [], offset
    complete = chunk[:chunk.rfind(b"\n") + 1]
    return [orjson.loads(line) for line in complete.splitlines()], offset + len(complete)


def _interrupt_on_sigterm() -> object | None:
    """SIGTERM (a supervisor or a script stopping ``dtprobe run``) is handled as Ctrl-C: the workers are stopped
    and the run is marked crashed, instead of the launcher dying alone. Returns the previous handler (None when not
    on the main thread, where handlers cannot be set)."""
    import threading

    if threading.current_thread() is not threading.main_thread():
        return None

    def interrupt(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    return signal.signal(signal.SIGTERM, interrupt)


def _terminate(proc: subprocess.Popen, *, grace_s: float = 15.0) -> None:
    """SIGTERM the torchrun process group (the agent stops its workers), SIGKILL after ``grace_s``."""
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait_s)
            return
        except subprocess.TimeoutExpired:
            continue


def _wait_for(path: Path, *, timeout_s: float, hint: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        if time.monotonic() > deadline:
            raise ConfigError(f"waited {timeout_s:.0f} s for {path}, which never appeared; {hint}")
        time.sleep(0.2)


def _print_failure(console: object, run_dir: Path, log_path: Path) -> None:
    """The first failure (rank, exit code or signal: the recorded ``attempts``, whose first failure corrects
    torchrun's whole-second ordering, else torchrun's root cause), injected crashes, and the end of the failing
    worker's stderr."""
    import re

    first = _first_failure(run_dir)
    if first is not None:
        rank = (str(first["rank"]), str(first.get("local_rank", "?")))
        how = first.get("signal") or f"exit code {first.get('exit_code', '?')}"
    else:
        text = log_path.read_text(errors="replace") if log_path.exists() else ""
        root = text[text.rfind("Root Cause"):] if "Root Cause" in text else ""
        found = re.search(r"rank\s*:\s*(\d+) \(local_rank: (\d+)\)", root)
        code = re.search(r"exitcode\s*:\s*(-?\d+)", root)
        rank = found.groups() if found else None
        how = f"exit code {code.group(1) if code else '?'}"
    if rank:
        console.print(f"[red]workers failed[/red]: first failure on rank {rank[0]} (local rank {rank[1]}), {how}; "
                      f"torchrun log: {log_path}")
    else:
        console.print(f"[red]workers failed[/red]; torchrun log: {log_path}")
    crashes = _injected_crashes(run_dir)
    if crashes:
        console.print(f"injected: {crashes}")
    logs = sorted((run_dir / LOGS_DIR).rglob("stderr.log"), key=lambda p: p.stat().st_mtime)
    if rank:
        own = [p for p in logs if p.parent.name == rank[1] and p.stat().st_size]
        logs = own[-1:] + logs
    failing = [p for p in logs if p.stat().st_size and b"Error" in p.read_bytes()]
    if failing:
        tail = failing[0].read_text(errors="replace").splitlines()[-6:]
        console.print(f"last lines of {failing[0]}:")
        for line in tail:
            console.print("  " + line, markup=False, highlight=False)


def _first_failure(run_dir: Path) -> dict | None:
    """The first failure of the newest failed attempt in run.json ``attempts`` (None when none is recorded)."""
    try:
        attempts = store_manifest.read_manifest(run_dir).attempts
    except (OSError, ValueError):
        return None
    for attempt in sorted(attempts, key=lambda a: a["attempt"], reverse=True):
        firsts = [r for r in attempt.get("ranks", ()) if r.get("first_failure")]
        if attempt.get("result") == "failed" and firsts:
            return firsts[0]
    return None


def _injected_crashes(run_dir: Path) -> str:
    path_glob = (run_dir / "events" / "faults").glob("rank*.jsonl")
    found = []
    for path in sorted(path_glob):
        for line in path.read_bytes().splitlines():
            try:
                row = orjson.loads(line)
            except orjson.JSONDecodeError:
                continue
            if row.get("kind") == "crash" and row.get("injected"):
                found.append(f"crash on rank {row['rank']} at step {row['step']}")
    return ", ".join(found)


def _print_summary(console: object, run_dir: Path, status: str, *, loss_rank: int = 0) -> None:
    from dtprobe.store import RunStore

    store = RunStore.open(run_dir, tables=["steps"])
    steps = store.table("steps")
    leader = steps[steps["rank"] == 0]
    if len(leader):
        step_ms = (leader["end_ns"] - leader["start_ns"]) / 1e6
        later = step_ms.iloc[1:] if len(step_ms) > 1 else step_ms
        loss = steps[steps["rank"] == loss_rank].sort_values("step")["loss"].dropna()
        where = "" if loss_rank == 0 else f" (rank {loss_rank}, last pipeline stage)"
        console.print(f"steps {int(leader['step'].max()) + 1} on rank 0, mean step {later.mean():.1f} ms "
                      f"(median {later.median():.1f} ms, first step excluded), final loss{where} "
                      f"{loss.iloc[-1] if len(loss) else float('nan'):.4f}")
    elif (run_dir / "loop_timing.json").exists():
        timing = json.loads((run_dir / "loop_timing.json").read_text())
        mean = timing["mean_step_s_after_first"]
        console.print(f"steps {timing['steps']} (telemetry off), loop {timing['loop_s']:.2f} s"
                      + (f", mean step {mean * 1e3:.1f} ms (first step excluded)" if mean is not None else ""))
    else:
        console.print("steps: none recorded (telemetry off, or the workers failed before step 0)")
    color = "green" if status == "finished" else "red"
    console.print(f"status [{color}]{status}[/{color}]; run directory (also on stdout):")
    print(run_dir, flush=True)
