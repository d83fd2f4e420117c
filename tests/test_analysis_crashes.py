"""RANK_CRASH and HANG verdicts from telemetry (attempts, lifecycle, pending, sampler rows) on small hand-made runs:
who died first and how, the survivors are no culprits, the liveness of stuck ranks, point-to-point stalls, a
network partition, and no verdict from an injected row."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest
from analysis_synth import (MS, T0, cut_rank, frames, lockstep_tables, pending_row, sampler_rows, stall_rank,
                            write_rows_run)

from dtprobe.analysis import RunAnalysis
from dtprobe.analysis.crashes import classify_cause, how
from dtprobe.analysis.hangs import merge_pending
from dtprobe.analysis.render import event_lines

S = 1000 * MS


def _codes(a: RunAnalysis, *codes: str) -> list:
    return [f for f in a.findings() if f.code in codes]


def _attempt(attempt: int, result: str, ranks: list[dict], *, started: int = T0, ended: int | None = None) -> dict:
    return {"attempt": attempt, "node_rank": 0, "started_ns": started, "ended_ns": ended, "result": result,
            "ranks": [{"local_rank": r["rank"], "pid": 100 + r["rank"], "signal": None, "first_failure": False,
                       "time_ns": ended, "error": None, **r} for r in ranks]}


def _killed_rank1_at_step3(*, restart: bool, attempts: bool) -> tuple[dict, list | None, list]:
    """2 ranks; rank 1 is SIGKILLed at 330 ms (step 3, in its forward); rank 0 enters all-reduce #4 at 360 ms
    (a pending row), torchrun SIGTERMs it at 500 ms. With ``restart``: attempt 1 resumes from step 2 at 2 s."""
    rows = lockstep_tables(world=2, num_steps=6)
    cut_rank(rows, 1, T0 + 330 * MS)
    stall_rank(rows, 0, T0 + 360 * MS, until_ns=T0 + 500 * MS, close=("crashed", "SIGTERM"))
    rows["pending"] = [pending_row(0, step=3, seq=4, t_ns=T0 + 360 * MS)]
    faults = []
    att = [_attempt(0, "failed", [{"rank": 1, "exit_code": -9, "signal": "SIGKILL", "first_failure": True,
                                   "time_ns": T0 + 330 * MS},
                                  {"rank": 0, "exit_code": -15, "signal": "SIGTERM", "time_ns": T0 + 500 * MS}],
                    ended=T0 + 500 * MS)]
    if restart:
        again = lockstep_tables(world=2, num_steps=4, t0=T0 + 2 * S, first_step=2, restart=1)
        for table, new in again.items():
            rows[table] += new
        faults.append({"rank": 0, "time_ns": T0 + 2 * S - 10 * MS, "step": 2, "kind": "restart", "injected": False,
                       "detail": json.dumps({"restart": 1, "from_step": 2, "checkpoint_step": 1, "last_step": 2,
                                             "steps_lost": 1})})
        att.append(_attempt(1, "succeeded", [{"rank": 0, "exit_code": 0}, {"rank": 1, "exit_code": 0}],
                            started=T0 + 2 * S, ended=T0 + 3 * S))
    return rows, att if attempts else None, faults


@pytest.mark.parametrize("attempts", [True, False], ids=["dtprobe-run", "plain-torchrun"])
def test_rank_crash_names_the_killed_rank_not_the_sigtermed_survivor_and_no_hang(tmp_path, attempts):
    rows, att, faults = _killed_rank1_at_step3(restart=False, attempts=attempts)
    a = RunAnalysis.open(write_rows_run(tmp_path / "run", rows, world_size=2, status="crashed", attempts=att,
                                        faults=faults))
    assert _codes(a, "HANG") == []                       # rank 0 waited for a dead rank: not a hang
    [f] = _codes(a, "RANK_CRASH")
    ev = f.evidence
    assert (f.ranks, f.severity, ev["step"], ev["last_step"], ev["also_lost"]) == ((1,), "critical", 3, 2, [0])
    # the phase it died in: from the launcher's exit time (330 ms: fwd), else from its last sign of life (its
    # sampler row at 300 ms, the step's start: data)
    assert (ev["cause"], ev["recovered"], ev["phase"]) == ("killed_by_signal", False, "fwd" if attempts else "data")
    assert ev["signal"] == ("SIGKILL" if attempts else None)
    assert ev["source"] == ("attempts" if attempts else "lifecycle")
    assert [(w["op"], w["seq"], w["arrived_ranks"]) for w in ev["waited_at"]] == [("allreduce", 4, [0])]
    assert ev["injected"] is False


def test_a_rank_the_oom_killer_ended_is_out_of_memory_with_the_kernels_line_as_evidence(tmp_path):
    rows, att, _ = _killed_rank1_at_step3(restart=False, attempts=True)
    said = "Memory cgroup out of memory: Killed process 101 (python) total-vm:3518248kB, anon-rss:1250848kB"
    att[0]["ranks"][0]["oom_kill"] = said                  # rank 1's entry, as the launcher recorded it
    a = RunAnalysis.open(write_rows_run(tmp_path / "run", rows, world_size=2, status="crashed", attempts=att))
    [f] = _codes(a, "RANK_CRASH")
    assert (f.ranks, f.evidence["signal"], f.evidence["cause"], f.evidence["oom_kill"]) == (
        (1,), "SIGKILL", "out_of_memory", said)
    assert f.title.startswith("rank 1 died at step 3 (SIGKILL from the kernel's OOM killer; cause out_of_memory)")
    assert f.recommendation.startswith("The kernel's OOM killer ended rank 1")
    # the same kill without that evidence: a signal from outside, nothing more is known
    del att[0]["ranks"][0]["oom_kill"]
    [f] = _codes(RunAnalysis.open(write_rows_run(tmp_path / "run2", rows, world_size=2, status="crashed",
                                                 attempts=att)), "RANK_CRASH")
    assert (f.evidence["cause"], f.evidence["oom_kill"]) == ("killed_by_signal", None)


@pytest.mark.parametrize("fails_after_s, hang", [(2.0, False), (90.0, True)])
def test_a_rank_alive_in_a_stall_that_then_fails_on_its_own_is_a_crash_unless_it_was_stuck_longer_than_a_hang(
        tmp_path, fails_after_s, hang):
    # rank 1 stops entering collectives at 330 ms (its DataLoader waits for a worker the OOM killer ended) while
    # its sampler shows it alive; rank 0 waits in all-reduce #4 from 360 ms. Rank 1 raises after 2 s: its crash,
    # with that wait; raising only after 90 s (more than the 60-s hang timeout) it was stuck: a HANG
    fail_ns = T0 + 360 * MS + int(fails_after_s * S)
    rows = lockstep_tables(world=2, num_steps=6)
    stall_rank(rows, 1, T0 + 330 * MS, until_ns=fail_ns, close=("crashed", "exception"))
    stall_rank(rows, 0, T0 + 360 * MS, until_ns=fail_ns + 200 * MS, close=("crashed", "SIGTERM"))
    rows["pending"] = [pending_row(0, step=3, seq=4, t_ns=T0 + 360 * MS)]
    error = {"type": "RuntimeError", "message": "DataLoader worker (pid(s) 4321) exited unexpectedly",
             "traceback": None}
    att = [_attempt(0, "failed", [{"rank": 1, "exit_code": 1, "first_failure": True, "error": error,
                                   "time_ns": fail_ns},
                                  {"rank": 0, "exit_code": -15, "signal": "SIGTERM", "time_ns": fail_ns + 200 * MS}],
                    ended=fail_ns + 200 * MS)]
    a = RunAnalysis.open(write_rows_run(tmp_path / "run", rows, world_size=2, status="crashed", attempts=att))
    assert [f.ranks for f in _codes(a, "HANG")] == ([(1,)] if hang else [])
    [crash] = _codes(a, "RANK_CRASH")
    assert (crash.ranks, crash.evidence["cause"]) == ((1,), "user_exception")
    if not hang:                          # the wait it imposed is in its crash: until torchrun stopped rank 0
        [w] = crash.evidence["waited_at"]
        assert (w["seq"], w["arrived_ranks"], w["waited_s"]) == (4, [0], pytest.approx(2.2, abs=0.06))


@pytest.mark.parametrize("signal, oom_kill, cause, advice", [
    ("Killed", None, "killed_by_signal", "A DataLoader worker of rank 1 was killed (SIGKILL), most often by the "
                                          "kernel's OOM killer"),
    ("Killed", "its DataLoader worker 4321: Memory cgroup out of memory: Killed process 4321 (pt_data_worker)",
     "out_of_memory", "The kernel's OOM killer ended a DataLoader worker of rank 1"),
    ("Bus error", None, "out_of_memory", "A DataLoader worker of rank 1 died of a bus error: its shared memory "
                                         "(/dev/shm) is too small")])
def test_a_rank_whose_dataloader_worker_died_is_classed_by_how_the_worker_died(tmp_path, signal, oom_kill, cause,
                                                                               advice):
    rows, att, _ = _killed_rank1_at_step3(restart=False, attempts=True)
    error = {"type": "RuntimeError", "message": f"DataLoader worker (pid 4321) is killed by signal: {signal}. ",
             "traceback": None}
    att[0]["ranks"][0].update(exit_code=1, signal=None, error=error, **({"oom_kill": oom_kill} if oom_kill else {}))
    [f] = _codes(RunAnalysis.open(write_rows_run(tmp_path / "run", rows, world_size=2, status="crashed",
                                                 attempts=att)), "RANK_CRASH")
    assert (f.ranks, f.evidence["cause"], f.evidence["oom_kill"]) == ((1,), cause, oom_kill)
    assert f.recommendation.startswith(advice), f.recommendation


def test_a_rank_silent_in_a_stall_whose_peers_an_operator_stopped_is_no_crash(tmp_path):
    # 2 nodes, no host sampler (--no-devices); the link between them is cut: both ranks are in all-reduce #4 from
    # 360 ms. Node 0's launcher is stopped by its operator at 60 s (its attempt recorded interrupted; rank 0 closes
    # on that SIGTERM); node 1's launcher never records (killed), and rank 1 never closes. That SIGTERM came from
    # the operator, not from torchrun after a death: rank 1 did not die first, and the stall is a HANG
    rows = lockstep_tables(world=2, num_steps=6)
    rows["devices"] = []
    cut_rank(rows, 1, T0 + 330 * MS)
    rows["lifecycle"] = [x for x in rows["lifecycle"] if not (x["rank"] == 0 and x["event"] == "close")]
    rows["lifecycle"].append({"rank": 0, "restart": 0, "time_ns": T0 + 60 * S, "event": "close",
                              "status": "crashed", "reason": "SIGTERM", "pid": 100})
    rows["collectives"] = [x for x in rows["collectives"] if x["enqueue_ns"] < T0 + 330 * MS]
    rows["pending"] = [pending_row(r, step=3, seq=4, t_ns=T0 + (360 + r) * MS) for r in (0, 1)]
    att = [_attempt(0, "interrupted", [{"rank": 0, "exit_code": -15, "signal": "SIGTERM", "time_ns": T0 + 60 * S}],
                    ended=T0 + 60 * S)]
    a = RunAnalysis.open(write_rows_run(tmp_path / "run", rows, world_size=2, status="crashed", attempts=att,
                                        node_of={0: 0, 1: 1}))
    assert _codes(a, "RANK_CRASH") == []
    [hang] = _codes(a, "HANG")
    assert hang.ranks == (0, 1) and hang.evidence["liveness"] == {"0": "waiting", "1": "stopped"}


def test_a_killed_rank_whose_exit_status_torchrun_never_reported_is_still_the_crash_not_a_hang(tmp_path):
    # the launcher saw rank 1's process go (its exit time) but torchrun reported no status for it and named no
    # first failure; rank 0 raised on the dead peer (closed crashed, "exception") before torchrun's SIGTERM
    rows, att, faults = _killed_rank1_at_step3(restart=False, attempts=True)
    rows["lifecycle"] = [x for x in rows["lifecycle"] if not (x["rank"] == 0 and x["event"] == "close")]
    rows["lifecycle"].append({"rank": 0, "restart": 0, "time_ns": T0 + 400 * MS, "event": "close",
                              "status": "crashed", "reason": "exception", "pid": 100})
    att[0]["ranks"][0].update(exit_code=None, signal=None, first_failure=False)
    a = RunAnalysis.open(write_rows_run(tmp_path / "run", rows, world_size=2, status="crashed", attempts=att,
                                        faults=faults))
    assert _codes(a, "HANG") == []
    [f] = _codes(a, "RANK_CRASH")
    assert (f.ranks, f.severity, f.evidence["cause"]) == ((1,), "critical", "killed_by_signal")


def test_a_restart_that_fails_at_start_up_is_its_own_crash_and_the_first_ones_wait_ends_with_its_attempt(tmp_path):
    rows, att, _ = _killed_rank1_at_step3(restart=False, attempts=True)
    error = {"type": "RuntimeError", "message": "Gloo connectFullMesh failed with ... timed out connecting",
             "traceback": None}
    att.append(_attempt(1, "failed", [{"rank": 1, "exit_code": 1, "first_failure": True, "error": error,
                                       "time_ns": T0 + 5 * S},
                                      {"rank": 0, "exit_code": -15, "signal": "SIGTERM", "time_ns": T0 + 5200 * MS}],
                        started=T0 + 4 * S, ended=T0 + 5200 * MS))       # no rows: it died before attaching
    a = RunAnalysis.open(write_rows_run(tmp_path / "run", rows, world_size=2, status="crashed", attempts=att))
    first, again = sorted(_codes(a, "RANK_CRASH"), key=lambda f: f.evidence["restart"])
    assert (first.ranks, first.evidence["step"], again.ranks, again.evidence["cause"]) == ((1,), 3, (1,),
                                                                                          "communication")
    [w] = first.evidence["waited_at"]        # rank 0 waited from 360 ms until torchrun stopped it at 500 ms
    assert (w["seq"], w["waited_s"]) == (4, pytest.approx(0.14, abs=0.05))
    # the restart ran no step and entered no collective: no step of the first attempt's stall is its own
    assert pd.isna(again.evidence["step"]) and again.evidence["waited_at"] == []
    assert again.title.startswith("rank 1 died before completing a step of attempt 1 (RuntimeError: Gloo")


@pytest.mark.parametrize("attempts", [True, False], ids=["torchrun-named-the-survivor", "plain-torchrun"])
def test_a_survivor_that_raised_on_the_dead_peer_is_not_the_culprit_even_when_torchrun_names_it(tmp_path, attempts):
    # rank 1 is SIGKILLed at 330 ms and never closes; rank 0 raises on the lost connection and closes crashed
    # ("exception") at 400 ms, then torchrun's SIGTERM ends it before its error file is written. torchrun ranks
    # failures by whole seconds (an error file's second before a signal's discovery), so its log can name rank 0
    # first: rank 0 was still running after rank 1's last row, so rank 1 died first
    rows, att, faults = _killed_rank1_at_step3(restart=False, attempts=True)
    rows["lifecycle"] = [x for x in rows["lifecycle"] if not (x["rank"] == 0 and x["event"] == "close")]
    rows["lifecycle"].append({"rank": 0, "restart": 0, "time_ns": T0 + 400 * MS, "event": "close",
                              "status": "crashed", "reason": "exception", "pid": 100})
    att[0]["ranks"][0]["first_failure"] = False            # rank 1's entry
    att[0]["ranks"][1]["first_failure"] = True             # rank 0's: SIGTERM, named first by torchrun
    a = RunAnalysis.open(write_rows_run(tmp_path / "run", rows, world_size=2, status="crashed",
                                        attempts=att if attempts else None, faults=faults))
    [f] = _codes(a, "RANK_CRASH")
    assert (f.ranks, f.severity, f.evidence["cause"], f.evidence["also_lost"]) == (
        (1,), "critical", "killed_by_signal", [0])


def test_a_recovered_crash_is_a_warning_with_steps_lost_and_time_to_recover(tmp_path):
    rows, att, faults = _killed_rank1_at_step3(restart=True, attempts=True)
    a = RunAnalysis.open(write_rows_run(tmp_path / "run", rows, world_size=2, status="finished", attempts=att,
                                        faults=faults))
    [f] = _codes(a, "RANK_CRASH")
    ev = f.evidence
    assert (f.ranks, f.severity, ev["recovered"], ev["resumed_from_step"], ev["steps_lost"]) == (
        (1,), "warning", True, 2, 1)
    assert ev["time_to_recover_s"] == pytest.approx(2.0 - 0.33)    # crash to the first step of attempt 1
    assert "HANG" not in [x.code for x in a.findings()]
    header = a.metrics()["run"]
    assert [(c["rank"], c["step"], c["recovered"]) for c in header["crashes"]] == [(1, 3, True)]
    assert [(r["restart"], r["from_step"], r["steps_lost"]) for r in header["restarts"]] == [(1, 2, 1)]
    assert header["crashes"][0]["title"] == f.title


def test_the_first_failure_is_the_culprit_and_its_cause_not_the_survivors_communication_errors(tmp_path):
    rows, _, _ = _killed_rank1_at_step3(restart=False, attempts=True)
    oom = {"type": "torch.OutOfMemoryError", "message": "CUDA out of memory. Tried to allocate 2.00 GiB",
           "traceback": "..."}
    gloo = {"type": "torch.distributed.DistBackendError", "message": "Connection closed by peer [127.0.0.1]:1234",
            "traceback": "..."}
    att = [_attempt(0, "failed", [{"rank": 1, "exit_code": 1, "first_failure": True, "time_ns": T0 + 330 * MS,
                                   "error": oom},
                                  {"rank": 0, "exit_code": 1, "time_ns": T0 + 400 * MS, "error": gloo}])]
    a = RunAnalysis.open(write_rows_run(tmp_path / "run", rows, world_size=2, status="crashed", attempts=att))
    [f] = _codes(a, "RANK_CRASH")
    assert (f.ranks, f.evidence["cause"], f.evidence["error_type"]) == ((1,), "out_of_memory",
                                                                        "torch.OutOfMemoryError")
    assert "CUDA out of memory" in f.title


_ABORT = ("terminate called after throwing an instance of 'c10::Error'\n  what():  {}\nFatal Python error: Aborted\n"
          'File "/home/u/train.py", line 40 in step')


@pytest.mark.parametrize("kw,cause", [
    (dict(error_type="torch.OutOfMemoryError", error_message="CUDA out of memory"), "out_of_memory"),
    (dict(error_type="MemoryError", error_message=""), "out_of_memory"),
    (dict(error_type="RuntimeError", error_message="CUDA error: an illegal memory access was encountered"), "device"),
    (dict(error_type=None, error_message=None, xid=True), "device"),
    (dict(error_type="torch.distributed.DistBackendError", error_message="NCCL error in: ..."), "communication"),
    (dict(error_type="RuntimeError", error_message="[../gloo/transport/tcp/pair.cc:534] Connection closed by peer"),
     "communication"),
    (dict(error_type="ValueError", error_message="bad batch"), "user_exception"),
    (dict(error_type=None, error_message=None, exit_code=-9, signal="SIGKILL"), "killed_by_signal"),
    (dict(error_type=None, error_message=None, exit_code=None, closed=False), "killed_by_signal"),
    (dict(error_type=None, error_message=None, exit_code=1, closed=False), "unknown"),   # os._exit(1): no signal
    (dict(error_type=None, error_message=None, exit_code=3), "unknown"),
    # no Python error: a death of its own is classed by the error lines of its stderr excerpt, a kill is not
    (dict(error_type=None, error_message=None, exit_code=-6, signal="SIGABRT", stderr=_ABORT.format(
        "CUDA error: an illegal memory access was encountered")), "device"),
    (dict(error_type=None, error_message=None, exit_code=-6, signal="SIGABRT", stderr=_ABORT.format(
        "[Rank 1] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=7, OpType=ALLREDUCE)")),
     "communication"),
    (dict(error_type=None, error_message=None, exit_code=-6, signal="SIGABRT", stderr=_ABORT.format(
        "CUDA out of memory. Tried to allocate 2.00 GiB")), "out_of_memory"),
    (dict(error_type=None, error_message=None, exit_code=1, stderr="RuntimeError: NCCL error: unhandled system "
          "error"), "communication"),
    (dict(error_type=None, error_message=None, exit_code=-9, signal="SIGKILL", stderr="CUDA error: launch failure"),
     "killed_by_signal"),
    (dict(error_type=None, error_message=None, exit_code=-11, signal="SIGSEGV",
          stderr='Fatal Python error: Segmentation fault\nFile "/opt/gloo_socket_utils.py", line 3 in send'),
     "killed_by_signal"),      # frame lines and the dump's header name no cause
    (dict(error_type=None, error_message=None, exit_code=-6, signal="SIGABRT",
          stderr="loaded 12 gloo timeout settings\nFatal Python error: Aborted"), "killed_by_signal"),
])
def test_crash_cause_classes(kw, cause):
    base = dict(exit_code=1, signal=None)
    assert classify_cause(**{**base, **kw}) == cause


def test_a_native_abort_is_titled_with_its_message_and_the_scripts_line_and_a_kill_with_its_signal_alone():
    abort = _abort_row(signal="SIGABRT", stderr_tail=_ABORT.format("CUDA error: an illegal memory access"))
    assert how(abort) == 'SIGABRT in train.py:40, its stderr: "CUDA error: an illegal memory access"'
    assert how(_abort_row(signal="SIGKILL", stderr_tail="CUDA error: launch failure")) == "SIGKILL"
    assert how(_abort_row(signal="SIGSEGV", stderr_tail=None)) == "SIGSEGV"


def _abort_row(**kw):
    from types import SimpleNamespace

    return SimpleNamespace(**{"error_type": None, "error_message": None, "exit_code": None, "oom_kill": None,
                              "source": "attempts", **kw})


def _frozen_rank1(*, attempts: bool, world: int = 2) -> tuple[dict, list | None]:
    """Rank 1 freezes (SIGSTOP) at 330 ms; the others wait in all-reduce #4 from 360 ms, alive (sampler rows)
    until their watchdog fires at 10.4 s; torchrun then SIGKILLs the frozen rank."""
    rows = lockstep_tables(world=world, num_steps=6)
    cut_rank(rows, 1, T0 + 330 * MS)
    rows["pending"] = []
    for r in [r for r in range(world) if r != 1]:
        stall_rank(rows, r, T0 + 360 * MS, until_ns=T0 + 10_400 * MS, close=("crashed", "watchdog"))
        rows["pending"].append(pending_row(r, step=3, seq=4, t_ns=T0 + 360 * MS + r * MS, world=world))
    ranks = [{"rank": 0, "exit_code": 124, "first_failure": True, "time_ns": T0 + 10_400 * MS},
             {"rank": 1, "exit_code": -9, "signal": "SIGKILL", "time_ns": T0 + 40 * S}]
    return rows, [_attempt(0, "failed", ranks)] if attempts else None


@pytest.mark.parametrize("attempts", [True, False], ids=["dtprobe-run", "plain-torchrun"])
def test_a_frozen_rank_is_a_hang_with_liveness_stopped_and_the_waiter_waiting_not_a_crash(tmp_path, attempts):
    rows, att = _frozen_rank1(attempts=attempts)
    stack = {"reason": "watchdog", "stack": 'File "train.py", line 80, in train_step\n  dist.all_reduce(t)'}
    faults = [{"rank": 0, "time_ns": T0 + 10_360 * MS, "step": 3, "kind": "stack", "injected": False,
               "detail": json.dumps(stack)},
              {"rank": 0, "time_ns": T0 + 10_360 * MS, "step": 3, "kind": "hang", "injected": False,
               "detail": json.dumps({"pg": "dp", "pg_ranks": "0,1", "seq": 4, "op": "allreduce",
                                     "waiting_for_ranks": [1]})}]
    a = RunAnalysis.open(write_rows_run(tmp_path / "run", rows, world_size=2, status="crashed", attempts=att,
                                        faults=faults))
    assert _codes(a, "RANK_CRASH") == []                  # the watchdog ended a hang: not a crash
    [f] = _codes(a, "HANG")
    ev = f.evidence
    assert (f.ranks, f.severity, f.group, ev["op"], ev["seq"], ev["step"]) == ((1,), "critical", "dp", "allreduce",
                                                                              4, 3)
    assert ev["liveness"] == {"0": "waiting", "1": "stopped"} and ev["cause"] == "missing_rank"
    assert ev["stacks"] == {"0": stack["stack"]}
    assert ev["watchdog_report"]["reported_by"] == 0 and ev["watchdog_report"]["waiting_for_ranks"] == [1]
    assert ev["waited_s"] == pytest.approx(10.4 - 0.36, abs=0.2)


def test_a_missing_rank_whose_program_ended_normally_is_exited_not_stopped(tmp_path):
    # rank 1 freezes, rank 2's script returned after step 2 (its probe closed finished): rank 0 waits in #4 for
    # both. Rank 2 left no row after the stall either, but it is not frozen
    rows, _ = _frozen_rank1(attempts=False, world=3)
    cut_rank(rows, 2, T0 + 300 * MS)
    rows["lifecycle"].append({"rank": 2, "restart": 0, "time_ns": T0 + 302 * MS, "event": "close",
                              "status": "finished", "reason": "exit", "pid": 102})
    rows["pending"] = [x for x in rows["pending"] if x["rank"] != 2]
    a = RunAnalysis.open(write_rows_run(tmp_path / "run", rows, world_size=3, status="crashed"))
    [f] = _codes(a, "HANG")
    assert f.evidence["liveness"] == {"0": "waiting", "1": "stopped", "2": "exited"}
    assert "rank 1 stopped" in f.title and "rank 2 exited" in f.title
    assert _codes(a, "COLLECTIVE_MISMATCH") == []      # a frozen rank's record is cut: nothing says it ended


def test_a_frozen_rank_killed_when_the_operator_stopped_the_hung_job_is_a_hang_not_a_crash(tmp_path):
    # Rank 1 freezes at 330 ms; rank 0 waits in all-reduce #4 from 360 ms until the operator interrupts the job at
    # 40 s: rank 0 closes on torchrun's SIGTERM, the frozen rank 1 cannot, and is SIGKILLed 15 s later.
    rows = lockstep_tables(world=2, num_steps=6)
    cut_rank(rows, 1, T0 + 330 * MS)
    stall_rank(rows, 0, T0 + 360 * MS, until_ns=T0 + 40 * S, close=("crashed", "SIGTERM"))
    rows["pending"] = [pending_row(0, step=3, seq=4, t_ns=T0 + 360 * MS)]
    ranks = [{"rank": 0, "exit_code": -15, "signal": "SIGTERM", "time_ns": T0 + 40 * S},
             {"rank": 1, "exit_code": -9, "signal": "SIGKILL", "time_ns": T0 + 55 * S}]
    a = RunAnalysis.open(write_rows_run(tmp_path / "run", rows, world_size=2, status="crashed",
                                        attempts=[_attempt(0, "interrupted", ranks, ended=T0 + 55 * S)]))
    assert _codes(a, "RANK_CRASH") == []
    [f] = _codes(a, "HANG")
    assert f.ranks == (1,) and f.evidence["liveness"] == {"0": "waiting", "1": "stopped"}
    assert f.evidence["waited_s"] == pytest.approx(40 - 0.36, abs=0.2)
    # the same exits with rank 1 gone before rank 0's SIGTERM: it died first, and torchrun stopped the job
    ranks[1]["time_ns"] = T0 + 335 * MS
    a = RunAnalysis.open(write_rows_run(tmp_path / "run2", rows, world_size=2, status="crashed",
                                        attempts=[_attempt(0, "failed", ranks, ended=T0 + 40 * S)]))
    [crash] = _codes(a, "RANK_CRASH")
    assert crash.ranks == (1,) and _codes(a, "HANG") == []


def test_a_rank_alive_outside_the_collective_is_named_alive(tmp_path):
    rows = lockstep_tables(world=2, num_steps=6)
    stall_rank(rows, 1, T0 + 330 * MS, until_ns=T0 + 10_400 * MS, close=("crashed", "watchdog"))
    stall_rank(rows, 0, T0 + 360 * MS, until_ns=T0 + 10_400 * MS, close=("crashed", "watchdog"))
    rows["pending"] = [pending_row(0, step=3, seq=4, t_ns=T0 + 360 * MS)]
    a = RunAnalysis.open(write_rows_run(tmp_path / "run", rows, world_size=2, status="crashed"))
    [f] = _codes(a, "HANG")
    assert f.ranks == (1,) and f.evidence["liveness"] == {"0": "waiting", "1": "alive"}


def test_network_partition_is_a_hang_with_cause_network_and_both_sides_waiting(tmp_path):
    rows = lockstep_tables(world=4, num_steps=6)
    rows["pending"] = []
    for r in range(4):
        stall_rank(rows, r, T0 + 360 * MS, until_ns=T0 + 10_400 * MS, close=("crashed", "watchdog"))
        rows["pending"].append(pending_row(r, step=3, seq=4, t_ns=T0 + 360 * MS + r * MS, world=4))
    a = RunAnalysis.open(write_rows_run(tmp_path / "run", rows, world_size=4, status="crashed",
                                        node_of={0: 0, 1: 0, 2: 1, 3: 1}))
    [f] = _codes(a, "HANG")
    ev = f.evidence
    assert ev["cause"] == "network" and ev["sides"] == {"node0": [0, 1], "node1": [2, 3]}
    assert ev["liveness"] == {str(r): "waiting" for r in range(4)}
    assert f.ranks == (0, 1, 2, 3) and _codes(a, "RANK_CRASH") == []


def test_partition_where_one_side_finished_the_collective_is_still_network(tmp_path):
    # the link goes down during all-reduce #4's last message: rank 1 got everything, finished #4 and waits in #5;
    # rank 0 never gets its last message and waits inside #4 (it never reaches #5): both wait, across two nodes
    rows = lockstep_tables(world=2, num_steps=6)
    rows["pending"] = []
    for r in range(2):
        stall_rank(rows, r, T0 + 360 * MS, until_ns=T0 + 10_400 * MS, close=("crashed", "watchdog"))
    rows["pending"].append(pending_row(0, step=3, seq=4, t_ns=T0 + 360 * MS))
    done = {**pending_row(1, step=3, seq=4, t_ns=T0 + 361 * MS), "end_ns": T0 + 380 * MS}
    done.pop("restart")
    rows["collectives"].append({**done, "restart": 0})
    rows["pending"].append(pending_row(1, step=3, seq=5, t_ns=T0 + 390 * MS))
    a = RunAnalysis.open(write_rows_run(tmp_path / "run", rows, world_size=2, status="crashed",
                                        node_of={0: 0, 1: 1}))
    [f] = _codes(a, "HANG")
    ev = f.evidence
    assert ev["cause"] == "network" and ev["sides"] == {"node0": [0], "node1": [1]}
    assert ev["liveness"] == {"0": "waiting", "1": "waiting"} and f.ranks == (0, 1)


def test_all_entered_on_one_node_is_not_called_network(tmp_path):
    rows = lockstep_tables(world=2, num_steps=6)
    rows["pending"] = []
    for r in range(2):
        stall_rank(rows, r, T0 + 360 * MS, until_ns=T0 + 10_400 * MS, close=("crashed", "watchdog"))
        rows["pending"].append(pending_row(r, step=3, seq=4, t_ns=T0 + 360 * MS))
    a = RunAnalysis.open(write_rows_run(tmp_path / "run", rows, world_size=2, status="crashed"))
    [f] = _codes(a, "HANG")
    assert f.evidence["cause"] == "mutual_wait" and f.evidence["sides"] is None


def test_a_mutual_wait_names_as_never_arrived_only_the_ranks_that_did_not_arrive(tmp_path):
    # a cycle: rank 0 waits for rank 1 in group a, rank 1 for rank 2 in group b, rank 2 for rank 0 in group c, all
    # alive. Each stall names both its ranks (neither can go on), but only the missing one never arrived
    rows = lockstep_tables(world=3, num_steps=6)
    rows["pending"] = []
    for r, (pg, members) in enumerate([("a", "0,1"), ("b", "1,2"), ("c", "0,2")]):
        stall_rank(rows, r, T0 + 360 * MS, until_ns=T0 + 10_400 * MS, close=("crashed", "watchdog"))
        rows["pending"].append(pending_row(r, step=3, seq=1, t_ns=T0 + (360 + r) * MS, pg=pg, pg_ranks=members))
    a = RunAnalysis.open(write_rows_run(tmp_path / "run", rows, world_size=3, status="crashed"))
    hangs = sorted(_codes(a, "HANG"), key=lambda f: f.evidence["pg"])
    assert [(f.evidence["pg"], f.ranks, f.evidence["cause"], f.evidence["missing_ranks"]) for f in hangs] == [
        ("a", (0, 1), "mutual_wait", [1]), ("b", (1, 2), "mutual_wait", [2]), ("c", (0, 2), "mutual_wait", [0])]
    assert [f.title.split(" never arrived")[0] for f in hangs] == ["rank(s) [1]", "rank(s) [2]", "rank(s) [0]"]
    assert hangs[0].title.startswith("rank(s) [1] never arrived at allreduce #1 on a group [0, 1] (step 3); "
                                     "rank(s) [0] waited ")


def _pipeline(world: int = 3) -> dict:
    """A pipeline 0 -> 1 -> ...: each step stage s sends to s+1 (the k-th send = the peer's k-th recv)."""
    rows = lockstep_tables(world=world, num_steps=6)
    rows["collectives"] = []
    for step in range(6):
        t = T0 + step * 100 * MS
        for s in range(world - 1):
            for rank, peer, op in ((s, s + 1, "send"), (s + 1, s, "recv")):
                rows["collectives"].append({"rank": rank, "pg": "pp", "pg_ranks": ",".join(map(str, range(world))),
                                            "pg_size": world, "seq": step + 1, "op": op, "num_bytes": 1 << 20,
                                            "dtype": "float32", "enqueue_ns": t + (10 + 10 * s) * MS,
                                            "end_ns": t + (15 + 10 * s) * MS, "step": step, "peer": peer,
                                            "restart": 0, "timing": "host"})
    return rows


def test_p2p_a_stage_blocked_in_recv_names_the_stage_that_never_sent_not_the_chain(tmp_path):
    rows = _pipeline(world=3)
    cut_rank(rows, 0, T0 + 305 * MS)               # stage 0 freezes before its step-3 send
    stall_rank(rows, 1, T0 + 310 * MS, until_ns=T0 + 10_400 * MS, close=("crashed", "watchdog"))
    stall_rank(rows, 2, T0 + 320 * MS, until_ns=T0 + 10_400 * MS, close=("crashed", "watchdog"))
    rows["pending"] = [
        pending_row(1, step=3, seq=4, t_ns=T0 + 310 * MS, world=3, pg="pp", op="recv", peer=0, num_bytes=1 << 20),
        pending_row(2, step=3, seq=4, t_ns=T0 + 320 * MS, world=3, pg="pp", op="recv", peer=1, num_bytes=1 << 20)]
    a = RunAnalysis.open(write_rows_run(tmp_path / "run", rows, world_size=3, status="crashed"))
    [f] = _codes(a, "HANG")
    ev = f.evidence
    assert (f.ranks, ev["op"], ev["peer"], ev["arrived_ranks"], ev["liveness"]["0"]) == ((0,), "recv", 0, [1],
                                                                                        "stopped")
    assert f.title.startswith("rank(s) [0] never sent: rank(s) [1] waited ")
    assert " s in recv #4 from rank 0 on pp " in f.title


def test_a_stopped_rank_that_leaves_peers_stuck_in_several_groups_is_one_hang_listing_them_all(tmp_path):
    # dp2 x pp2: pipelines 0 -> 1 and 2 -> 3, dp groups [0, 2] and [1, 3]; each step a stage-0 rank sends at +10 ms,
    # then the dp all-reduces at +50 ms. Rank 0 freezes at 305 ms: rank 1 waits in its recv from 0 from 310 ms,
    # rank 2 in the dp all-reduce from 350 ms (rank 3 waits there on rank 1: behind it, not a hang of its own)
    rows = lockstep_tables(world=4, num_steps=6)
    rows["collectives"] = []

    def coll(rank: int, step: int, pg: str, members: str, op: str, at_ms: float, peer: int | None = None) -> dict:
        t = T0 + step * 100 * MS + int(at_ms * MS)
        return {"rank": rank, "pg": pg, "pg_ranks": members, "pg_size": 2, "seq": step + 1, "op": op,
                "num_bytes": 1 << 20, "dtype": "float32", "enqueue_ns": t, "end_ns": t + 5 * MS, "step": step,
                "restart": 0, "timing": "host", **({"peer": peer} if peer is not None else {})}
    for step in range(6):
        for first, second in ((0, 1), (2, 3)):
            rows["collectives"] += [coll(first, step, "pp", f"{first},{second}", "send", 10, second),
                                    coll(second, step, "pp", f"{first},{second}", "recv", 10, first)]
        rows["collectives"] += [coll(r, step, "dp", members, "allreduce", 50) for members in ("0,2", "1,3")
                                for r in map(int, members.split(","))]
    cut_rank(rows, 0, T0 + 305 * MS)
    for rank, at_ms in ((1, 310), (2, 350), (3, 350)):
        stall_rank(rows, rank, T0 + at_ms * MS, until_ns=T0 + 10_400 * MS, close=("crashed", "watchdog"))
    rows["pending"] = [
        pending_row(1, step=3, seq=4, t_ns=T0 + 310 * MS, pg="pp", pg_ranks="0,1", op="recv", peer=0),
        pending_row(2, step=3, seq=4, t_ns=T0 + 350 * MS, pg="dp", pg_ranks="0,2"),
        pending_row(3, step=3, seq=4, t_ns=T0 + 350 * MS, pg="dp", pg_ranks="1,3")]
    a = RunAnalysis.open(write_rows_run(tmp_path / "run", rows, world_size=4, status="crashed"))
    [f] = _codes(a, "HANG")
    ev = f.evidence
    assert (f.ranks, ev["op"], ev["peer"], ev["arrived_ranks"]) == ((0,), "recv", 0, [1])     # the first wait
    assert [(x["pg"], x["pg_ranks"], x["op"], x["seq"], x["arrived_ranks"]) for x in ev["also_stuck"]] == [
        ("dp", [0, 2], "allreduce", 4, [2])]
    assert ev["also_stuck"][0]["waited_s"] == pytest.approx(10.4 - 0.35, abs=0.2)
    assert ev["liveness"] == {"0": "stopped", "1": "waiting", "2": "waiting"}
    assert f.title.endswith("; also stuck on it: allreduce #4 on dp group [0, 2] (rank(s) [2] waiting)")


def test_p2p_recv_whose_peer_sent_is_no_stall():
    from dtprobe.analysis.hangs import p2p_stalls

    rows = _pipeline(world=2)
    last = [x for x in rows["collectives"] if x["op"] == "recv" and x["step"] == 5][0]
    last["end_ns"] = None                            # still finishing, but stage 0 did send #6
    coll = frames(rows)["collectives"]
    assert p2p_stalls(coll, now_ns=T0 + 10 * S, min_wait_ns=0).empty
    rows["collectives"] = [x for x in rows["collectives"] if not (x["op"] == "send" and x["step"] == 5)]
    [stall] = p2p_stalls(frames(rows)["collectives"], now_ns=T0 + 10 * S, min_wait_ns=0).itertuples()
    assert (stall.arrived_ranks, stall.missing_ranks, stall.seq) == ("1", "0", 6)


def test_a_clean_run_gives_no_crash_hang_or_mismatch(tmp_path):
    a = RunAnalysis.open(write_rows_run(tmp_path / "run", lockstep_tables(world=4, num_steps=8), world_size=4,
                                        status="finished",
                                        attempts=[_attempt(0, "succeeded", [{"rank": r, "exit_code": 0}
                                                                            for r in range(4)])]))
    assert _codes(a, "HANG", "RANK_CRASH", "COLLECTIVE_MISMATCH", "CHECKPOINT_CORRUPT") == []
    assert a.metrics()["run"]["crashes"] == [] and a.metrics()["run"]["restarts"] == []


def test_injected_rows_alone_give_no_finding(tmp_path):
    faults = [{"rank": 1, "time_ns": T0 + 200 * MS, "step": 2, "kind": kind, "injected": True, "detail": "{}"}
              for kind in ("hang", "crash", "corrupt-ckpt", "straggler")]
    a = RunAnalysis.open(write_rows_run(tmp_path / "run", lockstep_tables(world=2, num_steps=8), world_size=2,
                                        status="finished", faults=faults))
    assert _codes(a, "HANG", "RANK_CRASH", "CHECKPOINT_CORRUPT", "STRAGGLER") == []


def test_a_running_run_whose_rank_went_silent_long_ago_reports_it_lost(tmp_path):
    rows = lockstep_tables(world=2, num_steps=6)
    cut_rank(rows, 1, T0 + 330 * MS)                 # no close: killed; rank 0 carries on alone (no collectives)
    rows["lifecycle"] = [x for x in rows["lifecycle"] if x["event"] == "attach"]
    rows["devices"] += sampler_rows(0, T0 + 600 * MS, T0 + 90 * S, every_ms=1000)
    a = RunAnalysis(RunAnalysis.open(write_rows_run(tmp_path / "run", rows, world_size=2, status="running")).source,
                    now_ns=T0 + 90 * S)
    [f] = _codes(a, "RANK_CRASH")
    assert f.ranks == (1,) and f.evidence["source"] == "lifecycle"


def test_pending_rows_become_unfinished_collectives_unless_a_completed_row_matches():
    rows = lockstep_tables(world=2, num_steps=3)
    f = frames({**rows, "pending": [pending_row(0, step=2, seq=3, t_ns=T0 + 260 * MS),     # completed later
                                    pending_row(0, step=3, seq=4, t_ns=T0 + 360 * MS)]})   # never completed
    merged = merge_pending(f["collectives"], f["pending"])
    assert len(merged) == len(f["collectives"]) + 1
    new = merged.iloc[-1]
    assert (int(new["seq"]), int(new["rank"]), new["op"]) == (4, 0, "allreduce") and new["end_ns"] is __import__(
        "pandas").NA
    assert merge_pending(f["collectives"], frames({})["pending"]) is f["collectives"]


def test_a_rank_killed_inside_a_collective_is_named_with_the_collective_and_phase_not_a_hang(tmp_path):
    rows = lockstep_tables(world=2, num_steps=6)
    cut_rank(rows, 1, T0 + 361 * MS)                 # rank 1 entered all-reduce #4 at 361 ms and was killed there
    rows["collectives"] = [x for x in rows["collectives"] if not (x["rank"] == 1 and x["seq"] == 4)]
    stall_rank(rows, 0, T0 + 360 * MS, until_ns=T0 + 500 * MS, close=("crashed", "SIGTERM"))
    rows["pending"] = [pending_row(0, step=3, seq=4, t_ns=T0 + 360 * MS),
                       pending_row(1, step=3, seq=4, t_ns=T0 + 361 * MS)]
    a = RunAnalysis.open(write_rows_run(tmp_path / "run", rows, world_size=2, status="crashed"))
    assert _codes(a, "HANG") == []                       # both entered it; one of them died there
    [f] = _codes(a, "RANK_CRASH")
    assert f.ranks == (1,) and f.evidence["step"] == 3 and f.evidence["phase"] == "bwd"
    assert f.evidence["doing"] == {"pg": "dp", "seq": 4, "op": "allreduce", "peer": None, "step": 3, "open": True}
    assert "in allreduce #4 on dp" in f.title


def test_a_killed_leader_of_a_plain_torchrun_job_is_lost_although_run_json_still_says_running(tmp_path):
    rows = lockstep_tables(world=2, num_steps=6)
    cut_rank(rows, 0, T0 + 330 * MS)                 # rank 0 (which would have set the status) is SIGKILLed
    stall_rank(rows, 1, T0 + 361 * MS, until_ns=T0 + 500 * MS, close=("crashed", "SIGTERM"))
    rows["pending"] = [pending_row(1, step=3, seq=4, t_ns=T0 + 361 * MS)]
    run = write_rows_run(tmp_path / "run", rows, world_size=2, status="running")
    a = RunAnalysis(RunAnalysis.open(run).source, now_ns=T0 + 5 * S)
    [f] = _codes(a, "RANK_CRASH")
    assert f.ranks == (0,) and f.evidence["also_lost"] == [1] and _codes(a, "HANG") == []


def test_a_frozen_rank_whose_peers_die_on_the_collective_timeout_is_a_hang_not_their_crash(tmp_path):
    rows, _ = _frozen_rank1(attempts=False)
    for x in rows["lifecycle"]:
        if x["event"] == "close":
            x["reason"] = "exception"                # gloo's timeout raised in rank 0 (no watchdog)
    a = RunAnalysis.open(write_rows_run(tmp_path / "run", rows, world_size=2, status="crashed"))
    [f] = _codes(a, "HANG")
    assert f.ranks == (1,) and f.evidence["liveness"] == {"0": "waiting", "1": "stopped"}
    assert _codes(a, "RANK_CRASH") == []


@pytest.mark.parametrize("attempts", [True, False], ids=["dtprobe-run", "plain-torchrun"])
def test_ranks_torchrun_sigtermed_before_they_reached_the_collective_are_the_crashs_not_a_hang(tmp_path, attempts):
    # a dp2 x pp2 kill of the verdicts matrix: rank 0 is SIGKILLed between a checkpoint's collectives; rank 1 enters
    # the next one at 360 ms, ranks 2 and 3 are still writing their shards when torchrun SIGTERMs them 35 ms later
    # (their probes close on it); rank 1 raises on the broken connection at 560 ms; the job restarts at 2 s
    rows = lockstep_tables(world=4, num_steps=6)
    cut_rank(rows, 0, T0 + 330 * MS)
    stall_rank(rows, 1, T0 + 360 * MS, until_ns=T0 + 560 * MS, close=("crashed", "exception"))
    for r in (2, 3):
        stall_rank(rows, r, T0 + 340 * MS, until_ns=T0 + 395 * MS, close=("crashed", "SIGTERM"))
    rows["pending"] = [pending_row(1, step=3, seq=4, t_ns=T0 + 360 * MS, world=4)]
    again = lockstep_tables(world=4, num_steps=4, t0=T0 + 2 * S, first_step=2, restart=1)
    for table, new in again.items():
        rows[table] += new
    att = [_attempt(0, "failed", [{"rank": 0, "exit_code": -9, "signal": "SIGKILL", "first_failure": True,
                                   "time_ns": T0 + 330 * MS},
                                  {"rank": 1, "exit_code": 1, "time_ns": T0 + 560 * MS},
                                  {"rank": 2, "exit_code": -15, "signal": "SIGTERM", "time_ns": T0 + 395 * MS},
                                  {"rank": 3, "exit_code": -15, "signal": "SIGTERM", "time_ns": T0 + 395 * MS}],
                    ended=T0 + 560 * MS),
           _attempt(1, "succeeded", [{"rank": r, "exit_code": 0} for r in range(4)], started=T0 + 2 * S,
                    ended=T0 + 3 * S)]
    a = RunAnalysis.open(write_rows_run(tmp_path / "run", rows, world_size=4, status="finished",
                                        attempts=att if attempts else None))
    assert _codes(a, "HANG") == []
    [f] = _codes(a, "RANK_CRASH")
    assert f.ranks == (0,) and f.evidence["recovered"] is True
    # it died at 330 ms (the launcher's exit time), else at its last row of attempt 0 (its sampler at 300 ms), not
    # at its next incarnation's attach 5 ms before the restart
    died_s = 0.33 if attempts else 0.3
    assert f.evidence["phase"] == ("fwd" if attempts else "data")
    assert f.evidence["time_to_recover_s"] == pytest.approx(2.0 - died_s, abs=0.01)


def test_a_hangs_wait_ends_with_the_waiters_last_row_of_that_attempt_not_the_restarted_jobs(tmp_path):
    # the frozen rank 1 of above; torchrun restarts the job at 12 s and it runs to 12.6 s
    rows, att = _frozen_rank1(attempts=True)
    again = lockstep_tables(world=2, num_steps=6, t0=T0 + 12 * S, first_step=2, restart=1)
    for table, new in again.items():
        rows[table] += new
    att.append(_attempt(1, "succeeded", [{"rank": 0, "exit_code": 0}, {"rank": 1, "exit_code": 0}],
                        started=T0 + 12 * S, ended=T0 + 13 * S))
    a = RunAnalysis.open(write_rows_run(tmp_path / "run", rows, world_size=2, status="finished", attempts=att))
    [f] = _codes(a, "HANG")
    assert f.ranks == (1,) and f.evidence["liveness"] == {"0": "waiting", "1": "stopped"}
    assert f.evidence["waited_s"] == pytest.approx(10.4 - 0.36, abs=0.2)


def test_a_stopped_pipeline_rank_is_one_hang_not_one_per_group_it_froze():
    # real run (tests/data/dp2xpp2_rank0_stopped/README.md): the stall on rank 0 also left an all-reduce in each
    # pipeline group that every member entered and nobody finished; those are stuck behind it, not hangs of
    # their own
    a = RunAnalysis.open(Path(__file__).resolve().parent / "data" / "dp2xpp2_rank0_stopped")
    [f] = _codes(a, "HANG")
    ev = f.evidence
    assert (f.ranks, ev["pg"], ev["op"], ev["step"], ev["cause"]) == ((0,), "dp", "allreduce", 10, "missing_rank")
    assert ev["liveness"] == {"0": "stopped", "1": "waiting"}
    assert not [x for x in a.findings() if x.code in ("RANK_CRASH", "STRAGGLER", "COLLECTIVE_MISMATCH")
                and x.severity != "info"]


def test_a_rank_missing_from_its_dp_group_because_it_waits_inside_the_frozen_rank_s_collective_is_no_hang():
    # real run (tests/data/dp2xpp2_rank0_frozen_in_pp/README.md): rank 0 froze inside a pipeline-group all-reduce
    # rank 2 had entered too, so rank 2 never reached its dp all-reduce and rank 3 waited there for it: that stall
    # is rank 0's consequence, not a second HANG naming ranks 2 and 3
    a = RunAnalysis.open(Path(__file__).resolve().parent / "data" / "dp2xpp2_rank0_frozen_in_pp")
    [f] = _codes(a, "HANG")
    ev = f.evidence
    assert (f.ranks, ev["pg"], ev["pg_ranks"], ev["step"], ev["cause"]) == ((0,), "dp", [0, 1], 11, "missing_rank")
    assert ev["liveness"] == {"0": "stopped", "1": "waiting"}
    assert not [x for x in a.findings() if x.code in ("RANK_CRASH", "STRAGGLER", "COLLECTIVE_MISMATCH")
                and x.severity != "info"]


def test_a_rank_that_gloo_aborted_on_an_oversized_message_is_told_to_look_for_a_skipped_collective(tmp_path):
    # rank 1 skipped a collective, so rank 0's next one received rank 1's larger one: gloo's size check aborted
    # rank 0 within milliseconds, its last rows lost. The network advice would send the user the wrong way
    rows, att, faults = _killed_rank1_at_step3(restart=False, attempts=True)
    [aborted] = [r for r in att[0]["ranks"] if r["rank"] == 1]
    aborted.update(exit_code=-6, signal="SIGABRT", stderr_tail=(
        "terminate called after throwing an instance of 'gloo::EnforceNotMet'\n  what():  [enforce fail at "
        "gloo/transport/tcp/pair.cc:456] op.preamble.length <= op.nbytes. 1024 vs 256. Received data size doesn't "
        "match expected size. Is there a distributed collective mismatch in your code?\nFatal Python error: Aborted"))
    a = RunAnalysis.open(write_rows_run(tmp_path / "run", rows, world_size=2, status="crashed", attempts=att,
                                        faults=faults))
    [f] = _codes(a, "RANK_CRASH")
    assert f.ranks == (1,) and f.evidence["cause"] == "communication"
    assert "skipped or reordered a collective" in f.recommendation and "network is not at fault" in f.recommendation
    # the title quotes gloo's message, not the source file it was thrown in
    assert 'its stderr: "op.preamble.length <= op.nbytes. 1024 vs 256. Received data size doesn\'t match' in f.title
    assert "enforce fail" not in f.title


def test_the_timeout_a_hang_ended_in_heads_the_report_as_its_consequence_not_as_a_crash_finding(tmp_path):
    # rank 1 froze (SIGSTOP: no rows from 330 ms); rank 0 waited in all-reduce #4 and raised on the 90-s timeout,
    # torchrun's first failure. The verdict is the HANG on rank 1; rank 0's death is no RANK_CRASH, but the header
    # still names how the attempt ended, as the HANG's consequence
    rows = lockstep_tables(world=2, num_steps=6)
    rows["devices"] = [d for d in rows["devices"] if not (d["rank"] == 1 and d["time_ns"] > T0 + 330 * MS)]
    cut_rank(rows, 1, T0 + 330 * MS)
    fail_ns = T0 + 360 * MS + 90 * S
    stall_rank(rows, 0, T0 + 360 * MS, until_ns=fail_ns, close=("crashed", "exception"))
    rows["pending"] = [pending_row(0, step=3, seq=4, t_ns=T0 + 360 * MS)]
    error = {"type": "torch.distributed.DistBackendError", "message": "[gloo] Timed out waiting 90000ms for recv",
             "traceback": None}
    att = [_attempt(0, "failed", [{"rank": 0, "exit_code": 1, "first_failure": True, "error": error,
                                   "time_ns": fail_ns},
                                  {"rank": 1, "exit_code": -15, "signal": "SIGTERM", "time_ns": fail_ns + 200 * MS}],
                    ended=fail_ns + 200 * MS)]
    a = RunAnalysis.open(write_rows_run(tmp_path / "run", rows, world_size=2, status="crashed", attempts=att))
    [hang] = _codes(a, "HANG")
    assert hang.ranks == (1,) and hang.evidence["liveness"] == {"0": "waiting", "1": "stopped"}
    assert _codes(a, "RANK_CRASH") == []
    [c] = a.report()["metrics"]["run"]["crashes"]
    assert (c["rank"], c["step"], c["cause"], c["recovered"], c["explained_by"]) == (0, 3, "communication", False,
                                                                                     "HANG")
    assert c["title"].startswith("rank 0 died at step 3 in allreduce #4") and c["title"].endswith(
        "the job did not recover (a consequence of the HANG)")
    assert event_lines(a.report())[0] == f"crash: {c['title']}"
