"""RANK_STALL: a rank that stopped for a while and went on while its peers waited, on synthetic runs read through
the facade and on hand-made per-step frames (the real SIGSTOP of a worker: tests/chaos/test_process_faults.py)."""

from __future__ import annotations

import pandas as pd
import pytest
from analysis_synth import MS, T0, dp_stall_tables, lockstep_tables, sampler_rows, write_rows_run, write_run

from dtprobe.analysis import rank_stalls
from dtprobe.analysis.facade import RunAnalysis
from dtprobe.store.frames import frame_from_rows

STALL_STEP = 15


def _ddp_run(tmp_path, *, delay_ms: float, sampler_ms: float | None = 20.0, frozen: bool = False,
             num_steps: int = 30, stall_step: int = STALL_STEP) -> RunAnalysis:
    """A 4-rank DDP run where rank 2's forward takes ``delay_ms`` longer in ``stall_step`` only
    (``synthetic.dp_stall_tables``); no device rows at all without ``sampler_ms``."""
    tables = dp_stall_tables(num_steps=num_steps, rank=2, step=stall_step, delay_ms=delay_ms, sampler_ms=sampler_ms,
                             frozen=frozen)
    if sampler_ms is None:
        tables["devices"] = frame_from_rows("devices", [])
    return RunAnalysis.open(write_run(tmp_path / "run", tables, world_size=4))


def _codes(analysis: RunAnalysis) -> list[str]:
    return [f.code for f in analysis.findings() if f.severity != "info"]


def test_a_rank_late_by_four_steps_once_is_a_rank_stall_naming_it_and_what_it_did(tmp_path):
    a = _ddp_run(tmp_path, delay_ms=400.0)
    [stall] = a.rank_stalls().to_dict(orient="records")
    assert (stall["rank"], stall["step"], stall["kind"], stall["pg"]) == (2, STALL_STEP, "late_arrival", "dp")
    assert stall["stall_ns"] == pytest.approx(400 * MS, abs=3 * MS)
    assert stall["phase"] == "fwd" and stall["phase_excess_ns"] == pytest.approx(400 * MS, abs=2 * MS)
    assert stall["liveness"] == "running"                  # its sampler kept writing every 20 ms
    [f] = [f for f in a.findings() if f.code == "RANK_STALL"]
    assert (f.ranks, f.group, f.severity) == ((2,), "dp", "warning")
    wall = a.wall_ns()
    assert f.evidence["lost_frac"] == pytest.approx(stall["stall_ns"] / wall, abs=1e-4)
    assert 0.1 < f.evidence["lost_frac"] < 0.25
    assert f.predicted_gain.metric == "wall_time"
    assert f.evidence["stalls"][0]["op"] == "allreduce" and f.evidence["liveness"] == "running"
    assert "kept running" in f.recommendation and "fwd" in f.recommendation
    assert "STRAGGLER" not in _codes(a)                    # once is not a straggler


def test_a_stalled_rank_whose_sampler_wrote_nothing_meanwhile_was_frozen(tmp_path):
    a = _ddp_run(tmp_path, delay_ms=400.0, frozen=True)
    [f] = [f for f in a.findings() if f.code == "RANK_STALL"]
    assert f.evidence["liveness"] == "frozen" and f.evidence["stalls"][0]["max_gap_ms"] >= 400
    assert "frozen" in f.recommendation and "SIGSTOP" in f.recommendation


def test_no_sampler_rows_leave_the_liveness_unknown_not_the_stall(tmp_path):
    a = _ddp_run(tmp_path, delay_ms=400.0, sampler_ms=None)              # as under --no-devices
    [f] = [f for f in a.findings() if f.code == "RANK_STALL"]
    assert f.ranks == (2,) and f.evidence["liveness"] == "unknown"
    assert f.evidence["stalls"][0]["max_gap_ms"] is None
    assert "a pause of its process" in f.recommendation and "fwd" in f.recommendation


@pytest.mark.parametrize("delay_ms", [0.0, 150.0])
def test_no_rank_stall_on_a_clean_run_or_a_delay_under_two_steps(tmp_path, delay_ms):
    a = _ddp_run(tmp_path, delay_ms=delay_ms)
    assert a.rank_stalls().empty
    assert "RANK_STALL" not in [f.code for f in a.findings()]


