"""Tests for dtprobe.schedule_sim: action lists and the event-driven pipeline simulator."""

from __future__ import annotations

import pytest

from dtprobe.schedule_sim import SCHEDULES, Action, schedule_order, simulate, stage_ranks


@pytest.mark.parametrize("p,m", [(2, 8), (4, 8), (4, 4), (8, 32), (3, 5)])
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_simulate_reproduces_gpipe_ideal_bubble_exactly(schedule, p, m):
    r = simulate(schedule, num_ranks=p, num_microbatches=m, cost_f=1.0, cost_b=2.0)
    assert r.bubble_frac == pytest.approx((p - 1) / (m + p - 1), abs=1e-12)
    assert r.makespan == pytest.approx((m + p - 1) * 3.0)
    for frac in r.bubble_frac_per_rank:
        assert frac == pytest.approx((p - 1) / (m + p - 1), abs=1e-12)


@pytest.mark.parametrize("schedule,v,p,expected", [
    ("interleaved-1f1b", 2, 2, 0.059), ("interleaved-1f1b", 2, 4, 0.158),
    ("zero-bubble", 2, 2, 0.020), ("zero-bubble", 2, 4, 0.059),
    ("zbv", 2, 2, 0.020), ("zbv", 2, 4, 0.059),
])
def test_simulate_matches_torch_reference_bubbles_when_m8_f1_b2(schedule, v, p, expected):
    # reference: notes/torch-distributed-on-cpu.md section 5 (torch's own pipeline_order, F=1 B=2 I=W=1)
    r = simulate(schedule, num_ranks=p, num_microbatches=8, virtual_stages=v, cost_f=1.0, cost_b=2.0)
    assert r.bubble_frac == pytest.approx(expected, abs=0.0006)


def test_interleaved_bubble_is_megatron_formula_when_m_multiple_of_p():
    # idle = (p-1)(F+B) per chunk: bubble share of compute (p-1)/(v m)
    for p, m, v in [(2, 8, 2), (4, 8, 2), (4, 16, 4), (8, 16, 2)]:
        r = simulate("interleaved-1f1b", num_ranks=p, num_microbatches=m, virtual_stages=v, cost_f=1.0, cost_b=2.0)
        work = m * v * 3.0
        assert r.makespan - work == pytest.approx((p - 1) * 3.0)


def test_zero_bubble_h1_beats_1f1b_with_split_backward():
    one = simulate("1f1b", num_ranks=4, num_microbatches=8, cost_f=1.0, cost_b=2.0)
    zb = simulate("zero-bubble", num_ranks=4, num_microbatches=8, cost_f=1.0, cost_b=2.0, cost_w=1.0)
    assert zb.bubble_frac < one.bubble_frac / 2
    assert zb.idle == pytest.approx(3.0)        # ZB-H1: (p-1)(F + I - W) = 3


@pytest.mark.parametrize("schedule,v", [("gpipe", 1), ("1f1b", 1), ("interleaved-1f1b", 2), ("zero-bubble", 1),
                                        ("zero-bubble", 2), ("zbv", 2)])
def test_idle_time_is_steady_once_m_reaches_2p(schedule, v):
    # the planner simulates long pipelines at m = 2p and reuses the idle time
    for p in (2, 4, 8):
        idles = [simulate(schedule, num_ranks=p, num_microbatches=k * p, virtual_stages=v).idle for k in (2, 4)]
        assert idles[0] == pytest.approx(idles[1])


def test_peak_inflight_is_p_minus_rank_for_1f1b_and_m_for_gpipe():
    assert simulate("1f1b", num_ranks=4, num_microbatches=8).peak_inflight == (4, 3, 2, 1)
    assert simulate("gpipe", num_ranks=4, num_microbatches=8).peak_inflight == (8, 8, 8, 8)


def test_p2p_latency_adds_fill_and_drain_hops_to_gpipe():
    base = simulate("gpipe", num_ranks=4, num_microbatches=8)
    lat = simulate("gpipe", num_ranks=4, num_microbatches=8, p2p_latency=0.5)
    assert lat.makespan - base.makespan == pytest.approx(2 * 3 * 0.5)


