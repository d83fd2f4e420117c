"""Clock offset of each rank to rank 0 (NTP-style ping-pong over a gloo group); stored in the rank info file."""

from __future__ import annotations

import socket
import time
from pathlib import Path

import torch
import torch.distributed as dist

BOOT_ID_FILE = Path("/proc/sys/kernel/random/boot_id")


def host_clock_id() -> str:
    """Identifies the system clock this process reads: the kernel's boot id (shared by every process and
    container on one machine, which all read the same ``CLOCK_REALTIME``), else the host name."""
    try:
        return "boot:" + BOOT_ID_FILE.read_text().strip()
    except OSError:
        return "host:" + socket.gethostname()


def measure_clock_offset(group: dist.ProcessGroup | None = None, *, rounds: int = 8,
                         clock_id: str | None = None) -> tuple[int, int]:
    """Return ``(offset_ns, rtt_ns)`` of this rank: rank 0's clock minus this rank's clock, and the round trip
    of the sample it came from. Collective over ``group`` (CPU tensors: a gloo group); rank 0 returns (0, 0).

    Ranks on rank 0's machine (same ``clock_id``, default ``host_clock_id()``) read the very same clock: their
    offset is exactly 0, so they are not measured: a measurement would replace that exact 0 by the ping-pong's
    error, which grows with the host's load and shifts every arrival of the rank (biasing straggler verdicts).
    Rank 0 serves every other rank in turn, ``rounds`` ping-pongs each. Per round the client notes t0 (send),
    the server t1 (receive) and t2 (reply), the client t3 (reply received); offset = ((t1-t0) + (t2-t3)) / 2
    and rtt = (t3-t0) - (t2-t1). The round with the smallest rtt is kept: its error is at most rtt / 2.
    """
    world = dist.get_world_size(group)
    me = dist.get_rank(group)
    if world == 1:
        return 0, 0
    ids: list[str | None] = [None] * world
    dist.all_gather_object(ids, clock_id or host_clock_id(), group=group)
    if me != 0 and ids[me] == ids[0]:
        return 0, 0
    ping = torch.zeros(1, dtype=torch.int64)
    pong = torch.zeros(2, dtype=torch.int64)
    root = dist.get_global_rank(group, 0) if group is not None else 0
    if me == 0:
        for client in range(1, world):
            if ids[client] == ids[0]:
                continue
            peer = dist.get_global_rank(group, client) if group is not None else client
            for _ in range(rounds):
                dist.recv(ping, src=peer, group=group)
                t1 = time.time_ns()
                pong[0] = t1
                pong[1] = time.time_ns()
                dist.send(pong, dst=peer, group=group)
        return 0, 0
    best: tuple[int, int] | None = None
    for _ in range(rounds):
        t0 = time.time_ns()
        dist.send(ping, dst=root, group=group)
        dist.recv(pong, src=root, group=group)
        t3 = time.time_ns()
        t1, t2 = int(pong[0]), int(pong[1])
        rtt = (t3 - t0) - (t2 - t1)
        offset = ((t1 - t0) + (t2 - t3)) // 2
        if best is None or rtt < best[1]:
            best = (offset, rtt)
    assert best is not None
    return best
