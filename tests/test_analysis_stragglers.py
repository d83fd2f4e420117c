"""Straggler metrics and detector on hand-made tables with known answers (analysis_synth)."""

from __future__ import annotations

import pandas as pd
import pytest
from analysis_synth import MS, T0, dp_pp_tables, dp_tables

from dtprobe.analysis import straggler_causes as sc
from dtprobe.analysis import straggler_scores as ss
from dtprobe.analysis import stragglers as st
from dtprobe.store.errors import TraceError
from dtprobe.store.frames import frame_from_rows


def _findings(t: dict, detect: dict | None = None, **kw) -> list:
    skew = st.collective_skew(t["collectives"])
    lateness = st.rank_lateness(t["collectives"], t["steps"])
    lateness = lateness[lateness["step"] >= 1]          # warm-up step skipped, as the facade does
    scores = ss.straggler_scores(lateness, **kw)
    waits = st.collective_waits(t["collectives"], skew)
    causes = sc.straggler_causes(scores, lateness, t["steps"], t.get("devices", pd.DataFrame()),
                                 blocked=sc.blocked_outside_groups(t["collectives"], waits))
    return st.detect_stragglers(scores, causes, links=st.linked_ranks(t["collectives"]), lateness=lateness,
                                **(detect or {}))


def _coll(rows):
    return frame_from_rows("collectives", [
        {"pg": "dp", "pg_ranks": "0,1,2", "pg_size": 3, "op": "allreduce", "num_bytes": 1024, "step": 1,
         "end_ns": T0 + 100 * MS, **r} for r in rows])


def test_collective_skew_names_last_arriver_with_skew_margin_and_victims_wait():
    coll = _coll([{"rank": 0, "seq": 1, "enqueue_ns": T0}, {"rank": 1, "seq": 1, "enqueue_ns": T0 + 10 * MS},
                  {"rank": 2, "seq": 1, "enqueue_ns": T0 + 40 * MS}])
    skew = st.collective_skew(coll)
    row = skew.iloc[0]
    assert (row["late_rank"], row["skew_ns"], row["margin_ns"]) == (2, 40 * MS, 30 * MS)
    assert row["victims_wait_ns"] == pytest.approx(35 * MS)     # (40 + 30) / 2
    assert bool(row["complete"]) and row["num_members"] == 3


def test_rank_lateness_is_arrival_minus_median_of_peers():
    coll = _coll([{"rank": 0, "seq": 1, "enqueue_ns": T0}, {"rank": 1, "seq": 1, "enqueue_ns": T0 + 10 * MS},
                  {"rank": 2, "seq": 1, "enqueue_ns": T0 + 40 * MS}])
    steps = frame_from_rows("steps", [{"rank": r, "step": 1, "start_ns": T0 - 60 * MS, "end_ns": T0 + 140 * MS}
                                      for r in range(3)])
    late = st.rank_lateness(coll, steps).set_index("rank")
    assert late.loc[2, "lateness_ns"] == 35 * MS          # 40 - median(0, 10)
    assert late.loc[0, "lateness_ns"] == -25 * MS         # 0 - median(10, 40)
    assert late.loc[1, "lateness_ns"] == -10 * MS         # 10 - median(0, 40)
    assert late.loc[2, "lateness_frac"] == pytest.approx(35 / 200)
    assert bool(late.loc[2, "is_last"]) and not bool(late.loc[0, "is_last"])
    assert late.loc[2, "victims_wait_ns"] == pytest.approx(35 * MS)


def test_rank_lateness_compares_each_ranks_time_in_the_groups_collectives_with_its_peers():
    # one step of 200 ms, two collectives ending at 100 and 120 ms; rank 2 arrives last at the first one: the
    # others wait for it there, and it spends the least time in the group's collectives
    coll = _coll([{"rank": 0, "seq": 1, "enqueue_ns": T0}, {"rank": 1, "seq": 1, "enqueue_ns": T0 + 10 * MS},
                  {"rank": 2, "seq": 1, "enqueue_ns": T0 + 40 * MS},
                  {"rank": 0, "seq": 2, "enqueue_ns": T0 + 110 * MS, "end_ns": T0 + 120 * MS},
                  {"rank": 1, "seq": 2, "enqueue_ns": T0 + 90 * MS, "end_ns": T0 + 120 * MS},
                  {"rank": 2, "seq": 2, "enqueue_ns": T0 + 115 * MS, "end_ns": T0 + 120 * MS}])
    steps = frame_from_rows("steps", [{"rank": r, "step": 1, "start_ns": T0 - 60 * MS, "end_ns": T0 + 140 * MS}
                                      for r in range(3)])
    late = st.rank_lateness(coll, steps).set_index("rank")
    # in them: rank 0 100 + 10 = 110 ms, rank 1 90 + 30 = 120 ms, rank 2 60 + 5 = 65 ms; each minus the median
    # of the other two
    assert late["comm_excess_frac"].to_dict() == pytest.approx({0: 17.5 / 200, 1: 32.5 / 200, 2: -50 / 200})
    # a member still in a collective: its group's step is not compared
    coll.loc[(coll["rank"] == 1) & (coll["seq"] == 2), "end_ns"] = None
    assert st.rank_lateness(coll, steps)["comm_excess_frac"].isna().all()


