"""Hang watchdog when the c10d store is out of reach (a network partition): every store call is bounded, a rank cut
off from the store still fires with its report and stack, and a member whose publication went stale is reported
unreachable rather than missing from the collective. Fake stores that block or raise, then a real TCPStore whose
server process is stopped."""

from __future__ import annotations

import datetime
import os
import signal
import subprocess
import threading
import time

import orjson
import pytest
from hang_fakes import FakeProbe, FakeStore

from dtprobe.runtime.hang import HANG_EXIT_CODE, BoundedStore, HangConfig, StoreUnreachable, Watchdog

CFG = HangConfig(collective_timeout_s=2.0, poll_interval_s=0.05)
STORE_TIMEOUT_S = 0.3


class CutOffStore(FakeStore):
    """``set`` is buffered by the socket and returns; ``check`` and ``get`` wait for a reply that never comes
    (until ``heal``), which is what a TCPStore client does behind a cut link."""

    def __init__(self) -> None:
        super().__init__()
        self.healed = threading.Event()
        self.calls: list[str] = []

    def check(self, keys):
        self.calls.append("check")
        self.healed.wait(30)
        raise ConnectionError("Broken pipe")

    def get(self, key):
        self.calls.append("get")
        self.healed.wait(30)
        raise ConnectionError("Broken pipe")


class BrokenStore(FakeStore):
    """Every call fails at once, as after the link came back to a store whose host is gone."""

    def set(self, key, value):
        raise ConnectionError("Broken pipe")

    def get(self, key):
        raise ConnectionError("Broken pipe")

    def check(self, keys):
        raise ConnectionError("Broken pipe")


def _allreduce_pending(since_ns: int, seq: int = 18) -> list[dict]:
    return [{"pg": "world", "pg_ranks": "0,1", "seq": seq, "op": "allreduce", "step": 9, "enqueue_ns": since_ns}]


def _progress(issued: int, completed: int) -> dict:
    return {"world": {"pg_ranks": "0,1", "last_issued_seq": issued, "last_issued_op": "allreduce",
                      "last_completed_seq": completed, "last_completed_op": "allreduce"}}


def test_bounded_store_gives_up_on_a_blocked_call_and_fails_fast_until_it_returns():
    store = CutOffStore()
    bounded = BoundedStore(store, timeout_s=STORE_TIMEOUT_S)
    t0 = time.monotonic()
    with pytest.raises(StoreUnreachable, match="store.check did not answer within 0.3s"):
        bounded.check(["k"])
    assert STORE_TIMEOUT_S <= time.monotonic() - t0 < STORE_TIMEOUT_S + 1.0
    t1 = time.monotonic()
    with pytest.raises(StoreUnreachable, match=r"store.check did not answer within 0.3s \(still waiting; store.get"):
        bounded.get("k")
    assert time.monotonic() - t1 < 0.1 and store.calls == ["check"]      # not queued behind the blocked call
    store.healed.set()                                                    # the blocked call returns (with an error)
    bounded._blocked.join(5)
    bounded.set("k", "v")                                                 # usable again
    assert store.data["k"] == b"v"


def test_bounded_store_turns_a_store_error_into_store_unreachable_naming_it():
    with pytest.raises(StoreUnreachable, match="store.get failed: ConnectionError: Broken pipe"):
        BoundedStore(BrokenStore(), timeout_s=STORE_TIMEOUT_S).get("k")


@pytest.mark.parametrize("store_kind", ["cut_off", "broken"])
def test_watchdog_cut_off_from_the_store_still_fires_writes_its_rows_and_exits(store_kind):
    store = CutOffStore() if store_kind == "cut_off" else BrokenStore()
    probe, exits = FakeProbe(world_size=2), []
    dog = Watchdog(CFG, store=store, rank=1, restart=0, probe=probe, exit=exits.append,
                   progress=lambda: _progress(18, 17), pending=lambda: _allreduce_pending(time.time_ns() - int(3e9)),
                   store_timeout_s=STORE_TIMEOUT_S, peer_exit_grace_s=0.0)
    t0 = time.monotonic()
    try:
        dog.start()
        dog._thread.join(timeout=10)
        elapsed = time.monotonic() - t0
    finally:
        if isinstance(store, CutOffStore):
            store.healed.set()
    assert not dog._thread.is_alive() and exits == [HANG_EXIT_CODE]
    assert elapsed < 3 * STORE_TIMEOUT_S + 1.0                         # at most one call waits for the timeout
    faults = dict(probe.faults())                                      # kind -> row
    hang, stack = faults["hang"], faults["stack"]
    assert hang["injected"] is False and hang["step"] == 9 and hang["seq"] == 18 and hang["op"] == "allreduce"
    assert hang["unreachable_ranks"] == [0] and hang["waiting_for_ranks"] == []   # rank 0 unknown, not accused
    assert hang["ranks"]["0"] is None                                  # could not be read
    assert hang["ranks"]["1"]["last_issued_seq"] == 18 and hang["ranks"]["1"]["age_s"] < 1.0   # itself, from memory
    expected = "did not answer within 0.3s" if store_kind == "cut_off" else "Broken pipe"
    assert expected in hang["store_error"]
    assert stack["reason"] == "watchdog fired" and stack["step"] == 9 and "Thread MainThread" in stack["stack"]
    assert probe.names() == ["hang", "flush", "stack", "close"] and probe.log[-1] == ("close", "crashed", "watchdog")


