"""The recorder's cheap paths keep their meaning: a caller descheduled inside the backend's issue call still counts as
waiting promptly (no done-callback comes back), a late wait still brings it back; the watchdog's progress lists a
group only once it issued; and ``benchmarks/probe_overhead.py``'s ``record_cost`` case accounts for every collective
it runs (a 1-rank gloo group and the stub backend, each way of waiting)."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import torch

from dtprobe.collectors.pg_wrapper import CollectiveRecorder, RecordingProcessGroup, _WaitHabit

from collector_fakes import ListWriter

SLOW_ISSUE_S = 3 * _WaitHabit.PROMPT_WAIT_NS / 1e9
"""How long the slow backend's issue call takes: well past ``PROMPT_WAIT_NS``."""


class DoneWork(torch.distributed.Work):
    """A work that completed inside the backend's issue call (a tiny collective)."""

    def __init__(self) -> None:
        super().__init__()
        self.fut = torch.futures.Future()
        self.fut.set_result(None)

    def wait(self, timeout=None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True

    def get_future(self):
        return self.fut


class SlowIssueInner:
    """A backend whose all_reduce completes, but returns only after ``SLOW_ISSUE_S`` (the caller descheduled inside
    the call on a busy machine)."""

    def allreduce(self, tensors, *args):
        time.sleep(SLOW_ISSUE_S)
        return DoneWork()

    def _set_group_name(self, name):
        pass


def _group() -> tuple[RecordingProcessGroup, CollectiveRecorder, ListWriter]:
    recorder, writer = CollectiveRecorder(), ListWriter()
    recorder.start(writer, flush_interval_s=3600)
    pg = RecordingProcessGroup(SlowIssueInner(), 0, 2, backend_name="dtprobe_gloo", recorder=recorder)
    pg.dtprobe_name = "tp"
    return pg, recorder, writer


def test_a_wait_right_after_a_slow_issue_call_counts_as_prompt():
    pg, recorder, writer = _group()
    num_works = _WaitHabit.PROMPT_WAITS + 2
    for _ in range(num_works):
        pg.allreduce([torch.ones(4)]).wait()
    habit = pg._habits["allreduce"]
    assert not habit.needs_callback and habit.prompt == _WaitHabit.PROMPT_WAITS
    recorder.stop()
    rows = writer.table("collectives")
    assert [r["seq"] for r in rows] == list(range(1, num_works + 1))
    # Each end is at least the slow issue call after its enqueue: stamped after the backend returned.
    assert all(r["end_ns"] - r["enqueue_ns"] >= SLOW_ISSUE_S * 1e9 for r in rows)


def test_a_wait_long_after_the_issue_returned_still_brings_the_callback_back():
    pg, recorder, writer = _group()
    for _ in range(_WaitHabit.PROMPT_WAITS + 1):
        pg.allreduce([torch.ones(4)]).wait()
    assert not pg._habits["allreduce"].needs_callback
    late = pg.allreduce([torch.ones(4)])
    time.sleep(2 * _WaitHabit.PROMPT_WAIT_NS / 1e9)
    late.wait()
    assert pg._habits["allreduce"].needs_callback
    recorder.stop()


def test_progress_lists_a_group_once_it_issued_and_its_last_completion():
    recorder = CollectiveRecorder()
    recorder.start(ListWriter(), flush_interval_s=3600)
    key = recorder.group_key("dp", "0,1", 2)
    recorder.group_progress(key)                      # looked up by a group that has not issued yet
    assert recorder.progress() == {}
    row = (key, 1, "allreduce", 8, "float32", 3, "host", 1_000, 0)
    done = recorder.run_blocking(row, recorder.group_progress(key), lambda t: None, (torch.ones(2),), {})
    assert done is None
    assert recorder.progress() == {key: {"pg_ranks": "0,1", "last_completed_seq": 1, "last_completed_op": "allreduce",
                                         "last_issued_seq": 1, "last_issued_op": "allreduce", "last_issued_step": 3,
                                         "last_issued_ns": 1_000}}
    recorder.stop()


def test_record_cost_case_records_every_collective_it_runs(repo_root, child_env, tmp_path):
    out = tmp_path / "record_cost.json"
    proc = subprocess.run([sys.executable, str(repo_root / "benchmarks" / "probe_overhead.py"), "--record-cost-worker",
                           str(out), "--record-cost-rounds", "3", "--record-cost-block", "4"],
                          env=child_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]     # the worker checks the recorder saw each collective
    costs = json.loads(out.read_text())
    keys = [f"{b}/{m}" for b in ("gloo", "stub") for m in ("blocking", "async", "future")]
    assert sorted(k for k in costs if "/" in k) == sorted(keys)
    for key in keys:
        for side in ("plain", "recorded"):
            rounds = costs[key][side]
            assert len(rounds) == 3 and all(len(r) == 3 for r in rounds)
            assert all(r[0] > 0 and r[1] > 0 and r[2] > 0 for r in rounds)   # thread CPU, process CPU, wall
