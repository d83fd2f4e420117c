"""A ``dtprobe run`` started in the background by the multi-process tests that act on it from outside while it runs
(a rank SIGKILLed, a checkpoint damaged): wait for what it writes, and never leave it running."""

from __future__ import annotations

import subprocess
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest


@contextmanager
def background_run(cmd: list[str], *, env: dict[str, str]) -> Iterator[subprocess.Popen]:
    """``cmd`` started with stdout and stderr piped (text); SIGKILLed and reaped on leaving if still running."""
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def wait_for(cond: Callable[[], bool], *, timeout: float, proc: subprocess.Popen, what: str,
             poll_s: float = 0.05) -> None:
    """Poll ``cond`` every ``poll_s`` until it holds; fail the test (naming ``what``) if the run ends first, with its
    stderr, or after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not cond():
        if proc.poll() is not None:
            pytest.fail(f"dtprobe run ended ({proc.returncode}) before {what}:\n{proc.stderr.read()[-3000:]}")
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(poll_s)


def run_logs_tail(run_dir: Path, *, chars: int = 2500) -> str:
    """The tail of the run's torchrun log and of every rank's stderr and stdout in every attempt (``logs/``), for
    an assertion message: what a failed restart said, which the launcher's own output does not show."""
    logs = Path(run_dir) / "logs"
    parts = []
    for path in sorted(logs.glob("torchrun.node*.log")) + sorted(logs.glob("node*/*/attempt_*/*/std*.log")):
        text = path.read_text(errors="replace")
        if text.strip():
            parts.append(f"--- {path.relative_to(logs)} (last {chars} chars):\n{text[-chars:]}")
    return "\n".join(parts) or f"(no logs under {logs})"
