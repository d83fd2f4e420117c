"""A ``dtprobe run`` started in the background by the multi-process tests that act on it from outside while it runs
(a rank SIGKILLed, a checkpoint damaged): wait for what it writes, and never leave it running."""

from __future__ import annotations

import subprocess
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

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
