"""The suite's rules for two pytest-xdist workers (the README's ``-n 2 --dist loadgroup``), as hooks that
``tests/conftest.py`` imports:
- a test whose verdict depends on how fast its ranks ran (marked ``exclusive``, and every ``chaos`` test) runs
  while no other test runs: the other worker finishes its current test and waits (``suite_lock``);
- a file's tests stay on one worker, and files whose tests use the same run made once per session
  (``SHARED_RUNS``) are one group, so module and session fixtures are made once (``assign_groups``).
Without ``-n`` nothing changes: one test at a time, nothing locked.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import tempfile
from collections.abc import Iterator

import pytest

SHARED_RUNS = ("hang_rank1_run", "fp16_overflow_run", "crash_restart_run", "clean_dp4_run")
"""Session fixtures of ``tests/conftest.py`` that make a ``dtprobe run`` for tests in several files: those files
run on one xdist worker, so each run is made once."""
LOCK_DIR_ENV = "DTPROBE_TEST_LOCK_DIR"
"""Set by the xdist controller for its workers: the folder of ``suite_lock``'s two lock files."""


def pytest_configure(config: pytest.Config) -> None:
    """In the xdist controller: a folder for ``suite_lock``'s files, named to the workers through the environment
    (they start after this hook)."""
    if getattr(config.option, "numprocesses", None) and not hasattr(config, "workerinput"):
        os.environ[LOCK_DIR_ENV] = tempfile.mkdtemp(prefix="dtprobe-test-locks-")


def pytest_unconfigure(config: pytest.Config) -> None:
    if not hasattr(config, "workerinput") and LOCK_DIR_ENV in os.environ:
        shutil.rmtree(os.environ.pop(LOCK_DIR_ENV), ignore_errors=True)


@pytest.hookimpl(tryfirst=True)     # before xdist's own hook reads the groups (``--dist loadgroup``)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if config.pluginmanager.hasplugin("xdist"):       # it declares the marker
        assign_groups(items)


def assign_groups(items: list[pytest.Item]) -> None:
    """Each test gets the ``xdist_group`` of its file; files whose tests use the same ``SHARED_RUNS`` fixture are
    merged into one group (by the alphabetically first of them)."""
    parent: dict[str, str] = {}

    def root(node: str) -> str:
        while parent.setdefault(node, node) != node:
            node = parent[node]
        return node

    for item in items:
        for name in set(SHARED_RUNS) & set(getattr(item, "fixturenames", ())):
            a, b = sorted((root(item.nodeid.split("::")[0]), root(f"~{name}")))   # "~" sorts after a path
            parent[b] = a
    for item in items:
        item.add_marker(pytest.mark.xdist_group(root(item.nodeid.split("::")[0])))


def is_exclusive(item: pytest.Item) -> bool:
    """Whether ``item`` runs alone under xdist: marked ``exclusive`` or ``chaos``."""
    return any(item.get_closest_marker(name) for name in ("exclusive", "chaos"))


@contextlib.contextmanager
def suite_lock(lock_dir: str | None, exclusive: bool) -> Iterator[None]:
    """Held around one test's setup, call and teardown. ``exclusive``: no other test runs meanwhile; else shared
    with other non-exclusive tests. Two ``flock`` files: ``main`` (shared by running tests, exclusive for an
    exclusive one) and ``gate``, which an exclusive test holds from before it waits for ``main``, so that the other
    worker, once its current test ends, starts no new one until the exclusive test is done. Without xdist
    (``lock_dir`` None) nothing is locked."""
    if lock_dir is None:
        yield
        return
    with open(os.path.join(lock_dir, "gate"), "a") as gate, open(os.path.join(lock_dir, "main"), "a") as main:
        if exclusive:
            fcntl.flock(gate, fcntl.LOCK_EX)
            fcntl.flock(main, fcntl.LOCK_EX)
        else:
            fcntl.flock(gate, fcntl.LOCK_SH)
            fcntl.flock(main, fcntl.LOCK_SH)
            fcntl.flock(gate, fcntl.LOCK_UN)
        try:
            yield
        finally:
            fcntl.flock(main, fcntl.LOCK_UN)
            fcntl.flock(gate, fcntl.LOCK_UN)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None):
    """Every test (fixture set-up and teardown included) inside ``suite_lock``."""
    with suite_lock(os.environ.get(LOCK_DIR_ENV) if hasattr(item.config, "workerinput") else None,
                    is_exclusive(item)):
        return (yield)
