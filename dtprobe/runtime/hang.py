"""Hang watchdog (``--collective-timeout T``) and the ``hang`` fault; produces ``faults`` rows ``kind="hang"``.

Every rank runs a daemon thread that, every ``poll_interval_s``:

1. publishes this rank's collective progress per group into the c10d store (the torchrun agent's store, which
   outlives the workers) under ``dtprobe/hang/<restart>/rank<r>``: JSON
   ``{"rank", "step", "time_ns", "groups": {pg: {"pg_ranks", "last_issued_seq", "last_issued_op",
   "last_completed_seq", "last_completed_op"}}}`` (from the recording process group,
   ``collectors.pg_wrapper.RECORDER.progress()``);
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

The ``faults`` row (``kind="hang"``, ``injected=false``, ``step`` = the step of the stuck collective) has detail
keys, read by the analysis' HANG finding:

- ``pg``, ``pg_ranks``: the group of the stuck operation; ``seq``, ``op``: that operation (for a collective this
  rank's ``seq`` on ``pg``, the same number on every member for the same collective; for ``send``/``recv`` the
  number per (peer, direction), matching the peer's opposite operation);
- ``peer``: for ``send``/``recv``, the global rank it exchanges with (-1: any source); null for collectives;
- ``last_issued_seq``, ``last_completed_seq``: this rank's on ``pg`` (issued == seq, completed < seq; for p2p
  both refer to the group's collectives);
- ``waiting_for_ranks``: for a collective, members whose published ``last_issued_seq`` on ``pg`` is below
  ``seq`` (they never reached it); members that published nothing are listed too (dead or never started); for
  p2p, the peer (every other member for any-source);
- ``ranks``: every member's published ``{"last_issued_seq", "last_completed_seq", "last_issued_op", "step",
  "age_s"}`` (``age_s``: seconds since it published; null if it never did);
- ``timeout_s``: T; ``waited_s``: how long the collective had been pending when the watchdog fired.

The ``stack`` row (``kind="stack"``, ``injected=false``, ``step`` = the stuck operation's step, or the current
step on a rank leaving because a peer fired) has detail ``{"reason": "watchdog fired" | "peer watchdog fired",
"stack": <the Python stack of every thread, main thread first, taken before anything else is done>}``.

``--inject hang:rank=R,step=S``: at the start of step S (first attempt only) rank R writes a ``faults`` row
``kind="hang", injected=true`` and stops issuing collectives (sleeps) while its watchdog thread keeps publishing.
"""

from __future__ import annotations

import inspect
import os
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from typing import Any, Callable

import orjson

from dtprobe.runtime.config import register_section
from dtprobe.runtime.faults import FaultKind, job_faults_of, register_fault_kind
from dtprobe.runtime.train import TrainContext, TrainHooks, register_hooks
from dtprobe.store.errors import ConfigError

HANG_EXIT_CODE = 124
"""Exit code of a rank whose watchdog fired (the same as ``timeout(1)``)."""
KEY_PREFIX = "dtprobe/hang"


@dataclass(kw_only=True, frozen=True)
class HangConfig:
    """The collective watchdog (``--collective-timeout``)."""

    collective_timeout_s: float = 0.0
    """Seconds a collective may stay incomplete before the watchdog reports a hang and exits; 0 = off."""
    poll_interval_s: float = 1.0
    """Seconds between the watchdog's checks (and progress publications)."""

    def __post_init__(self) -> None:
        if self.collective_timeout_s < 0:
            raise ConfigError(f"hang.collective_timeout_s = {self.collective_timeout_s}; use 0 (off) or a number of "
                              f"seconds, e.g. --collective-timeout 30.")
        if not self.poll_interval_s > 0:
            raise ConfigError(f"hang.poll_interval_s = {self.poll_interval_s}; it must be > 0 (e.g. 1.0).")

    @property
    def enabled(self) -> bool:
        return self.collective_timeout_s > 0


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


def close_crashed(probe: Any, *, reason: str) -> None:
    """``probe.close(status="crashed", reason=reason)``, without ``reason`` for a probe whose close lacks it."""
    try:
        takes_reason = "reason" in inspect.signature(probe.close).parameters
    except (TypeError, ValueError):
        takes_reason = False
    probe.close(status="crashed", **({"reason": reason} if takes_reason else {}))