def test_rank_lateness_skips_collectives_some_member_never_reached():
    coll = _coll([{"rank": 0, "seq": 1, "enqueue_ns": T0}, {"rank": 1, "seq": 1, "enqueue_ns": T0 + 10 * MS}])
    assert st.rank_lateness(coll, frame_from_rows("steps", [])).empty


@pytest.mark.parametrize("culprit", [0, 1, 2, 3])
def test_stragglers_names_only_the_culprit_in_dp4_at_ten_percent_delay(culprit):
    findings = _findings(dp_tables(straggler=culprit, delay_ms=11.0, num_steps=21, jitter_ms=3.0, seed=culprit))
    assert [(f.code, f.ranks, f.group) for f in findings] == [("STRAGGLER", (culprit,), "dp")]
    ev = findings[0].evidence
    assert ev["victims"] == [r for r in range(4) if r != culprit]
    assert ev["detected_at_step"] <= 20
    assert ev["cause"] == "compute"
    assert findings[0].predicted_gain.metric == "step_time"
    assert 0.07 < findings[0].predicted_gain.frac < 0.15
    # the title says the mean in ms and the median share apart (they differ when the lateness comes in bursts)
    assert (f"+{ev['mean_lateness_ms']} ms on average (median {ev['median_lateness_frac']:.0%} of the step), later "
            f"than its peers in {ev['positive_frac']:.0%} of steps {ev['window'][0]}-{ev['window'][1]}"
            in findings[0].title), findings[0].title


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_stragglers_finds_nothing_in_a_clean_dp4_run(seed):
    assert _findings(dp_tables(num_steps=40, jitter_ms=5.0, seed=seed)) == []


def test_stragglers_ignores_a_delay_that_starts_after_the_window():
    t = dp_tables(straggler=1, delay_ms=20, num_steps=30, from_step=28)
    assert _findings(t) == []


def test_stragglers_detects_a_delay_that_starts_mid_run_in_a_later_window():
    f = _findings(dp_tables(straggler=1, delay_ms=20, num_steps=60, from_step=30))
    assert [x.ranks for x in f] == [(1,)]
    first, last = f[0].evidence["window"]
    # named once the delay shows, within one window of its start, from a window that holds delayed steps
    assert 30 <= f[0].evidence["detected_at_step"] == last < 30 + 20
    assert first < 30 <= last


@pytest.mark.parametrize("phase,throttle,cause", [
    ("data", False, "data"), ("fwd", False, "compute"), ("bwd", False, "compute"), ("fwd", True, "device")])
def test_straggler_cause_comes_from_phases_and_device_samples(phase, throttle, cause):
    f = _findings(dp_tables(straggler=3, delay_ms=15, phase=phase, throttle=throttle, num_steps=21))
    assert [x.ranks for x in f] == [(3,)]
    assert f[0].evidence["cause"] == cause


def _busy(extra: float, steps: range, *, straggler: int = 3, peers: tuple = (0, 1, 2), base: float = 0.5,
          ranks_with: tuple | None = None) -> pd.DataFrame:
    """``cpu_busy_per_step`` rows: every rank uses ``base`` cores' worth per step, the straggler ``extra`` more."""
    ranks = ranks_with if ranks_with is not None else (*peers, straggler)
    return pd.DataFrame([{"rank": r, "step": s, "cpu_busy_frac": base + (extra if r == straggler else 0.0)}
                         for r in ranks for s in steps])


@pytest.mark.parametrize("extra,host_compute,off_cpu", [
    (0.0, True, True),          # late with no more CPU than its peers: asleep, blocked
    (0.01, True, True),
    (None, True, None),         # the lateness share itself (filled in below): computing longer
    (0.0, False, None),         # a GPU run: its host thread may sleep while its device is slow
])
def test_a_compute_straggler_that_used_no_more_cpu_than_its_peers_was_off_the_cpu(extra, host_compute, off_cpu):
    t = dp_tables(straggler=3, delay_ms=15, phase="fwd", num_steps=21)
    [plain] = _findings(t)
    late = plain.evidence["mean_lateness_ms"] / plain.evidence["step_time_ms"]
    if extra is None:
        extra, off_cpu = late, (False if host_compute else None)
    [f] = _findings(t, detect={"cpu_busy": _busy(extra, range(1, 21)), "host_compute": host_compute})
    ev = f.evidence
    assert (f.ranks, ev["cause"], ev["off_cpu"]) == ((3,), "compute", off_cpu)
    assert ev["cpu_busy_frac"] == pytest.approx(0.5 + extra) and ev["peer_cpu_busy_frac"] == pytest.approx(0.5)
    assert ("off the CPU" in f.title) == bool(off_cpu)
    assert ("off the CPU" in f.recommendation) == bool(off_cpu)
    if not off_cpu:
        assert (f.title, f.recommendation) == (plain.title, plain.recommendation)