def test_a_run_too_short_to_know_its_noise_gets_no_rank_stall(tmp_path):
    a = _ddp_run(tmp_path, delay_ms=400.0, num_steps=10, stall_step=6)      # the first step skipped: 9 judged
    assert len(a.late_rank_per_step()) == rank_stalls.MIN_GROUP_STEPS - 1
    assert a.rank_stalls().empty


# ----------------------------------------------------------------------------------- hand-made per-step frames

STEP = 100 * MS
RANKS = (0, 1, 2, 3)


def _frames(num_steps: int = 20, *, restart_from: int | None = None) -> dict[str, pd.DataFrame]:
    """Per-step frames of a clean 4-rank run of 100 ms steps: late_rank (1 ms margins, rank s % 4 last), one
    all-reduce a step (2 ms transfers), 10 ms of communication per rank and step, sampler rows every 10 ms; steps
    from ``restart_from`` on belong to attempt 1."""
    steps = [{"rank": r, "step": s, "start_ns": T0 + s * STEP, "end_ns": T0 + (s + 1) * STEP, "data_ns": 1 * MS,
              "fwd_ns": 30 * MS, "bwd_ns": 60 * MS, "opt_ns": 9 * MS,
              "restart": 1 if restart_from is not None and s >= restart_from else 0}
             for s in range(num_steps) for r in RANKS]
    late = [{"pg": "dp", "pg_ranks": "0,1,2,3", "step": s, "seq": s + 1, "op": "allreduce", "late_rank": s % 4,
             "margin_ns": 1.0 * MS + (s % 3) * 0.2 * MS} for s in range(num_steps)]
    bandwidth = [{"pg": "dp", "pg_ranks": "0,1,2,3", "seq": s + 1, "op": "allreduce", "step": s,
                  "duration_ns": 2.0 * MS} for s in range(num_steps)]
    exposure = [{"rank": r, "step": s, "comm_ns": 10.0 * MS} for s in range(num_steps) for r in RANKS]
    devices = [row for r in RANKS for row in sampler_rows(r, T0, T0 + num_steps * STEP, every_ms=10.0)]
    return {"late_rank": pd.DataFrame(late), "bandwidth": pd.DataFrame(bandwidth), "exposure": pd.DataFrame(exposure),
            "steps": frame_from_rows("steps", steps), "devices": frame_from_rows("devices", devices),
            "checkpoints": frame_from_rows("checkpoints", [])}


def _stall(f: dict, *, rank: int, step: int, ms: float, pg: str = "dp", members: str = "0,1,2,3") -> None:
    """``rank`` late by ``ms`` at ``step``'s collective of group ``pg`` (a group new to the frames gets 1 ms
    margins in every step first), its step that much longer."""
    lr = f["late_rank"]
    if not (lr["pg"] == pg).any():
        ranks = [int(m) for m in members.split(",")]
        steps = sorted(f["steps"]["step"].unique())
        lr = f["late_rank"] = pd.concat([lr, pd.DataFrame([
            {"pg": pg, "pg_ranks": members, "step": s, "seq": 1000 + s, "op": "allgather",
             "late_rank": ranks[s % len(ranks)], "margin_ns": 1.0 * MS} for s in steps])], ignore_index=True)
    lr.loc[(lr["pg"] == pg) & (lr["step"] == step), ["late_rank", "margin_ns"]] = [rank, ms * MS]
    _longer_step(f, rank, step, ms)


def _longer_step(f: dict, rank: int, step: int, ms: float, phase: str = "fwd_ns") -> None:
    s = f["steps"]
    at = (s["rank"] == rank) & (s["step"] == step)
    s.loc[at, phase] = s.loc[at, phase] + int(ms * MS)
    s.loc[at, "end_ns"] = s.loc[at, "end_ns"] + int(ms * MS)


def _freeze(f: dict, rank: int, step: int) -> None:
    """No sampler row of ``rank`` during ``step``."""
    s = f["steps"]
    row = s[(s["rank"] == rank) & (s["step"] == step)].iloc[0]
    d = f["devices"]
    f["devices"] = d[~((d["rank"] == rank) & (d["time_ns"] > row["start_ns"]) & (d["time_ns"] < row["end_ns"]))]


