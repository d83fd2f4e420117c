"""The launcher of ``dtprobe launch``: an unmodified script under torchrun with dtprobe attached in every worker;
prepares the run directory, runs torchrun, shows progress, finalizes the store. Called by
``dtprobe.commands.launch``.

Same shape as ``dtprobe run``'s launcher (``runtime.launcher``, whose torchrun command, attempt recording, signal
handling and failure report it reuses): one launcher per node; node 0 creates the run directory, ``run.json``
(``config``: the ``[collect]`` options and ``launch``: the script, its arguments, the torchrun flags; no model or
training keys, since the script's are unknown) and ``launch.json``, which every worker reads
(``runtime.launch_worker``); other nodes wait for it on the shared filesystem. Workers' stdout/stderr go to
``<run>/logs/node<K>/<rdzv id>/attempt_<n>/<local rank>/``, torchrun's own to ``<run>/logs/torchrun.node<K>.log``.

Progress: optimizer steps done on rank 0 (tailing its ``steps`` events; the total is unknown). Exit code: the
script's (0, or the exit code of the first failing rank as recorded in run.json ``attempts``; 1 when unknown), 130
when interrupted.
"""

from __future__ import annotations

import json
import os
import subprocess
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from dtprobe.runtime import launcher
from dtprobe.runtime.config import JobConfig
from dtprobe.store import manifest as store_manifest
from dtprobe.store.errors import ConfigError
from dtprobe.store.schema import EVENTS_FILE, MANIFEST_FILE

LAUNCH_FILE = "launch.json"
WORKER_MODULE = "dtprobe.runtime.launch_worker"


@dataclass(kw_only=True, frozen=True)
class LaunchTarget:
    """What each worker runs: a script file or a module (``-m``), with its arguments."""

    script: str | None = None
    """Path of the Python script (as given to ``python SCRIPT``)."""
    module: str | None = None
    """Module name (as given to ``python -m MODULE``)."""
    args: tuple[str, ...] = ()
    """Its arguments (``sys.argv[1:]`` in the workers)."""
    stacks_after_s: float | None = None
    """``--stacks-after``: seconds a collective or send/recv stays pending before every rank's Python stack is
    written to the run (0: never); None: half the script's process-group timeout, at most 300
    (``launch_worker.stacks_after``)."""

    def __post_init__(self) -> None:
        if (self.script is None) == (self.module is None):
            raise ConfigError("dtprobe launch needs a SCRIPT or -m MODULE (exactly one), e.g. "
                              "`dtprobe launch --nproc 2 train.py --epochs 1`.")
        if self.stacks_after_s is not None and not self.stacks_after_s >= 0:
            raise ConfigError(f"dtprobe launch: --stacks-after {self.stacks_after_s:g}; give 0 (never) or the "
                              f"seconds a collective may stay pending before the ranks' stacks are written, "
                              f"e.g. --stacks-after 60.")
        if self.script is not None and not Path(self.script).is_file():
            raise ConfigError(f"dtprobe launch: script {self.script!r} is not a file; give the path of the Python "
                              f"script to run (or -m MODULE).")

    @property
    def name(self) -> str:
        """Short name for the default run directory: the script's stem or the module's last part."""
        return Path(self.script).stem if self.script else str(self.module).rpartition(".")[2]


def default_run_dir(target: LaunchTarget, *, world_size: int, root: str = "runs") -> Path:
    """``runs/<YYYYmmdd-HHMMSS>-<script>-n<world size>`` (with a numeric suffix if taken)."""
    return launcher.timestamped_dir(f"{target.name}-n{world_size}", root=root)


def launch_spec(job: JobConfig, target: LaunchTarget) -> dict[str, Any]:
    """The content of ``launch.json`` (read by every worker)."""
    collect = asdict(job.collect)
    collect["profile_steps"] = list(job.collect.profile_steps) if job.collect.profile_steps is not None else None
    return {"run_dir": job.run_dir, "script": str(Path(target.script).resolve()) if target.script else None,
            "module": target.module, "args": list(target.args), "collect": collect, "timeout_s": job.timeout_s,
            "stacks_after_s": target.stacks_after_s}


def prepare(job: JobConfig, target: LaunchTarget, *, command: list[str]) -> JobConfig:
    """Node 0: create the run directory, run.json and launch.json; other nodes: wait for them. Returns the job with
    an absolute ``run_dir``."""
    run_dir = Path(job.run_dir) if job.run_dir else default_run_dir(target, world_size=job.world_size)
    job = replace(job, run_dir=str(run_dir.resolve()))
    run_dir = Path(job.run_dir)
    if job.node_rank != 0:
        launcher._wait_for(run_dir / LAUNCH_FILE, timeout_s=job.timeout_s,
                           hint="node 0's launcher creates it; is --run-dir on a filesystem shared by every node?")
        return job
    if (run_dir / MANIFEST_FILE).exists():
        raise ConfigError(f"--run-dir {run_dir} already holds a run ({MANIFEST_FILE}); choose a new directory "
                          f"or remove that one.")
    spec = launch_spec(job, target)
    config = {"collect": spec["collect"], "launch": {
        "script": spec["script"], "module": spec["module"], "args": spec["args"], "nproc": job.nproc,
        "nnodes": job.nnodes, "max_restarts": job.max_restarts}}
    store_manifest.create_manifest(run_dir, run_id=run_dir.name, command=command, config=config,
                                   world_size=job.world_size, nnodes=job.nnodes)
    tmp = run_dir / f".{LAUNCH_FILE}.tmp"
    tmp.write_text(json.dumps(spec, indent=1) + "\n")
    os.replace(tmp, run_dir / LAUNCH_FILE)
    return job


