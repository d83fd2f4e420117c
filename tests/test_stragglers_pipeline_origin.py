"""STRAGGLER in dp2 x pp2 with pipeline rows: a rank late at its dp group only because it waited on its pipeline
peer is followed upstream, and the rank named is the one whose own time on its stage is confirmed longer than the
same stage's in the other pipeline (``pipeline_delay.stage_excess``, ``stragglers.pipeline_origin_scores``)."""

from __future__ import annotations

import math
import random
from dataclasses import replace

import pandas as pd
import pytest

from dtprobe.analysis import straggler_causes as sc
from dtprobe.analysis import straggler_scores as ss
from dtprobe.analysis import stragglers as st
from dtprobe.analysis.bubble import pipeline_shape
from dtprobe.analysis.findings import info_without_gain
from dtprobe.analysis.pipeline_delay import median_own_delay, pipeline_replicas, schedule_gain_ns, stage_excess
from dtprobe.store.frames import frame_from_rows
from dtprobe.synthetic import MS, T0

DP, MICROBATCHES, F_MS, B_MS, XFER_MS, DATA_MS, OPT_MS = 2, 2, 10.0, 20.0, 1.0, 2.0, 5.0


def _ns(x_ms: float) -> int:
    return round(x_ms * MS)


def _at(t_ms: float) -> int:
    return T0 + _ns(t_ms)


def dp2_pp2_tables(*, slow: dict[int, float] | None = None, jitter_ms: float = 0.5, num_steps: int = 30,
                   seed: int = 0) -> dict[str, pd.DataFrame]:
    """dp2 x pp2 as the verdicts matrix lays it out: rank = stage * 2 + pipeline, pp groups [0,2] and [1,3], dp
    groups [0,1] (stage 0) and [2,3] (stage 1). GPipe, 2 micro-batches, F 10 ms and B 20 ms (+ up to
    ``jitter_ms`` each); ``slow`` (rank -> share) lengthens a rank's actions by that share. Each stage's gradient
    all-reduce is enqueued after its last backward; every rank starts the next step after the slowest ended."""
    rng = random.Random(seed)
    slow = slow or {}
    pipe, steps, coll = [], [], []
    seq: dict[tuple, int] = {}

    def row(rank: int, pg: str, members: str, op: str, enq: float, end: float, step: int, peer: int | None = None):
        key = (rank, pg, members, peer)
        seq[key] = seq.get(key, 0) + 1
        coll.append({"rank": rank, "pg": pg, "pg_ranks": members, "pg_size": 2, "seq": seq[key], "op": op,
                     "num_bytes": 1 << 20, "dtype": "float32", "enqueue_ns": _at(enq), "end_ns": _at(end),
                     "step": step, "timing": "host", **({"peer": peer} if peer is not None else {})})

    t = 0.0
    for step in range(num_steps):
        last_b, fwd, bwd = {}, {}, {}
        for d in range(DP):
            first, second = d, DP + d                          # stage 0 and stage 1 of pipeline d
            pp = f"{first},{second}"

            def cost(rank: int, base: float) -> float:
                return (base + rng.uniform(0, jitter_ms)) * (1 + slow.get(rank, 0.0))
            f0, f1 = [], []
            at = t + DATA_MS
            for mb in range(MICROBATCHES):
                f0.append((at, at + cost(first, F_MS)))
                at = f0[-1][1]
            ready = t + DATA_MS
            for mb in range(MICROBATCHES):
                arrive = f0[mb][1] + XFER_MS
                row(first, "pp", pp, "send", f0[mb][1], arrive, step, second)
                row(second, "pp", pp, "recv", ready, arrive, step, first)
                start = max(ready, arrive)
                f1.append((start, start + cost(second, F_MS)))
                ready = f1[-1][1]
            b1 = []
            for mb in range(MICROBATCHES):
                b1.append((ready, ready + cost(second, B_MS)))
                ready = b1[-1][1]
            b0, ready = [], f0[-1][1]
            for mb in range(MICROBATCHES):
                arrive = b1[mb][1] + XFER_MS
                row(second, "pp", pp, "send", b1[mb][1], arrive, step, first)
                row(first, "pp", pp, "recv", ready, arrive, step, second)
                start = max(ready, arrive)
                b0.append((start, start + cost(first, B_MS)))
                ready = b0[-1][1]
            for rank, stage, acts in ((first, 0, (("F", f0), ("B", b0))), (second, 1, (("F", f1), ("B", b1)))):
                for action, spans in acts:
                    for mb, (a, b) in enumerate(spans):
                        pipe.append({"rank": rank, "stage": stage, "step": step, "microbatch": mb, "action": action,
                                     "start_ns": _at(a), "end_ns": _at(b)})
                last_b[rank] = acts[1][1][-1][1]
                fwd[rank] = sum(b - a for a, b in acts[0][1])
                bwd[rank] = last_b[rank] - acts[0][1][-1][1]
        ends = {}
        for stage in range(2):
            group = [stage * DP + d for d in range(DP)]
            done = max(last_b[r] for r in group) + 2.0
            for r in group:
                row(r, "dp", ",".join(map(str, group)), "allreduce", last_b[r], done, step)
                ends[r] = done + OPT_MS
                steps.append({"rank": r, "step": step, "start_ns": _at(t), "end_ns": _at(ends[r]),
                              "data_ns": _ns(DATA_MS), "fwd_ns": _ns(fwd[r]), "bwd_ns": _ns(bwd[r] + done - last_b[r]),
                              "opt_ns": _ns(OPT_MS), "tokens": 256})
        t = max(ends.values()) + 1.0
    return {"pipeline": frame_from_rows("pipeline", pipe), "steps": frame_from_rows("steps", steps),
            "collectives": frame_from_rows("collectives", coll)}


