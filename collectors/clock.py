"""Clock offset of each rank to rank 0 (NTP-style ping-pong over a gloo group): measured at attach (stored in the
rank info file) and re-measured periodically by a background thread (rows of the ``clock`` table, which the store
reader interpolates to follow drift)."""

from __future__ import annotations

import dataclasses
import os
import socket
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist

from dtprobe.collectors.collective_recorder import RECORDER

BOOT_ID_FILE = Path("/proc/sys/kernel/random/boot_id")
CLOCK_ID_ENV = "DTPROBE_CLOCK_ID"
"""Overrides ``host_clock_id()``: processes given different values are measured against each other as if on
different machines (tests of the ping-pong on one machine)."""
RESYNC_TIMEOUT_S = 10.0
"""Timeout of the dedicated group the re-measuring thread uses: a dead or hung peer ends the thread (with one
"failed" row) after this long, never blocking training or the process's exit."""
STOP_JOIN_S = 1.0
"""How long ``ClockResync.stop`` waits for the thread (a ping-pong takes well under a second; a thread stuck on a
dead peer is a daemon and is left to its timeout)."""


def host_clock_id() -> str:
    """Identifies the system clock this process reads: ``$DTPROBE_CLOCK_ID`` when set, else the kernel's boot id
    (shared by every process and container on one machine, which all read the same ``CLOCK_REALTIME``), else the
    host name."""
    override = os.environ.get(CLOCK_ID_ENV)
    if override:
        return "env:" + override
    try:
        return "boot:" + BOOT_ID_FILE.read_text().strip()
    except OSError:
        return "host:" + socket.gethostname()


@dataclass(frozen=True)
class ClockSample:
    """One measurement of this rank's offset to rank 0."""

    offset_ns: int
    """Rank 0's clock minus this rank's clock."""
    rtt_ns: int
    """Round trip of the ping-pong round kept (0 when not measured)."""
    time_ns: int
    """When, on this rank's clock (the middle of the round kept; the call's end when not measured)."""
    measured: bool
    """False for rank 0 and ranks on rank 0's clock, whose offset is exactly 0."""
    num_other_clocks: int = 0
    """Ranks of the group on another clock than rank 0's (the same number on every rank): 0 means nothing is
    ever measured, so no re-measurement is needed."""

    def row(self, *, restart: int, event: str) -> dict[str, Any]:
        """This sample as a ``clock`` row."""
        return {"restart": restart, "time_ns": self.time_ns, "offset_ns": self.offset_ns, "rtt_ns": self.rtt_ns,
                "event": event}


def measure_clock_offset(group: dist.ProcessGroup | None = None, *, rounds: int = 8,
                         clock_id: str | None = None) -> tuple[int, int]:
    """Return ``(offset_ns, rtt_ns)`` of this rank: ``measure_clock_sample``'s offset and round trip."""
    sample = measure_clock_sample(group, rounds=rounds, clock_id=clock_id)
    return sample.offset_ns, sample.rtt_ns


def measure_clock_sample(group: dist.ProcessGroup | None = None, *, rounds: int = 8,
                         clock_id: str | None = None) -> ClockSample:
    """This rank's offset to rank 0 (rank 0's clock minus this rank's) and the round trip of the sample it came
    from. Collective over ``group`` (CPU tensors: a gloo group); rank 0 gets offset 0, not measured.

    Ranks on rank 0's machine (same ``clock_id``, default ``host_clock_id()``) read the very same clock: their
    offset is exactly 0, so they are not measured: a measurement would replace that exact 0 by the ping-pong's
    error, which grows with the host's load and shifts every arrival of the rank (biasing straggler verdicts).
    Rank 0 serves every other rank in turn, ``rounds`` ping-pongs each (``_serve``, ``_ping``).
    """
    world = dist.get_world_size(group)
    me = dist.get_rank(group)
    if world == 1:
        return ClockSample(0, 0, time.time_ns(), False)
    ids: list[str | None] = [None] * world
    dist.all_gather_object(ids, clock_id or host_clock_id(), group=group)
    clients = _clients(ids)
    if me == 0:
        for client in clients:
            _serve(_global(group, client), rounds, group)
        return ClockSample(0, 0, time.time_ns(), False, len(clients))
    if ids[me] == ids[0]:
        return ClockSample(0, 0, time.time_ns(), False, len(clients))
    return dataclasses.replace(_ping(_global(group, 0), rounds, group), num_other_clocks=len(clients))


def _clients(ids: list) -> list[int]:
    """Group ranks rank 0 measures: those on another clock than rank 0's."""
    return [r for r in range(1, len(ids)) if ids[r] != ids[0]]


def _global(group: dist.ProcessGroup | None, group_rank: int) -> int:
    return dist.get_global_rank(group, group_rank) if group is not None else group_rank


def _serve(peer: int, rounds: int, group: dist.ProcessGroup | None) -> None:
    """Rank 0's side of ``rounds`` ping-pongs with ``peer`` (a global rank): note t1 at each ping, t2 at the reply."""
    ping = torch.zeros(1, dtype=torch.int64)
    pong = torch.zeros(2, dtype=torch.int64)
    for _ in range(rounds):
        dist.recv(ping, src=peer, group=group)
        pong[0] = time.time_ns()
        pong[1] = time.time_ns()
        dist.send(pong, dst=peer, group=group)


