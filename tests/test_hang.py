"""Hang watchdog: detection logic on fake progress, and an injected hang on rank 1 through ``dtprobe run``."""

from __future__ import annotations

import json
import time

import orjson
import pytest
from hang_fakes import FakeProbe, FakeStore

from dtprobe.runtime.hang import HANG_EXIT_CODE, HangConfig, Watchdog, stuck_ranks
from dtprobe.store.errors import ConfigError


def _progress(issued, completed):
    return {"world": {"pg_ranks": "0,1,2", "last_issued_seq": issued, "last_issued_op": "allreduce",
                      "last_completed_seq": completed, "last_completed_op": "allreduce"}}


def test_stuck_ranks_lists_members_that_never_issued_the_collective_or_published_nothing():
    published = {0: {"groups": _progress(12, 11)}, 1: {"groups": _progress(11, 11)}, 2: None}
    assert stuck_ranks(12, "world", [0, 1, 2], published) == [1, 2]


def test_watchdog_fires_after_timeout_with_the_rank_that_never_reached_the_collective():
    store, probe, exits = FakeStore(), FakeProbe(current_step=7), []
    cfg = HangConfig(collective_timeout_s=2.0, poll_interval_s=0.05)
    pending_since = time.time_ns() - int(2.5e9)
    pending = [{"pg": "world", "pg_ranks": "0,1,2", "seq": 12, "op": "allreduce", "step": 7,
                "enqueue_ns": pending_since}]
    dogs = {r: Watchdog(cfg, store=store, rank=r, restart=0, probe=probe, exit=exits.append,
                        progress=lambda r=r: _progress(12 if r != 1 else 11, 11),
                        pending=lambda r=r: pending if r != 1 else []) for r in range(3)}
    for dog in dogs.values():
        dog.publish()
    assert orjson.loads(store.get("dtprobe/hang/0/rank1"))["groups"]["world"]["last_issued_seq"] == 11
    assert dogs[1].check() is None                                  # the hung rank waits on nothing
    detail = dogs[0].check()
    assert detail["waiting_for_ranks"] == [1] and detail["seq"] == 12 and detail["op"] == "allreduce"
    assert detail["last_issued_seq"] == 12 and detail["last_completed_seq"] == 11
    assert detail["ranks"]["1"]["last_issued_seq"] == 11 and detail["timeout_s"] == 2.0
    assert detail["waited_s"] >= 2.5
    dogs[0].fire(detail)
    kind, row = probe.faults()[0]
    assert kind == "hang" and row["injected"] is False and row["step"] == 7 and row["waiting_for_ranks"] == [1]
    assert exits == [HANG_EXIT_CODE] and probe.log[-1] == ("close", "crashed", "watchdog")
    assert probe.names() == ["hang", "flush", "stack", "close"]  # the report flushed on its own, before the close
    assert probe.log[1] == ("flush", True)  # with the pending collectives: the evidence of who never arrived
    assert store.get("dtprobe/hang/0/fired") == b"0"


def test_watchdog_stays_quiet_before_the_timeout():
    dog = Watchdog(HangConfig(collective_timeout_s=30.0), store=FakeStore(), rank=0, restart=0,
                   probe=FakeProbe(current_step=7),
                   progress=lambda: _progress(3, 2),
                   pending=lambda: [{"pg": "world", "pg_ranks": "0,1", "seq": 3, "op": "allreduce", "step": 1,
                                     "enqueue_ns": time.time_ns()}])
    assert dog.check() is None


@pytest.mark.parametrize("kwargs,match", [({"collective_timeout_s": -1}, "collective_timeout_s = -1"),
                                          ({"poll_interval_s": 0}, "poll_interval_s = 0")])