def test_the_off_cpu_rule_needs_the_cpu_of_the_rank_and_a_peer_over_half_the_window():
    t = dp_tables(straggler=3, delay_ms=15, phase="fwd", num_steps=21)
    for busy in (_busy(0.0, range(15, 21)),                   # 6 of the window's 20 steps
                 _busy(0.0, range(1, 21), ranks_with=(3,)),  # no peer
                 None):
        [f] = _findings(t, detect={"cpu_busy": busy, "host_compute": True})
        assert (f.evidence["cpu_busy_frac"], f.evidence["off_cpu"]) == (None, None)
        assert "off the CPU" not in f.recommendation
    # a cause other than compute is never called off the CPU
    [f] = _findings(dp_tables(straggler=3, delay_ms=15, phase="data", num_steps=21),
                    detect={"cpu_busy": _busy(0.0, range(1, 21)), "host_compute": True})
    assert (f.evidence["cause"], f.evidence["off_cpu"]) == ("data", None)


@pytest.mark.parametrize("culprit,victim", [(2, 3), (3, 2), (0, 1), (1, 0)])
def test_stragglers_in_dp2_pp2_names_the_culprit_and_its_group_not_the_pipeline_victim(culprit, victim):
    f = _findings(dp_pp_tables(straggler=culprit, delay_ms=20, num_steps=21))
    assert [(x.code, x.ranks, x.group) for x in f] == [("STRAGGLER", (culprit,), "dp")]
    assert f[0].evidence["propagated_to"] == [victim]
    dp_peer = culprit ^ 2                                    # rank = dp_index * 2 + stage
    assert f[0].evidence["pg_ranks"] == sorted([culprit, dp_peer])


def test_stragglers_finds_nothing_in_a_clean_dp2_pp2_run():
    assert _findings(dp_pp_tables(num_steps=30, jitter_ms=3.0)) == []


def test_straggler_severity_is_critical_when_victims_wait_a_fifth_of_the_step():
    f = _findings(dp_tables(straggler=0, delay_ms=40, num_steps=21))
    assert f[0].severity == "critical"
    assert f[0].evidence["victims_wait_frac"] >= 0.2


def test_collective_skew_rejects_a_table_without_store_columns():
    with pytest.raises(TraceError, match=r"table 'collectives' lacks the columns \['pg'"):
        st.collective_skew(pd.DataFrame({"rank": [0], "seq": [1]}))


@pytest.mark.parametrize("values", [[1.0, 5.0], [3.0, 1.0, 2.0], [4.0, 1.0, 3.0, 2.0], [5.0, 5.0, 1.0, 9.0, 0.0]])
def test_median_of_others_excludes_each_element_in_turn(values):
    import numpy as np

    v = np.array(values)
    expected = [float(np.median(np.delete(v, i))) for i in range(len(v))]
    assert st.median_of_others(v).tolist() == expected


def test_stragglers_does_not_judge_pipeline_groups_where_the_schedule_sets_the_arrival_order():
    # GPipe: stage 0 finishes its last backward last, so it is always last at an end-of-step pp collective.
    rows, steps = [], []
    for step in range(21):
        t = T0 + step * 300 * MS
        for r in range(4):
            rows.append({"rank": r, "pg": "pp", "pg_ranks": "0,1,2,3", "pg_size": 4, "seq": step + 1,
                         "op": "allreduce", "num_bytes": 4, "enqueue_ns": t + (250 - 20 * r) * MS,
                         "end_ns": t + 260 * MS, "step": step})
            steps.append({"rank": r, "step": step, "start_ns": t, "end_ns": t + 270 * MS, "fwd_ns": 100 * MS})
    t = {"collectives": frame_from_rows("collectives", rows), "steps": frame_from_rows("steps", steps)}
    lateness = st.rank_lateness(t["collectives"], t["steps"])
    scores = ss.straggler_scores(lateness)
    assert scores.set_index("rank").loc[0, "median_lateness_frac"] > 0.1      # the metric sees it ...
    assert _findings(t) == []                                                 # ... the detector does not judge it


