"""Hang watchdog (``--collective-timeout T``) and the ``hang`` fault; produces ``faults`` rows ``kind="hang"``.

Every rank runs a daemon thread that, every ``poll_interval_s`` (the local check of 2. first; 1. only while
nothing is due):

1. publishes this rank's collective progress per group into the c10d store (the torchrun agent's store, which
   outlives the workers) under ``dtprobe/hang/<restart>/rank<r>``: JSON
   ``{"rank", "step", "time_ns", "groups": {pg: {"pg_ranks", "last_issued_seq", "last_issued_op",
   "last_completed_seq", "last_completed_op"}}}`` (from the recording process group,
   ``dtprobe.collectors.collective_recorder.RECORDER.progress()``; on NCCL every recorded collective counts as
   pending from its issue until NCCL reports it done: the completion hook, or without NCCL timing a poll of the work's
   ``is_completed()``, see ``dtprobe.collectors.nccl``);
2. checks its own oldest operation issued but not completed, collective or point-to-point (a pipeline stage
   blocked in ``recv`` hangs too); once it has waited ``T`` seconds the watchdog fires: it reads every member's
   published progress, writes one ``faults`` row and the key ``dtprobe/hang/<restart>/fired``, flushes the
   telemetry (in-flight collectives are written with a null ``end_ns``), writes a ``stack`` row, waits (at most
   two polls and a second) until every live peer has dumped its stack too (key ``dtprobe/hang/<restart>/stack<r>``),
   closes the probe (``reason="watchdog"``), sets ``dtprobe/hang/<restart>/left`` and exits the process with
   ``HANG_EXIT_CODE`` so torchrun restarts the job (``--max-restarts``) or ends it. A rank that sees ``fired``
   (e.g. the hung rank, which has nothing pending) writes a ``stack`` row, flushes, sets its ``stack<r>`` key and
   closes; it then waits for ``left`` and a grace period (torchrun stops it meanwhile, once the firing rank has
   exited), then exits with ``HANG_EXIT_CODE`` too: the firing rank stays the attempt's first failure.

The local check (own pending operations, time waited) comes before any store call, and every store call is bounded
(``BoundedStore``, ``store_timeout_s``): a rank cut off from the store's host (a network partition) still fires on
time, writes its ``hang`` row (the members it could not read listed as unreachable) and its ``stack`` row, and exits.

The ``faults`` row (``kind="hang"``, ``injected=false``, ``step`` = the step of the stuck collective) has detail
keys, read by the analysis' HANG finding:

- ``pg``, ``pg_ranks``: the group of the stuck operation; ``seq``, ``op``: that operation (for a collective this
  rank's ``seq`` on ``pg``, the same number on every member for the same collective; for ``send``/``recv`` the
  number per (peer, direction), matching the peer's opposite operation);
- ``peer``: for ``send``/``recv``, the global rank it exchanges with (-1: any source); null for collectives;
- ``last_issued_seq``, ``last_completed_seq``: this rank's on ``pg`` (issued == seq, completed < seq; for p2p
  both refer to the group's collectives);
- ``waiting_for_ranks``: for a collective, reachable members whose published ``last_issued_seq`` on ``pg`` is
  below ``seq`` (they never reached it); members that published nothing are listed too (dead or never started);
  for p2p, the peer (every other member for any-source), reachable or not;
- ``unreachable_ranks``: members whose state this rank does not know, so it asserts nothing about them: their last
  publication is older than ``STALE_POLLS`` polls plus a second (``ranks[r]["age_s"]`` says how old; their
  watchdog stopped publishing: dead, frozen, or cut off from the store), or the store did not answer when this
  rank read them (``ranks[r]`` null, ``store_error`` set). This rank itself is never in it (read from memory);
- ``ranks``: every member's published ``{"last_issued_seq", "last_completed_seq", "last_issued_op", "step",
  "age_s"}`` (``age_s``: seconds since it published, by this host's clock; this rank's own state with age 0);
  null if it never published, or if it could not be read (then it is in ``unreachable_ranks``);
- ``store_error``: why the store could not be read (timed out, connection lost), else null;
- ``timeout_s``: T; ``waited_s``: how long the collective had been pending when the watchdog fired.

The ``stack`` row (``kind="stack"``, ``injected=false``, ``step`` = the stuck operation's step, or the current
step on a rank leaving because a peer fired) has detail ``{"reason": "watchdog fired" | "peer watchdog fired",
"stack": <the Python stack of every thread, main thread first, taken before anything else is done>}``.

``--inject hang:rank=R,step=S`` (``runtime.faults.inject_hang``): at the start of step S (first attempt only) rank
R writes a ``faults`` row ``kind="hang", injected=true`` and stops issuing collectives (sleeps) while its watchdog
thread keeps publishing.
"""

