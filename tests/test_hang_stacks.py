"""Hang watchdog: point-to-point hangs (a stage blocked in ``recv``), the ``stack`` rows it writes when it fires or
when a peer's fired, and the close reason. Fake store/progress, then one 2-stage pipeline through ``dtprobe run``."""

from __future__ import annotations

import json
import threading
import time

import pytest
from hang_fakes import FakeProbe, FakeStore

from dtprobe.runtime.hang import HANG_EXIT_CODE, HangConfig, Watchdog, thread_stacks


CFG = HangConfig(collective_timeout_s=2.0, poll_interval_s=0.05)


def _recv_pending(since_ns: int) -> list[dict]:
    return [{"pg": "pp", "pg_ranks": "0,1", "seq": 4, "op": "recv", "peer": 0, "step": 3, "enqueue_ns": since_ns}]


def test_watchdog_fires_on_a_recv_that_waited_past_the_timeout_and_names_the_peer():
    store, probe, exits = FakeStore(), FakeProbe(), []
    stage1 = Watchdog(CFG, store=store, rank=1, restart=0, probe=probe, exit=exits.append, progress=lambda: {},
                      pending=lambda: _recv_pending(time.time_ns() - int(2.5e9)))
    stage0 = Watchdog(CFG, store=store, rank=0, restart=0, probe=FakeProbe(), exit=exits.append,
                      progress=lambda: {}, pending=lambda: [])
    stage0.publish()
    detail = stage1.check()
    assert detail["op"] == "recv" and detail["peer"] == 0 and detail["seq"] == 4 and detail["pg"] == "pp"
    assert detail["waiting_for_ranks"] == [0] and detail["step"] == 3 and detail["waited_s"] >= 2.5
    assert detail["ranks"]["0"]["step"] == 11 and detail["ranks"]["0"]["age_s"] >= 0   # rank 0 published
    assert stage0.check() is None                                # the stage that never sent waits on nothing


def test_watchdog_stays_quiet_on_a_recv_younger_than_the_timeout():
    dog = Watchdog(CFG, store=FakeStore(), rank=1, restart=0, probe=FakeProbe(), progress=lambda: {},
                   pending=lambda: _recv_pending(time.time_ns()))
    assert dog.check() is None


def test_any_source_recv_waits_for_every_other_member():
    dog = Watchdog(CFG, store=FakeStore(), rank=1, restart=0, probe=FakeProbe(), progress=lambda: {},
                   pending=lambda: [{**_recv_pending(time.time_ns() - int(3e9))[0], "peer": -1,
                                     "pg_ranks": "0,1,2"}])
    assert dog.check()["waiting_for_ranks"] == [0, 2]


def test_fired_watchdog_writes_its_report_then_the_stack_and_closes_with_reason_watchdog():
    store, probe, exits = FakeStore(), FakeProbe(), []
    dog = Watchdog(CFG, store=store, rank=1, restart=0, probe=probe, exit=exits.append, progress=lambda: {},
                   pending=lambda: _recv_pending(time.time_ns() - int(3e9)))
    dog.fire(dog.check())
    assert probe.names() == ["hang", "flush", "stack", "close"]   # the close flushes the stack first thing
    stack = probe.faults()[1][1]
    assert stack["injected"] is False and stack["step"] == 3 and stack["reason"] == "watchdog fired"
    assert stack["stack"].startswith("Thread MainThread (") and "test_fired_watchdog_writes" in stack["stack"]
    assert probe.log[-1] == ("close", "crashed", "watchdog") and exits == [HANG_EXIT_CODE]


def test_rank_leaving_because_a_peer_fired_writes_its_stack_flushes_then_closes():
    store, probe, exits = FakeStore(), FakeProbe(), []
    store.set("dtprobe/hang/0/fired", "0")
    store.set("dtprobe/hang/0/left", "0")
    dog = Watchdog(HangConfig(collective_timeout_s=30.0, poll_interval_s=0.01), store=store, rank=1, restart=0,
                   probe=probe, exit=exits.append, progress=lambda: {}, pending=lambda: [], peer_exit_grace_s=0.0)
    dog.start()
    dog._thread.join(timeout=5)
    assert [e[0] for e in probe.log] == ["fault", "flush", "close"]
    kind, row = probe.faults()[0]
    assert kind == "stack" and row["reason"] == "peer watchdog fired" and row["step"] == 11
    assert row["injected"] is False and "dtprobe-hang-watchdog" in row["stack"]
    assert probe.log[-1] == ("close", "crashed", "watchdog") and exits == [HANG_EXIT_CODE]