def _two_stage_pipeline(sleep_rank: int | None, sleep_ms: float = 50.0, steps: int = 3):
    """One pipeline (ranks 0, 1 = stages 0, 1), GPipe with 2 micro-batches, F = 10 ms, B = 20 ms; the
    ``sleep_rank`` idles ``sleep_ms`` before its first action of every step."""
    pipe, step_rows, coll = [], [], []
    for step in range(steps):
        t0 = T0 + step * 1000 * MS
        s0 = t0 + (int(sleep_ms * MS) if sleep_rank == 0 else 0)
        f0 = [(s0 + i * 10 * MS, s0 + (i + 1) * 10 * MS) for i in range(2)]
        s1 = t0 + (int(sleep_ms * MS) if sleep_rank == 1 else 0)
        f1, prev = [], s1
        for i in range(2):
            a = max(prev, f0[i][1])
            f1.append((a, a + 10 * MS))
            prev = a + 10 * MS
        b1 = [(prev + i * 20 * MS, prev + (i + 1) * 20 * MS) for i in range(2)]
        prev = f0[-1][1]
        b0 = []
        for i in range(2):
            a = max(prev, b1[i][1])
            b0.append((a, a + 20 * MS))
            prev = a + 20 * MS
        for rank, acts in ((0, [("F", f0), ("B", b0)]), (1, [("F", f1), ("B", b1)])):
            for action, spans in acts:
                for mb, (a, b) in enumerate(spans):
                    pipe.append({"rank": rank, "stage": rank, "step": step, "microbatch": mb, "action": action,
                                 "start_ns": int(a), "end_ns": int(b)})
            step_rows.append({"rank": rank, "step": step, "start_ns": t0, "end_ns": t0 + 500 * MS})
            coll.append({"rank": rank, "pg": "pp", "pg_ranks": "0,1", "pg_size": 2, "seq": step + 1, "op": "allreduce",
                         "num_bytes": 4, "enqueue_ns": t0 + 400 * MS, "end_ns": t0 + 401 * MS, "step": step})
    return (frame_from_rows("pipeline", pipe), frame_from_rows("steps", step_rows),
            frame_from_rows("collectives", coll))


@pytest.mark.parametrize("sleeper", [0, 1])
def test_pipeline_own_delay_blames_the_rank_idle_outside_its_actions_not_the_one_waiting_for_input(sleeper):
    pipe, steps, coll = _two_stage_pipeline(sleeper)
    groups = st.pipeline_groups(coll)
    assert groups == {0: (0, 1), 1: (0, 1)}
    own = st.pipeline_own_delay(pipe, steps, groups).groupby("rank")["own_delay_ns"].median()
    # stage 1 could not start before stage 0's first forward ended (10 ms): only 40 ms of its sleep delayed it
    assert own[sleeper] == pytest.approx((50 if sleeper == 0 else 40) * MS)
    assert own[1 - sleeper] == pytest.approx(0)


def test_pipeline_own_delay_keeps_one_row_per_rank_and_step_when_a_restart_recomputes_steps():
    # a torchrun restart runs the last steps again: their steps rows appear twice (one per attempt)
    pipe, steps, coll = _two_stage_pipeline(0)
    again = steps[steps["step"] >= steps["step"].max() - 1].assign(start_ns=lambda x: x["start_ns"] + 10**10,
                                                                    end_ns=lambda x: x["end_ns"] + 10**10)
    own = st.pipeline_own_delay(pipe, pd.concat([steps, again], ignore_index=True), st.pipeline_groups(coll))
    assert len(own) == len(pipe[["rank", "step"]].drop_duplicates())
    kept = own[(own["rank"] == 0) & (own["step"] < steps["step"].max() - 1)]["own_delay_ns"]   # not recomputed
    assert len(kept) == 1 and kept.iloc[0] == pytest.approx(50 * MS)


def test_stragglers_linked_by_a_pipeline_keep_the_one_with_the_larger_own_delay():
    scores = pd.DataFrame([
        {"pg": "dp", "pg_ranks": pr, "rank": r, "num_steps": 20, "window_steps": 20, "window_first_step": 1,
         "window_last_step": 20, "median_lateness_frac": 0.15, "positive_frac": 0.9, "median_pre_excess_frac": 0.0,
         "pre_positive_frac": 0.5, "last_frac": 0.9, "mean_lateness_ns": 1e8, "mean_victims_wait_ns": 1e8,
         "mean_step_ns": 1e9, "detected_at_step": 20, "detected_by": "arrival", "gain_first_step": 1,
         "gain_last_step": 20, "gain_victims_wait_ns": 1e8, "gain_step_ns": 1e9}
        for pr, r in (("0,1", 0), ("2,3", 2))])[ss.SCORE_COLUMNS]
    causes = pd.DataFrame({c: [] for c in sc.CAUSE_COLUMNS})
    links = {frozenset((0, 2))}
    f = st.detect_stragglers(scores, causes, links=links, own_delay_ns={0: 4e7, 2: 1.6e8, 1: 3e7, 3: 5e7})
    assert [(x.ranks, x.evidence["propagated_to"]) for x in f] == [((2,), [0])]


def test_unique_seq_separates_collectives_of_different_torchrun_attempts():
    from dtprobe.analysis.arrivals import ATTEMPT_SEQ_STRIDE, unique_seq

    rows = []
    for attempt, t in ((0, T0), (1, T0 + 10_000 * MS)):
        for seq in (1, 2, 3):
            for r in (0, 1):
                rows.append({"rank": r, "pg": "dp", "pg_ranks": "0,1", "pg_size": 2, "seq": seq, "op": "allreduce",
                             "enqueue_ns": t + seq * 100 * MS + r * MS, "end_ns": t + seq * 100 * MS + 5 * MS,
                             "step": seq})
    coll = unique_seq(frame_from_rows("collectives", rows))
    assert sorted(coll["seq"].unique()) == [1, 2, 3, ATTEMPT_SEQ_STRIDE + 1, ATTEMPT_SEQ_STRIDE + 2,
                                            ATTEMPT_SEQ_STRIDE + 3]
    skew = st.collective_skew(coll)
    assert len(skew) == 6 and (skew["skew_ns"] == MS).all()
    clean = frame_from_rows("collectives", rows[:6])
    assert unique_seq(clean) is clean


