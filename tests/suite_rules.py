"""The suite's rules for two pytest-xdist workers (the README's ``-n 2 --dist loadfile``), as hooks that
``tests/conftest.py`` imports:
- a test whose verdict depends on how fast its ranks ran (marked ``exclusive``) runs while no other test runs: the
  other worker finishes its current test and waits (``WorkerLock``); a file's exclusive tests run first in it and
  back to back, so the other worker is waited for once per file;
- a file's tests stay on one worker, and files whose tests use the same run made once per session
  (``SHARED_RUNS``) are one unit of work, so module and session fixtures are made once (``shared_run_groups``,
  through xdist's scheduler hook: ``xdist_group`` markers would need node ids xdist can rewrite, which pytest 9.2
  no longer lets it do);
- the units are handed out longest first, by the seconds each file took in a recorded run (``FILE_COSTS``,
  ``order_units``), so the last minutes do not leave one worker idle while the other runs a long unit.
Without ``-n`` nothing changes: one test at a time, nothing locked.

``python tests/suite_rules.py REPORT`` rewrites ``FILE_COSTS`` from a run's ``--durations=0 -vvv`` report
(``-vvv`` after the README's ``-q``: every duration listed, the shortest too).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import shutil
import statistics
import sys
import tempfile
from collections import OrderedDict
from collections.abc import Iterator, Mapping
from pathlib import Path

import pytest

SHARED_RUNS = ("hang_rank1_run", "fp16_overflow_run", "crash_restart_run", "clean_dp4_run", "sample_trace_analyze")
"""Session fixtures of ``tests/conftest.py`` that make a ``dtprobe run`` (or ``dtprobe analyze`` a checked-in one)
for tests in several files: those files run on one xdist worker, so each is made once."""
FILE_COSTS = Path(__file__).with_name("file_costs.json")
"""Seconds each test file's tests took (set-up, call and teardown summed), from a recorded run of the suite."""
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


@pytest.hookimpl(optionalhook=True)     # xdist's hook: without xdist installed, never called
def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object | None:
    """``--dist loadfile``, with the files that share a session-made run (``shared_run_groups``) as one unit."""
    if config.getvalue("dist") != "loadfile":
        return None
    try:
        from xdist.scheduler import LoadFileScheduling
    except ImportError:         # a pytest-xdist without it: its own scheduling
        return None
    groups = shared_run_groups({str(p.relative_to(config.rootpath)): p.read_text(errors="replace")
                                for p in (config.rootpath / "tests").rglob("test_*.py")})
    costs = json.loads(FILE_COSTS.read_text()) if FILE_COSTS.exists() else {}

    class SharedRunScheduling(LoadFileScheduling):
        ordered = False

        def _split_scope(self, nodeid: str) -> str:
            file = super()._split_scope(nodeid)
            return groups.get(file, file)

        def _assign_work_unit(self, node) -> None:
            if not self.ordered:              # the first hand-out: the queue holds every unit
                self.workqueue = order_units(self.workqueue, costs)
                self.ordered = True
            super()._assign_work_unit(node)

    return SharedRunScheduling(config, log)


def order_units(workqueue: Mapping[str, Mapping[str, bool]], costs: Mapping[str, float]) -> OrderedDict:
    """xdist's work queue (unit -> {node id: done}) with the costliest unit first: a unit costs the sum of its files'
    ``costs`` (seconds), a file missing from them the median of the others (a new file is seldom the longest).
    Without costs, the queue's own order."""
    if not costs:
        return OrderedDict(workqueue)
    default = statistics.median(costs.values())

    def cost(unit: tuple[str, Mapping[str, bool]]) -> float:
        files = {nodeid.split("::", 1)[0] for nodeid in unit[1]}
        return sum(costs.get(file, default) for file in files)

    return OrderedDict(sorted(workqueue.items(), key=cost, reverse=True))     # stable: ties keep their order


def costs_from_durations(report: str) -> dict[str, float]:
    """{test file: seconds} summed over the set-up, call and teardown lines of a pytest ``--durations=0``
    report (``12.34s call     tests/test_x.py::test_y[param]``)."""
    costs: dict[str, float] = {}
    for match in re.finditer(r"^\s*([\d.]+)s (?:setup|call|teardown)\s+([^:\s]+)::", report, re.M):
        costs[match[2]] = costs.get(match[2], 0.0) + float(match[1])
    return {file: round(seconds, 1) for file, seconds in sorted(costs.items())}


def shared_run_groups(sources: dict[str, str]) -> dict[str, str]:
    """Test file -> its unit of work: the alphabetically first of the files that use a ``SHARED_RUNS`` fixture with
    it (files linked through several fixtures are one unit), else itself; ``sources`` maps each file to its text.
    The fixtures' names are looked up in the text, as whole words: the controller schedules by node id, before
    any worker has collected a fixture."""
    parent: dict[str, str] = {}

    def root(node: str) -> str:
        while parent.setdefault(node, node) != node:
            node = parent[node]
        return node

    for file, text in sources.items():
        for name in SHARED_RUNS:
            if re.search(rf"\b{name}\b", text):
                a, b = sorted((root(file), root(f"~{name}")))   # "~" sorts after a path: files name groups
                parent[b] = a
    return {file: root(file) for file in sources}