def _findings(t: dict) -> list:
    """The facade's straggler path on the tables (warm-up step skipped), the schedule gain included."""
    coll, steps = t["collectives"], t["steps"]
    lateness = st.rank_lateness(coll, steps)
    lateness = lateness[lateness["step"] >= 1]
    scores = ss.straggler_scores(lateness)
    waits = st.collective_waits(coll, st.collective_skew(coll))
    causes = sc.straggler_causes(scores, lateness, steps, pd.DataFrame(),
                                 blocked=sc.blocked_outside_groups(coll, waits))
    groups = st.pipeline_groups(coll)
    own = st.pipeline_own_delay(t["pipeline"], steps, groups)
    own = own[own["step"] >= 1]
    shape = pipeline_shape(t["pipeline"])

    def gain(rank: int, first: int, last: int) -> float | None:
        return schedule_gain_ns(t["pipeline"], own, shape, groups, rank, first, last)
    return st.detect_stragglers(scores, causes, links=st.linked_ranks(coll), lateness=lateness,
                                own_delay_ns=median_own_delay(own),
                                stage_excess=stage_excess(t["pipeline"], steps, own, groups), schedule_gain=gain)


def _verdicts(findings: list) -> list:
    return [(f.ranks, f.evidence["cause"]) for f in findings if f.severity in ("warning", "critical")]


def _tp_pp_stage_rows(own_ms: dict[int, float], *, stage_of: dict[int, int], steps: int = 3) -> tuple:
    """One action per rank and step of ``own_ms[rank]`` ms at its stage, no own delay: pipeline, steps and
    own-delay frames."""
    pipeline, step_rows, own = [], [], []
    for step in range(steps):
        t = T0 + step * 1000 * MS
        for r, ms in own_ms.items():
            pipeline.append({"rank": r, "stage": stage_of[r], "step": step, "microbatch": 0, "action": "F",
                             "start_ns": t, "end_ns": t + int(ms * MS)})
            step_rows.append({"rank": r, "step": step, "start_ns": t, "end_ns": t + 1000 * MS})
            own.append({"rank": r, "step": step, "own_delay_ns": 0.0, "num_actions": 1})
    return frame_from_rows("pipeline", pipeline), frame_from_rows("steps", step_rows), pd.DataFrame(own)


@pytest.mark.parametrize("calls,clock,own_ms", [
    ([], "host", 20),                                                  # the whole gap is its own
    ([("allreduce", 12, 27)], "host", 5),                             # a dp all-reduce in it is not
    ([("allreduce", 12, 27), ("allreduce", 25, 35)], "host", 2),      # each instant once: 12-35 covers 18 of it
    ([("send", 12, 27)], "host", 20),                                  # a send is the pipeline's own traffic
    ([("allreduce", 12, 27)], "device", 20),                           # device-clocked actions: left as they are
])
def test_own_delay_leaves_out_the_time_in_the_rank_s_other_groups_collectives(calls, clock, own_ms):
    # a zero-bubble schedule all-reduces a stage's gradients on dp between its actions, waiting for the other
    # replicas there: that wait is theirs, not the rank's own delay
    pipeline = frame_from_rows("pipeline", [
        {"rank": 0, "stage": 0, "step": 0, "microbatch": mb, "action": "F", "start_ns": T0 + a * MS,
         "end_ns": T0 + b * MS, "clock": clock} for mb, (a, b) in enumerate([(0, 10), (30, 40)])])
    steps = frame_from_rows("steps", [{"rank": 0, "step": 0, "start_ns": T0, "end_ns": T0 + 50 * MS}])
    collectives = frame_from_rows("collectives", [
        {"rank": 0, "pg": "dp", "pg_ranks": "0,2", "pg_size": 2, "seq": i + 1, "op": op, "step": 0,
         "enqueue_ns": T0 + a * MS, "end_ns": T0 + b * MS, "timing": "host"} for i, (op, a, b) in enumerate(calls)])
    own = st.pipeline_own_delay(pipeline, steps, {0: (0, 1), 1: (0, 1)}, collectives=collectives)
    assert own["own_delay_ns"].tolist() == [own_ms * MS]

