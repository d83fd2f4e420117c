"""The torchrun worker of ``dtprobe launch``: runs the user's unmodified script (or ``-m`` module) with dtprobe
attached; started by ``dtprobe.runtime.launch_script`` through ``torch.distributed.run``.

``python -m dtprobe.runtime.launch_worker`` reads ``DTPROBE_LAUNCH`` (``<run>/launch.json``: the script or module,
its arguments, the ``[collect]`` options, the process-group timeout), then:

1. wraps ``init_process_group`` (as ``torch.distributed``, ``distributed_c10d`` and ``device_mesh`` name it) so that
   right after the script's own call ``dtprobe.attach`` runs (attach after init: the default group and every group
   created later are recorded, ``collectors.attach``) and the step hooks are installed
   (``collectors.launch_steps``: a step per optimizer step attempt, fwd/bwd/opt phases, ``dtprobe.record``), and
   every ``torch.distributed.pipelining`` stage the script then builds is timed (``parallel.pp.ScriptPipelineTimers``:
   ``pipeline`` rows, when the script imported ``torch.distributed.pipelining`` before its init), and so are its
   checkpoint saves and loads (``collectors.launch_checkpoints``: DCP, ``torch.save`` to a file; ``checkpoints``
   rows: torch.save wrapped before the script runs, the other modules once imported);
   a script that never initializes torch.distributed is still run, and nothing is recorded; with collectives
   recorded, a watchdog that only reports (``runtime.hang.Watchdog``, ``leave=False``) writes every rank's
   Python stack into the run once one of its collectives or send/recvs has been pending ``stacks_after_s``
   (``stacks_after``: by default half the script's process-group timeout, at most ``STACKS_AFTER_MAX_S``), and
   leaves the ending to that timeout;
2. runs the script as ``python SCRIPT ARGS`` would (``runpy``: ``__name__ == "__main__"``, ``sys.argv`` =
   ``[SCRIPT, *ARGS]``, the script's folder first on ``sys.path``; ``-m``: ``sys.argv[0]`` the module's file);
3. closes the probe ("finished" when the script returned or exited 0, else "crashed"), destroys the process
   groups a script that ended with 0 left initialized (``release_process_groups``), and exits with the script's
   exit code (an uncaught exception: 1, written to torchelastic's error file by ``@record``).

Like ``runtime.worker`` it writes ``worker.json`` beside torchelastic's error file, for the launcher's attempts.
"""

from __future__ import annotations

import json
import os
import runpy
import sys
import time
from pathlib import Path
from typing import Any

import dtprobe
from dtprobe.runtime.error_file import record
from dtprobe.runtime.worker import write_worker_file

LAUNCH_ENV = "DTPROBE_LAUNCH"
"""Environment variable naming ``<run>/launch.json``."""
STACKS_POLL_MAX_S = 5.0
"""The stack watchdog checks at most this far apart (each check publishes the rank's progress to the store)."""
STACKS_AFTER_MAX_S = 300.0
"""The default wait before every rank's stack is written is half the script's process-group timeout, at most
this (torch's default timeouts are 10 and 30 minutes)."""


def stacks_after(spec: dict[str, Any], pg_timeout_s: float | None) -> float:
    """Seconds a pending collective or send/recv waits before every rank's stack is written: ``launch.json``'s
    ``stacks_after_s`` (0: never), else half ``pg_timeout_s`` (the script's process-group timeout), at most
    ``STACKS_AFTER_MAX_S``."""
    given = spec.get("stacks_after_s")
    if given is not None:
        return float(given)
    return STACKS_AFTER_MAX_S if pg_timeout_s is None else min(STACKS_AFTER_MAX_S, pg_timeout_s / 2)


def pg_timeout_s(original: Any, args: tuple, kwargs: dict[str, Any]) -> float | None:
    """The timeout (seconds) of the default group that ``init_process_group(*args, **kwargs)`` made: the one given,
    else torch's default for its backend; None when it cannot be told."""
    import inspect

    import torch.distributed as dist

    try:
        timeout = inspect.signature(original).bind_partial(*args, **kwargs).arguments.get("timeout")
        if timeout is None:
            from torch.distributed import distributed_c10d

            timeout = distributed_c10d._get_default_timeout(dist.get_backend())
        return float(timeout.total_seconds())
    except (TypeError, ValueError, AttributeError, RuntimeError):
        return None