def _redone_step_tables() -> tuple[pd.DataFrame, pd.DataFrame]:
    """Two ranks; attempt 0 ran steps 3 and 4 (rank 0 3 ms late at step 4's all-reduce, steps of 50 ms) and was
    killed; attempt 1 resumed from the checkpoint at step 4 and redid it (rank 1 2 ms late, a step of 80 ms)."""
    from dtprobe.analysis.arrivals import unique_seq

    colls, steps = [], []
    for restart, step, late_rank, late_ms, step_ms, seq, t in (
            (0, 3, 1, 1, 50, 1, T0), (0, 4, 0, 3, 50, 2, T0 + 100 * MS), (1, 4, 1, 2, 80, 1, T0 + 1_000 * MS)):
        for r in (0, 1):
            enq = t + 30 * MS + (late_ms * MS if r == late_rank else 0)
            colls.append({"rank": r, "restart": restart, "pg": "dp", "pg_ranks": "0,1", "pg_size": 2, "seq": seq,
                          "op": "allreduce", "num_bytes": 1024, "step": step, "enqueue_ns": enq,
                          "end_ns": t + 30 * MS + late_ms * MS + 4 * MS})
            steps.append({"rank": r, "restart": restart, "step": step, "start_ns": t, "end_ns": t + step_ms * MS})
    return unique_seq(frame_from_rows("collectives", colls)), frame_from_rows("steps", steps)


def test_completing_attempts_keeps_each_rank_steps_last_attempt_and_rows_outside_steps():
    from dtprobe.analysis.tables import completing_attempts

    steps = frame_from_rows("steps", [
        {"rank": 0, "step": 3, "restart": None}, {"rank": 0, "step": 4, "restart": None},   # null: attempt 0
        {"rank": 0, "step": 4, "restart": 1}, {"rank": 1, "step": 4, "restart": 0},          # rank 1 never redid it
        {"rank": 0, "step": None, "restart": 0}, {"rank": 0, "step": 5, "restart": 1}])
    kept = completing_attempts(steps)
    assert list(zip(kept["rank"], kept["step"].fillna(-1), kept["restart"].fillna(0))) == [
        (0, 3, 0), (0, 4, 1), (1, 4, 0), (0, -1, 0), (0, 5, 1)]
    one, without = steps[steps["step"] == 3], steps.drop(columns="restart")     # one attempt: the frame itself
    assert completing_attempts(one) is one and completing_attempts(without) is without


def test_a_step_redone_after_a_restart_is_judged_on_the_attempt_that_redid_it():
    from dtprobe.analysis.exposed_comm import comm_exposure

    coll, steps = _redone_step_tables()
    late = st.rank_lateness(coll, steps)
    step4 = late[late["step"] == 4].set_index("rank")
    # attempt 1 alone: rank 1 2 ms late, rank 0 2 ms early (both attempts mixed: rank 0 +3 ms and rank 1 +2 ms)
    assert step4["lateness_ns"].to_dict() == {0: -2 * MS, 1: 2 * MS}
    assert (step4["step_ns"] == 80 * MS).all()
    skew = st.collective_skew(coll)
    top = st.late_rank_per_step(skew, steps).set_index("step")
    assert (top.loc[4, "late_rank"], top.loc[4, "margin_ns"], top.loc[4, "step_ns"]) == (1, 2 * MS, 80 * MS)
    assert (top.loc[3, "late_rank"], top.loc[3, "step_ns"]) == (1, 50 * MS)
    exposure = comm_exposure(coll, steps, skew)
    assert sorted(zip(exposure["rank"], exposure["step"])) == [(0, 3), (0, 4), (1, 3), (1, 4)]   # one row each
    by = exposure.set_index(["rank", "step"])
    assert by.loc[(0, 4), "step_ns"] == 80 * MS and by.loc[(0, 4), "comm_ns"] == 6 * MS   # waited 2 ms, ran 4
    assert by.loc[(1, 4), "comm_ns"] == 4 * MS
    blocked = sc.blocked_outside_groups(coll, st.collective_waits(coll, skew))
    blocked = blocked[blocked["outside_pg_ranks"] == sc.OUTSIDE_NONE].set_index(["rank", "step"])["blocked_ns"]
    assert blocked.to_dict() == {(0, 3): 1 * MS, (0, 4): 2 * MS}          # rank 1's 3 ms wait was attempt 0's


