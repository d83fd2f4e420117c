"""The suite's rules for two xdist workers (tests/suite_rules.py): an exclusive test runs while no other test runs,
files that share a session-made run are scheduled as one group, and groups are handed out longest first."""

from __future__ import annotations

import json
import threading
import time
from types import SimpleNamespace

import pytest
from suite_rules import (FILE_COSTS, SHARED_RUNS, WorkerLock, costs_from_durations, is_exclusive, order_units,
                         pytest_collection_modifyitems, shared_run_groups, suite_lock)

WAIT_S = 0.3
"""How long a thread that should stay blocked is watched."""


def hold(lock_dir: str, exclusive: bool, order: list[str], name: str, release: threading.Event) -> threading.Thread:
    """A thread that takes the lock, appends ``name`` to ``order`` once it has it, and keeps it until ``release``."""
    def body() -> None:
        with suite_lock(lock_dir, exclusive):
            order.append(name)
            release.wait(30)
    thread = threading.Thread(target=body, daemon=True)
    thread.start()
    return thread


def wait_for(order: list[str], name: str) -> None:
    deadline = time.monotonic() + 10
    while name not in order:
        assert time.monotonic() < deadline, f"{name} never took the lock: {order}"
        time.sleep(0.01)


def test_shared_holders_run_together_and_an_exclusive_one_waits_for_them(tmp_path):
    order: list[str] = []
    done_a, done_b, done_x = threading.Event(), threading.Event(), threading.Event()
    a = hold(str(tmp_path), False, order, "a", done_a)
    b = hold(str(tmp_path), False, order, "b", done_b)
    wait_for(order, "a")
    wait_for(order, "b")                              # two shared holders at once
    x = hold(str(tmp_path), True, order, "x", done_x)
    time.sleep(WAIT_S)
    assert "x" not in order
    done_a.set()
    a.join(10)
    time.sleep(WAIT_S)
    assert "x" not in order                           # b still runs
    done_b.set()
    b.join(10)
    wait_for(order, "x")
    done_x.set()
    x.join(10)


def test_a_waiting_exclusive_test_stops_new_shared_ones_from_starting(tmp_path):
    order: list[str] = []
    done_a, done_x, done_c = threading.Event(), threading.Event(), threading.Event()
    a = hold(str(tmp_path), False, order, "a", done_a)
    wait_for(order, "a")
    x = hold(str(tmp_path), True, order, "x", done_x)
    time.sleep(WAIT_S)                                # x now holds the gate and waits for a
    c = hold(str(tmp_path), False, order, "c", done_c)
    time.sleep(WAIT_S)
    assert order == ["a"]                             # c does not slip in beside a while x waits
    done_a.set()
    wait_for(order, "x")
    time.sleep(WAIT_S)
    assert order == ["a", "x"]                        # nor beside x
    done_x.set()
    wait_for(order, "c")
    done_c.set()
    for thread in (a, x, c):
        thread.join(10)


def test_an_exclusive_hold_kept_for_the_next_exclusive_test_lets_no_other_test_start_in_between(tmp_path):
    worker = WorkerLock(str(tmp_path))
    worker.enter(exclusive=True)
    order: list[str] = []
    done_c = threading.Event()
    c = hold(str(tmp_path), False, order, "c", done_c)      # the other worker, waiting for its next test
    worker.leave(keep=True)                                 # the next test on this worker is exclusive too
    time.sleep(WAIT_S)
    assert order == []
    worker.enter(exclusive=True)                            # no wait: the hold is still this worker's
    worker.leave(keep=False)                                # the next test is not exclusive
    wait_for(order, "c")
    worker.enter(exclusive=False)                           # shared: runs beside c
    worker.leave(keep=True)                                 # keep applies to an exclusive hold only
    x = hold(str(tmp_path), True, order, "x", threading.Event())
    time.sleep(WAIT_S)
    assert order == ["c"]                                   # x waits for c alone
    done_c.set()
    wait_for(order, "x")
    c.join(10)


def test_a_files_exclusive_tests_are_moved_together_first_in_it_in_xdist_workers_only():
    class Item(FakeItem):
        def __init__(self, nodeid: str, marks: tuple[str, ...] = ()) -> None:
            super().__init__(marks)
            self.nodeid = nodeid

    def items() -> list[Item]:
        return [Item("tests/test_a.py::t1"), Item("tests/test_a.py::x1", ("exclusive",)),
                Item("tests/test_a.py::t2"), Item("tests/test_a.py::x2", ("exclusive",)),
                Item("tests/test_b.py::t1"), Item("tests/sub/test_c.py::x[1]", ("exclusive",)),
                Item("tests/sub/test_c.py::t[1]")]

    worker, controller = items(), items()
    pytest_collection_modifyitems(SimpleNamespace(workerinput={}), worker)
    pytest_collection_modifyitems(SimpleNamespace(), controller)
    assert [i.nodeid for i in worker] == ["tests/test_a.py::x1", "tests/test_a.py::x2", "tests/test_a.py::t1",
                                          "tests/test_a.py::t2", "tests/test_b.py::t1", "tests/sub/test_c.py::x[1]",
                                          "tests/sub/test_c.py::t[1]"]
    assert [i.nodeid for i in controller] == [i.nodeid for i in items()]