def test_member_with_a_stale_publication_is_unreachable_not_waiting_and_a_fresh_laggard_is_waiting():
    store, probe = FakeStore(), FakeProbe(world_size=2)
    pending = [{"pg": "world", "pg_ranks": "0,1,2", "seq": 18, "op": "allreduce", "step": 9,
                "enqueue_ns": time.time_ns() - int(9e9)}]
    dog = Watchdog(CFG, store=store, rank=0, restart=0, probe=probe, exit=lambda code: None,
                   progress=lambda: _progress(18, 17), pending=lambda: pending, store_timeout_s=STORE_TIMEOUT_S)
    stale = {"rank": 1, "step": 5, "time_ns": time.time_ns() - int(9e9), "groups": _progress(11, 11)}
    fresh = {"rank": 2, "step": 8, "time_ns": time.time_ns(), "groups": _progress(17, 17)}
    store.set("dtprobe/hang/0/rank1", orjson.dumps(stale))
    store.set("dtprobe/hang/0/rank2", orjson.dumps(fresh))
    detail = dog.check()
    assert detail["unreachable_ranks"] == [1] and detail["waiting_for_ranks"] == [2]
    assert 9.0 <= detail["ranks"]["1"]["age_s"] < 10.0 and detail["ranks"]["1"]["last_issued_seq"] == 11
    assert detail["ranks"]["2"]["last_issued_seq"] == 17 and detail["store_error"] is None
    assert dog.stale_after_s == pytest.approx(3 * CFG.poll_interval_s + 1.0)


def test_member_that_never_published_is_waiting_when_the_store_answers():
    dog = Watchdog(CFG, store=FakeStore(), rank=0, restart=0, probe=FakeProbe(world_size=2),
                   progress=lambda: _progress(18, 17), pending=lambda: _allreduce_pending(time.time_ns() - int(3e9)),
                   store_timeout_s=STORE_TIMEOUT_S)
    detail = dog.check()
    assert detail["waiting_for_ranks"] == [1] and detail["unreachable_ranks"] == [] and detail["ranks"]["1"] is None


STORE_SERVER = """
import sys, time, torch.distributed as dist
store = dist.TCPStore("127.0.0.1", int(sys.argv[1]), is_master=True, wait_for_workers=False)
print("ready", flush=True)
time.sleep(120)
"""


@pytest.mark.multiproc
def test_watchdog_fires_when_the_real_tcpstore_server_stops_answering(free_port, start_python):
    """A stopped server keeps the connection open and never replies, as across a cut link: a TCPStore ``check``
    then blocks without bound (neither ``set_timeout`` nor the client's timeout applies to it)."""
    import torch.distributed as dist

    port = free_port()
    server = start_python(STORE_SERVER, str(port), stdout=subprocess.PIPE, text=True)
    try:
        assert server.stdout.readline().strip() == "ready"
        client = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=5))
        store = dist.PrefixStore("0", client)
        probe, exits = FakeProbe(world_size=2), []
        dog = Watchdog(CFG, store=store, rank=1, restart=0, probe=probe, exit=exits.append,
                       progress=lambda: _progress(18, 17),
                       pending=lambda: _allreduce_pending(time.time_ns() - int(3e9)),
                       store_timeout_s=STORE_TIMEOUT_S, peer_exit_grace_s=0.0)
        dog.publish()                                    # reachable: the publication lands
        assert client.check(["0/dtprobe/hang/0/rank1"])
        os.kill(server.pid, signal.SIGSTOP)
        t0 = time.monotonic()
        dog.start()
        dog._thread.join(timeout=10)
        assert not dog._thread.is_alive() and exits == [HANG_EXIT_CODE]
        assert time.monotonic() - t0 < 3 * STORE_TIMEOUT_S + 1.0
        faults = dict(probe.faults())
        hang, stack = faults["hang"], faults["stack"]
        assert hang["unreachable_ranks"] == [0] and "did not answer" in hang["store_error"]
        assert stack["reason"] == "watchdog fired"
    finally:
        os.kill(server.pid, signal.SIGKILL)
        server.wait(timeout=10)