def test_collective_skew_margin_is_exact_nanoseconds_when_another_collective_has_one_arrival():
    # A collective with one arrival has no second-last arrival; the margins must stay exact integers, not
    # Unix nanoseconds rounded through float64 (256 ns steps near 1.7e18).
    coll = _coll([{"rank": 0, "seq": 1, "enqueue_ns": T0 + 1}, {"rank": 1, "seq": 1, "enqueue_ns": T0 + 3},
                  {"rank": 2, "seq": 1, "enqueue_ns": T0 + 10}, {"rank": 0, "seq": 2, "enqueue_ns": T0 + MS}])
    skew = st.collective_skew(coll)
    assert skew["margin_ns"].tolist() == [7, 0]
    assert skew["skew_ns"].tolist() == [9, 0]


def _scores_one_group_at_a_time(lateness: pd.DataFrame, window_steps: int) -> pd.DataFrame:
    """Reference: every window of every (group, rank) scored with plain numpy, one group at a time."""
    import warnings

    import numpy as np

    rows = []
    for (pg, pg_ranks, rank), grp in lateness.groupby(["pg", "pg_ranks", "rank"], sort=True):
        grp = grp.sort_values("step", kind="stable")
        frac, pre = grp["lateness_frac"].to_numpy(), grp["pre_excess_frac"].to_numpy()
        w = max(1, min(window_steps, len(grp)))
        win = np.lib.stride_tricks.sliding_window_view(frac, w)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            med = np.nanmedian(win, axis=1)
            pmed = np.nanmedian(np.lib.stride_tricks.sliding_window_view(pre, w), axis=1)
        best = int(np.nanargmax(med)) if np.isfinite(med).any() else 0
        rows.append({"pg": pg, "rank": int(rank), "window_steps": w, "window_first_step": int(grp["step"].iloc[best]),
                     "median_lateness_frac": med[best], "median_pre_excess_frac": pmed[best],
                     "positive_frac": float((win[best] > ss.LATE_TIE_FRAC).mean()),
                     "mean_lateness_ns": float(grp["lateness_ns"].iloc[best:best + w].mean())})
    return pd.DataFrame(rows)


def test_straggler_scores_scores_each_rank_alone_when_ranks_have_different_step_counts_and_gaps():
    import numpy as np

    rng = np.random.default_rng(7)
    rows = []
    for pg, num_steps in (("dp", 30), ("tp", 6)):            # tp: fewer steps than the window
        for rank in range(3):
            steps = np.sort(rng.choice(60, num_steps - rank, replace=False))
            for s in steps:
                rows.append({"pg": pg, "pg_ranks": "0,1,2", "step": int(s), "rank": rank,
                             "lateness_ns": float(rng.normal(1e6, 1e6)), "victims_wait_ns": 0.0, "is_last": False,
                             "step_ns": 1e8, "lateness_frac": float(rng.normal(0.0, 0.01)) if rng.random() > 0.1
                             else float("nan"), "pre_excess_frac": float("nan") if rng.random() < 0.3 else 0.0})
    lateness = pd.DataFrame(rows).sample(frac=1.0, random_state=1)   # any row order
    # thresholds no window reaches: every rank's window is the one with the largest median
    got = ss.straggler_scores(lateness, window_steps=10, min_lateness_frac=1.0)
    want = _scores_one_group_at_a_time(lateness, 10)
    assert got["window_steps"].tolist() == want["window_steps"].tolist() == [10, 10, 10, 6, 5, 4]
    pd.testing.assert_frame_equal(got[want.columns].reset_index(drop=True), want, check_dtype=False, rtol=1e-12)
    assert got["detected_at_step"].isna().all()


def test_a_tie_with_the_peers_median_is_not_a_late_step():
    # a 2-rank run killed at step 6 (the chaos suite's SIGKILL test on a loaded host): rank 0 started 10 ms late
    # and caught up over three steps, then the two arrived together, +30 ns apart; a catch-up, not a straggler
    fracs = [0.28, 0.165, 0.13, -0.0012, 7e-7]
    rows = [{"pg": "world", "pg_ranks": "0,1", "step": s + 1, "rank": r, "lateness_ns": sign * f * 4e7,
             "victims_wait_ns": max(sign * f, 0.0) * 4e7, "is_last": sign * f > 0, "step_ns": 4e7,
             "lateness_frac": sign * f, "pre_excess_frac": 0.0}
            for s, f in enumerate(fracs) for r, sign in ((0, 1.0), (1, -1.0))]
    scores = ss.straggler_scores(pd.DataFrame(rows), window_steps=20)
    assert scores.set_index("rank").loc[0, "positive_frac"] == pytest.approx(0.6)     # 3 of 5: the tie is not late
    findings = st.detect_stragglers(scores, pd.DataFrame(columns=sc.CAUSE_COLUMNS))
    assert [f for f in findings if f.severity != "info"] == []