def _stalls(f: dict) -> pd.DataFrame:
    return rank_stalls.rank_stalls(f["late_rank"], bandwidth=f["bandwidth"], exposure=f["exposure"],
                                   steps=f["steps"], devices=f["devices"], checkpoints=f["checkpoints"],
                                   step_ns=float(STEP))


def test_frames_find_the_stall_and_its_liveness():
    f = _frames()
    _stall(f, rank=1, step=12, ms=250)
    _freeze(f, 1, 12)
    [s] = _stalls(f).to_dict(orient="records")
    assert (s["rank"], s["step"], s["kind"], s["liveness"], s["phase"]) == (1, 12, "late_arrival", "frozen", "fwd")
    assert s["noise_ns"] == pytest.approx(1.2 * MS)


def test_a_group_whose_margins_are_wide_needs_ten_times_its_median_margin():
    f = _frames()
    f["late_rank"]["margin_ns"] = 30.0 * MS            # median margin 30 ms: a stall needs 300 ms
    _stall(f, rank=1, step=12, ms=250)
    assert _stalls(f).empty
    _stall(f, rank=1, step=12, ms=350)
    assert _stalls(f)["rank"].tolist() == [1]


def test_a_stall_lasts_a_tenth_of_a_second_however_short_the_steps():
    # steps of 2 ms with 0.05 ms margins: a rank 8 ms late once is 4 steps and 160x the noise, a spell of its host
    # that a clean 2-ms-step run has a dozen of, not a stall; 150 ms is
    f = _frames()
    f["late_rank"]["margin_ns"] = 0.05 * MS
    _stall(f, rank=1, step=12, ms=8)
    assert rank_stalls.rank_stalls(f["late_rank"], bandwidth=f["bandwidth"], exposure=f["exposure"],
                                   steps=f["steps"], devices=f["devices"], checkpoints=f["checkpoints"],
                                   step_ns=2.0 * MS).empty
    _stall(f, rank=1, step=12, ms=150)
    assert rank_stalls.rank_stalls(f["late_rank"], bandwidth=f["bandwidth"], exposure=f["exposure"],
                                   steps=f["steps"], devices=f["devices"], checkpoints=f["checkpoints"],
                                   step_ns=2.0 * MS)["rank"].tolist() == [1]


def test_a_late_rank_that_was_waiting_in_communication_is_a_victim_and_the_stalled_one_is_named():
    # a pipeline-like step: rank 3 froze; rank 2 waited for it in a send/recv, then came late to its dp group
    f = _frames()
    _stall(f, rank=2, step=12, ms=300)
    _stall(f, rank=3, step=12, ms=300, pg="tp", members="1,3")
    ex = f["exposure"]
    ex.loc[(ex["rank"] == 2) & (ex["step"] == 12), "comm_ns"] = 310.0 * MS
    assert _stalls(f)[["rank", "pg"]].values.tolist() == [[3, "tp"]]


@pytest.mark.parametrize("frozen", [True, False])
def test_a_rank_frozen_inside_a_send_recv_is_the_stalled_one_not_a_victim(frozen):
    # rank 1 was stopped while inside its pipeline send/recv: that time counts as its communication, as a waiting
    # victim's does, but its sampler wrote nothing meanwhile; its p2p peer, rank 3, waited (and kept writing)
    f = _frames()
    _stall(f, rank=1, step=12, ms=300)
    _stall(f, rank=3, step=12, ms=300, pg="tp", members="2,3")
    ex = f["exposure"]
    ex.loc[ex["rank"].isin([1, 3]) & (ex["step"] == 12), "comm_ns"] = 310.0 * MS
    if frozen:
        _freeze(f, 1, 12)
    got = _stalls(f)
    assert got[["rank", "pg", "liveness"]].values.tolist() == ([[1, "dp", "frozen"]] if frozen else [])


def test_one_stall_seen_by_two_groups_is_one_row_with_the_longer_margin():
    f = _frames()
    _stall(f, rank=1, step=12, ms=300)
    _stall(f, rank=1, step=12, ms=280, pg="tp", members="1,3")
    [s] = _stalls(f).to_dict(orient="records")
    assert (s["rank"], s["pg"], s["stall_ns"]) == (1, "dp", 300 * MS)