def test_a_watchdog_that_only_reports_writes_the_stacks_and_leaves_the_job_running():
    # dtprobe launch's: the firing rank and a peer that sees it write their report and stacks, flushed, and neither
    # closes the probe nor exits: the script's own process-group timeout ends the job
    store, probe, exits = FakeStore(), FakeProbe(), []
    dog = Watchdog(CFG, store=store, rank=1, restart=0, probe=probe, exit=exits.append, progress=lambda: {},
                   pending=lambda: _recv_pending(time.time_ns() - int(3e9)), leave=False)
    dog.fire(dog.check())
    assert probe.names() == ["hang", "flush", "stack", "flush"] and exits == []
    assert store.check(["dtprobe/hang/0/fired"])
    peer_probe = FakeProbe()
    peer = Watchdog(HangConfig(collective_timeout_s=30.0, poll_interval_s=0.01), store=store, rank=0, restart=0,
                    probe=peer_probe, exit=exits.append, progress=lambda: {}, pending=lambda: [], leave=False)
    peer.start()
    peer._thread.join(timeout=5)
    assert not peer._thread.is_alive() and [e[0] for e in peer_probe.log] == ["fault", "flush"] and exits == []
    assert peer_probe.faults()[0][1]["reason"] == "peer watchdog fired" and store.check(["dtprobe/hang/0/stack0"])


def test_thread_stacks_lists_every_thread_main_first():
    ready, done = threading.Event(), threading.Event()

    def parked_worker_fn():
        ready.set()
        done.wait(5)

    t = threading.Thread(target=parked_worker_fn, name="parked")
    t.start()
    ready.wait(5)
    try:
        text = thread_stacks()
    finally:
        done.set()
        t.join()
    headers = [line for line in text.splitlines() if line.startswith("Thread ")]
    assert headers[0].startswith("Thread MainThread") and any(h.startswith("Thread parked") for h in headers)
    assert "parked_worker_fn" in text and "test_thread_stacks_lists_every_thread_main_first" in text


def test_fired_watchdog_waits_for_the_live_peer_to_dump_its_stack_before_leaving():
    store, shared = FakeStore(), []                               # shared: (rank, what it did) of both ranks
    hung = Watchdog(HangConfig(collective_timeout_s=30.0, poll_interval_s=0.2), store=store, rank=0, restart=0,
                    probe=FakeProbe(rank=0, world_size=2, timeline=shared),
                    exit=lambda code: shared.append((0, "exit")), progress=lambda: {},
                    pending=lambda: [], peer_exit_grace_s=0.3)
    waiting = Watchdog(CFG, store=store, rank=1, restart=0, probe=FakeProbe(rank=1, world_size=2, timeline=shared),
                       exit=lambda code: shared.append((1, "exit")),
                       progress=lambda: {}, pending=lambda: _recv_pending(time.time_ns() - int(3e9)))
    hung.publish()
    hung.start()
    t0 = time.monotonic()
    waiting.fire(waiting.check())
    hung._thread.join(timeout=5)
    order = [e for e in shared if e[1] in ("hang", "stack", "close", "exit")]
    assert order.index((0, "stack")) < order.index((1, "close"))      # the hung rank's stack is on disk first
    assert order.index((1, "exit")) < order.index((0, "exit"))        # the firing rank leaves first
    assert (1, "hang") in order and (1, "stack") in order
    assert time.monotonic() - t0 < 2 * 0.05 + 1.0 + 1.0               # bounded wait


@pytest.mark.multiproc
@pytest.mark.exclusive
def test_pipeline_stage_blocked_in_recv_fires_the_watchdog_naming_the_stage_that_never_sent(tmp_path, run_cli):
    from dtprobe.store import RunStore

    run_dir = tmp_path / "pp"
    proc = run_cli("run", "--run-dir", run_dir, "--no-devices", "--timeout", "120", "--batch-size", "4", "--seq-len",
                   "16", "--nproc", "2", "--pp", "2", "--steps", "10", "--collective-timeout", "6", "--inject",
                   "hang:rank=0,step=4", timeout_s=400)
    assert proc.returncode != 0
    faults = RunStore.open(run_dir).table("faults")
    observed = faults[(faults["kind"] == "hang") & ~faults["injected"]]
    assert list(observed["rank"]) == [1], proc.stderr[-3000:]
    detail = json.loads(observed["detail"].iloc[0])
    assert detail["op"] == "recv" and detail["peer"] == 0 and detail["waiting_for_ranks"] == [0]
    assert int(observed["step"].iloc[0]) == 4
    stacks = faults[faults["kind"] == "stack"]
    by_rank = {int(r.rank): json.loads(r.detail) for r in stacks.itertuples()}
    assert by_rank[1]["reason"] == "watchdog fired" and by_rank[0]["reason"] == "peer watchdog fired"
    assert "inject_hang" in by_rank[0]["stack"]                   # where the stage that never sent was
    assert not stacks["injected"].any()