def torchrun_command(job: JobConfig) -> list[str]:
    """``dtprobe run``'s torchrun command for this node, running the launch worker instead of the built-in one."""
    cmd = launcher.torchrun_command(job)
    assert cmd[-2:] == ["-m", "dtprobe.runtime.worker"], cmd
    return cmd[:-2] + ["-m", WORKER_MODULE]


def worker_env(job: JobConfig) -> dict[str, str]:
    """The workers' environment: this one, with ``DTPROBE_LAUNCH`` and this dtprobe first on ``PYTHONPATH``."""
    env = dict(os.environ)
    env["DTPROBE_LAUNCH"] = str(Path(job.run_dir) / LAUNCH_FILE)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(launcher.PACKAGE_ROOT), env.get("PYTHONPATH")]))
    return env


@dataclass(frozen=True)
class LaunchResult:
    """How a launch ended."""

    exit_code: int
    """The script's exit code (see ``script_exit_code``), 130 when interrupted."""
    run_dir: Path
    """The run directory (absolute)."""


def launch(job: JobConfig, target: LaunchTarget, *, command: list[str], console: Any = None) -> LaunchResult:
    """Run ``target`` on this node under torchrun with dtprobe attached."""
    from rich.console import Console

    console = console or Console(stderr=True)
    job = prepare(job, target, command=command)
    run_dir = Path(job.run_dir)
    what = target.script or f"-m {target.module}"
    console.print(f"dtprobe launch: {what} {' '.join(target.args)} on {job.world_size} ranks -> {run_dir}",
                  highlight=False)
    log_path = run_dir / launcher.LOGS_DIR / f"torchrun.node{job.node_rank}.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    attempts = launcher.AttemptRecorder(job, log_path)
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(torchrun_command(job), env=worker_env(job), stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
        previous = launcher._interrupt_on_sigterm()
        try:
            follow(proc, run_dir, console, on_poll=attempts.poll)
            rc = proc.wait()
        except KeyboardInterrupt:
            console.print("dtprobe launch: interrupted; stopping the workers ...")
            launcher._terminate(proc)
            rc = 130
        except BaseException:
            launcher._terminate(proc)
            raise
        finally:
            if previous is not None:
                import signal

                signal.signal(signal.SIGTERM, previous)
    attempts.finish(exit_code=rc, interrupted=rc == 130)
    code = script_exit_code(run_dir, rc)
    if job.node_rank == 0:
        store_manifest.set_status(run_dir, "finished" if rc == 0 else "crashed", exit_code=code)
        from dtprobe.store import compact

        compact(run_dir)
    if rc not in (0, 130):
        launcher._print_failure(console, run_dir, log_path)
    console.print(f"worker output: {run_dir / launcher.LOGS_DIR / f'node{job.node_rank}'}", highlight=False)
    return LaunchResult(code, run_dir)


def script_exit_code(run_dir: Path, torchrun_rc: int) -> int:
    """The script's exit code: 0 and 130 as torchrun's; on a failure the exit code of the first failing rank
    recorded in run.json ``attempts`` (torchrun itself exits 1 whatever the worker's code), else 1."""
    if torchrun_rc in (0, 130):
        return torchrun_rc
    first = launcher._first_failure(run_dir)
    code = first.get("exit_code") if first else None
    return int(code) if isinstance(code, int) and code > 0 else 1


def follow(proc: subprocess.Popen, run_dir: Path, console: Any, *, on_poll: Any = None, rank: int = 0) -> None:
    """Progress: ``rank``'s optimizer steps so far, its last step time and loss (when the script records it), until
    torchrun exits (the total is unknown: the bar pulses)."""
    from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    steps_file = run_dir / EVENTS_FILE.format(table="steps", rank=rank)
    offset, done = 0, 0
    columns = (SpinnerColumn(), TextColumn("[progress.description]{task.description}"), TimeElapsedColumn(),
               TextColumn("{task.fields[info]}"))
    # Redrawn at each poll, not by rich's refresh thread (10 a second), which would wake on the ranks' cores.
    with Progress(*columns, console=console, transient=False, auto_refresh=False) as progress:
        task = progress.add_task("optimizer steps: 0", total=None, info="starting workers")
        exited = False
        while not exited:
            exited = launcher.wait_exit(proc, launcher._POLL_S)
            if on_poll is not None:
                on_poll()
            rows, offset = launcher.new_rows(steps_file, offset)
            for row in rows:
                done = max(done, int(row["step"]) + 1)
                info = f"{(row['end_ns'] - row['start_ns']) / 1e6:.0f} ms/step"
                if row.get("loss") is not None:
                    info += f"  loss {row['loss']:.3f}"
                progress.update(task, description=f"optimizer steps: {done}", info=info)
            progress.refresh()


__all__ = ["LAUNCH_FILE", "LaunchResult", "LaunchTarget", "launch", "launch_spec", "prepare", "script_exit_code", "torchrun_command"]