def test_the_first_steps_of_an_attempt_and_checkpoint_steps_are_not_judged():
    f = _frames(restart_from=10)
    _stall(f, rank=1, step=11, ms=300)                  # 2nd step of attempt 1: every rank restores
    assert _stalls(f).empty
    _stall(f, rank=1, step=1, ms=300)                   # the first attempt's (a live window's) first steps count
    assert _stalls(f)[["rank", "step"]].values.tolist() == [[1, 1]]
    f = _frames()
    _stall(f, rank=1, step=12, ms=300)
    f["checkpoints"] = frame_from_rows("checkpoints", [{"rank": 1, "step": 11, "kind": "save", "ok": True}])
    assert _stalls(f).empty                             # the save of step 11 delays step 12: CHECKPOINT_STALL's
    for blocking_ms, judged in ((300, False), (160, False), (12, True)):
        f["checkpoints"] = frame_from_rows("checkpoints", [{"rank": 1, "step": 11, "kind": "save", "ok": True,
                                                            "blocking_ns": blocking_ms * MS}])
        # a save that blocked the rank for half the stall or more explains it; an asynchronous save that blocked
        # it 12 ms (its writing beside the steps blocks nothing) leaves the 300 ms stall a stall
        assert _stalls(f)[["rank", "step"]].values.tolist() == ([[1, 12]] if judged else []), blocking_ms
    f["checkpoints"] = frame_from_rows("checkpoints", [{"rank": 1, "step": 11, "kind": "load", "ok": True,
                                                        "blocking_ns": 12 * MS}])
    assert _stalls(f).empty                             # a load: the rank restored, whatever it blocked


@pytest.mark.parametrize("frozen,named", [((2,), [2]), ((), []), ((1, 2), [])])
def test_a_transfer_that_took_seconds_names_the_one_member_frozen_meanwhile(frozen, named):
    f = _frames()
    f["bandwidth"].loc[f["bandwidth"]["step"] == 12, "duration_ns"] = 300.0 * MS
    for r in RANKS:                                      # every member's step waited inside the collective
        _longer_step(f, r, 12, 300, phase="bwd_ns")
    for r in frozen:
        _freeze(f, r, 12)
    s = _stalls(f)
    assert s["rank"].tolist() == named
    if named:
        assert s.iloc[0]["kind"] == "in_collective" and s.iloc[0]["liveness"] == "frozen"


def test_severity_follows_the_share_of_the_wall_time_lost():
    f = _frames()
    _stall(f, rank=1, step=12, ms=250)
    stalls = _stalls(f)
    hosts = {r: f"h{r}" for r in RANKS}

    def severity(wall_s: float) -> str:
        [finding] = rank_stalls.detect_rank_stalls(stalls, wall_ns=wall_s * 1e9, hosts=hosts,
                                                   axis_of_pg=lambda pg: pg)
        return finding.severity

    assert (severity(0.9), severity(2.3), severity(100.0)) == ("critical", "warning", "info")


@pytest.mark.parametrize("steps, period", [([1, 11, 21, 31], 10), ([1, 11, 31, 41], 10), ([5, 6, 7, 8], None),
                                           ([1, 5, 17, 40], None), ([3, 13], None), ([2, 12, 22, 25], None)])
def test_stalls_on_a_schedule_have_their_period(steps, period):
    # every 10 steps, also with one missed (a gap of two periods); not consecutive steps, scattered ones, two
    # stalls, or a schedule broken by an extra stall
    import numpy as np

    assert rank_stalls.stall_period(np.array(steps)) == period


def test_a_rank_that_stalls_every_n_steps_is_told_to_look_at_its_scheduled_work():
    # rank 1 late by 250 ms at steps 12, 17 and 22 (its evaluation every 5 steps): the title and advice say so
    f = _frames(30)
    for step in (12, 17, 22):
        _stall(f, rank=1, step=step, ms=250)
    [finding] = rank_stalls.detect_rank_stalls(_stalls(f), wall_ns=100e9, hosts={r: f"h{r}" for r in RANKS},
                                               axis_of_pg=lambda pg: pg)
    assert finding.evidence["period_steps"] == 5
    assert "stalled 3 times, every 5 steps (steps 12, 17, 22, ...)" in finding.title
    assert finding.recommendation.startswith("Its stalls recur every 5 steps: work that rank alone does on a schedule")


