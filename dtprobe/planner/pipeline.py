"""Pipeline idle time and in-flight micro-batches per schedule, from ``dtprobe.schedule_sim``; read by the search.

The search asks about thousands of layouts, so results are cached on (schedule, p, m, v, backward/forward
ratio, p2p latency) and long pipelines are simulated at ``m_sim = 2p`` micro-batches: with uniform stage costs
the idle time of every schedule here stops growing once ``m >= 2p`` (steady state; checked by a test), and
the p2p latency's cost grows linearly from there (simulated at 2p and 3p, extrapolated).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from dtprobe.schedule_sim import SPLIT_BACKWARD, simulate


@dataclass(frozen=True)
class PipelineShape:
    """Idle time and activation residency of one schedule, in units of one chunk's forward time."""

    idle_per_chunk_f: float
    """Makespan minus the busiest rank's work without p2p latency, divided by one chunk's forward time."""
    p2p_per_chunk_f: float
    """What the p2p latency adds to the makespan (every cross-rank hop on the critical path), same unit."""
    inflight_first: int
    """Peak chunks (F done, B/I not) on the rank holding stage 0."""
    inflight_last: int
    """Peak chunks on the rank holding the last stage (where the logits live)."""
    last_rank: int
    """Pipeline rank holding the last stage (p-1, or 0 for zbv)."""


def sim_microbatches(schedule: str, p: int, m: int) -> int:
    """Micro-batches to simulate: ``m`` itself, or ``2p`` once the idle time is steady."""
    return m if m <= 2 * p else 2 * p


def _bucket(x: float) -> float:
    """The latency/forward ratio simulated for ``x``: 0.1 below 0.25 (the makespan grows linearly with small
    latencies, so the result is scaled), else ``x`` to one significant digit."""
    return 0.1 if x < 0.25 else float(f"{x:.0e}")


def pipeline_shape(schedule: str, p: int, m: int, v: int, b_over_f: float, lat_over_f: float = 0.0) -> PipelineShape:
    """Idle, p2p and in-flight figures for ``p`` ranks, ``m`` micro-batches, ``v`` stages per rank.

    ``b_over_f`` is the backward/forward time ratio of a chunk (2, more with recompute), ``lat_over_f`` a
    p2p transfer's time over a chunk's forward. Without latency the idle time of the schedules that do not
    split the backward is (F + B) times a constant, so they are simulated once at F=1, B=2 and scaled; the
    zero-bubble ones replay their order at the ratio (rounded to 1/2, W = F). The latency's cost grows linearly
    with ``m`` past ``2p`` (steady state), so it is simulated at ``2p`` and ``3p`` and extrapolated.
    """
    m_sim = sim_microbatches(schedule, p, m)
    b_key = round(b_over_f * 2) / 2
    if schedule in SPLIT_BACKWARD:
        span, idle, first, last = _simulated(schedule, p, m_sim, v, b_key, 0.0)
    else:
        span, idle, first, last = _simulated(schedule, p, m_sim, v, 2.0, 0.0)
        idle = idle / 3.0 * (1.0 + b_over_f)
    p2p = 0.0
    if lat_over_f > 0:
        lat = _bucket(lat_over_f)
        b_lat = b_key if schedule in SPLIT_BACKWARD else 2.0   # hops on the critical path do not depend on B
        extra = _simulated(schedule, p, m_sim, v, b_lat, lat)[0] - _simulated(schedule, p, m_sim, v, b_lat, 0.0)[0]
        if m > m_sim:
            m_b = 3 * p
            extra_b = (_simulated(schedule, p, m_b, v, b_lat, lat)[0]
                       - _simulated(schedule, p, m_b, v, b_lat, 0.0)[0])
            extra += (extra_b - extra) * (m - m_sim) / (m_b - m_sim)
        p2p = extra * lat_over_f / lat
    if schedule == "gpipe":
        first = last = m
    return PipelineShape(idle_per_chunk_f=idle, p2p_per_chunk_f=p2p, inflight_first=first, inflight_last=last,
                         last_rank=0 if schedule == "zbv" else p - 1)


@lru_cache(maxsize=8192)
def _simulated(schedule: str, p: int, m: int, v: int, b_over_f: float, lat: float) -> tuple[float, float, int, int]:
    kw = dict(num_ranks=p, num_microbatches=m, virtual_stages=v, cost_f=1.0, cost_b=b_over_f,
              cost_w=min(1.0, b_over_f / 2) if schedule in SPLIT_BACKWARD else None)
    r = simulate(schedule, **kw, p2p_latency=lat)
    last_rank = 0 if schedule == "zbv" else p - 1
    return r.makespan, r.idle, r.peak_inflight[0], r.peak_inflight[last_rank]


def clear_caches() -> None:
    """Forget every cached simulation (benchmarks measure a cold search)."""
    from dtprobe.schedule_sim import _canonical_order

    _simulated.cache_clear()
    _canonical_order.cache_clear()