def test_measured_costs_per_stage_and_action_override_the_scalars():
    # 2-stage GPipe, m=2, stage 1 forward takes 3: stage 0 F0 [0,1] F1 [1,2]; stage 1 F0 [1,4] F1 [4,7]
    # B (2 each) stage1 B0 [7,9] B1 [9,11]; stage0 B0 [9,11] B1 [11,13]
    r = simulate("gpipe", num_ranks=2, num_microbatches=2, costs={(1, "F"): 3.0})
    assert r.makespan == pytest.approx(13.0)
    tl = r.timeline
    assert list(tl.columns) == ["rank", "stage", "microbatch", "action", "start", "end"]
    row = tl[(tl["stage"] == 1) & (tl["action"] == "F") & (tl["microbatch"] == 1)].iloc[0]
    assert (row["start"], row["end"]) == (4.0, 7.0)


def test_per_stage_cost_lists_and_split_schedules_emit_i_and_w():
    r = simulate("zero-bubble", num_ranks=2, num_microbatches=4, cost_f=[1.0, 2.0], cost_b=[2.0, 4.0])
    kinds = set(r.timeline["action"])
    assert kinds == {"F", "I", "W"}
    w = r.timeline[(r.timeline["stage"] == 1) & (r.timeline["action"] == "W")]
    assert ((w["end"] - w["start"]) == 2.0).all()


def test_placements_are_looped_and_v_shaped():
    assert stage_ranks("interleaved-1f1b", num_ranks=4, virtual_stages=2) == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert stage_ranks("zbv", num_ranks=4, virtual_stages=2) == [[0, 7], [1, 6], [2, 5], [3, 4]]


def test_every_schedule_runs_each_action_once_per_stage_and_microbatch():
    for schedule in SCHEDULES:
        v = 1 if schedule in ("gpipe", "1f1b") else 2
        p, m = 4, 8
        order = schedule_order(schedule, num_ranks=p, num_microbatches=m, virtual_stages=v)
        acts = [a for rank in order for a in rank]
        assert all(isinstance(a, Action) for a in acts)
        kinds = ("F", "I", "W") if schedule in ("zero-bubble", "zbv") else ("F", "B")
        assert sorted(acts) == sorted(Action(s, k, i) for s in range(p * v) for k in kinds for i in range(m))


@pytest.mark.parametrize("kwargs,match", [
    (dict(schedule="pipedream", num_ranks=2, num_microbatches=4), "unknown"),
    (dict(schedule="1f1b", num_ranks=2, num_microbatches=4, virtual_stages=2), "one stage per rank"),
    (dict(schedule="interleaved-1f1b", num_ranks=4, num_microbatches=6, virtual_stages=2), "multiple of"),
    (dict(schedule="zbv", num_ranks=2, num_microbatches=4, virtual_stages=3), "exactly 2"),
    (dict(schedule="gpipe", num_ranks=2, num_microbatches=4, cost_f=[1.0]), "per-stage values"),
])
def test_simulate_rejects_bad_arguments_with_a_message(kwargs, match):
    schedule = kwargs.pop("schedule")
    with pytest.raises(ValueError, match=match):
        simulate(schedule, **kwargs)


@pytest.mark.parametrize("schedule,v", [("zero-bubble", 1), ("zero-bubble", 2), ("zbv", 2)])
def test_replaying_the_zero_bubble_orders_gives_the_same_timeline(schedule, v):
    # simulate() returns the greedy scheduler's own timeline; replaying its action lists must agree
    for latency in (0.0, 0.3):
        r = simulate(schedule, num_ranks=4, num_microbatches=12, virtual_stages=v, cost_f=1.0, cost_b=2.5,
                     cost_w=1.0, p2p_latency=latency)
        order = [[] for _ in range(4)]
        for rank, stage, mb, kind, _, _ in sorted(r.records, key=lambda x: (x[0], x[4])):
            order[rank].append(Action(stage, kind, mb))
        again = simulate(schedule, num_ranks=4, num_microbatches=12, virtual_stages=v, cost_f=1.0, cost_b=2.5,
                         cost_w=1.0, p2p_latency=latency, order=order)
        assert again.makespan == pytest.approx(r.makespan)
        assert again.peak_inflight == r.peak_inflight


def test_measured_backward_of_a_split_schedule_is_divided_into_i_and_w():
    r = simulate("zero-bubble", num_ranks=2, num_microbatches=2, costs={(1, "B"): 8.0, (0, "I"): 3.0, (0, "W"): 1.0})
    tl = r.timeline
    dur = (tl["end"] - tl["start"]).groupby([tl["stage"], tl["action"]]).first()
    assert dur[(1, "I")] == 4.0 and dur[(1, "W")] == 4.0
    assert dur[(0, "I")] == 3.0 and dur[(0, "W")] == 1.0