def test_a_rank_frozen_inside_a_collective_is_a_stall_and_not_exposed_communication(tmp_path):
    # a 4-rank DDP run whose rank 2 froze for 2 s inside the all-reduces of step 15 (they completed 2 s late, its
    # sampler silent meanwhile): the peers' 2 s in the collective are RANK_STALL's loss. Counted as communication
    # left exposed, they made a clean run's 3% exposure over 30%, an EXPOSED_COMM warning advising better overlap
    from dtprobe.synthetic import DataParallelTimeline

    timeline = DataParallelTimeline(world=4, jitter_ms=1.0, device_source="host")
    rows = timeline.next_rows(15)
    timeline.xfer_ms = 700.0                             # each of the 3 buckets of step 15
    stalled = timeline.next_rows(1)
    timeline.xfer_ms = 3.0
    later = timeline.next_rows(14)
    for table in rows:
        rows[table] += stalled[table] + later[table]
    span = next(r for r in stalled["steps"] if r["rank"] == 2)
    end = max(r["end_ns"] for r in rows["steps"])
    rows["devices"] = [row for r in range(4) for row in sampler_rows(r, T0, end, every_ms=20.0)
                       if not (r == 2 and span["start_ns"] + 100 * MS < row["time_ns"] < span["end_ns"])]
    a = RunAnalysis.open(write_run(tmp_path / "run", {t: frame_from_rows(t, v) for t, v in rows.items()},
                                   world_size=4))
    [stall] = a.rank_stalls().to_dict(orient="records")
    assert (stall["rank"], stall["step"], stall["kind"], stall["liveness"]) == (2, 15, "in_collective", "frozen")
    assert a.exposure_by_rank()["exposed_frac"].min() > 0.3       # the measure keeps every analysed step
    assert [f.code for f in a.findings() if f.severity != "info"] == ["RANK_STALL"]


def _call(rank: int, pg: str, ranks: str, seq: int, op: str, at: int, end: int, step: int, **more) -> dict:
    """One host-timed 1-MiB float32 ``collectives`` row of ``rank`` in group ``pg`` (members ``ranks``)."""
    return {"rank": rank, "pg": pg, "pg_ranks": ranks, "pg_size": len(ranks.split(",")), "seq": seq, "op": op,
            "num_bytes": 1 << 20, "dtype": "float32", "enqueue_ns": at, "start_ns": at, "end_ns": end, "step": step,
            "restart": 0, "timing": "host", **more}


def _with_rank_frozen(tmp_path, rows: dict, *, world: int, rank: int, from_ns: int, for_ns: int) -> RunAnalysis:
    """The run of ``rows`` with sampler rows every 50 ms, none of ``rank``'s for ``for_ns`` from ``from_ns``."""
    rows["devices"] = [d for r in range(world) for d in sampler_rows(r, T0, T0 + 3400 * MS)
                       if not (r == rank and from_ns < d["time_ns"] < from_ns + for_ns)]
    return RunAnalysis.open(write_rows_run(tmp_path / "run", rows, world_size=world, status="finished"))


