"""The chaos harness's own check of a STRAGGLER verdict (``straggler_confirmed``), on rows written here: it must
tell a rank that is slow on its own from a rank that only waits, whichever phase the slowness falls in."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from harness import own_work_ms, straggler_confirmed

MS = 1_000_000


def _write_run(run_dir: Path, phases_ms: dict[int, list[dict[str, float]]]) -> None:
    """A data-parallel run whose rank r's step s runs ``phases_ms[r][s]`` (data, fwd, bwd_pre: backward up to the
    gradient all-reduce's enqueue, wait: the all-reduce's wait inside backward, opt), steps back to back; every
    rank leaves the all-reduce when the last one has enqueued it."""
    steps = {r: [] for r in phases_ms}
    colls = {r: [] for r in phases_ms}
    start = {r: 0.0 for r in phases_ms}
    for s in range(len(next(iter(phases_ms.values())))):
        enqueue = {r: start[r] + p[s]["data"] + p[s]["fwd"] + p[s]["bwd_pre"] for r, p in phases_ms.items()}
        done = max(enqueue.values()) + 1.0                       # the all-reduce itself takes 1 ms
        for r, p in phases_ms.items():
            ph = p[s]
            bwd = done - (start[r] + ph["data"] + ph["fwd"])
            end = done + ph["opt"]
            steps[r].append({"rank": r, "step": s, "restart": 0, "start_ns": int(start[r] * MS),
                             "end_ns": int(end * MS), "data_ns": int(ph["data"] * MS), "fwd_ns": int(ph["fwd"] * MS),
                             "bwd_ns": int(bwd * MS), "opt_ns": int(ph["opt"] * MS)})
            colls[r].append({"rank": r, "pg": "world", "seq": s + 1, "op": "allreduce", "step": s, "restart": 0,
                             "enqueue_ns": int(enqueue[r] * MS), "end_ns": int(done * MS)})
            start[r] = end + 0.1
    for kind, rows in (("steps", steps), ("collectives", colls)):
        folder = run_dir / "events" / kind
        folder.mkdir(parents=True, exist_ok=True)
        for r, rank_rows in rows.items():
            (folder / f"rank{r:05d}.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rank_rows))


def _finding(rank: int, lateness_ms: float) -> dict:
    return {"code": "STRAGGLER", "ranks": [rank],
            "evidence": {"window": [1, 9], "mean_lateness_ms": lateness_ms, "pg_ranks": [0, 1]}}


BASE = {"data": 0.2, "fwd": 3.0, "bwd_pre": 4.0, "opt": 5.0}


@pytest.mark.parametrize("slow_phase", ["fwd", "bwd_pre", "opt"])
def test_a_rank_slow_in_any_phase_is_confirmed_and_its_waiting_peer_is_not(tmp_path, slow_phase):
    extra_ms = 6.0
    slow = [dict(BASE, **{slow_phase: BASE[slow_phase] + extra_ms}) for _ in range(10)]
    _write_run(tmp_path, {0: [dict(BASE) for _ in range(10)], 1: slow})

    own = own_work_ms(tmp_path, 1, 9)
    # from backward's end to the next enqueue: opt + the 0.1 ms between steps + data + fwd + bwd_pre
    assert own[0] == pytest.approx(12.3, abs=0.01)
    assert own[1] - own[0] == pytest.approx(extra_ms, abs=0.01)
    assert straggler_confirmed(tmp_path, _finding(1, extra_ms))
    assert not straggler_confirmed(tmp_path, _finding(0, extra_ms))       # the victim waited, did not work


def test_a_slowdown_only_the_median_of_sums_sees_is_confirmed(tmp_path):
    """Throttled in a different phase each step: every per-phase median stays at the peer's, the sum does not."""
    phases = list(BASE)[1:]
    slow = [dict(BASE, **{phases[s % 3]: BASE[phases[s % 3]] + 6.0}) for s in range(10)]
    _write_run(tmp_path, {0: [dict(BASE) for _ in range(10)], 1: slow})
    assert straggler_confirmed(tmp_path, _finding(1, 6.0))


def test_a_rank_only_a_little_slower_than_its_lateness_claims_is_not_confirmed(tmp_path):
    _write_run(tmp_path, {0: [dict(BASE) for _ in range(10)], 1: [dict(BASE, fwd=5.0) for _ in range(10)]})
    assert not straggler_confirmed(tmp_path, _finding(1, 8.6))           # 2 ms of own work for 8.6 ms late


def _write_pipeline(run_dir: Path, action_ms: dict[int, float], *, steps: int = 10, actions: int = 4) -> None:
    """Pipeline actions (``events/pipeline``) of ranks of one stage in different pipelines: ``actions`` per step of
    ``action_ms[r]`` each, with gaps between them (the waits for the other stage, which actions never hold)."""
    folder = run_dir / "events" / "pipeline"
    folder.mkdir(parents=True, exist_ok=True)
    for r, ms in action_ms.items():
        rows, t = [], 0.0
        for s in range(steps):
            for _ in range(actions):
                rows.append({"rank": r, "step": s, "restart": 0, "start_ns": int(t * MS), "end_ns": int((t + ms) * MS)})
                t += ms + 7.0                                     # 7 ms waiting for the other stage each time
        (folder / f"rank{r:05d}.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))


def test_a_pipeline_ranks_own_work_is_its_actions_not_its_waits_for_the_other_stage(tmp_path):
    _write_pipeline(tmp_path, {0: 25.0, 1: 27.0})                 # rank 1: 8 ms more compute a step
    assert straggler_confirmed(tmp_path, _finding(1, 14.0))
    assert not straggler_confirmed(tmp_path, _finding(1, 17.0))   # 8 ms of own work for 17 ms late
    assert not straggler_confirmed(tmp_path, _finding(0, 14.0))   # the faster one