class LaunchSession:
    """Attaches dtprobe when the script initializes torch.distributed, and closes it at the end."""

    def __init__(self, spec: dict[str, Any]) -> None:
        self.spec = spec
        self.probe: Any = None
        self.steps: Any = None
        self.pipeline: Any = None
        self.watchdog: Any = None
        self.checkpoints: Any = None
        self._patched: list[tuple[Any, Any]] = []

    def install(self) -> None:
        """Wrap ``init_process_group`` wherever torch keeps a reference to it."""
        import torch.distributed as dist
        from torch.distributed import distributed_c10d, device_mesh

        original = distributed_c10d.init_process_group
        session = self

        def init_process_group(*args: Any, **kwargs: Any) -> Any:
            result = original(*args, **kwargs)
            session.attach(pg_timeout_s=pg_timeout_s(original, args, kwargs))
            return result

        init_process_group.__wrapped__ = original     # type: ignore[attr-defined]
        init_process_group.__doc__ = original.__doc__
        for module in (dist, distributed_c10d, device_mesh):
            if getattr(module, "init_process_group", None) is original:
                self._patched.append((module, original))
                module.init_process_group = init_process_group
        if self.spec["collect"].get("enabled", True):
            from dtprobe.collectors.launch_checkpoints import CheckpointTimer

            self.checkpoints = CheckpointTimer()     # torch.save timed before the script binds it
            self.checkpoints.install()

    def attach(self, *, pg_timeout_s: float | None = None) -> None:
        """``dtprobe.attach`` (after init), the step hooks and the stack watchdog; once."""
        if self.probe is not None:
            return
        from dtprobe.collectors.attach import Probe
        from dtprobe.collectors.launch_steps import ScriptSteps
        from dtprobe.runtime.parallel.pp import ScriptPipelineTimers

        spec = self.spec
        self.probe = dtprobe.attach(spec["run_dir"], manage_status=False, run_id=Path(spec["run_dir"]).name,
                                    timeout_s=spec["timeout_s"], **spec["collect"])
        if isinstance(self.probe, Probe):       # not the NullProbe of --no-collect
            self.steps = ScriptSteps(self.probe)
            self.steps.install()
            self.pipeline = ScriptPipelineTimers(self.steps, self.probe.record)
            self.pipeline.install()
            self.probe.step_hooks = self.steps      # a second attach or a framework callback stops them
            dtprobe._record_sink = self.steps.record
            if self.checkpoints is not None:
                self.checkpoints.start(self.probe.record, self._current_step, self.probe.rank)
            after = stacks_after(spec, pg_timeout_s)
            if after > 0 and self.probe.config.collectives:
                import torch.distributed as dist

                from dtprobe.runtime.config_sections import HangConfig
                from dtprobe.runtime.hang import Watchdog

                # polls (a store write and read per rank each) a quarter of the wait apart, at most 5 s
                poll = min(STACKS_POLL_MAX_S, max(0.25, after / 4))
                self.watchdog = Watchdog(HangConfig(collective_timeout_s=after, poll_interval_s=poll),
                                         store=dist.distributed_c10d._get_default_store(), rank=self.probe.rank,
                                         restart=int(getattr(self.probe, "restart", 0)), probe=self.probe,
                                         leave=False).start()

    def _current_step(self) -> int | None:
        """The step a checkpoint call falls in: the open step (the hook-driven steps', or a framework callback's,
        which replaces them), else, between the hook-driven steps, the next one (a step starts where the previous
        ended); None when neither is known."""
        step = self.probe.current_step
        if step >= 0:
            return step
        return self.steps.num_steps if self.probe.step_hooks is self.steps else None

    def close(self, status: str) -> None:
        for module, original in self._patched:
            module.init_process_group = original
        self._patched = []
        dtprobe._record_sink = None
        if self.watchdog is not None:
            self.watchdog.stop()
        if self.checkpoints is not None:
            self.checkpoints.close()
        if self.pipeline is not None:
            self.pipeline.close()
        if self.steps is not None:
            self.steps.close()
        if self.probe is not None:
            self.probe.close(status=status)


def run_target(spec: dict[str, Any]) -> None:
    """Run the script or module as ``python`` would, with its arguments in ``sys.argv``."""
    args = list(spec["args"])
    if spec.get("module"):
        sys.argv = [spec["module"], *args]       # runpy replaces argv[0] with the module's file
        sys.path.insert(0, os.getcwd())
        runpy.run_module(spec["module"], run_name="__main__", alter_sys=True)
    else:
        script = spec["script"]
        sys.argv = [script, *args]
        sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
        runpy.run_path(script, run_name="__main__")


def release_process_groups() -> None:
    """Destroy the process groups a finished script left initialized, as torch asks scripts to and many do not:
    torch's interpreter teardown of gloo groups still alive at exit can abort the process (exit -6, "terminate
    called without an active exception") after all of its work is done, which torchrun reports as a failed worker.
    ``destroy_process_group`` shuts each group's threads down first. No barrier: a peer may have ended already.
    Runs before the script's ``atexit`` functions, so one of those that uses a group finds none."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def exit_code_of(exc: SystemExit) -> int:
    """The process exit code ``sys.exit(code)`` gives (None: 0; a message: printed, 1)."""
    code = exc.code
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1


@record
def main() -> int:
    write_worker_file()
    path = os.environ.get(LAUNCH_ENV)
    if not path:
        print(f"dtprobe launch worker: {LAUNCH_ENV} is not set; start it with `dtprobe launch`.", file=sys.stderr)
        return 2
    spec = json.loads(Path(path).read_text())
    session = LaunchSession(spec)
    session.install()
    try:
        run_target(spec)
        code = 0
    except SystemExit as exc:
        code = exit_code_of(exc)
    except BaseException:
        session.close("crashed")
        raise
    session.close("finished" if code == 0 else "crashed")
    if code == 0:   # (a failed script's groups may still wait on peers: left to the exit)
        release_process_groups()
    write_worker_file(ended_ns=time.time_ns(), exit_code=code)
    return code


if __name__ == "__main__":
    sys.exit(main())