class Watchdog:
    """The per-rank watchdog thread. ``progress`` and ``pending`` default to the recording process group's."""

    def __init__(self, config: HangConfig, *, store: Any, rank: int, restart: int, probe: Any,
                 progress: Callable[[], dict[str, dict[str, Any]]] | None = None,
                 pending: Callable[[], list[dict[str, Any]]] | None = None,
                 exit: Callable[[int], None] = os._exit, peer_exit_grace_s: float = 5.0) -> None:
        from collectors.pg_wrapper import RECORDER

        self.config = config
        self.store = store
        self.rank = rank
        self.restart = restart
        self.probe = probe
        self._progress = progress or RECORDER.progress
        self._pending = pending or RECORDER.pending
        self._exit = exit
        self.peer_exit_grace_s = peer_exit_grace_s
        """A rank leaving because a peer fired exits this long after the firing rank left (if torchrun has not
        stopped it by then), so that the firing rank is the attempt's first failure."""
        self._stop = threading.Event()
        self.fired: dict[str, Any] | None = None
        self._thread = threading.Thread(target=self._run, name="dtprobe-hang-watchdog", daemon=True)

    def start(self) -> "Watchdog":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _run(self) -> None:
        while not self._stop.wait(self.config.poll_interval_s):
            self.publish()
            if self._peer_fired():
                self._leave_after_peer()
                return
            detail = self.check()
            if detail is not None:
                self.fire(detail)
                return

    def publish(self) -> None:
        snap = {"rank": self.rank, "step": int(getattr(self.probe, "current_step", -1)), "time_ns": time.time_ns(),
                "groups": {pg: {k: p.get(k) for k in ("pg_ranks", "last_issued_seq", "last_issued_op",
                                                      "last_completed_seq", "last_completed_op")}
                           for pg, p in self._progress().items()}}
        self.store.set(_key(self.restart, f"rank{self.rank}"), orjson.dumps(snap))

    def _peer_fired(self) -> bool:
        try:
            return bool(self.store.check([_key(self.restart, "fired")]))
        except Exception:  # noqa: BLE001 - the agent's store is gone: the job is ending anyway
            return False

    def read_published(self, ranks: list[int]) -> dict[int, dict[str, Any] | None]:
        out: dict[int, dict[str, Any] | None] = {}
        for r in ranks:
            key = _key(self.restart, f"rank{r}")
            out[r] = orjson.loads(self.store.get(key)) if self.store.check([key]) else None
        return out

    def check(self) -> dict[str, Any] | None:
        """The hang detail when this rank's oldest pending collective or p2p operation has waited ``T`` seconds,
        else None."""
        pending = self._pending()
        if not pending:
            return None
        oldest = min(pending, key=lambda r: r["enqueue_ns"])
        waited_s = (time.time_ns() - oldest["enqueue_ns"]) / 1e9
        if waited_s < self.config.collective_timeout_s:
            return None
        pg, seq = oldest["pg"], int(oldest["seq"])
        members = [int(x) for x in str(oldest.get("pg_ranks") or "").split(",") if x != ""]
        peer = oldest.get("peer")
        if peer is None:
            published = self.read_published(members)
        else:                                             # p2p: it waits for its peer (any member for -1)
            published = self.read_published([int(peer)] if int(peer) >= 0 else
                                            [r for r in members if r != self.rank])
        now = time.time_ns()
        mine = self._progress().get(pg, {})
        return {
            "pg": pg, "pg_ranks": oldest.get("pg_ranks"), "seq": seq, "op": oldest["op"], "peer": peer,
            "step": oldest.get("step"),
            "last_issued_seq": mine.get("last_issued_seq", seq), "last_completed_seq": mine.get("last_completed_seq"),
            "waiting_for_ranks": (stuck_ranks(seq, pg, members, published) if peer is None
                                  else sorted(published)),
            "ranks": {str(r): None if snap is None else {
                "last_issued_seq": (snap["groups"].get(pg) or {}).get("last_issued_seq"),
                "last_completed_seq": (snap["groups"].get(pg) or {}).get("last_completed_seq"),
                "last_issued_op": (snap["groups"].get(pg) or {}).get("last_issued_op"),
                "step": snap.get("step"), "age_s": round((now - snap["time_ns"]) / 1e9, 3)}
                for r, snap in published.items()},
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
        except Exception:  # noqa: BLE001 - best effort: the row above is what matters
            pass
        what = "collective" if detail.get("peer") is None else f"p2p (peer {detail['peer']})"
        print(f"[dtprobe] rank {self.rank}: {what} {detail['op']} #{detail['seq']} on {detail['pg']} pending "
              f"{detail['waited_s']:.1f}s > --collective-timeout {detail['timeout_s']:g}s; waiting for ranks "
              f"{detail['waiting_for_ranks']}. Exiting with {HANG_EXIT_CODE}.", flush=True)
        # The stack goes after the report's own flush; the close below flushes it first thing.
        self.probe.fault("stack", step=-1 if step is None else step, injected=False, reason="watchdog fired",
                         stack=stack)
        self._await_peer_stacks()
        self._leave()

    def _await_peer_stacks(self) -> None:
        """Give the live peers' watchdogs time to see ``fired`` and dump their stacks (each sets
        ``dtprobe/hang/<restart>/stack<r>``): once this rank exits, torchrun SIGTERMs them. Peers whose last
        publication is older than three polls (dead or frozen) are not waited for."""
        poll = self.config.poll_interval_s
        world = int(getattr(self.probe, "world_size", 0) or 0)
        peers = [r for r in range(world) if r != self.rank] or [int(r) for r in (self.fired or {}).get("ranks", {})
                                                                if int(r) != self.rank]
        try:
            now = time.time_ns()
            waiting = {r for r, snap in self.read_published(peers).items()
                       if snap is not None and now - int(snap["time_ns"]) < 3 * poll * 1e9}
            deadline = time.monotonic() + 2 * poll + 1.0
            while waiting and time.monotonic() < deadline:
                waiting = {r for r in waiting if not self.store.check([_key(self.restart, f"stack{r}")])}
                time.sleep(0.05)
        except Exception:  # noqa: BLE001 - the agent's store is gone: nobody is left to wait for
            pass

    def _leave_after_peer(self) -> None:
        self.probe.fault("stack", step=int(getattr(self.probe, "current_step", -1)), injected=False,
                         reason="peer watchdog fired", stack=thread_stacks())
        self.probe.flush()
        try:
            self.store.set(_key(self.restart, f"stack{self.rank}"), "1")
        except Exception:  # noqa: BLE001 - best effort: the row above is on disk
            pass
        try:
            close_crashed(self.probe, reason="watchdog")
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
        except Exception:  # noqa: BLE001 - the agent's store is gone: the job is ending anyway
            pass
        time.sleep(self.peer_exit_grace_s)

    def _leave(self) -> None:
        try:
            close_crashed(self.probe, reason="watchdog")
        finally:
            try:
                self.store.set(_key(self.restart, "left"), str(self.rank))
            except Exception:  # noqa: BLE001 - best effort: peers stop waiting after their deadline
                pass
            self._exit(HANG_EXIT_CODE)


def inject_hang(probe: Any, *, step: int) -> None:
    """Stop issuing collectives forever (the ``hang`` fault): record it, flush, sleep until killed."""
    probe.fault("hang", step=step, injected=True)
    probe.flush()
    while True:
        time.sleep(3600)


class HangHooks(TrainHooks):
    """Starts the watchdog at setup, injects ``hang`` at the start of its step, stops the watchdog at close."""

    def __init__(self, ctx: TrainContext, config: HangConfig) -> None:
        probe = ctx.probe
        restart = int(getattr(probe, "restart", 0))
        self.hang_steps = ({int(f.get("step")) for f in job_faults_of(ctx.job.faults, "hang", rank=probe.rank)}
                           if restart == 0 else set())
        self.watchdog: Watchdog | None = None
        if config.enabled:
            import torch.distributed as dist

            self.watchdog = Watchdog(config, store=dist.distributed_c10d._get_default_store(), rank=probe.rank,
                                     restart=restart, probe=probe)

    def setup(self, ctx: TrainContext) -> None:
        if self.watchdog is not None:
            self.watchdog.start()
        if ctx.start_step in self.hang_steps:
            inject_hang(ctx.probe, step=ctx.start_step)

    def step_end(self, ctx: TrainContext, step: int) -> None:
        if step + 1 in self.hang_steps:                     # the start of step S is the end of step S-1
            inject_hang(ctx.probe, step=step + 1)

    def close(self, ctx: TrainContext, status: str) -> None:
        if self.watchdog is not None:
            self.watchdog.stop()


def _hooks_factory(ctx: TrainContext) -> TrainHooks | None:
    config = ctx.job.section("hang")
    hangs = job_faults_of(ctx.job.faults, "hang")
    if config is None or (not config.enabled and not hangs):
        return None
    if config.enabled:
        if not (getattr(ctx.probe, "config", None) and ctx.probe.config.enabled and ctx.probe.config.collectives):
            raise ConfigError("--collective-timeout needs collective recording (the watchdog reads it); drop "
                              "--no-collect / --no-collectives.")
        if config.collective_timeout_s >= ctx.job.timeout_s:
            raise ConfigError(f"--collective-timeout {config.collective_timeout_s:g} must be below the process-group "
                              f"--timeout {ctx.job.timeout_s:g}, or gloo/NCCL aborts the collective first; raise "
                              f"--timeout or lower --collective-timeout.")
    return HangHooks(ctx, config)


register_section("hang", HangConfig)
register_fault_kind(FaultKind(
    name="hang", keys={"rank": int, "step": int}, required=("rank", "step"), example="hang:rank=1,step=5",
    help="at the start of step S rank R stops issuing collectives (sleeps; first attempt only); pair it with "
         "--collective-timeout T"))
register_hooks(_hooks_factory)