@pytest.mark.parametrize("step_ms, named", [(2.0, False), (200.0, True)])
def test_a_window_spans_a_second_so_a_spell_of_a_few_steps_of_milliseconds_is_no_straggler(step_ms, named):
    # 2 ranks, 500 steps; rank 0 is 40% of the step late in 16 of the 20 steps 41-60 and even elsewhere. At 2 ms a
    # step that is a 40 ms spell of its host (a clean `dtprobe launch` run's critical false verdict): the window
    # grows to 500 steps, whose median is a tie. At 200 ms the same steps last 4 s, and 20-step windows name it
    import numpy as np

    rng = np.random.default_rng(3)
    step_ns = step_ms * 1e6
    rows = []
    for step in range(1, 501):
        late = 0.4 if 41 <= step <= 60 and step % 5 else float(rng.normal(0.0, 0.01))
        for rank, frac in ((0, late), (1, -late)):
            rows.append({"pg": "world", "pg_ranks": "0,1", "step": step, "rank": rank,
                         "lateness_ns": frac * step_ns, "victims_wait_ns": max(frac, 0.0) * step_ns,
                         "is_last": frac > 0, "step_ns": step_ns, "lateness_frac": frac, "pre_excess_frac": 0.0})
    scores = ss.straggler_scores(pd.DataFrame(rows), window_steps=20)
    assert scores["window_steps"].tolist() == ([250, 250] if not named else [20, 20])
    findings = [f for f in st.detect_stragglers(scores, pd.DataFrame(columns=sc.CAUSE_COLUMNS))
                if f.severity != "info"]
    assert [f.ranks for f in findings] == ([(0,)] if named else [])
    if named:                                               # the first window with 10 of the spell's late steps
        first, last = findings[0].evidence["window"]
        assert last - first == 19 and sum(41 <= s <= 60 and s % 5 != 0 for s in range(first, last + 1)) >= 10


@pytest.mark.parametrize("step_ms, named", [(3.0, False), (200.0, True)])
def test_a_run_shorter_than_a_window_of_time_is_not_judged(step_ms, named):
    # a 2-rank run that crashed after 6 steps, rank 1 30% late in each: 18 ms of steps say nothing of a straggler
    # (a crash test's critical false verdict); 1.2 s of them do
    step_ns = step_ms * 1e6
    rows = [{"pg": "world", "pg_ranks": "0,1", "step": step, "rank": rank, "lateness_ns": frac * step_ns,
             "victims_wait_ns": max(frac, 0.0) * step_ns, "is_last": frac > 0, "step_ns": step_ns,
             "lateness_frac": frac, "pre_excess_frac": 0.0}
            for step in range(1, 7) for rank, frac in ((0, -0.3 - step / 1000), (1, 0.3 + step / 1000))]
    scores = ss.straggler_scores(pd.DataFrame(rows), window_steps=20)
    findings = st.detect_stragglers(scores, pd.DataFrame(columns=sc.CAUSE_COLUMNS))
    assert [f.ranks for f in findings if f.severity != "info"] == ([(1,)] if named else [])


def test_a_slowdown_that_lengthens_the_steps_is_named_from_the_first_window_that_spans_the_minimum_time():
    # 2 ranks, 200 steps of 8 ms; from step 60 on rank 1 arrives 20 ms late and the steps take 28 ms (a slow data
    # pipeline on one rank of a launched script). The run's median step sets 20-step windows; the first window
    # that qualifies straddles the fast steps and spans 0.46 s, under the 0.5-s minimum: a later one is judged
    import numpy as np

    rng = np.random.default_rng(5)
    rows = []
    for step in range(1, 201):
        slow = step >= 60
        step_ns = (28.0 if slow else 8.0) * 1e6 * (1 + float(rng.normal(0.0, 0.01)))
        late = (20e6 / step_ns if slow else 0.0) + float(rng.normal(0.0, 0.005))
        for rank, frac in ((1, late), (0, -late)):
            rows.append({"pg": "world", "pg_ranks": "0,1", "step": step, "rank": rank,
                         "lateness_ns": frac * step_ns, "victims_wait_ns": max(frac, 0.0) * step_ns,
                         "is_last": frac > 0, "step_ns": step_ns, "lateness_frac": frac, "pre_excess_frac": 0.0})
    scores = ss.straggler_scores(pd.DataFrame(rows), window_steps=20)
    row = scores.set_index("rank").loc[1]
    assert row["window_steps"] == 20 and row["window_steps"] * row["mean_step_ns"] >= 0.5e9
    assert 56 <= row["window_first_step"] < 60, row      # a few fast steps: the window's mean step is long enough
    findings = [f for f in st.detect_stragglers(scores, pd.DataFrame(columns=sc.CAUSE_COLUMNS))
                if f.severity != "info"]
    assert [f.ranks for f in findings] == [(1,)]
    assert findings[0].evidence["detected_at_step"] == row["detected_at_step"] <= 79