from __future__ import annotations

import os
import sys
import threading
import time
import traceback
from typing import Any, Callable

import orjson

from dtprobe.runtime.config import JobConfig
from dtprobe.runtime.config_sections import HangConfig
from dtprobe.store.errors import ConfigError

HANG_EXIT_CODE = 124
"""Exit code of a rank whose watchdog fired (the same as ``timeout(1)``)."""
KEY_PREFIX = "dtprobe/hang"
STALE_POLLS = 3
"""A member whose publication is older than this many polls (plus a second) is ``unreachable``."""


class StoreUnreachable(RuntimeError):
    """The c10d store did not answer in time, or failed (its host is gone or behind a cut link)."""


class BoundedStore:
    """The watchdog's view of the c10d store: each call runs on a helper thread and gives up after ``timeout_s``.

    A TCPStore client blocks in its socket read for as long as the link to the store's host is down: neither
    ``set_timeout`` nor the client's own timeout bounds ``check`` or ``get``, and the blocked call holds the
    client's lock. So a call that gave up is left behind on its (daemon) thread, and until it returns every
    further call fails at once instead of queueing behind it. Every failure raises ``StoreUnreachable``.
    """

    def __init__(self, store: Any, *, timeout_s: float) -> None:
        self._store = store
        self.timeout_s = timeout_s
        self._blocked: threading.Thread | None = None
        self._blocked_call = ""

    def set(self, key: str, value: Any) -> None:
        self._call("set", key, value)

    def get(self, key: str) -> bytes:
        return self._call("get", key)

    def check(self, keys: list[str]) -> bool:
        return bool(self._call("check", keys))

    def _call(self, name: str, *args: Any) -> Any:
        if self._blocked is not None and self._blocked.is_alive():
            raise StoreUnreachable(f"{self._blocked_call} did not answer within {self.timeout_s:g}s (still waiting; "
                                   f"store.{name} not tried)")
        result: dict[str, Any] = {}

        def call() -> None:
            try:
                result["value"] = getattr(self._store, name)(*args)
            except Exception as e:  # noqa: BLE001 - handed to the caller as StoreUnreachable below
                result["error"] = e

        thread = threading.Thread(target=call, name=f"dtprobe-hang-store-{name}", daemon=True)
        thread.start()
        thread.join(self.timeout_s)
        if thread.is_alive():
            self._blocked, self._blocked_call = thread, f"store.{name}"
            raise StoreUnreachable(f"store.{name} did not answer within {self.timeout_s:g}s")
        if "error" in result:
            e = result["error"]
            raise StoreUnreachable(f"store.{name} failed: {type(e).__name__}: {e}") from e
        return result.get("value")


def _key(restart: int, what: str) -> str:
    return f"{KEY_PREFIX}/{restart}/{what}"


def stuck_ranks(seq: int, pg: str, members: list[int], published: dict[int, dict[str, Any] | None]) -> list[int]:
    """Members of ``pg`` that never issued collective ``seq``: published ``last_issued_seq`` < seq, or nothing."""
    out = []
    for r in members:
        snap = published.get(r)
        group = (snap or {}).get("groups", {}).get(pg)
        if snap is None or group is None or int(group.get("last_issued_seq") or 0) < seq:
            out.append(r)
    return out


def thread_stacks() -> str:
    """The Python stack of every thread of this process, main thread first (``Thread <name> (<ident>):``
    headers, innermost call last)."""
    frames = sys._current_frames()
    names = {t.ident: t.name for t in threading.enumerate()}
    main = threading.main_thread().ident
    out = []
    for ident in sorted(frames, key=lambda i: (i != main, names.get(i, ""), i)):
        out.append(f"Thread {names.get(ident, '?')} ({ident}):\n" + "".join(traceback.format_stack(frames[ident])))
    return "\n".join(out)