def is_exclusive(item: pytest.Item) -> bool:
    """Whether ``item`` runs alone under xdist: marked ``exclusive`` (a ``chaos`` test too only when so marked:
    a crash, a damaged checkpoint or a wrong collective is found the same however busy the machine is)."""
    return item.get_closest_marker("exclusive") is not None


class WorkerLock:
    """One worker's hold on the suite's two ``flock`` files: ``main`` (shared by running tests, exclusive for an
    exclusive one) and ``gate``, which an exclusive test holds from before it waits for ``main``, so that the other
    worker, once its current test ends, starts no new one until the exclusive test is done.

    ``leave(keep=True)`` after an exclusive test whose successor on this worker is exclusive too keeps both locks:
    released in between, the other worker would start a new test and the next exclusive one would wait for all of
    it. Without xdist (``lock_dir`` None) nothing is locked."""

    def __init__(self, lock_dir: str | None) -> None:
        self.lock_dir = lock_dir
        self.files: tuple | None = None
        self.exclusive_held = False

    def enter(self, exclusive: bool) -> None:
        if self.lock_dir is None or (exclusive and self.exclusive_held):
            return
        if self.exclusive_held:            # kept for an exclusive test that did not come: let the other worker on
            self.leave()
        gate, main = self.files = (open(os.path.join(self.lock_dir, "gate"), "a"),
                                   open(os.path.join(self.lock_dir, "main"), "a"))
        if exclusive:
            fcntl.flock(gate, fcntl.LOCK_EX)
            fcntl.flock(main, fcntl.LOCK_EX)
            self.exclusive_held = True
        else:
            fcntl.flock(gate, fcntl.LOCK_SH)
            fcntl.flock(main, fcntl.LOCK_SH)
            fcntl.flock(gate, fcntl.LOCK_UN)

    def leave(self, *, keep: bool = False) -> None:
        if self.files is None or (keep and self.exclusive_held):
            return
        for file in reversed(self.files):       # closing a file drops its flock
            file.close()
        self.files, self.exclusive_held = None, False


@contextlib.contextmanager
def suite_lock(lock_dir: str | None, exclusive: bool) -> Iterator[None]:
    """Held around one test's setup, call and teardown (``WorkerLock``): ``exclusive``, no other test runs
    meanwhile; else shared with other non-exclusive tests."""
    lock = WorkerLock(lock_dir)
    lock.enter(exclusive)
    try:
        yield
    finally:
        lock.leave()


_WORKER_LOCK: WorkerLock | None = None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """In an xdist worker: each file's exclusive tests moved together, first in their file (their own order kept),
    so that one wait for the other worker serves them all (``WorkerLock.leave``). Every worker sorts alike, so
    their collections stay equal, as xdist requires."""
    if not hasattr(config, "workerinput"):
        return
    position = {}
    for index, item in enumerate(items):
        position.setdefault(item.nodeid.split("::", 1)[0], index)
    items.sort(key=lambda item: (position[item.nodeid.split("::", 1)[0]], not is_exclusive(item)))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None):
    """Every test (fixture set-up and teardown included) inside the worker's lock (``WorkerLock``), kept into the
    next test when both are exclusive."""
    global _WORKER_LOCK
    if not hasattr(item.config, "workerinput"):
        return (yield)
    if _WORKER_LOCK is None:
        _WORKER_LOCK = WorkerLock(os.environ.get(LOCK_DIR_ENV))
    exclusive = is_exclusive(item)
    _WORKER_LOCK.enter(exclusive)
    try:
        return (yield)
    finally:
        _WORKER_LOCK.leave(keep=exclusive and nextitem is not None and is_exclusive(nextitem))


if __name__ == "__main__":
    USAGE = ("usage: python tests/suite_rules.py REPORT\n  REPORT: the output of the README's test command run with "
             f"--durations=0 -vvv added; rewrites {FILE_COSTS}")
    if len(sys.argv) == 2 and sys.argv[1] in ("-h", "--help"):
        print(USAGE)
        sys.exit(0)
    if len(sys.argv) != 2:
        sys.exit(USAGE)
    try:
        found = costs_from_durations(Path(sys.argv[1]).read_text(errors="replace"))
    except OSError as e:
        sys.exit(f"{sys.argv[1]}: cannot read it ({e.strerror}); pass the saved output of the test command")
    if not found:
        sys.exit(f"{sys.argv[1]}: no duration lines; run pytest with --durations=0 -vvv and pass its output")
    FILE_COSTS.write_text(json.dumps(found, indent=0, sort_keys=True) + "\n")
    print(f"{FILE_COSTS}: {len(found)} files, {sum(found.values()):.0f} s in all")