def test_without_xdist_nothing_is_locked(tmp_path):
    with suite_lock(None, True), suite_lock(None, True):
        pass
    assert list(tmp_path.iterdir()) == []


class FakeItem:
    def __init__(self, marks: tuple[str, ...] = ()) -> None:
        self.marks = set(marks)

    def get_closest_marker(self, name: str):
        return SimpleNamespace(name=name) if name in self.marks else None


def test_files_sharing_a_session_run_are_one_unit_and_other_files_their_own():
    shared_a, shared_b = SHARED_RUNS[0], SHARED_RUNS[1]
    sources = {"tests/test_z.py": f"def test_t1({shared_a}): ...", "tests/test_b.py": f"def t({shared_a}, {shared_b})",
               "tests/test_m.py": f"def test_t1(tmp_path, {shared_b}): ...", "tests/test_q.py": "def test_t1(): ...",
               "tests/sub/test_q.py": "def test_t1(tmp_path): ..."}
    # z and b share the first run, b and m the second: one unit named by the first file
    assert shared_run_groups(sources) == {"tests/test_z.py": "tests/test_b.py", "tests/test_b.py": "tests/test_b.py",
                                          "tests/test_m.py": "tests/test_b.py", "tests/test_q.py": "tests/test_q.py",
                                          "tests/sub/test_q.py": "tests/sub/test_q.py"}


def test_the_suites_own_files_sharing_runs_are_one_unit(repo_root):
    groups = shared_run_groups({str(p.relative_to(repo_root)): p.read_text()
                                for p in (repo_root / "tests").rglob("test_*.py")})
    # the hang, fp16-overflow and crash-restart runs are read by these four files, the clean dp4 run by two others,
    # the analyze output of sample traces by the exporters' files and the golden findings
    for users in (["tests/test_findings_on_fault_injected_runs.py", "tests/test_hang.py", "tests/test_precision.py",
                   "tests/test_recovery.py"], ["tests/test_planner_calibrate_runs.py",
                                               "tests/test_stragglers_on_dp4_runs.py"],
                  ["tests/test_export_mlflow.py", "tests/test_export_prometheus.py", "tests/test_export_tensorboard.py",
                   "tests/test_sample_trace_findings.py"]):
        assert {groups[f] for f in users} == {users[0]}
    assert sum(group == "tests/test_findings_on_fault_injected_runs.py" for group in groups.values()) == 4
    assert groups["tests/test_layouts.py"] == "tests/test_layouts.py"


@pytest.mark.parametrize(("marks", "expected"), [((), False), (("multiproc",), False), (("exclusive",), True),
                                                 (("chaos", "multiproc"), False),
                                                 (("chaos", "multiproc", "exclusive"), True)])
def test_only_tests_marked_exclusive_run_alone(marks, expected):
    assert is_exclusive(FakeItem(marks)) is expected


def test_units_are_handed_out_costliest_first_summing_their_files_and_a_new_file_costs_the_median():
    queue = {"tests/test_a.py": {"tests/test_a.py::t1": False, "tests/test_a.py::t2": False},
             "tests/test_b.py": {"tests/test_b.py::t": False, "tests/test_c.py::t": False},     # a shared-run unit
             "tests/test_new.py": {"tests/test_new.py::t": False},
             "tests/test_d.py": {"tests/test_d.py::t[x]": False, "tests/test_d.py::t[y]": False}}
    costs = {"tests/test_a.py": 30.0, "tests/test_b.py": 20.0, "tests/test_c.py": 25.0, "tests/test_d.py": 1.0,
             "tests/test_gone.py": 5.0}
    ordered = order_units(queue, costs)
    # b + c = 45 > a 30 > new (median of the five: 20) > d 1
    assert list(ordered) == ["tests/test_b.py", "tests/test_a.py", "tests/test_new.py", "tests/test_d.py"]
    assert ordered["tests/test_b.py"] is queue["tests/test_b.py"]              # the units themselves untouched
    assert list(order_units(queue, {})) == list(queue)                          # no costs: xdist's own order


def test_costs_are_summed_per_file_from_a_durations_report():
    report = """============================= slowest durations ==============================
94.41s call     tests/test_conv.py::test_lamb[dp4]
1.50s setup    tests/test_conv.py::test_lamb[dp4]
0.25s teardown tests/chaos/test_process_faults.py::test_sigkill
12.00s call     tests/chaos/test_process_faults.py::test_quota[a::b]
(20 durations < 0.005s hidden.  Use -vv to show these durations.)
1 passed in 3.0s"""
    assert costs_from_durations(report) == {"tests/chaos/test_process_faults.py": 12.2, "tests/test_conv.py": 95.9}


def test_the_recorded_costs_name_only_files_that_exist(repo_root):
    # a renamed file would be scheduled at the median: rewrite the table (python tests/suite_rules.py REPORT)
    costs = json.loads(FILE_COSTS.read_text())
    assert len(costs) > 50 and all(seconds >= 0 for seconds in costs.values())
    assert [file for file in costs if not (repo_root / file).is_file()] == []