class Watchdog:
    """The per-rank watchdog thread. ``progress`` and ``pending`` default to the recording process group's."""

    def __init__(self, config: HangConfig, *, store: Any, rank: int, restart: int, probe: Any,
                 progress: Callable[[], dict[str, dict[str, Any]]] | None = None,
                 pending: Callable[[], list[dict[str, Any]]] | None = None,
                 exit: Callable[[int], None] = os._exit, peer_exit_grace_s: float = 5.0,
                 store_timeout_s: float = 2.0, leave: bool = True) -> None:
        from dtprobe.collectors.collective_recorder import RECORDER

        self.config = config
        self.store = BoundedStore(store, timeout_s=store_timeout_s)
        """Every store call is bounded by ``store_timeout_s``: a rank cut off from the store still fires."""
        self.rank = rank
        self.restart = restart
        self.probe = probe
        self._progress = progress or RECORDER.progress
        self._pending = pending or RECORDER.pending
        self._exit = exit
        self.peer_exit_grace_s = peer_exit_grace_s
        """A rank leaving because a peer fired exits this long after the firing rank left (if torchrun has not
        stopped it by then), so that the firing rank is the attempt's first failure."""
        self.leave = leave
        """False: the watchdog only reports (its ``hang`` row and every rank's ``stack`` row, flushed), and the job
        goes on until its own process-group timeout ends it (``dtprobe launch``: the script's job is not ended
        by dtprobe)."""
        self._stop = threading.Event()
        self.fired: dict[str, Any] | None = None
        self._thread = threading.Thread(target=self._run, name="dtprobe-hang-watchdog", daemon=True)

    def start(self) -> "Watchdog":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    @property
    def stale_after_s(self) -> float:
        """A member whose last publication is older than this (three polls and a second) is ``unreachable``: its
        watchdog stopped publishing (dead, frozen) or cannot reach the store (a network partition)."""
        return STALE_POLLS * self.config.poll_interval_s + 1.0

    def _run(self) -> None:
        while not self._stop.wait(self.config.poll_interval_s):
            # The local check first: it needs no store, so a rank cut off from the store still fires on time.
            due = self._oldest_due()
            if due is None:
                self._publish_if_reachable()
            if self._peer_fired():
                self._leave_after_peer()
                return
            if due is not None:
                self.fire(self._report(*due))
                return

    def _snapshot(self) -> dict[str, Any]:
        return {"rank": self.rank, "step": int(getattr(self.probe, "current_step", -1)), "time_ns": time.time_ns(),
                "groups": {pg: {k: p.get(k) for k in ("pg_ranks", "last_issued_seq", "last_issued_op",
                                                      "last_completed_seq", "last_completed_op")}
                           for pg, p in self._progress().items()}}

    def publish(self) -> None:
        """Publish this rank's progress; raises ``StoreUnreachable`` when the store does not answer in time."""
        self.store.set(_key(self.restart, f"rank{self.rank}"), orjson.dumps(self._snapshot()))

    def _publish_if_reachable(self) -> None:
        try:
            self.publish()
        except StoreUnreachable:                # peers will see this rank's publication age and call it unreachable
            pass

    def _peer_fired(self) -> bool:
        try:
            return bool(self.store.check([_key(self.restart, "fired")]))
        except StoreUnreachable:                # no peer can tell this rank; its own check still fires
            return False

    def read_published(self, ranks: list[int]) -> dict[int, dict[str, Any] | None]:
        """Each rank's last publication (None: it never published); raises ``StoreUnreachable``."""
        out: dict[int, dict[str, Any] | None] = {}
        for r in ranks:
            key = _key(self.restart, f"rank{r}")
            out[r] = orjson.loads(self.store.get(key)) if self.store.check([key]) else None
        return out

    def _read_states(self, ranks: list[int]) -> tuple[dict[int, dict[str, Any] | None], str | None]:
        """The publications of ``ranks`` this rank could read (its own from memory, never from the store), and the
        store's failure (None if every one was read). A rank missing from the result could not be read."""
        out: dict[int, dict[str, Any] | None] = {r: self._snapshot() for r in ranks if r == self.rank}
        for r in ranks:
            if r == self.rank:
                continue
            try:
                out.update(self.read_published([r]))
            except StoreUnreachable as e:
                return out, str(e)
        return out, None

    def _oldest_due(self) -> tuple[dict[str, Any], float] | None:
        """This rank's oldest pending operation and how long it waited, once that reached ``T`` (local only)."""
        pending = self._pending()
        if not pending:
            return None
        oldest = min(pending, key=lambda r: r["enqueue_ns"])
        waited_s = (time.time_ns() - oldest["enqueue_ns"]) / 1e9
        return (oldest, waited_s) if waited_s >= self.config.collective_timeout_s else None

    def check(self) -> dict[str, Any] | None:
        """The hang detail when this rank's oldest pending collective or p2p operation has waited ``T`` seconds,
        else None."""
        due = self._oldest_due()
        return None if due is None else self._report(*due)

    def _report(self, oldest: dict[str, Any], waited_s: float) -> dict[str, Any]:
        """The ``hang`` detail of ``oldest``: the members' published states as far as the store answers."""
        pg, seq = oldest["pg"], int(oldest["seq"])
        members = [int(x) for x in str(oldest.get("pg_ranks") or "").split(",") if x != ""]
        peer = oldest.get("peer")
        if peer is None:
            asked = members
        else:                                             # p2p: it waits for its peer (any member for -1)
            asked = [int(peer)] if int(peer) >= 0 else [r for r in members if r != self.rank]
        published, store_error = self._read_states(asked)
        now = time.time_ns()
        ages = {r: None if snap is None else (now - int(snap["time_ns"])) / 1e9 for r, snap in published.items()}
        unreachable = sorted([r for r in asked if r not in published]
                             + [r for r, age in ages.items() if age is not None and age > self.stale_after_s])
        fresh = {r: snap for r, snap in published.items() if r not in unreachable}
        mine = self._progress().get(pg, {})
        return {
            "pg": pg, "pg_ranks": oldest.get("pg_ranks"), "seq": seq, "op": oldest["op"], "peer": peer,
            "step": oldest.get("step"),
            "last_issued_seq": mine.get("last_issued_seq", seq), "last_completed_seq": mine.get("last_completed_seq"),
            "waiting_for_ranks": (stuck_ranks(seq, pg, [r for r in members if r in fresh], fresh) if peer is None
                                  else sorted(asked)),
            "unreachable_ranks": unreachable,
            "ranks": {str(r): None if snap is None else {
                "last_issued_seq": (snap["groups"].get(pg) or {}).get("last_issued_seq"),
                "last_completed_seq": (snap["groups"].get(pg) or {}).get("last_completed_seq"),
                "last_issued_op": (snap["groups"].get(pg) or {}).get("last_issued_op"),
                "step": snap.get("step"), "age_s": round(ages[r], 3)}
                for r, snap in sorted(published.items())} | {str(r): None for r in asked if r not in published},
            "store_error": store_error,
            "timeout_s": self.config.collective_timeout_s, "waited_s": round(waited_s, 3),
        }

    def fire(self, detail: dict[str, Any]) -> None:
        stack = thread_stacks()                         # before anything moves: where every thread is stuck
        self.fired = detail
        step = detail.pop("step", None)
        self.probe.fault("hang", step=-1 if step is None else step, injected=False, **detail)
        # The report and the pending collectives (end null) on disk first: the other ranks' watchdogs fire too, and
        # torchrun SIGTERMs the rest as soon as one exits; the close below (profiler export, sampler) is slow.
        self.probe.flush(in_flight=True)
        try:
            self.store.set(_key(self.restart, "fired"), str(self.rank))
        except StoreUnreachable:                # peers see this rank's publication go stale instead
            pass
        what = "collective" if detail.get("peer") is None else f"p2p (peer {detail['peer']})"
        print(f"[dtprobe] rank {self.rank}: {what} {detail['op']} #{detail['seq']} on {detail['pg']} pending "
              f"{detail['waited_s']:.1f}s > --collective-timeout {detail['timeout_s']:g}s; waiting for ranks "
              f"{detail['waiting_for_ranks']}"
              + (f", unreachable ranks {detail['unreachable_ranks']}" if detail.get("unreachable_ranks") else "")
              + (f" ({detail['store_error']})" if detail.get("store_error") else "")
              + (f". Exiting with {HANG_EXIT_CODE}." if self.leave else
                 "; every rank's stack is written to the run, and the job's own timeout ends it."), flush=True)
        # The stack goes after the report's own flush; the close below flushes it first thing.
        self.probe.fault("stack", step=-1 if step is None else step, injected=False, reason="watchdog fired",
                         stack=stack)
        if not self.leave:
            self.probe.flush()
            return
        self._await_peer_stacks()
        self._leave()

    def _await_peer_stacks(self) -> None:
        """Give the live peers' watchdogs time to see ``fired`` and dump their stacks (each sets
        ``dtprobe/hang/<restart>/stack<r>``): once this rank exits, torchrun SIGTERMs them. Peers whose last
        publication is older than ``stale_after_s`` (dead, frozen or cut off) are not waited for."""
        poll = self.config.poll_interval_s
        world = int(getattr(self.probe, "world_size", 0) or 0)
        peers = [r for r in range(world) if r != self.rank] or [int(r) for r in (self.fired or {}).get("ranks", {})
                                                                if int(r) != self.rank]
        try:
            now = time.time_ns()
            waiting = {r for r, snap in self.read_published(peers).items()
                       if snap is not None and now - int(snap["time_ns"]) <= self.stale_after_s * 1e9}
            deadline = time.monotonic() + 2 * poll + 1.0
            while waiting and time.monotonic() < deadline:
                waiting = {r for r in waiting if not self.store.check([_key(self.restart, f"stack{r}")])}
                time.sleep(0.05)
        except StoreUnreachable:                # cut off from the store: no peer can see our key either
            pass

    def _leave_after_peer(self) -> None:
        self.probe.fault("stack", step=int(getattr(self.probe, "current_step", -1)), injected=False,
                         reason="peer watchdog fired", stack=thread_stacks())
        self.probe.flush()
        try:
            self.store.set(_key(self.restart, f"stack{self.rank}"), "1")
        except StoreUnreachable:                # best effort: the row above is on disk
            pass
        if not self.leave:
            return
        try:
            self.probe.close(status="crashed", reason="watchdog")
        finally:
            self._await_firing_rank_left()
            self._exit(HANG_EXIT_CODE)

    def _await_firing_rank_left(self) -> None:
        """Wait until the firing rank has left (key ``left``; at most two polls and 5 s for its close), then
        ``peer_exit_grace_s`` more for torchrun to stop this rank, as it does once a worker exits."""
        deadline = time.monotonic() + 2 * self.config.poll_interval_s + 5.0
        try:
            while not self.store.check([_key(self.restart, "left")]) and time.monotonic() < deadline:
                time.sleep(0.05)
        except StoreUnreachable:                # the agent's store is gone: the job is ending anyway
            pass
        time.sleep(self.peer_exit_grace_s)

    def _leave(self) -> None:
        try:
            self.probe.close(status="crashed", reason="watchdog")
        finally:
            try:
                self.store.set(_key(self.restart, "left"), str(self.rank))
            except StoreUnreachable:            # best effort: peers stop waiting after their deadline
                pass
            self._exit(HANG_EXIT_CODE)