def test_a_stage_of_tensor_parallel_ranks_is_measured_against_the_other_replicas_only():
    # dp2 x tp2 x pp2: pipelines (pp groups) 0-4, 1-5, 2-6, 3-7; tp groups 0-1, 2-3, 4-5, 6-7. Replicas 0 (ranks 0, 1,
    # 4, 5) and 2. Each replica's second tp rank takes 10 ms longer on stage 0 (say it starts its action early and
    # waits for its peer inside it): against the other pipelines it is the slow one; the replicas' stages are alike.
    groups = {r: (r % 4, r % 4 + 4) for r in range(8)}
    rows = pd.DataFrame({"pg": ["tp"] * 4 + ["pp"] * 4, "pg_ranks": ["0,1", "2,3", "4,5", "6,7", "0,4", "1,5",
                                                                     "2,6", "3,7"]})
    replicas = pipeline_replicas(groups, rows)
    assert replicas == {0: 0, 1: 0, 4: 0, 5: 0, 2: 2, 3: 2, 6: 2, 7: 2}
    own = {0: 100, 1: 110, 2: 100, 3: 110, 4: 100, 5: 100, 6: 100, 7: 100}
    pipeline, steps, delay = _tp_pp_stage_rows(own, stage_of={r: r // 4 for r in range(8)})
    by_pipeline = stage_excess(pipeline, steps, delay, groups).groupby("rank")["own_excess_frac"].mean()
    assert by_pipeline[1] == pytest.approx(0.01)          # 10 ms over the median of 100, 100, 110: 1% of the step
    ex = stage_excess(pipeline, steps, delay, groups, replicas=replicas).groupby("rank")["own_excess_frac"].mean()
    # each against the other replica's stage 0 (its two tp ranks' mean, 105 ms): a unit's excesses cancel out
    assert ex[[0, 1, 2, 3]].tolist() == pytest.approx([-0.005, 0.005, -0.005, 0.005])
    assert ex[[4, 5, 6, 7]].tolist() == [0.0] * 4
    own[2] = own[3] = 130                                 # replica 2's stage 0 slower: both its tp ranks
    pipeline, steps, delay = _tp_pp_stage_rows(own, stage_of={r: r // 4 for r in range(8)})
    ex = stage_excess(pipeline, steps, delay, groups, replicas=replicas).groupby("rank")["own_excess_frac"].mean()
    assert ex[[0, 1, 2, 3]].tolist() == pytest.approx([-0.03, -0.02, 0.025, 0.025])
    # tp2 x pp2: one replica, no other to measure a stage against
    groups = {0: (0, 2), 2: (0, 2), 1: (1, 3), 3: (1, 3)}
    replicas = pipeline_replicas(groups, pd.DataFrame({"pg": ["tp", "tp"], "pg_ranks": ["0,1", "2,3"]}))
    assert set(replicas.values()) == {0}
    pipeline, steps, delay = _tp_pp_stage_rows({0: 100, 1: 110, 2: 100, 3: 100}, stage_of={0: 0, 1: 0, 2: 1, 3: 1})
    assert stage_excess(pipeline, steps, delay, groups, replicas=replicas)["own_excess_frac"].isna().all()

def test_stage_excess_is_a_ranks_own_time_over_the_same_stage_of_the_other_pipeline():
    t = dp2_pp2_tables(slow={0: 0.3}, jitter_ms=0.0, num_steps=4)
    groups = st.pipeline_groups(t["collectives"])
    assert groups == {0: (0, 2), 2: (0, 2), 1: (1, 3), 3: (1, 3)}
    ex = stage_excess(t["pipeline"], t["steps"], st.pipeline_own_delay(t["pipeline"], t["steps"], groups), groups)
    mean = ex.groupby("rank")["own_excess_frac"].mean()
    step_ms = (t["steps"]["end_ns"] - t["steps"]["start_ns"]).median() / MS
    # rank 0's four actions (2 F, 2 B) each run 30% longer; its stage-1 peer only waits for it (its one extra
    # transfer that does not overlap a forward counts as its own)
    assert mean[0] == pytest.approx(0.3 * (2 * F_MS + 2 * B_MS) / step_ms, rel=1e-6)
    assert mean[1] == pytest.approx(-mean[0])
    assert mean[2] == pytest.approx(XFER_MS / step_ms, rel=1e-6) and mean[3] == pytest.approx(-mean[2])
    # as a share of the other pipeline's own time on the stage (its actions and the transfer it waits on alone),
    # whatever the step's length
    rel, own = ex.groupby("rank")["own_excess_rel"].mean(), ex.groupby("rank")["own_ns"].mean()
    assert rel[0] == pytest.approx(0.3 * (2 * F_MS + 2 * B_MS) * MS / own[1], rel=1e-6)
    assert rel[1] == pytest.approx(own[1] / own[0] - 1, rel=1e-6) and 0.28 < rel[0] < 0.3
    assert ex.set_index("rank")["pipeline"].groupby(level=0).first().to_dict() == {0: 0, 1: 1, 2: 0, 3: 1}


@pytest.mark.parametrize("seed", [0, 1])
def test_stragglers_names_a_slow_stage0_rank_with_cause_compute_not_its_pipeline_victim(seed):
    f = _findings(dp2_pp2_tables(slow={0: 0.35}, seed=seed))
    assert _verdicts(f) == [((0,), "compute")]
    ev = f[0].evidence
    assert ev["propagated_to"] == [2] and ev["pg_ranks"] == [0, 1]
    assert "rank 2" in f[0].title
    assert all(x.ranks != (2,) for x in f)
    # GPipe puts all of stage 0's extra fill and drain on the step: the schedule gives back what its peer waits
    assert f[0].predicted_gain.frac == pytest.approx(min(ev["victims_wait_frac"], ev["schedule_gain_frac"]))
    assert ev["schedule_gain_frac"] == pytest.approx(ev["victims_wait_frac"], abs=0.02)


def _gain_ms(t: dict, rank: int, first: int = 1, last: int = 5) -> float | None:
    groups = st.pipeline_groups(t["collectives"])
    own = st.pipeline_own_delay(t["pipeline"], t["steps"], groups)
    ns = schedule_gain_ns(t["pipeline"], own, pipeline_shape(t["pipeline"]), groups, rank, first, last)
    return None if ns is None else ns / MS


def test_schedule_gain_is_the_longest_pipelines_simulated_makespan_now_minus_with_the_rank_as_its_stage_mates():
    # GPipe, 2 micro-batches; rank 0 (stage 0 of pipeline 0) runs F in 13 ms and B in 26 ms, stage 1 F 10, B 20:
    # F0 0-13, 13-26; F1 13-23, 26-36; B1 36-56, 56-76; B0 56-82, 82-108: 108 ms, against 90 ms at 10 and 20
    assert _gain_ms(dp2_pp2_tables(slow={0: 0.3}, jitter_ms=0.0, num_steps=6), 0) == pytest.approx(18.0)
    # its stage-mate and a rank of the other pipeline cost nothing; rank 2 only its one transfer that does not
    # overlap a forward, which its own delay counts (test above)
    t = dp2_pp2_tables(slow={0: 0.3}, jitter_ms=0.0, num_steps=6)
    assert [_gain_ms(t, r) for r in (1, 2, 3)] == [pytest.approx(0.0), pytest.approx(XFER_MS), pytest.approx(0.0)]
    # the other pipeline takes longer (both its ranks 30% slower): making rank 0 as fast as rank 1 leaves the step
    # as long as pipeline 1's
    slower = dp2_pp2_tables(slow={0: 0.1, 1: 0.3, 3: 0.3}, jitter_ms=0.0, num_steps=6)
    assert _gain_ms(slower, 0) == pytest.approx(0.0)
    assert _gain_ms(slower, 3) > 0
    # no other pipeline runs its stage, or no pipeline rows in the steps asked: unknown
    assert _gain_ms(t, 0, 50, 60) is None
    # a shape the simulator refuses (the config's 1f1b with two stages per rank measured): unknown, not an error
    groups = st.pipeline_groups(t["collectives"])
    own = st.pipeline_own_delay(t["pipeline"], t["steps"], groups)
    refused = replace(pipeline_shape(t["pipeline"]), schedule="1f1b", virtual_stages=2)
    assert schedule_gain_ns(t["pipeline"], own, refused, groups, 0, 1, 5) is None
    # interleaved 1F1B with 3 micro-batches on 2 ranks: simulated with 4, a whole round, each 3/4 as costly (the
    # same global batch), as the ideal bubble is; 4 measured micro-batches are simulated as they are
    three, four = (replace(pipeline_shape(t["pipeline"]), schedule="interleaved-1f1b", num_microbatches=m)
                   for m in (3, 4))
    gain = schedule_gain_ns(t["pipeline"], own, three, groups, 0, 1, 5)
    assert gain is not None and gain > 0
    assert gain == pytest.approx(0.75 * schedule_gain_ns(t["pipeline"], own, four, groups, 0, 1, 5))


def test_a_straggler_whose_wait_the_schedule_does_not_put_on_the_step_has_that_smaller_gain():
    wobble = [0.01 * (-1) ** i for i in range(20)]
    stage = _stage({0: [0.12 + w for w in wobble], 1: [-0.12 - w for w in wobble], 2: [w for w in wobble],
                    3: [-w for w in wobble]})
    asked = []

    def gain(rank: int, first: int, last: int) -> float | None:
        asked.append((rank, first, last))
        return {0: 0.03e9}.get(rank)        # 3% of the 1 s step, where its peers wait 15%

    scores = pd.DataFrame([_score(0, "0,1", late=0.15), _score(1, "0,1", late=-0.15), _score(2, "2,3", late=0.0),
                           _score(3, "2,3", late=0.0)])[ss.SCORE_COLUMNS]
    f = st.detect_stragglers(scores, pd.DataFrame(columns=sc.CAUSE_COLUMNS), stage_excess=stage,
                             schedule_gain=gain)
    assert [(x.ranks, x.severity) for x in f] == [((0,), "warning")]
    assert f[0].predicted_gain.frac == pytest.approx(0.03)
    assert f[0].evidence["schedule_gain_frac"] == pytest.approx(0.03)
    assert f[0].evidence["victims_wait_frac"] == pytest.approx(0.15)
    assert "the step would be only 3% shorter without it" in f[0].title
    assert asked == [(0, 1, 20)]
    # a gain that rounds to 0%: info; a larger schedule gain than the wait: the wait
    none = st.detect_stragglers(scores, pd.DataFrame(columns=sc.CAUSE_COLUMNS), stage_excess=stage,
                                schedule_gain=lambda r, a, b: 0.002e9)
    assert [(x.ranks, x.predicted_gain.frac) for x in none] == [((0,), pytest.approx(0.002))]
    assert [x.severity for x in info_without_gain(none)] == ["info"]
    more = st.detect_stragglers(scores, pd.DataFrame(columns=sc.CAUSE_COLUMNS), stage_excess=stage,
                                schedule_gain=lambda r, a, b: 0.5e9)
    assert more[0].predicted_gain.frac == pytest.approx(0.15) and "shorter without it" not in more[0].title


def test_the_schedule_caps_the_victims_wait_over_the_steps_that_wait_was_measured_on():
    # the stage view confirms rank 0 over steps 1-20 (its slowdown began at step 11); its peers' wait is measured
    # over 21-40, where it is slow throughout: the schedule is asked about those steps, not the stage view's
    late = [0.0] * 10 + [0.12 + 0.01 * (-1) ** i for i in range(30)]
    stage = _stage({0: late, 1: [-x for x in late], 2: [0.003 * (-1) ** i for i in range(40)],
                    3: [-0.003 * (-1) ** i for i in range(40)]})
    asked = []

    def gain(rank: int, first: int, last: int) -> float | None:
        asked.append((rank, first, last))
        return 0.03e9 if first > 10 else 0.001e9   # the steps before the slowdown dilute what the schedule loses

    scores = pd.DataFrame([_score(0, "0,1", late=0.15, first=21, last=40), _score(1, "0,1", late=-0.15),
                           _score(2, "2,3", late=0.0), _score(3, "2,3", late=0.0)])[ss.SCORE_COLUMNS]
    f = st.detect_stragglers(scores, pd.DataFrame(columns=sc.CAUSE_COLUMNS), stage_excess=stage, schedule_gain=gain)
    assert [(x.ranks, x.severity) for x in f] == [((0,), "warning")]
    assert f[0].evidence["stage_window"][0] < 11 and f[0].evidence["window"] == [21, 40]
    assert asked == [(0, 21, 40)] and f[0].predicted_gain.frac == pytest.approx(0.03)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_stragglers_gives_no_verdict_when_a_pipelines_ranks_are_slowed_alike(seed):
    # a slower core under both ranks of pipeline 0: each is late at its dp group, neither stands out of the other
    f = _findings(dp2_pp2_tables(slow={0: 0.12, 2: 0.12}, seed=seed))
    assert _verdicts(f) == []
    assert [x.evidence["pipeline_origin"] for x in f] == ["unconfirmed"]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_stragglers_finds_nothing_in_a_clean_dp2_pp2_run_with_pipeline_rows(seed):
    assert _verdicts(_findings(dp2_pp2_tables(jitter_ms=2.0, seed=seed))) == []


def _score(rank: int, pg_ranks: str, *, late: float, first: int = 1, last: int = 20) -> dict:
    return {"pg": "dp", "pg_ranks": pg_ranks, "rank": rank, "num_steps": 20, "window_steps": last - first + 1,
            "window_first_step": first, "window_last_step": last, "median_lateness_frac": late,
            "positive_frac": 0.9 if late > 0 else 0.1, "median_pre_excess_frac": 0.0, "pre_positive_frac": 0.5,
            "last_frac": 0.9 if late > 0 else 0.1, "mean_lateness_ns": late * 1e9, "mean_victims_wait_ns": late * 1e9,
            "mean_step_ns": 1e9, "detected_at_step": 20 if late >= 0.05 else None,
            "detected_by": "arrival" if late >= 0.05 else None, "gain_first_step": first, "gain_last_step": last,
            "gain_victims_wait_ns": late * 1e9, "gain_step_ns": 1e9}


def test_a_rank_flagged_in_two_groups_was_detected_when_the_first_of_them_flagged_it():
    # dp2 x tp2, rank 1 under a CPU quota: its tp group shows it later but by more (the row the finding reads),
    # its dp group flagged it 19 steps earlier; the verdict was available then
    tp = {**_score(1, "0,1", late=0.13, first=20, last=39), "pg": "tp", "detected_at_step": 39}
    tp_peer = {**_score(0, "0,1", late=-0.13, first=20, last=39), "pg": "tp"}
    dp = {**_score(1, "1,3", late=0.06, first=1, last=20), "detected_at_step": 20}
    dp_peer = _score(3, "1,3", late=-0.06)
    scores = pd.DataFrame([tp, tp_peer, dp, dp_peer])[ss.SCORE_COLUMNS]
    [f] = st.detect_stragglers(scores, pd.DataFrame(columns=sc.CAUSE_COLUMNS))
    assert (f.ranks, f.evidence["pg"], f.evidence["window"]) == ((1,), "tp", [20, 39])
    assert f.evidence["detected_at_step"] == 20


def test_a_pipeline_rank_confirmed_by_its_stage_before_any_arrival_view_was_detected_then():
    # rank 0 (dp2 x pp2) is named from its dp group's arrival row, flagged at step 30; its own stage time was
    # confirmed slower over steps 1-20 already, when the stage view alone would have named it
    wobble = [0.003 * (-1) ** i for i in range(30)]
    stage = _stage({0: [0.05 + w for w in wobble], 1: [-0.05 - w for w in wobble], 2: wobble,
                    3: [-w for w in wobble]})
    scores = pd.DataFrame([{**_score(0, "0,1", late=0.06, first=11, last=30), "detected_at_step": 30},
                           _score(1, "0,1", late=-0.06, first=11, last=30), _score(2, "2,3", late=0.0),
                           _score(3, "2,3", late=0.0)])[ss.SCORE_COLUMNS]
    [f] = [x for x in st.detect_stragglers(scores, pd.DataFrame(columns=sc.CAUSE_COLUMNS), stage_excess=stage)
           if x.severity != "info"]
    assert (f.ranks, f.evidence["window"], f.evidence["stage_window"]) == ((0,), [11, 30], [1, 20])
    assert f.evidence["detected_at_step"] == 20


def _stage(excess: dict[int, list[float]], stage_share: float = 0.5) -> pd.DataFrame:
    """stage_excess rows of dp2 x pp2 (pipelines {0, 2} and {1, 3}), steps 1.., the given excess per rank (share of
    the step), each stage's own time ``stage_share`` of the step."""
    return pd.DataFrame([{"rank": r, "step": i + 1, "pipeline": r % 2, "stage": r // 2, "own_ns": 1e8,
                          "own_excess_frac": x, "own_excess_rel": x / stage_share}
                         for r, xs in excess.items() for i, x in enumerate(xs)])


def _victim_only(stage: pd.DataFrame) -> list:
    """Rank 2 late at dp [2,3] by its waits (cause communication); rank 0 on time at dp [0,1]."""
    scores = pd.DataFrame([_score(0, "0,1", late=0.0), _score(1, "0,1", late=0.0), _score(2, "2,3", late=0.15),
                           _score(3, "2,3", late=-0.15)])[ss.SCORE_COLUMNS]
    causes = pd.DataFrame([{"pg": "dp", "pg_ranks": "2,3", "rank": 2, "data_excess_ns": 0.0, "compute_excess_ns": 0.0,
                            "comm_excess_ns": 1.5e8, "throttled_frac": float("nan"), "cause": "communication"}])
    links = st.LinkedRanks({0: frozenset({"0,1"}), 1: frozenset({"0,1"}), 2: frozenset({"2,3"}),
                            3: frozenset({"2,3"})}, frozenset({frozenset((0, 2)), frozenset((1, 3))}))
    return st.detect_stragglers(scores, causes[sc.CAUSE_COLUMNS], links=links, stage_excess=stage)


def test_stragglers_follows_a_waiting_victim_upstream_to_the_rank_confirmed_slower_on_its_stage():
    wobble = [0.01 * (-1) ** i for i in range(20)]
    stage = _stage({0: [0.12 + w for w in wobble], 1: [-0.12 - w for w in wobble], 2: [w for w in wobble],
                    3: [-w for w in wobble]})
    f = _victim_only(stage)
    assert [(x.code, x.severity, x.ranks, x.group, x.evidence["cause"]) for x in f] == [
        ("STRAGGLER", "warning", (0,), "dp", "compute")]
    ev = f[0].evidence
    # its own stage time is confirmed in the first window: the stage view names it, its victim told in the title
    assert ev["propagated_to"] == [2] and ev["pg_ranks"] == [0, 1] and ev["detected_by"] == "stage"
    assert ev["pipeline_origin"] == "confirmed" and ev["stage_excess_frac"] == pytest.approx(0.12)
    assert ev["stage_excess_rel"] == pytest.approx(0.24)
    assert f[0].title.startswith("rank 0's own time on its pipeline stage is 24% longer (12% of the step)")
    assert "rank 2 arrives late" in f[0].title


@pytest.mark.parametrize("slower,named", [(0.10, True), (0.04, False)])
def test_the_stage_view_judges_a_rank_s_excess_against_its_stage_s_time_not_the_step_s(slower, named):
    # a stage is half the step: a rank 10% slower on it is 5% of the step later, under the 6% a rank that is its
    # whole step must reach, and is named; 4% slower is not
    wobble = [0.003 * (-1) ** i for i in range(20)]
    frac = slower * 0.5
    stage = _stage({0: [frac + w for w in wobble], 1: [-frac - w for w in wobble], 2: [w for w in wobble],
                    3: [-w for w in wobble]})
    f = [x for x in _victim_only(stage) if x.severity != "info"]
    assert [(x.ranks, x.evidence["detected_by"]) for x in f] == ([((0,), "stage")] if named else [])
    if named:
        assert f[0].evidence["stage_excess_rel"] == pytest.approx(0.10)
        assert f[0].evidence["stage_excess_frac"] == pytest.approx(0.05)


@pytest.mark.parametrize("t,named", [(5.0, True), (3.5, False)])
def test_the_stage_view_names_a_rank_whose_excess_stands_four_standard_errors_above_zero(t, named):
    # rank 0 10% slower on its stage (5% of the step) every step, its steps swinging by +-amp: its mean stands
    # t = 0.05 x sqrt(19) / amp standard errors above zero. 5 (under the steady view's 6) is named, 3.5 is not.
    amp = 0.05 * math.sqrt(19) / t
    swing = [amp * (-1) ** i for i in range(20)]
    stage = _stage({0: [0.05 + w for w in swing], 1: [-0.05 - w for w in swing], 2: [0.003 * w / amp for w in swing],
                    3: [-0.003 * w / amp for w in swing]})
    f = [x for x in _victim_only(stage) if x.severity != "info"]
    assert [(x.ranks, x.evidence["detected_by"]) for x in f] == ([((0,), "stage")] if named else [])
    if named:
        assert ss.MIN_STAGE_T < 5.0 < ss.MIN_STEADY_T
        assert f[0].evidence["stage_excess_t"] == pytest.approx(5.0)
        assert f[0].evidence["stage_excess_rel"] == pytest.approx(0.10)


def _dp_lateness(pipeline0_late: float, steps: int = 20) -> pd.DataFrame:
    """rank_lateness rows of the dp groups [0, 1] and [2, 3]: pipeline 0's ranks (0, 2) that much of the step later
    than their dp peer every step (+-1%), pipeline 1's as much earlier."""
    rows = []
    for i in range(steps):
        x = pipeline0_late + 0.01 * (-1) ** (i // 2)
        for pg_ranks, ours, theirs in (("0,1", 0, 1), ("2,3", 2, 3)):
            for rank, frac in ((ours, x), (theirs, -x)):
                rows.append({"pg": "dp", "pg_ranks": pg_ranks, "step": i + 1, "rank": rank, "lateness_ns": frac * 1e9,
                             "victims_wait_ns": max(frac, 0.0) * 1e9, "is_last": frac > 0, "step_ns": 1e9,
                             "lateness_frac": frac, "pre_excess_frac": 0.0, "comm_excess_frac": float("nan")})
    return pd.DataFrame(rows)


@pytest.mark.parametrize("pipeline_late,named", [(0.03, True), (0.0, False)])
def test_a_rank_of_a_pipeline_late_at_its_dp_groups_is_named_at_a_lower_stage_t(pipeline_late, named):
    # rank 0's own time on its stage stands 3 standard errors above its stage-mate's: under MIN_STAGE_T, so named
    # only when its pipeline arrives late at its dp groups (it holds them back), not when the pipelines arrive
    # together. The scores are the same in both cases; only the per-step lateness the pipeline view reads differs.
    amp = 0.05 * math.sqrt(19) / 3.0
    swing = [amp * (-1) ** i for i in range(20)]
    stage = _stage({0: [0.05 + w for w in swing], 1: [-0.05 - w for w in swing], 2: [0.003 * w / amp for w in swing],
                    3: [-0.003 * w / amp for w in swing]})
    scores = pd.DataFrame([_score(0, "0,1", late=0.03), _score(1, "0,1", late=-0.03), _score(2, "2,3", late=0.03),
                           _score(3, "2,3", late=-0.03)])[ss.SCORE_COLUMNS]
    f = [x for x in st.detect_stragglers(scores, pd.DataFrame(columns=sc.CAUSE_COLUMNS), stage_excess=stage,
                                         lateness=_dp_lateness(pipeline_late)) if x.severity != "info"]
    assert [(x.ranks, x.evidence["detected_by"]) for x in f] == ([((0,), "stage")] if named else [])
    if named:
        ev = f[0].evidence
        assert ss.MIN_STAGE_T_IN_LATE_PIPELINE < 3.0 < ss.MIN_STAGE_T
        assert ev["stage_excess_t"] == pytest.approx(3.0) and ev["pipeline_late_t"] >= ss.MIN_LATE_PIPELINE_T
        assert ev["pipeline_origin"] == "confirmed" and ev["cause"] == "compute"


def test_stragglers_keeps_a_waiting_victim_at_info_when_no_upstream_rank_stands_out_of_the_noise():
    # rank 0's own time is 6% longer, but rank 3's swings by half as much again: rank 0 stands 2.9 standard errors
    # of the run's noise above zero, not confirmed
    noisy = [0.09 * (-1) ** i for i in range(20)]
    stage = _stage({0: [0.06 + 0.02 * (-1) ** i for i in range(20)], 1: [-0.06] * 20, 2: noisy,
                    3: [-x for x in noisy]})
    f = _victim_only(stage)
    assert [(x.severity, x.ranks, x.evidence["cause"]) for x in f] == [("info", (2,), "communication")]


def _coupled(t: dict) -> dict:
    """The tables with every dp all-reduce enqueued by both members at once (the later one's time): the two
    pipelines in lockstep, as the dp all-reduces of a real run make them, so no arrival shows a rank late."""
    coll = t["collectives"].copy()
    dp = coll["pg"] == "dp"
    coll.loc[dp, "enqueue_ns"] = coll[dp].groupby(["pg_ranks", "step"])["enqueue_ns"].transform("max")
    return {**t, "collectives": coll}


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("slow_rank", [0, 2])
def test_a_slow_pipeline_rank_no_arrival_shows_late_is_found_by_its_own_time_on_its_stage(slow_rank, seed):
    findings = [f for f in _findings(_coupled(dp2_pp2_tables(slow={slow_rank: 0.1}, jitter_ms=2.0, seed=seed)))
                if f.code == "STRAGGLER"]
    assert [(f.severity, f.ranks, f.group) for f in findings] == [("warning", (slow_rank,), "dp")]
    ev = findings[0].evidence
    assert (ev["detected_by"], ev["cause"], ev["pipeline_origin"]) == ("stage", "compute", "confirmed")
    # the first window (of 20 steps, after the warm-up) over which its excess is confirmed: at or soon after 1-20
    assert 20 <= ev["detected_at_step"] <= 22 and ev["stage_window"] == [ev["detected_at_step"] - 19,
                                                                          ev["detected_at_step"]]
    assert ev["stage_excess_rel"] >= 0.06 and ev["stage_excess_t"] >= ss.MIN_STAGE_T
    assert "own time on its pipeline stage" in findings[0].title


@pytest.mark.parametrize("slow", [{}, {0: 0.15, 2: 0.15}])
def test_the_stage_view_names_no_one_on_a_balanced_pipeline_or_one_slowed_as_a_whole(slow):
    # a whole pipeline slowed alike (its ranks sharing a slow core) has no rank of its own to blame
    findings = _findings(_coupled(dp2_pp2_tables(slow=slow, jitter_ms=2.0)))
    assert [f for f in findings if f.code == "STRAGGLER" and f.severity != "info"] == []
