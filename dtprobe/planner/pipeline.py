"""Pipeline idle time and in-flight micro-batches per schedule, from ``dtprobe.schedule_sim``; read by the search.

The search asks about thousands of layouts, so results are cached on (schedule, p, m, v, backward/forward
ratio) and long pipelines are simulated at ``m_sim = 2p`` micro-batches: with uniform stage costs the idle
time of every schedule here stops growing once ``m >= p`` (steady state; checked by a test), so the idle
time at ``m`` equals the idle time at ``m_sim``.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from dtprobe.schedule_sim import SPLIT_BACKWARD, simulate


@dataclass(frozen=True)
class PipelineShape:
    """Idle time and activation residency of one schedule, in units of one chunk's forward time."""

    idle_per_chunk_f: float
    """Makespan minus the busiest rank's work, divided by the forward time of one chunk."""
    inflight_first: int
    """Peak chunks (F done, B/I not) on the rank holding stage 0."""
    inflight_last: int
    """Peak chunks on the rank holding the last stage (where the logits live)."""
    last_rank: int
    """Pipeline rank holding the last stage (p-1, or 0 for zbv)."""


def sim_microbatches(schedule: str, p: int, m: int) -> int:
    """Micro-batches to simulate: ``m`` itself, or ``4p`` once the idle time is steady."""
    return m if m <= 2 * p else 2 * p


def pipeline_shape(schedule: str, p: int, m: int, v: int, b_over_f: float) -> PipelineShape:
    """Idle and in-flight figures for ``p`` ranks, ``m`` micro-batches, ``v`` stages per rank.

    ``b_over_f`` is the backward/forward time ratio of a chunk (2, more with recompute). For schedules
    that do not split the backward the idle time is (F + B) times a constant, so they are simulated once at
    F=1, B=2 and scaled; the zero-bubble schedules are simulated at the ratio (rounded to 1/2, W = F).
    """
    m_sim = sim_microbatches(schedule, p, m)
    if schedule in SPLIT_BACKWARD:
        idle, first, last = _simulated(schedule, p, m_sim, v, round(b_over_f * 2) / 2)
    else:
        idle, first, last = _simulated(schedule, p, m_sim, v, 2.0)
        idle = idle / 3.0 * (1.0 + b_over_f)
    if schedule == "gpipe":
        first = last = m
    return PipelineShape(idle_per_chunk_f=idle, inflight_first=first, inflight_last=last,
                         last_rank=0 if schedule == "zbv" else p - 1)


@lru_cache(maxsize=4096)
def _simulated(schedule: str, p: int, m: int, v: int, b_over_f: float) -> tuple[float, int, int]:
    r = simulate(schedule, num_ranks=p, num_microbatches=m, virtual_stages=v, cost_f=1.0, cost_b=b_over_f,
                 cost_w=min(1.0, b_over_f / 2) if schedule in SPLIT_BACKWARD else None)
    last_rank = 0 if schedule == "zbv" else p - 1
    return r.idle, r.peak_inflight[0], r.peak_inflight[last_rank]