class NoWatchdog:
    """The watchdog when ``--collective-timeout`` is off: starting and stopping it do nothing."""

    def start(self) -> "NoWatchdog":
        return self

    def stop(self) -> None:
        pass


def build_watchdog(job: JobConfig, *, probe: Any) -> Watchdog | NoWatchdog:
    """This rank's watchdog for ``job.hang`` (not started yet), or a do-nothing one when it is off. ConfigError
    when it cannot work: without collective recording, or with a timeout the process group reaches first."""
    config = job.hang
    if not config.enabled:
        return NoWatchdog()
    if not (getattr(probe, "config", None) and probe.config.enabled and probe.config.collectives):
        raise ConfigError("--collective-timeout needs collective recording (the watchdog reads it); drop "
                          "--no-collect / --no-collectives.")
    if config.collective_timeout_s >= job.timeout_s:
        raise ConfigError(f"--collective-timeout {config.collective_timeout_s:g} must be below the process-group "
                          f"--timeout {job.timeout_s:g}, or gloo/NCCL aborts the collective first; raise "
                          f"--timeout or lower --collective-timeout.")
    import torch.distributed as dist

    return Watchdog(config, store=dist.distributed_c10d._get_default_store(), rank=probe.rank,
                    restart=int(getattr(probe, "restart", 0)), probe=probe)
