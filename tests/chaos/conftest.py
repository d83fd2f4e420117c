"""Chaos suite fixtures: jobs, CPU hogs, CPU quotas and memory limits that are always cleaned up, even when a test
fails.

The functions behind them live in ``harness.py`` (importable by the benchmark too). A test asks for
``run_dir("scenario")`` (kept under ``$DTPROBE_CHAOS_RUNS/scenario`` when that is set), ``launch(cmd, run_dir)``
(a started ``Job``), ``busy_loop(core)``, ``cpu_quota(frac)`` and ``memory_limit(bytes)``; each is stopped or
removed in a finalizer.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import pytest

from harness import BusyLoop, Job, V1Cgroup, cpu_quota_cgroup, job_env, memory_limit_cgroup, scenario_dir


@pytest.fixture
def run_dir(tmp_path) -> Callable[[str], Path]:
    return lambda scenario: scenario_dir(scenario, tmp_path)


@pytest.fixture
def launch(request) -> Callable[..., Job]:
    def start(cmd: list[str], run_dir: Path, *, timeout_s: float, **env: str) -> Job:
        job = Job(cmd=cmd, run_dir=run_dir, timeout_s=timeout_s, env=job_env(**env))
        request.addfinalizer(job.stop)
        return job.start()
    return start


@pytest.fixture
def busy_loop(request) -> Callable[[int], BusyLoop]:
    def start(core: int, **kw) -> BusyLoop:
        hog = BusyLoop(core, **kw)
        request.addfinalizer(hog.stop)
        return hog.start()
    return start


def _made(request, cgroup: V1Cgroup) -> V1Cgroup:
    """``cgroup`` created, and removed when the test ends."""
    request.addfinalizer(cgroup.remove)
    return cgroup.create()


@pytest.fixture
def cpu_quota(request) -> Callable[[float], V1Cgroup]:
    return lambda frac: _made(request, cpu_quota_cgroup(frac))


@pytest.fixture
def memory_limit(request) -> Callable[[int], V1Cgroup]:
    return lambda limit_bytes: _made(request, memory_limit_cgroup(limit_bytes))
