"""Pipeline-schedule action lists and an event-driven simulator; read by the planner, the runtime and analysis.

Pure module (no torch). ``schedule_order`` builds each rank's ordered list of actions for a schedule;
``simulate`` replays those lists with per-action costs and returns the timeline, the makespan, each rank's
bubble fraction and its peak number of in-flight micro-batch chunks (activations held: F done, B/I not yet).

Schedules (``SCHEDULES``), with ``p`` ranks, ``m`` micro-batches and ``v`` stages per rank:

- ``gpipe``: all forwards, then all backwards; stage ``r`` on rank ``r``. Bubble ``(p-1)/(m+p-1)``.
- ``1f1b``: warm-up of ``p-1-r`` forwards, then one forward / one backward.
- ``interleaved-1f1b``: Megatron's interleaved 1F1B, looped placement (rank ``r`` holds stages
  ``r, r+p, ...``); needs ``m % p == 0``. Bubble ``(p-1)/(v*m)`` of the compute time.
- ``zero-bubble``: ZB-H1-like: backward split into I (input gradient) and W (weight gradient); W fills the
  idle slots. Looped placement when ``v > 1`` (like torch's InterleavedZeroBubble).
- ``zbv``: V-shape, ``v = 2``: rank ``r`` holds stages ``r`` and ``2p-1-r``; I and W split.

The zero-bubble orders are produced by a greedy list scheduler (backward first, forward while the in-flight
budget allows, W when nothing else is ready). ``simulate`` plans them once at the reference costs
(F = I = W = 1, no latency) and, like the runtime's static schedules, replays that order with the costs and
latency given; ``schedule_order(..., costs=)`` plans an order for other costs (replay it with ``order=``).
"""

from __future__ import annotations

import heapq
from functools import lru_cache
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b", "zero-bubble", "zbv")
"""Schedule names accepted by ``schedule_order`` and ``simulate``."""

SPLIT_BACKWARD = frozenset({"zero-bubble", "zbv"})
"""Schedules whose backward is split into I (input gradient) and W (weight gradient)."""

ACTIONS = ("F", "B", "I", "W")
"""F forward, B full backward, I backward for the input gradient, W backward for the weight gradient."""


class Action(NamedTuple):
    """One pipeline action: ``kind`` of micro-batch ``microbatch`` on global stage ``stage``."""

    stage: int
    kind: str
    microbatch: int


@dataclass(kw_only=True, frozen=True)
class SimResult:
    """A simulated pipeline step; times are in the unit of the costs given to ``simulate``."""

    schedule: str
    """Schedule name."""
    num_ranks: int
    """Pipeline ranks ``p``."""
    num_microbatches: int
    """Micro-batches per step ``m``."""
    virtual_stages: int
    """Stages held per rank ``v``."""
    records: tuple[tuple[int, int, int, str, float, float], ...]
    """(rank, stage, microbatch, action, start, end) per action, in simulation order."""
    makespan: float
    """Time from the first action's start (0) to the last action's end."""
    busy: tuple[float, ...]
    """Per-rank summed action time."""
    peak_inflight: tuple[int, ...]
    """Per-rank peak count of (stage, micro-batch) chunks whose F is done and whose B (or I) is not."""
    _frame: list = field(default_factory=list, repr=False, compare=False)

    @property
    def bubble_frac_per_rank(self) -> tuple[float, ...]:
        """Idle share of the makespan on each rank."""
        return tuple((self.makespan - b) / self.makespan for b in self.busy)

    @property
    def bubble_frac(self) -> float:
        """Idle share over all ranks: total idle time / (ranks * makespan)."""
        return sum(self.bubble_frac_per_rank) / self.num_ranks

    @property
    def idle(self) -> float:
        """Makespan minus the busiest rank's work: the time the step loses to the pipeline."""
        return self.makespan - max(self.busy)

    def order(self) -> list[list[Action]]:
        """The per-rank action lists this timeline ran (replay them with other costs via ``simulate(order=)``)."""
        out: list[list[Action]] = [[] for _ in range(self.num_ranks)]
        for rank, stage, mb, kind, _, _ in sorted(self.records, key=lambda x: (x[0], x[4], x[5])):
            out[rank].append(Action(stage, kind, mb))
        return out

    @property
    def timeline(self):
        """The records as a DataFrame: rank, stage, microbatch, action, start, end (built on first use)."""
        if not self._frame:
            import pandas as pd

            cols = ["rank", "stage", "microbatch", "action", "start", "end"]
            self._frame.append(pd.DataFrame(list(self.records), columns=cols))
        return self._frame[0]