def _pipeline_with_a_stalled_stage(tmp_path) -> RunAnalysis:
    """Three stages 0 -> 1 -> 2 of 100-ms steps, only send/recv between them: forward activations at +10/+20 ms
    (the receiver posts its recv 2 ms before), backward gradients 2 -> 1 at +50 ms and 1 -> 0 at +60 ms (both
    recvs posted at +45 ms). In ``STALL_STEP`` stage 2 freezes 400 ms before its backward send (no sampler row);
    stage 1 waits for it in its recv, then sends 400 ms late to stage 0: a victim. Every later step is 400 ms later."""
    world, stall = 3, 400 * MS
    rows = lockstep_tables(world=world, num_steps=30, pg="pp")
    rows["collectives"] = []
    for x in rows["steps"]:
        late = stall if x["step"] > STALL_STEP else 0
        x["start_ns"] += late
        x["end_ns"] += late + (stall if x["step"] == STALL_STEP else 0)
        x["bwd_ns"] += stall if x["step"] == STALL_STEP else 0
    for step in range(30):
        t = T0 + step * 100 * MS + (stall if step > STALL_STEP else 0)
        held = stall if step == STALL_STEP else 0
        jitter = (step * 3) % 5 * MS // 4
        pairs = [(0, 1, 10 * MS + jitter, 8 * MS), (1, 2, 20 * MS + jitter, 18 * MS),
                 (2, 1, 50 * MS + jitter + held, 45 * MS), (1, 0, 60 * MS + jitter + held, 45 * MS)]
        for src, dst, sent, posted in pairs:
            for rank, peer, op, enq in ((src, dst, "send", t + sent), (dst, src, "recv", t + posted)):
                rows["collectives"].append(_call(rank, "pp", "0,1,2", step + 1, op, enq, t + sent + 2 * MS, step,
                                                 peer=peer))
    return _with_rank_frozen(tmp_path, rows, world=world, rank=2, from_ns=T0 + STALL_STEP * 100 * MS + 48 * MS,
                             for_ns=stall)


def test_a_pipeline_stage_that_stalled_is_named_by_its_late_send_and_the_stage_it_held_up_is_not(tmp_path):
    a = _pipeline_with_a_stalled_stage(tmp_path)
    late = a.late_rank_per_step()
    links = late[(late["step"] == STALL_STEP) & (late["pg"] == "pp")].set_index("pg_ranks")
    assert links.loc["1,2", "late_rank"] == 2 and links.loc["0,1", "late_rank"] == 1      # both sends came late
    assert links.loc["1,2", "margin_ns"] == pytest.approx(405 * MS, abs=2 * MS)
    [stall] = a.rank_stalls().to_dict(orient="records")
    assert (stall["rank"], stall["step"], stall["kind"], stall["op"], stall["liveness"]) == (
        2, STALL_STEP, "late_arrival", "send", "frozen")
    [f] = [f for f in a.findings() if f.code == "RANK_STALL"]
    assert f.ranks == (2,) and f.severity == "warning"
    assert not [f for f in a.findings() if f.code in ("STRAGGLER", "HANG") and f.severity != "info"]


