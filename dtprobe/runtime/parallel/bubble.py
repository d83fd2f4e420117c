"""Measured vs ideal pipeline bubble per rank from ``pipeline`` rows; read by the layout tests and sample-trace
READMEs (row dicts in, no torch).

Measured (one step): the step's span runs from the first action's start to the last action's end over all ranks
(timestamps on one clock: the store's aligned columns, or one host); each rank's bubble is
``dtprobe.intervals.bubble_frac``, the definition ``dtprobe.analysis.bubble`` uses too: busy time is the union of
its action spans (F, B, I, W; overlapping actions count once), bubble = 1 - busy / span.
Ideal: the schedule's action lists replayed by ``dtprobe.schedule_sim.simulate`` with the measured mean cost
of each (stage, action): the bubble the schedule itself imposes, without p2p latency or host jitter.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from dtprobe.intervals import bubble_frac


@dataclass(kw_only=True, frozen=True)
class BubbleComparison:
    """Measured and ideal bubble fraction per pipeline rank (averaged over the steps given)."""

    schedule: str
    measured_frac: tuple[float, ...]
    """Per pipeline rank: idle share of the step span, measured."""
    ideal_frac: tuple[float, ...]
    """Per pipeline rank: idle share of the simulated makespan with the measured costs."""
    costs_ns: Mapping[tuple[int, str], float]
    """Mean measured duration per (stage, action), ns."""
    measured_span_ns: float
    """Mean step span (first action start to last action end), ns."""
    ideal_makespan_ns: float


def mean_costs(rows: Iterable[Mapping[str, Any]]) -> dict[tuple[int, str], float]:
    """Mean duration (ns) per (stage, action) over the rows."""
    total: dict[tuple[int, str], float] = defaultdict(float)
    count: dict[tuple[int, str], int] = defaultdict(int)
    for r in rows:
        key = (int(r["stage"]), str(r["action"]))
        total[key] += r["end_ns"] - r["start_ns"]
        count[key] += 1
    return {k: total[k] / count[k] for k in total}


def measured_bubble(rows: Sequence[Mapping[str, Any]], *, stage_to_pp_rank: Mapping[int, int],
                    num_ranks: int) -> tuple[tuple[float, ...], float]:
    """(bubble fraction per pipeline rank, span ns) of ONE step's rows (one replica: one dp/tp coordinate)."""
    start = min(r["start_ns"] for r in rows)
    end = max(r["end_ns"] for r in rows)
    span = end - start
    spans: list[list[tuple[int, int]]] = [[] for _ in range(num_ranks)]
    for r in rows:
        spans[stage_to_pp_rank[int(r["stage"])]].append((r["start_ns"], r["end_ns"]))
    fracs = [bubble_frac(np.asarray([a for a, _ in s]), np.asarray([b for _, b in s]), window_ns=span)[1]
             for s in spans]
    return tuple(fracs), float(span)


def compare_bubble(rows: Sequence[Mapping[str, Any]], *, schedule: str, num_ranks: int, num_microbatches: int,
                   virtual_stages: int, order: Sequence[Sequence[Any]] | None = None,
                   steps: Iterable[int] | None = None) -> BubbleComparison:
    """Measured vs ideal bubble per pipeline rank over ``steps`` (default: every step but the first, which pays
    for shape inference and warm-up). ``rows`` are the pipeline rows of one replica (one global rank per
    pipeline rank). ``order`` is the schedule's own action list (``pp.torch_action_order``); None uses the
    simulator's list for ``schedule``."""
    from dtprobe.schedule_sim import simulate, stage_ranks

    placement = stage_ranks(schedule, num_ranks=num_ranks, virtual_stages=virtual_stages)
    stage_to_rank = {s: r for r, stages in enumerate(placement) for s in stages}
    by_step: dict[int, list[Mapping[str, Any]]] = defaultdict(list)
    for r in rows:
        by_step[int(r["step"])].append(r)
    chosen = sorted(by_step)[1:] if steps is None else [s for s in steps if s in by_step]
    if not chosen:
        raise ValueError(f"no pipeline rows for steps {steps!r}; rows cover steps {sorted(by_step)}")
    kept = [r for s in chosen for r in by_step[s]]
    costs = mean_costs(kept)
    measured = [measured_bubble(by_step[s], stage_to_pp_rank=stage_to_rank, num_ranks=num_ranks) for s in chosen]
    measured_frac = tuple(sum(m[0][i] for m in measured) / len(measured) for i in range(num_ranks))
    sim = simulate(schedule, num_ranks=num_ranks, num_microbatches=num_microbatches,
                   virtual_stages=virtual_stages, costs=costs, order=order)
    return BubbleComparison(schedule=schedule, measured_frac=measured_frac, ideal_frac=sim.bubble_frac_per_rank,
                            costs_ns=costs, measured_span_ns=sum(m[1] for m in measured) / len(measured),
                            ideal_makespan_ns=sim.makespan)
