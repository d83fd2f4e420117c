"""Alpha-beta costs of ring collectives on a node/network topology; read by the planner's step-time model.

A ring collective over ``n`` ranks moving ``S`` logical bytes (NCCL / nccl-tests semantics) takes

    all-reduce                     2 (n-1) alpha + 2 (n-1)/n * S / B
    all-gather, reduce-scatter       (n-1) alpha +   (n-1)/n * S / B
    send/recv (p2p)                        alpha +             S / B

with ``B`` the per-device, per-direction bandwidth of the slowest link the ring crosses (NVLink inside a
node, the NIC across nodes) times the achieved fraction ``bw_eff``, and ``alpha`` that link's latency.
Ranks are laid out TP fastest, then DP, then PP (Megatron order), so a group of size ``n`` and stride
``k`` stays inside a node when ``n * k <= gpus_per_node``. Functions take scalars or numpy arrays.
"""

from __future__ import annotations

import numpy as np

BUS_FACTOR = {"allreduce": lambda n: 2 * (n - 1) / n, "allgather": lambda n: (n - 1) / n,
              "reduce_scatter": lambda n: (n - 1) / n, "broadcast": lambda n: 1.0, "send": lambda n: 1.0,
              "recv": lambda n: 1.0}
"""nccl-tests bus-bandwidth factors: busbw = algbw * factor(n)."""

HOPS = {"allreduce": lambda n: 2 * (n - 1), "allgather": lambda n: n - 1, "reduce_scatter": lambda n: n - 1,
        "broadcast": lambda n: n - 1, "send": lambda n: 1, "recv": lambda n: 1}
"""Latency terms (alpha count) of the ring algorithm per op."""


def link(*, span, gpus_per_node, intra_bw, inter_bw, intra_latency, inter_latency, bw_eff=1.0):
    """(bandwidth, latency) of a group covering ``span`` consecutive ranks: NVLink if it fits a node."""
    inside = np.asarray(span) <= gpus_per_node
    return (np.where(inside, intra_bw, inter_bw) * bw_eff, np.where(inside, intra_latency, inter_latency))


def collective_time(op: str, *, num_bytes, n, bw, latency):
    """Seconds for one ``op`` over ``n`` ranks; 0 when ``n`` is 1 (no communication)."""
    n = np.asarray(n, dtype=float)
    safe_n = np.maximum(n, 1.0)
    t = HOPS[op](safe_n) * latency + BUS_FACTOR[op](safe_n) * np.asarray(num_bytes, dtype=float) / bw
    return np.where(n > 1, t, 0.0)