def test_hang_config_rejects_bad_values(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        HangConfig(**kwargs)


# ------------------------------------------------------------------------------ 2 ranks through dtprobe run

@pytest.mark.multiproc
@pytest.mark.exclusive
def test_hang_on_rank1_fires_the_watchdog_within_timeout_and_names_the_missing_rank(hang_rank1_run):
    from dtprobe.store import RunStore

    proc, run_dir, timeout_s = hang_rank1_run.proc, hang_rank1_run.run_dir, hang_rank1_run.timeout_s
    assert (hang_rank1_run.rank, hang_rank1_run.step) == (1, 5)
    assert proc.returncode != 0                        # the job ends (no restarts allowed) instead of hanging
    store = RunStore.open(run_dir)
    faults = store.table("faults")
    injected = faults[(faults["kind"] == "hang") & faults["injected"]]
    observed = faults[(faults["kind"] == "hang") & ~faults["injected"]]
    assert list(injected["rank"]) == [1] and list(injected["step"]) == [5]
    assert list(observed["rank"]) == [0], proc.stdout[-2000:] + proc.stderr[-2000:]
    detail = json.loads(observed["detail"].iloc[0])
    assert detail["waiting_for_ranks"] == [1] and detail["pg"] == "world" and detail["op"] == "allreduce"
    assert detail["ranks"]["1"]["last_issued_seq"] < detail["seq"] == detail["last_issued_seq"]
    assert detail["last_completed_seq"] < detail["seq"]
    assert int(observed["step"].iloc[0]) == 5 and detail["timeout_s"] == timeout_s
    fired_after_s = (int(observed["time_ns"].iloc[0]) - int(injected["time_ns"].iloc[0])) / 1e9
    assert timeout_s - 1 <= fired_after_s <= timeout_s + 10     # rank 0 enqueues just after the hang
    coll = store.table("collectives")
    stuck = coll[(coll["rank"] == 0) & (coll["pg"] == "world") & (coll["seq"] == detail["seq"])]
    assert len(stuck) == 1 and stuck["end_ns"].isna().all()   # written at exit, never completed


@pytest.mark.multiproc
def test_the_hung_job_s_per_step_summaries_equal_its_raw_rows_and_count_the_collective_left_waiting(hang_rank1_run):
    from comm_summary_checks import assert_summaries_equal_raw_rows

    summaries = assert_summaries_equal_raw_rows(hang_rank1_run.run_dir)
    at_hang = summaries[(summaries["step"] == hang_rank1_run.step) & (summaries["pg"] == "world")].set_index("rank")
    # rank 0 waited in the step's all-reduce until its watchdog gave up: written at close, never completed
    assert at_hang.loc[0, "num_collectives"] == at_hang.loc[0, "num_completed"] + 1


def test_a_hang_title_places_a_missing_rank_at_its_own_line_not_in_the_library_it_waits_in():
    # the main thread's innermost frame outside the Python installation and dtprobe: a rank blocked in a
    # DataLoader's queue is at the script's line that asked for the batch; other threads do not count
    import sysconfig

    from dtprobe.analysis.hangs import _at

    lib = sysconfig.get_paths()["stdlib"]
    stack = ("Thread MainThread (1):\n"
             '  File "/home/u/train.py", line 120, in main\n    batch = next(it)\n'
             f'  File "{lib}/queue.py", line 180, in get\n    self.not_empty.wait(remaining)\n'
             f'  File "{lib}/threading.py", line 331, in wait\n    gotit = waiter.acquire(True, timeout)\n'
             "\nThread worker (2):\n"
             '  File "/home/u/loader.py", line 7, in run\n    time.sleep(1)\n')
    assert _at(stack) == ", at train.py:120"
    assert _at(f'Thread MainThread (1):\n  File "{lib}/threading.py", line 331, in wait\n') == ", at threading.py:331"
    assert _at(None) == "" and _at("no frames") == ""


def test_a_rank_waiting_inside_its_dataloader_for_a_batch_is_said_to_wait_for_it():
    # with worker processes the main thread waits on their queue inside torch's DataLoader iterator, below the
    # script's line; without workers the dataset's own code is innermost and is the place named
    import sysconfig

    from dtprobe.analysis.hangs import _at, waits_for_batch

    lib, site = sysconfig.get_paths()["stdlib"], sysconfig.get_paths()["purelib"]
    loader = f'  File "{site}/torch/utils/data/dataloader.py", line 725, in __next__\n    data = self._next_data()\n'
    workers = ("Thread MainThread (1):\n"
               '  File "/home/u/train.py", line 58, in <module>\n    for step, (x, y) in enumerate(loader):\n'
               + loader + f'  File "{lib}/selectors.py", line 415, in select\n    fd_event_list = poll(t)\n')
    in_dataset = ("Thread MainThread (1):\n"
                  '  File "/home/u/train.py", line 58, in <module>\n    for step, (x, y) in enumerate(loader):\n'
                  + loader + '  File "/home/u/data.py", line 41, in __getitem__\n    time.sleep(3600)\n')
    elsewhere = ("Thread MainThread (1):\n"
                 '  File "/home/u/train.py", line 70, in <module>\n    loss.backward()\n'
                 f'  File "{site}/torch/_tensor.py", line 623, in backward\n    torch.autograd.backward(\n'
                 "\nThread pin (2):\n" + loader)
    assert waits_for_batch(workers) and _at(workers) == ", at train.py:58, waiting for a batch from its DataLoader"
    assert not waits_for_batch(in_dataset) and _at(in_dataset) == ", at data.py:41"
    assert not waits_for_batch(elsewhere) and not waits_for_batch(None)