def _episode(*, slow_steps: int, after_steps: int) -> dict:
    """dp4: rank 1's backward 20 ms slower for its first ``slow_steps`` steps, then ``after_steps`` steps of none."""
    from analysis_synth import DataParallelTimeline

    timeline = DataParallelTimeline(straggler=1, delay_ms=20, phase="bwd")
    rows = timeline.next_rows(slow_steps)
    timeline.straggler = None
    for table, later in timeline.next_rows(after_steps).items():
        rows[table] += later
    return {table: frame_from_rows(table, table_rows) for table, table_rows in rows.items()}


@pytest.mark.parametrize("after_steps,passed", [(60, True), (5, False), (0, False)])
def test_a_straggler_whose_lateness_then_passed_is_info_and_says_so(after_steps, passed):
    # the arrival view names rank 1 in its first window; the steps after that window, mostly without the delay,
    # show the lateness gone (an episode: a host that favoured the others for a while); fewer steps after it than
    # the window has are too few to tell, and a run that ends slow is a straggler to the end
    [f] = _findings(_episode(slow_steps=30, after_steps=after_steps))
    assert f.ranks == (1,) and f.evidence["detected_by"] == "arrival"
    assert f.severity == ("info" if passed else "warning")
    ev, last = f.evidence["passed"], f.evidence["window"][1]
    if passed:
        assert last < 29 and ev["steps"] == [last + 1, 89] and ev["num_steps"] == 89 - last
        assert abs(ev["median_lateness_frac"]) < 0.02
        assert "an episode that passed" in f.title
    else:
        assert ev is None and "passed" not in f.title


def test_a_member_that_finished_no_step_is_no_peer_to_be_late_against():
    # DDP's join(): rank 1's data ran out, and it keeps answering rank 0's all-reduces at once without training
    # (no steps rows of its own from step 20 on); rank 0, which still computes (20 ms more from then on, as a
    # member with no work of its own sees it), is not late against it
    t = dp_tables(world=2, num_steps=60, straggler=0, delay_ms=20, phase="bwd", from_step=20)
    assert [f.ranks for f in _findings(t)] == [(0,)]                 # with rank 1 training alongside: a straggler
    steps = t["steps"]
    t["steps"] = steps[~((steps["rank"] == 1) & (steps["step"] >= 20))].reset_index(drop=True)
    lateness = st.rank_lateness(t["collectives"], t["steps"])
    assert lateness["step"].max() == 19 and set(lateness["rank"]) == {0, 1}
    assert _findings(t) == []


def _between_steps(t: dict, rank: int, delay_ms: float) -> dict:
    """``dp_tables`` with ``phase="data"``: ``rank``'s extra time taken out of its data phase, so that it is spent
    at the start of its steps in none of them (work after its optimizer step, as rank-0-only logging)."""
    steps = t["steps"].copy()
    mine = steps["rank"] == rank
    steps.loc[mine, "data_ns"] = steps.loc[mine, "data_ns"] - int(delay_ms * MS)
    return {**t, "steps": steps}


def _waits_outside_backward(t: dict) -> dict:
    """The tables with every backward cut to its own compute, the wait for the last bucket left in no phase (as
    ``dtprobe launch`` times a DDP backward): 50 ms + jitter, the synthetic timeline's backward."""
    steps = t["steps"].copy()
    steps["bwd_ns"] = steps["bwd_ns"].clip(upper=int(51 * MS))
    return {**t, "steps": steps}


@pytest.mark.parametrize("waits_in_backward", [True, False])
def test_a_straggler_whose_extra_time_lies_between_its_steps_is_told_to_look_for_work_only_it_runs(
        waits_in_backward):
    t = _between_steps(dp_tables(straggler=2, delay_ms=15, phase="data", num_steps=21), 2, 15)
    [f] = _findings(t if waits_in_backward else _waits_outside_backward(t))
    ev = f.evidence
    assert (f.ranks, ev["cause"], ev["outside_phases"]) == ((2,), "compute", True)
    assert abs(ev["forward_excess_ms"]) < 1.5
    # peers that wait inside their backward have it longer by the lateness; else it is as theirs
    assert ev["backward_excess_ms"] < -10 if waits_in_backward else abs(ev["backward_excess_ms"]) < 1.5
    assert "if rank == 0:" in f.recommendation and "between its optimizer step and its next forward" in \
        f.recommendation


@pytest.mark.parametrize("phase", ["fwd", "bwd"])
@pytest.mark.parametrize("waits_in_backward", [True, False])
def test_a_straggler_slower_in_its_forward_or_backward_is_not_sent_to_work_outside_them(phase, waits_in_backward):
    t = dp_tables(straggler=2, delay_ms=15, phase=phase, num_steps=21)
    if not waits_in_backward:   # (the culprit's longer backward kept: only the peers' waits leave it)
        t = _waits_outside_backward(t)
        if phase == "bwd":
            steps = t["steps"].copy()
            steps.loc[steps["rank"] == 2, "bwd_ns"] += int(15 * MS)
            t = {**t, "steps": steps}
    [f] = _findings(t)
    assert (f.ranks, f.evidence["cause"], f.evidence["outside_phases"]) == ((2,), "compute", False)
    assert "if rank == 0:" not in f.recommendation