def _ping(root: int, rounds: int, group: dist.ProcessGroup | None) -> ClockSample:
    """A client's side: per round t0 (send), t3 (reply received), rank 0's t1, t2 from the reply; offset =
    ((t1-t0) + (t2-t3)) / 2 and rtt = (t3-t0) - (t2-t1). The round with the smallest rtt is kept: its error is
    at most rtt / 2."""
    ping = torch.zeros(1, dtype=torch.int64)
    pong = torch.zeros(2, dtype=torch.int64)
    best: ClockSample | None = None
    for _ in range(rounds):
        t0 = time.time_ns()
        dist.send(ping, dst=root, group=group)
        dist.recv(pong, src=root, group=group)
        t3 = time.time_ns()
        t1, t2 = int(pong[0]), int(pong[1])
        rtt = (t3 - t0) - (t2 - t1)
        if best is None or rtt < best.rtt_ns:
            best = ClockSample(((t1 - t0) + (t2 - t3)) // 2, rtt, (t0 + t3) // 2, True)
    assert best is not None
    return best


class ClockResync:
    """Re-measures this rank's offset to rank 0 every ``interval_s`` in a daemon thread, over a group used for
    nothing else; each sample goes to ``write`` as a ``clock`` row ("remeasure").

    Started on rank 0 and on the ranks on another clock than rank 0's (``start_clock_resync``); ranks on rank 0's
    clock have offset exactly 0 and run nothing. Rounds follow one schedule on rank 0's clock (``start_ns + k *
    interval``), each rank waking at its estimate of that time, so rank 0 serves the clients one after another
    while they wait a moment at most. Any error (a dead or hung peer: the group's short timeout) ends the thread
    after one "failed" row; ``stop`` never waits for a thread stuck on a peer longer than ``STOP_JOIN_S``.
    """

    def __init__(self, group: dist.ProcessGroup, *, clients: list[int], start_ns: int, interval_s: float,
                 rounds: int, offset_ns: int, restart: int, write: Callable[[dict[str, Any]], None]) -> None:
        self._group = group
        self._clients = clients
        self._start_ns = start_ns
        self._interval_ns = int(interval_s * 1e9)
        self._rounds = rounds
        self._offset_ns = offset_ns
        self._restart = restart
        self._write = write
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="dtprobe-clock", daemon=True)

    @property
    def is_leader(self) -> bool:
        """Rank 0 of the group: serves the others."""
        return dist.get_rank(self._group) == 0

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Stop after the round in progress (at most ``STOP_JOIN_S``; a thread stuck on a dead peer is left)."""
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=STOP_JOIN_S)

    @property
    def alive(self) -> bool:
        """True while the thread runs (also while stuck on a dead peer after ``stop``)."""
        return self._thread.is_alive()

    def _run(self) -> None:
        leader = self.is_leader
        root = _global(self._group, 0)
        k = 0
        try:
            with RECORDER.paused():         # the group may be a recording one: these are not the job's
                while True:
                    k += 1
                    due = self._start_ns + k * self._interval_ns - self._offset_ns   # on this rank's clock
                    if self._stop.wait(max(0.0, (due - time.time_ns()) / 1e9)):
                        return
                    if not dist.is_initialized():   # the script destroyed its groups (ours too): a normal end
                        return
                    if leader:
                        for client in self._clients:
                            _serve(_global(self._group, client), self._rounds, self._group)
                    else:
                        sample = _ping(root, self._rounds, self._group)
                        self._offset_ns = sample.offset_ns
                        if self._stop.is_set():
                            return
                        self._write(sample.row(restart=self._restart, event="remeasure"))
        except Exception as exc:  # noqa: BLE001 - a background thread ends quietly; the row says why
            if not self._stop.is_set():
                self._write({"restart": self._restart, "time_ns": time.time_ns(), "event": "failed",
                             "detail": f"clock re-measurement stopped at round {k}: {type(exc).__name__}: "
                                       f"{str(exc)[:300]}"})


def start_clock_resync(group: dist.ProcessGroup, *, interval_s: float, rounds: int, offset_ns: int, restart: int,
                       write: Callable[[dict[str, Any]], None], clock_id: str | None = None) -> ClockResync | None:
    """Collective over ``group`` (a gloo group for this purpose only, created by every rank at attach): agree on
    the schedule (rank 0's clock now) and who is measured; start the thread on rank 0 and the ranks on another
    clock, when there is at least one such rank. Returns the running ``ClockResync``, or None on a rank that runs
    nothing (also on every rank when all share rank 0's clock)."""
    world = dist.get_world_size(group)
    if world == 1 or interval_s <= 0:
        return None
    info: list[Any] = [None] * world
    with RECORDER.paused():
        dist.all_gather_object(info, (clock_id or host_clock_id(), time.time_ns()), group=group)
    ids = [i[0] for i in info]
    clients = _clients(ids)
    me = dist.get_rank(group)
    if not clients or (me != 0 and me not in clients):
        return None
    resync = ClockResync(group, clients=clients, start_ns=int(info[0][1]), interval_s=interval_s, rounds=rounds,
                         offset_ns=offset_ns, restart=restart, write=write)
    resync.start()
    return resync