def stage_ranks(schedule: str, *, num_ranks: int, virtual_stages: int = 1) -> list[list[int]]:
    """Stages held by each rank, in local-chunk order: looped (``r, r+p, ...``) or V-shape for ``zbv``."""
    p, v = num_ranks, virtual_stages
    if schedule == "zbv":
        return [[r, 2 * p - 1 - r] for r in range(p)]
    return [[c * p + r for c in range(v)] for r in range(p)]


def _check(schedule: str, num_ranks: int, num_microbatches: int, virtual_stages: int) -> None:
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule {schedule!r} is unknown; use one of {', '.join(SCHEDULES)}")
    if num_ranks < 1 or num_microbatches < 1 or virtual_stages < 1:
        raise ValueError(f"num_ranks ({num_ranks}), num_microbatches ({num_microbatches}) and "
                         f"virtual_stages ({virtual_stages}) must all be >= 1")
    if schedule in ("gpipe", "1f1b") and virtual_stages != 1:
        raise ValueError(f"schedule {schedule!r} holds one stage per rank; got virtual_stages={virtual_stages}. "
                         f"Use interleaved-1f1b, zero-bubble or zbv for several stages per rank.")
    if schedule == "zbv" and virtual_stages != 2:
        raise ValueError(f"schedule 'zbv' holds exactly 2 stages per rank (V shape); "
                         f"got virtual_stages={virtual_stages}")
    if schedule == "interleaved-1f1b" and num_microbatches % num_ranks:
        raise ValueError(f"interleaved-1f1b needs num_microbatches ({num_microbatches}) to be a multiple of "
                         f"num_ranks ({num_ranks}); change the micro-batch count or use 1f1b")


def schedule_order(schedule: str, *, num_ranks: int, num_microbatches: int, virtual_stages: int = 1,
                   costs: Mapping[tuple[int, str], float] | None = None) -> list[list[Action]]:
    """Per-rank ordered action lists. ``costs`` ((stage, action) -> time) only shapes the zero-bubble orders."""
    p, m, v = num_ranks, num_microbatches, virtual_stages
    _check(schedule, p, m, v)
    if schedule == "gpipe":
        return [[Action(r, "F", i) for i in range(m)] + [Action(r, "B", i) for i in range(m)] for r in range(p)]
    if schedule == "1f1b":
        orders = []
        for r in range(p):
            warmup = min(p - 1 - r, m)
            order = [Action(r, "F", i) for i in range(warmup)]
            for i in range(m - warmup):
                order += [Action(r, "F", warmup + i), Action(r, "B", i)]
            order += [Action(r, "B", i) for i in range(m - warmup, m)]
            orders.append(order)
        return orders
    if schedule == "interleaved-1f1b":
        return [_interleaved_order(r, p, m, v) for r in range(p)]
    if costs is None:
        costs = _uniform_costs(schedule, p, v, cost_f=1.0, cost_b=2.0, cost_w=None)
    return _greedy_order(schedule, p, m, v, costs, p2p_latency=0.0)