def _dp2_tp2_frozen_in_the_dp_all_reduce(tmp_path) -> RunAnalysis:
    """dp2 x tp2 of 100-ms steps: tp groups [0, 1] and [2, 3] all-reduce at +30 ms, dp groups [0, 2] and [1, 3]
    at +80 ms. In ``STALL_STEP`` rank 3 freezes for 400 ms inside the dp all-reduce (no sampler row), holding rank
    1 in it; both then reach the next step's tp all-reduce 400 ms after their tp peers, who wait for them there."""
    world, stall, held = 4, 400 * MS, {1, 3}

    def start(rank: int, step: int) -> int:
        behind = step > STALL_STEP + 1 or (step > STALL_STEP and rank in held)
        return T0 + step * 100 * MS + (stall if behind else 0)

    def group_time(step: int) -> int:       # where the ranks meet again: after the stall, 400 ms later
        return T0 + step * 100 * MS + (stall if step > STALL_STEP else 0)

    rows = lockstep_tables(world=world, num_steps=30, pg="dp")
    rows["collectives"] = []
    for x in rows["steps"]:
        longer = (x["step"] == STALL_STEP) == (x["rank"] in held) and x["step"] in (STALL_STEP, STALL_STEP + 1)
        x["start_ns"] = start(x["rank"], x["step"])
        x["end_ns"] = x["start_ns"] + 100 * MS + (stall if longer else 0)
    for step in range(30):
        for rank in range(world):
            tp, dp = ("0,1", "2,3")[rank // 2], ("0,2", "1,3")[rank % 2]
            jitter = (rank * 7 + step * 3) % 5 * MS // 4
            frozen = step == STALL_STEP and rank in held
            met = group_time(step)
            rows["collectives"] += [
                _call(rank, "tp", tp, step + 1, "allreduce", start(rank, step) + 30 * MS + jitter, met + 36 * MS, step),
                _call(rank, "dp", dp, step + 1, "allreduce", met + 80 * MS + jitter,
                      met + 86 * MS + (stall if frozen else 0), step)]
    return _with_rank_frozen(tmp_path, rows, world=world, rank=3, from_ns=T0 + STALL_STEP * 100 * MS + 84 * MS,
                             for_ns=stall)


def test_a_rank_frozen_in_a_dp_all_reduce_is_one_stall_and_its_held_dp_peer_is_no_stall(tmp_path):
    a = _dp2_tp2_frozen_in_the_dp_all_reduce(tmp_path)
    late = a.late_rank_per_step()
    after = late[(late["step"] == STALL_STEP + 1) & (late["pg"] == "tp")].set_index("pg_ranks")
    assert after.loc["0,1", "late_rank"] == 1 and after.loc["0,1", "margin_ns"] > 300 * MS   # rank 1 came late
    [stall] = a.rank_stalls().to_dict(orient="records")
    assert (stall["rank"], stall["step"], stall["kind"], stall["pg"], stall["liveness"]) == (
        3, STALL_STEP, "in_collective", "dp", "frozen")
    [f] = [f for f in a.findings() if f.code == "RANK_STALL"]
    assert f.ranks == (3,) and f.evidence["num_stalls"] == 1
    assert f.evidence["lost_ms"] == pytest.approx(400, abs=10)


def _between_steps_barrier_run(tmp_path, *, spanned: bool) -> RunAnalysis:
    """2 ranks, 30 steps of 100 ms. Before step 15, rank 0 works 2 s alone (it prepares the next epoch's data)
    while rank 1 waits in a barrier that no step numbers (step -1). ``spanned``: step 15's rows start where step 14
    ended, as ``dtprobe launch`` writes them, so they span the barrier; else they start after it (a script
    timing its own steps)."""
    rows = lockstep_tables(world=2, num_steps=30)
    gap, t15 = 2000 * MS, T0 + 15 * 100 * MS
    for table, cols in (("steps", ("start_ns", "end_ns")), ("collectives", ("enqueue_ns", "start_ns", "end_ns"))):
        for x in rows[table]:
            if x["step"] >= 15:
                for col in cols:
                    x[col] += gap
                if table == "steps" and x["step"] == 15 and spanned:
                    x["start_ns"] = t15
    for r, at in ((0, t15 + gap - MS), (1, t15 + MS)):
        rows["collectives"].append({"rank": r, "pg": "dp", "pg_ranks": "0,1", "pg_size": 2, "seq": 1000,
                                    "op": "barrier", "num_bytes": 0, "dtype": None, "enqueue_ns": at,
                                    "start_ns": at, "end_ns": t15 + gap, "step": -1, "timing": "host",
                                    "restart": 0})
    rows["devices"] = sampler_rows(0, T0, T0 + 3000 * MS + gap) + sampler_rows(1, T0, T0 + 3000 * MS + gap)
    for x in rows["lifecycle"]:
        if x["event"] == "close":
            x["time_ns"] += gap
    return RunAnalysis.open(write_rows_run(tmp_path / "run", rows, world_size=2, status="finished"))


def test_a_rank_the_others_waited_for_in_a_barrier_between_two_steps_is_a_rank_stall_of_the_next_step(tmp_path):
    # dtprobe launch: no step is open between an optimizer step and the next forward, but the next step's row
    # starts where the last one ended; a barrier there, where rank 0 came 2 s late, is that step's stall
    a = _between_steps_barrier_run(tmp_path, spanned=True)
    [f] = [f for f in a.findings() if f.code == "RANK_STALL"]
    [stall] = f.evidence["stalls"]
    assert (f.ranks, stall["step"], stall["op"], stall["kind"]) == ((0,), 15, "barrier", "late_arrival")
    assert stall["stall_ms"] == pytest.approx(2000 - 2, abs=1)
    assert f.evidence["liveness"] == "running" and f.severity == "critical"    # 2 s of a 5 s run


def test_a_barrier_between_steps_that_no_step_row_spans_is_no_rank_stall(tmp_path):
    # steps a script times itself: the time between them is in no step, so no step's stall
    a = _between_steps_barrier_run(tmp_path, spanned=False)
    assert "RANK_STALL" not in [f.code for f in a.findings()]
    assert a.rank_stalls().empty