def _interleaved_order(r: int, p: int, m: int, v: int) -> list[Action]:
    """Megatron interleaved 1F1B for rank ``r`` (looped placement, micro-batches in groups of ``p``)."""
    total = m * v
    warmup = min((v - 1) * p + 2 * (p - 1 - r), total)

    def chunk_mb(k: int, forward: bool) -> tuple[int, int]:
        chunk = (k // p) % v
        if not forward:
            chunk = v - 1 - chunk
        return chunk, (k // (p * v)) * p + k % p

    def f(k: int) -> Action:
        c, i = chunk_mb(k, True)
        return Action(c * p + r, "F", i)

    def b(k: int) -> Action:
        c, i = chunk_mb(k, False)
        return Action(c * p + r, "B", i)

    order = [f(k) for k in range(warmup)]
    for k in range(total - warmup):
        order += [f(warmup + k), b(k)]
    order += [b(k) for k in range(total - warmup, total)]
    return order


def _inflight_budget(schedule: str, r: int, p: int, v: int) -> int:
    """Chunks a rank may hold between F and I in the zero-bubble orders (the 1F1B / interleaved budget)."""
    if schedule == "zbv":
        return 2 * p
    return (v - 1) * p + 2 * (p - 1 - r) + 1 if v > 1 else p - r


@lru_cache(maxsize=512)
def _canonical_order(schedule: str, p: int, m: int, v: int) -> tuple[tuple[Action, ...], ...]:
    """The zero-bubble order planned at F = I = W = 1 (the reference costs), reused for any costs."""
    costs = _uniform_costs(schedule, p, v, cost_f=1.0, cost_b=2.0, cost_w=None)
    return tuple(tuple(o) for o in _greedy(schedule, p, m, v, costs, 0.0)[0])


def _greedy_order(schedule: str, p: int, m: int, v: int, costs: Mapping[tuple[int, str], float],
                  p2p_latency: float) -> list[list[Action]]:
    """List-schedule F/I/W per rank: I first, then F within the in-flight budget, then W; else wait."""
    return _greedy(schedule, p, m, v, costs, p2p_latency)[0]


def _greedy(schedule: str, p: int, m: int, v: int, costs: Mapping[tuple[int, str], float],
            p2p_latency: float) -> tuple[list[list[Action]], SimResult]:
    """The greedy orders and their timeline (the same one ``_replay`` of those orders gives)."""
    placement = stage_ranks(schedule, num_ranks=p, virtual_stages=v)
    num_stages = p * v
    rank_of = {s: r for r, ss in enumerate(placement) for s in ss}
    inf = float("inf")
    end_f = [[inf] * m for _ in range(num_stages)]
    end_i = [[inf] * m for _ in range(num_stages)]
    next_f = [0] * num_stages
    next_i = [0] * num_stages
    pending_w: list[list[tuple[int, int]]] = [[] for _ in range(p)]
    inflight = [0] * p
    free = [0.0] * p
    orders: list[list[Action]] = [[] for _ in range(p)]
    records: list[tuple[int, int, int, str, float, float]] = []
    busy = [0.0] * p
    peak = [0] * p
    remaining = num_stages * m * 3
    budget = [_inflight_budget(schedule, r, p, v) for r in range(p)]
    # prefer the later stage (drains micro-batches toward the loss and back first)
    stage_pref = [sorted(ss, reverse=True) for ss in placement]
    entry = [min(ss) for ss in placement]

    def lat(src: int, dst: int) -> float:
        return p2p_latency if rank_of[src] != rank_of[dst] else 0.0

    def ready_f(s: int) -> float:
        i = next_f[s]
        if i >= m:
            return inf
        return 0.0 if s == 0 else end_f[s - 1][i] + lat(s - 1, s)

    def ready_i(s: int) -> float:
        i = next_i[s]
        if i >= next_f[s]:
            return inf
        up = end_f[s][i] if s == num_stages - 1 else max(end_f[s][i], end_i[s + 1][i] + lat(s + 1, s))
        return up

    heap = [(0.0, r, r) for r in range(p)]
    seq = p
    blocked = [False] * p          # waiting for an input whose producer is not scheduled yet
    while remaining:
        if not heap:
            raise RuntimeError(f"greedy {schedule} order deadlocked with {remaining} actions left")  # invariant
        t, _, r = heapq.heappop(heap)
        choice = None
        for s in stage_pref[r]:
            if ready_i(s) <= t:
                choice = (s, "I")
                break
        if choice is None:
            for s in stage_pref[r]:
                # the budget only holds back micro-batches entering the rank; continuing ones never wait
                if ready_f(s) <= t and (s != entry[r] or inflight[r] < budget[r]):
                    choice = (s, "F")
                    break
        if choice is None:
            soon = min([ready_i(x) for x in stage_pref[r]]
                       + [ready_f(x) for x in stage_pref[r] if x != entry[r] or inflight[r] < budget[r]])
            # fill with W unless an input already on its way lands before the W would finish
            if pending_w[r] and not t < soon < t + costs[(pending_w[r][0][0], "W")]:
                choice = pending_w[r][0][0], "W"
            elif soon < inf:
                seq += 1
                heapq.heappush(heap, (soon, seq, r))     # sleep until that input arrives
                continue
            else:
                blocked[r] = True                        # woken when a producer of its inputs is scheduled
                continue
        s, kind = choice
        if kind == "F":
            i = next_f[s]
            next_f[s] += 1
            inflight[r] += 1
        elif kind == "I":
            i = next_i[s]
            next_i[s] += 1
            inflight[r] -= 1
            pending_w[r].append((s, i))
        else:
            s, i = pending_w[r].pop(0)
        end = t + costs[(s, kind)]
        if kind == "F":
            end_f[s][i] = end
            consumer = rank_of.get(s + 1)
        elif kind == "I":
            end_i[s][i] = end
            consumer = rank_of.get(s - 1)
        else:
            consumer = None
        if consumer is not None and blocked[consumer]:
            blocked[consumer] = False
            seq += 1
            heapq.heappush(heap, (t, seq, consumer))
        orders[r].append(Action(s, kind, i))
        records.append((r, s, i, kind, t, end))
        busy[r] += end - t
        peak[r] = max(peak[r], inflight[r])
        free[r] = end
        remaining -= 1
        seq += 1
        heapq.heappush(heap, (end, seq, r))
    result = SimResult(schedule=schedule, num_ranks=p, num_microbatches=m, virtual_stages=v, records=tuple(records),
                       makespan=max(free), busy=tuple(busy), peak_inflight=tuple(peak))
    return orders, result


def _per_stage(value: float | Sequence[float], num_stages: int, name: str) -> list[float]:
    if isinstance(value, (int, float)):
        return [float(value)] * num_stages
    values = [float(x) for x in value]
    if len(values) != num_stages:
        raise ValueError(f"{name} has {len(values)} per-stage values; the pipeline has {num_stages} stages")
    return values


def _uniform_costs(schedule: str, p: int, v: int, *, cost_f, cost_b, cost_w) -> dict[tuple[int, str], float]:
    n = p * v
    f = _per_stage(cost_f, n, "cost_f")
    b = _per_stage(cost_b, n, "cost_b")
    costs: dict[tuple[int, str], float] = {}
    for s in range(n):
        costs[(s, "F")] = f[s]
        costs[(s, "B")] = b[s]
    if schedule in SPLIT_BACKWARD:
        w = _per_stage(cost_w, n, "cost_w") if cost_w is not None else [x / 2 for x in b]
        for s in range(n):
            costs[(s, "W")] = w[s]
            costs[(s, "I")] = b[s] - w[s]
    return costs


def simulate(schedule: str, *, num_ranks: int, num_microbatches: int, virtual_stages: int = 1,
             cost_f: float | Sequence[float] = 1.0, cost_b: float | Sequence[float] = 2.0,
             cost_w: float | Sequence[float] | None = None, p2p_latency: float = 0.0,
             costs: Mapping[tuple[int, str], float] | None = None,
             order: Sequence[Sequence[Action]] | None = None) -> SimResult:
    """Simulate one pipeline step and return its timeline, makespan and per-rank bubble.

    ``cost_f``/``cost_b`` are per-chunk forward/backward times (one number, or one per global stage);
    for zero-bubble schedules ``cost_w`` is the weight-gradient part of ``cost_b`` (default half) and
    I = B - W. ``costs`` maps (stage, action) -> time (measured costs) and overrides the scalars.
    ``p2p_latency`` is added to every dependency crossing ranks. ``order`` replays given action lists.
    """
    p, m, v = num_ranks, num_microbatches, virtual_stages
    _check(schedule, p, m, v)
    full = _uniform_costs(schedule, p, v, cost_f=cost_f, cost_b=cost_b, cost_w=cost_w)
    if costs:
        full.update({(int(s), str(a)): float(c) for (s, a), c in costs.items()})
        given = {(int(s), str(a)) for s, a in costs}
        if schedule in SPLIT_BACKWARD:   # keep B = I + W whichever of them was measured
            for s in range(p * v):
                has = {a for a in ("B", "I", "W") if (s, a) in given}
                if has == {"B"}:
                    full[(s, "W")] = full[(s, "B")] / 2 if cost_w is None else full[(s, "W")]
                    full[(s, "I")] = full[(s, "B")] - full[(s, "W")]
                elif has == {"B", "W"}:
                    full[(s, "I")] = full[(s, "B")] - full[(s, "W")]
                elif has == {"B", "I"}:
                    full[(s, "W")] = full[(s, "B")] - full[(s, "I")]
                elif has == {"I", "W"} or has == {"I"} or has == {"W"}:
                    full[(s, "B")] = full[(s, "I")] + full[(s, "W")]
    if order is None:
        if schedule in SPLIT_BACKWARD:
            order = _canonical_order(schedule, p, m, v)   # static, like the runtime's schedules
        else:
            order = schedule_order(schedule, num_ranks=p, num_microbatches=m, virtual_stages=v)
    return _replay(schedule, p, m, v, order, full, p2p_latency)


def _replay(schedule: str, p: int, m: int, v: int, order: Sequence[Sequence[Action]],
            costs: Mapping[tuple[int, str], float], p2p_latency: float) -> SimResult:
    """Run each rank's list in order; an action starts when its rank is free and its inputs have arrived."""
    num_stages = p * v
    rank_of = {s: r for r, ss in enumerate(stage_ranks(schedule, num_ranks=p, virtual_stages=v)) for s in ss}
    end_f = [[None] * m for _ in range(num_stages)]
    end_b = [[None] * m for _ in range(num_stages)]   # B or I: the input gradient sent upstream
    end_i_local = [[None] * m for _ in range(num_stages)]
    free = [0.0] * p
    busy = [0.0] * p
    ptr = [0] * p
    inflight = [0] * p
    peak = [0] * p
    records: list[tuple[int, int, int, str, float, float]] = []
    remaining = sum(len(o) for o in order)
    last = num_stages - 1
    while remaining:
        progressed = False
        for r in range(p):
            acts = order[r]
            while ptr[r] < len(acts):
                s, kind, i = acts[ptr[r]]
                if kind == "F":
                    if s == 0:
                        ready = 0.0
                    else:
                        dep = end_f[s - 1][i]
                        if dep is None:
                            break
                        ready = dep + (p2p_latency if rank_of[s - 1] != r else 0.0)
                elif kind in ("B", "I"):
                    own = end_f[s][i]
                    if own is None:
                        break
                    ready = own
                    if s != last:
                        dep = end_b[s + 1][i]
                        if dep is None:
                            break
                        ready = max(ready, dep + (p2p_latency if rank_of[s + 1] != r else 0.0))
                else:  # W
                    own = end_i_local[s][i]
                    if own is None:
                        break
                    ready = own
                start = max(free[r], ready)
                end = start + costs[(s, kind)]
                if kind == "F":
                    end_f[s][i] = end
                    inflight[r] += 1
                    peak[r] = max(peak[r], inflight[r])
                elif kind in ("B", "I"):
                    end_b[s][i] = end
                    end_i_local[s][i] = end
                    inflight[r] -= 1
                free[r] = end
                busy[r] += end - start
                records.append((r, s, i, kind, start, end))
                ptr[r] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            stuck = {r: order[r][ptr[r]] for r in range(p) if ptr[r] < len(order[r])}
            raise ValueError(f"{schedule} action lists deadlock; next actions per rank: {stuck}")
    return SimResult(schedule=schedule, num_ranks=p, num_microbatches=m, virtual_stages=v,
                     records=tuple(records), makespan=max(free), busy=tuple(busy), peak_inflight=tuple(peak))
