"""Metrics and detectors other than stragglers, on hand-made tables with known answers."""

from __future__ import annotations

import json
import math

import pandas as pd
import pytest
from analysis_synth import MS, T0, dp_tables, pipeline_tables

from dtprobe.analysis import amp, bubble, checkpoints, comm_efficiency, compression, devices, exposed_comm, hangs
from dtprobe.analysis import peaks, stragglers, throughput
from dtprobe.store.frames import frame_from_rows

# ---------------------------------------------------------------------------------------------------- bubble


@pytest.mark.parametrize("schedule,pp,m,ideal", [("gpipe", 4, 4, 3 / 7), ("gpipe", 2, 4, 1 / 5), ("1f1b", 4, 8, 3 / 11)])
def test_pipeline_bubble_measures_the_schedules_idle_share(schedule, pp, m, ideal):
    t = pipeline_tables(schedule=schedule, pp=pp, microbatches=m)
    by_rank = bubble.bubble_by_rank(bubble.pipeline_bubble(t["pipeline"]))
    assert by_rank["bubble_frac"].mean() == pytest.approx(ideal, abs=1e-6)
    shape = bubble.pipeline_shape(t["pipeline"], schedule=schedule)
    assert (shape.num_ranks, shape.num_microbatches, shape.virtual_stages) == (pp, m, 1)
    assert bubble.ideal_bubble(shape)[0] == pytest.approx(ideal, abs=1e-6)


def test_pipeline_bubble_finding_on_gpipe_pp4_mb4_predicts_gain_of_more_microbatches():
    t = pipeline_tables(schedule="gpipe", pp=4, microbatches=4, f_ms=10, b_ms=20)
    by_rank = bubble.bubble_by_rank(bubble.pipeline_bubble(t["pipeline"]))
    shape = bubble.pipeline_shape(t["pipeline"])          # schedule inferred from the action order
    assert shape.schedule == "gpipe"
    [f] = bubble.detect_pipeline_bubble(by_rank, shape, step_ns=210 * MS)
    assert (f.code, f.group, f.ranks) == ("PIPELINE_BUBBLE", "pp", (0, 1, 2, 3))
    assert f.evidence["ideal_bubble_frac"] == pytest.approx(3 / 7)
    assert f.evidence["ideal_bubble_frac_2x_microbatches"] == pytest.approx(3 / 11)
    # (4+3) x 30 ms -> (8+3) x 15 ms: 1 - 165/210
    assert f.predicted_gain.metric == "step_time"
    assert f.predicted_gain.frac == pytest.approx(1 - 165 / 210, abs=1e-6)
    assert "from 4 to 8" in f.recommendation


def test_the_schedule_is_inferred_from_the_last_whole_step_not_one_cut_after_its_forwards():
    t = pipeline_tables(schedule="1f1b", pp=2, microbatches=4, num_steps=3)
    assert bubble.pipeline_shape(t["pipeline"]).schedule == "1f1b"
    p = t["pipeline"]
    last = p["step"] == p["step"].max()
    cut = p[~last | (p["action"] == "F")]          # the run was stopped after the last step's forwards
    assert bubble.pipeline_shape(cut).schedule == "1f1b"
    assert bubble.pipeline_shape(pipeline_tables(schedule="gpipe", pp=2, microbatches=4, num_steps=3)["pipeline"]
                                 ).schedule == "gpipe"


def test_pipeline_bubble_reports_the_excess_when_p2p_gaps_stretch_the_step():
    t = pipeline_tables(schedule="gpipe", pp=4, microbatches=4, p2p_gap_ms=5.0)
    by_rank = bubble.bubble_by_rank(bubble.pipeline_bubble(t["pipeline"]))
    [f] = bubble.detect_pipeline_bubble(by_rank, bubble.pipeline_shape(t["pipeline"]), step_ns=None)
    assert f.evidence["measured_bubble_frac"] > f.evidence["ideal_bubble_frac"] + 0.05


@pytest.mark.parametrize("name,expected", [("GPipe", "gpipe"), ("Interleaved1F1B", "interleaved-1f1b"),
                                           ("ScheduleZBVZeroBubble", "zbv"), ("zero-bubble", "zero-bubble"),
                                           ("nonsense", None)])
def test_normalize_schedule_maps_torch_and_planner_names(name, expected):
    assert bubble.normalize_schedule(name) == expected


# ---------------------------------------------------------------------------------------------------- AMP


def _amp(rows):
    return frame_from_rows("amp", [{"rank": r, **row} for row in rows for r in range(2)])


def _scale_rows(num_steps, overflow_steps, start=65536.0):
    rows, scale = [], start
    for s in range(num_steps):
        over = s in overflow_steps
        after = scale / 2 if over else scale
        rows.append({"step": s, "scale_before": scale, "scale_after": after, "found_inf": over, "skipped": over})
        scale = after
    return rows


@pytest.mark.parametrize("overflows,severity", [
    ({3}, "info"),                          # one overflow in 40 steps: how dynamic scaling works
    ({3, 4, 5}, "warning"),                 # a burst of 3
    (set(range(0, 40, 2)), "critical"),     # half the tail overflows
])
def test_amp_overflow_severity_follows_rate_and_bursts(overflows, severity):
    per_step = amp.amp_steps(_amp(_scale_rows(40, overflows)))
    [f] = amp.detect_amp_overflow(per_step)
    assert f.code == "AMP_OVERFLOW" and f.severity == severity
    assert f.evidence["num_overflows"] == len(overflows)
    assert f.evidence["overflow_rate"] == pytest.approx(len(overflows) / 40)


def test_amp_overflow_is_critical_when_the_scale_sits_at_its_floor():
    per_step = amp.amp_steps(_amp(_scale_rows(20, {15}, start=1.0)))
    [f] = amp.detect_amp_overflow(per_step)
    assert f.severity == "critical" and f.evidence["at_floor"] is True


def test_amp_overflow_detects_a_drop_in_scale_without_found_inf_and_names_the_ranks():
    rows = [{"rank": 0, "step": 0, "scale_before": 8.0, "scale_after": 8.0, "found_inf": False},
            {"rank": 0, "step": 1, "scale_before": 8.0, "scale_after": 4.0},
            {"rank": 1, "step": 1, "scale_before": 8.0, "scale_after": 4.0, "found_inf": True}]
    per_step = amp.amp_steps(frame_from_rows("amp", rows))
    assert per_step["overflow"].tolist() == [False, True]
    assert amp.detect_amp_overflow(per_step)[0].ranks == (1,)


def test_amp_no_finding_without_overflow():
    assert amp.detect_amp_overflow(amp.amp_steps(_amp(_scale_rows(10, set())))) == []


# ---------------------------------------------------------------------------------------------------- checkpoints


def _ckpt(blocking_ms, every, num_steps=40, ranks=2, slow_rank=1):
    rows = []
    for s in range(every - 1, num_steps, every):
        for r in range(ranks):
            b = blocking_ms * (2 if r == slow_rank else 1)
            rows.append({"rank": r, "step": s, "kind": "save", "start_ns": T0 + s * 100 * MS,
                         "blocking_ns": int(b * MS), "async_ns": 0, "total_ns": int(b * MS), "num_bytes": 1 << 20,
                         "ok": True})
    return frame_from_rows("checkpoints", rows)


def test_checkpoint_stall_on_slow_blocking_saves_with_young_daly_interval():
    events = checkpoints.checkpoint_events(_ckpt(500, every=5))
    assert events["blocking_max_ns"].iloc[0] == 1000 * MS and events["slowest_rank"].iloc[0] == 1
    wall = 40 * 100 * MS + 8 * 1000 * MS
    summary = checkpoints.checkpoint_summary(events, wall_ns=wall, step_ns=100 * MS, mtbf_hours=24)
    assert summary["blocking_share_of_wall"] == pytest.approx(8 / 12)
    assert summary["young_daly_interval_s"] == pytest.approx(math.sqrt(2 * 1.0 * 24 * 3600))
    assert summary["interval_steps"] == 5
    [f] = checkpoints.detect_checkpoint_stall(events, summary)
    assert (f.code, f.severity, f.ranks) == ("CHECKPOINT_STALL", "critical", (1,))
    assert "async" in f.recommendation.lower()
    # interval 0.5 s vs Young/Daly 416 s: nearly all the blocking share is saved
    assert f.predicted_gain.metric == "wall_time" and f.predicted_gain.frac == pytest.approx(8 / 12 - 1 / 415.69, abs=1e-3)


def test_checkpoint_stall_of_a_save_only_rank_0_makes_says_its_peers_wait_for_it():
    one = _ckpt(300, every=5, ranks=1, slow_rank=-1)       # a torch.save under `if rank == 0:`
    events = checkpoints.checkpoint_events(one)
    summary = checkpoints.checkpoint_summary(events, wall_ns=40 * 100 * MS + 8 * 300 * MS, step_ns=100 * MS,
                                             checkpoints=one)
    [f] = checkpoints.detect_checkpoint_stall(events, summary, world_size=4)
    assert f.ranks == (0,)
    assert "Rank 0 alone saves" in f.recommendation and "other 3 rank(s) wait" in f.recommendation
    assert "storage path" not in f.recommendation
    # a rank that blocks longest among savers, or a single-rank job, keeps the storage advice
    for rows, world in ((_ckpt(300, every=5, ranks=4, slow_rank=2), 4), (one, 1)):
        events = checkpoints.checkpoint_events(rows)
        summary = checkpoints.checkpoint_summary(events, wall_ns=40 * 100 * MS + 8 * 600 * MS, step_ns=100 * MS,
                                                 checkpoints=rows)
        [f] = checkpoints.detect_checkpoint_stall(events, summary, world_size=world)
        assert "alone saves" not in f.recommendation and "storage path" in f.recommendation


def test_checkpoint_stall_absent_when_saves_are_cheap():
    events = checkpoints.checkpoint_events(_ckpt(1, every=20))
    summary = checkpoints.checkpoint_summary(events, wall_ns=40 * 100 * MS, step_ns=100 * MS)
    assert checkpoints.detect_checkpoint_stall(events, summary) == []


def test_young_daly_interval_formula():
    assert checkpoints.young_daly_interval_s(60.0, 3600.0 * 24) == pytest.approx(math.sqrt(2 * 60 * 86400))


# ---------------------------------------------------------------------------------------------------- hangs


def _hang_coll(missing_rank=3, seq=5):
    rows = []
    for s in range(1, seq + 1):
        for r in range(4):
            if s == seq and r == missing_rank:
                continue
            rows.append({"rank": r, "pg": "dp", "pg_ranks": "0,1,2,3", "pg_size": 4, "seq": s, "op": "allreduce",
                         "num_bytes": 4096, "enqueue_ns": T0 + s * 100 * MS + r * MS,
                         "end_ns": None if s == seq else T0 + s * 100 * MS + 10 * MS, "step": s})
    return frame_from_rows("collectives", rows)


def test_hang_names_the_rank_that_never_arrived_and_the_collective():
    coll = _hang_coll(missing_rank=2)
    skew = stragglers.collective_skew(coll)
    missing = hangs.missing_arrivals(skew, coll, now_ns=T0 + 900 * MS, min_wait_ns=0)
    [f] = hangs.detect_hangs(missing, frame_from_rows("faults", []),
                             last_seen=hangs.last_seen(frame_from_rows("steps", []), coll))
    assert (f.code, f.severity, f.ranks, f.group) == ("HANG", "critical", (2,), "dp")
    assert (f.evidence["op"], f.evidence["seq"], f.evidence["arrived_ranks"]) == ("allreduce", 5, [0, 1, 3])
    assert f.evidence["missing_last_seen"]["2"]["last_collective"] == "dp#4 allreduce"


def test_a_collective_the_arrived_ranks_finished_is_not_a_hang_on_the_rank_whose_row_is_missing():
    # rank 2 took part in allreduce #5 (the others finished it) but its row was lost, e.g. the rank was killed
    # before its buffered rows were written: no HANG, and a real hang later in the group is still found
    coll = _hang_coll(missing_rank=2)
    coll.loc[coll["seq"] == 5, "end_ns"] = T0 + 510 * MS
    skew = stragglers.collective_skew(coll)
    assert hangs.missing_arrivals(skew, coll, now_ns=T0 + 900 * MS, min_wait_ns=0).empty
    later = _hang_coll(missing_rank=1, seq=6)
    later = later[~((later["seq"] == 5) & (later["rank"] == 2))]
    later.loc[later["seq"] == 5, "end_ns"] = T0 + 510 * MS
    missing = hangs.missing_arrivals(stragglers.collective_skew(later), later, now_ns=T0 + 900 * MS, min_wait_ns=0)
    assert missing[["seq", "missing_ranks"]].values.tolist() == [[6, "1"]]


def test_hang_needs_the_timeout_while_the_run_is_still_running():
    coll = _hang_coll()
    skew = stragglers.collective_skew(coll)
    assert hangs.missing_arrivals(skew, coll, now_ns=T0 + 510 * MS, min_wait_ns=60 * 10**9).empty


def test_a_watchdog_fault_row_is_evidence_of_the_hang_the_collective_rows_show_never_the_verdict():
    faults = frame_from_rows("faults", [{"rank": 0, "time_ns": T0, "step": 7, "kind": "hang", "injected": False,
                                         "detail": json.dumps({"waiting_for_ranks": [3], "pg": "dp", "op": "allreduce"})}])
    assert hangs.detect_hangs(pd.DataFrame({c: [] for c in hangs.MISSING_COLUMNS}), faults) == []
    coll = _hang_coll(missing_rank=3)
    missing = hangs.missing_arrivals(stragglers.collective_skew(coll), coll, now_ns=T0 + 900 * MS, min_wait_ns=0)
    [f] = hangs.detect_hangs(missing, faults)
    assert (f.ranks, f.group, f.evidence["watchdog_report"]["reported_by"]) == ((3,), "dp", 0)


def test_rank_crash_is_a_warning_when_the_run_recovered():
    from dtprobe.analysis import crashes, liveness

    steps = frame_from_rows("steps", [{"rank": r, "step": s, "start_ns": T0 + s * 100 * MS + k * 10**9,
                                       "end_ns": T0 + (s + 1) * 100 * MS + k * 10**9, "restart": k}
                                      for r in range(2) for k, s_ in ((0, range(10 + (r == 0))), (1, range(9, 12)))
                                      for s in s_])
    lifecycle = frame_from_rows("lifecycle", [
        {"rank": 1, "restart": 0, "time_ns": T0, "event": "attach"},     # killed: no close
        {"rank": 0, "restart": 0, "time_ns": T0, "event": "attach"},
        {"rank": 0, "restart": 0, "time_ns": T0 + 1100 * MS, "event": "close", "status": "crashed",
         "reason": "SIGTERM"}])
    exits = liveness.rank_exits([], lifecycle)
    tables = {"steps": steps, "lifecycle": lifecycle}

    def events(s):
        return crashes.crash_events(exits, activity=liveness.Activity(tables), collectives=frame_from_rows(
            "collectives", []), steps=s, devices=frame_from_rows("devices", []), restarts=[], status="finished",
            attempts_known=False, stale_ns=60 * 10**9, now_ns=T0 + 2 * 10**9)
    [f] = crashes.detect_crashes(events(steps))
    assert (f.code, f.severity, f.ranks, f.evidence["step"], f.evidence["resumed_from_step"]) == (
        "RANK_CRASH", "warning", (1,), 10, 9)
    [f] = crashes.detect_crashes(events(steps[steps["restart"] == 0]))
    assert f.severity == "critical"


def test_crash_verdicts_read_the_liveness_tables_only_when_an_attempt_may_have_failed():
    # a large run's signs of life (every sampler row) are read only when a rank may be lost, never on a clean end
    from dtprobe.analysis import crashes, liveness

    steps = frame_from_rows("steps", [{"rank": r, "step": s, "start_ns": T0 + s * 100 * MS,
                                       "end_ns": T0 + (s + 1) * 100 * MS, "restart": 0}
                                      for r in range(2) for s in range(10 - r)])
    reads = []

    def tables():
        reads.append("activity")
        return {"steps": steps, "lifecycle": lifecycle}

    def devices():
        reads.append("devices")
        return frame_from_rows("devices", [{"rank": 1, "time_ns": T0 + 950 * MS, "xid": 79}])

    def events(status):
        return crashes.crash_events(liveness.rank_exits([], lifecycle), activity=liveness.Activity(tables),
                                    collectives=frame_from_rows("collectives", []), steps=steps, devices=devices,
                                    restarts=[], status=status, attempts_known=False, stale_ns=60 * 10**9,
                                    now_ns=T0 + 2 * 10**9)
    lifecycle = frame_from_rows("lifecycle", [
        {"rank": r, "restart": 0, "time_ns": t, "event": e, "status": "finished" if e == "close" else None}
        for r in range(2) for t, e in ((T0, "attach"), (T0 + 1100 * MS, "close"))])
    assert events("finished").empty and reads == []
    lifecycle = lifecycle[~((lifecycle["rank"] == 1) & (lifecycle["event"] == "close"))]    # rank 1 never closed
    [crash] = events("finished").to_dict("records")
    assert (crash["rank"], crash["step"], crash["cause"]) == (1, 9, "device")
    assert reads == ["activity", "devices"]


# ---------------------------------------------------------------------------------------------------- comm


@pytest.mark.parametrize("op,n,factor", [("allreduce", 4, 1.5), ("allreduce", 2, 1.0), ("allgather", 4, 0.75),
                                         ("reduce_scatter", 8, 7 / 8), ("broadcast", 4, 1.0), ("send", 2, 1.0),
                                         ("alltoall", 4, 0.75)])
def test_busbw_factors_follow_nccl_tests(op, n, factor):
    assert comm_efficiency.busbw_factor(op, n) == pytest.approx(factor)


def _sized_coll(sizes, alpha_us=50.0, gbps=8.0, n=4, count=20, counts=None):
    rows, seq = [], 0
    beta = gbps * 1e9 / 8
    for i, size in enumerate(sizes):
        for _ in range(counts[i] if counts else count):
            seq += 1
            dur = int(alpha_us * 1000 + size / beta * 1e9)
            for r in range(n):
                rows.append({"rank": r, "pg": "dp", "pg_ranks": ",".join(map(str, range(n))), "pg_size": n,
                             "seq": seq, "op": "allreduce", "num_bytes": size, "enqueue_ns": T0 + seq * 10 * MS + r,
                             "end_ns": T0 + seq * 10 * MS + n + dur, "step": seq // 10, "timing": "host"})
    return frame_from_rows("collectives", rows)


def test_comm_efficiency_fits_latency_and_bandwidth_and_computes_busbw():
    bw = comm_efficiency.collective_bandwidth(_sized_coll([4096, 65536, 1 << 20, 8 << 20]))
    alpha, beta = comm_efficiency.latency_bandwidth_fit(bw)
    assert alpha == pytest.approx(50_000, rel=0.02) and beta == pytest.approx(1e9, rel=0.02)
    big = bw[bw["num_bytes"] == 8 << 20].iloc[0]
    assert big["busbw_bytes_per_s"] == pytest.approx(big["algbw_bytes_per_s"] * 1.5)


def test_comm_inefficient_on_latency_bound_small_messages_recommends_a_bucket_size():
    coll = _sized_coll([4096, 8192, 16 << 20], counts=[400, 400, 2])
    bw = comm_efficiency.collective_bandwidth(coll)
    fit = comm_efficiency.latency_bandwidth_fit(bw)
    by_size = comm_efficiency.bandwidth_by_size(bw, fit=fit)
    assert by_size.set_index("size_bytes").loc[4096, "latency_bound"]
    [f] = comm_efficiency.detect_comm_inefficient(bw, by_size, fit=fit, step_ns=100 * MS, num_steps=80)
    assert f.code == "COMM_INEFFICIENT" and f.evidence["latency_bound_share"] > 0.5
    # half-bandwidth size = 50 us x 1 GB/s = 50 kB; advice: >= 4x, rounded up to a power of two
    assert f.evidence["half_bandwidth_bytes"] == pytest.approx(50_000, rel=0.05)
    assert f.evidence["recommended_bucket_bytes"] == 262144
    assert f.predicted_gain is not None and f.predicted_gain.frac > 0


def test_comm_efficiency_flags_busbw_below_the_given_link_peak():
    coll = _sized_coll([8 << 20], gbps=8.0)
    bw = comm_efficiency.collective_bandwidth(coll)
    by_size = comm_efficiency.bandwidth_by_size(bw)
    [f] = comm_efficiency.detect_comm_inefficient(bw, by_size, fit=None, step_ns=None, num_steps=1,
                                                  peak_busbw_bytes_per_s=100e9 / 8)
    assert f.evidence["peak_frac"] < 0.2


# ---------------------------------------------------------------------------------------------------- compression


def _compression_rows(ratio=4, encode_ms=1.0):
    return frame_from_rows("compression", [
        {"rank": r, "step": s, "bucket": 0, "method": "topk", "raw_bytes": 4 << 20, "sent_bytes": (4 << 20) // ratio,
         "encode_ns": int(encode_ms * MS), "decode_ns": int(encode_ms * MS)} for r in range(2) for s in range(10)])


def test_compression_reports_ratio_time_saved_and_loss_gap():
    summary = compression.compression_summary(_compression_rows(ratio=4))
    assert summary["ratio"].iloc[0] == pytest.approx(4.0) and summary["bytes_saved_frac"].iloc[0] == 0.75
    steps = frame_from_rows("steps", [{"rank": 0, "step": s, "loss": 2.0} for s in range(10)])
    base = frame_from_rows("steps", [{"rank": 0, "step": s, "loss": 1.9} for s in range(10)])
    gap = compression.loss_gap(steps, base)
    assert gap["loss_gap_frac"].iloc[0] == pytest.approx(0.1 / 1.9)
    [f] = compression.detect_compression(summary, gap, algbw_bytes_per_s=1e9, step_ns=100 * MS, baseline="b")
    assert f.code == "COMPRESSION" and f.severity == "warning"            # 5% worse loss
    assert f.evidence["transfer_saved_ms_per_step"] == pytest.approx(3 * (1 << 20) / 1e9 * 1e3)
    assert f.evidence["net_saved_ms_per_step"] == pytest.approx(3 * (1 << 20) / 1e6 - 2.0)


def test_compression_is_info_without_baseline_and_warns_when_encoding_costs_more():
    summary = compression.compression_summary(_compression_rows(encode_ms=10.0))
    [f] = compression.detect_compression(summary, None, algbw_bytes_per_s=10e9, step_ns=100 * MS)
    assert f.severity == "warning" and f.predicted_gain.frac > 0
    [g] = compression.detect_compression(compression.compression_summary(_compression_rows(encode_ms=0.01)), None,
                                         algbw_bytes_per_s=1e9, step_ns=100 * MS)
    assert g.severity == "info" and g.evidence["loss_gap_frac"] is None


# ---------------------------------------------------------------------------------------------------- devices


def test_device_health_flags_throttle_xid_and_memory_pressure():
    rows = []
    for i in range(10):
        rows.append({"rank": 0, "gpu": 0, "time_ns": T0 + i, "throttle_reasons": 0x20 if i < 5 else 0x1,
                     "power_w": 300.0, "power_limit_w": 400.0, "mem_used_bytes": 79 << 30, "mem_total_bytes": 80 << 30})
        rows.append({"rank": 1, "gpu": 1, "time_ns": T0 + i, "throttle_reasons": 0x1, "xid": 79 if i == 3 else 0,
                     "power_w": 100.0, "power_limit_w": 400.0, "mem_used_bytes": 10 << 30, "mem_total_bytes": 80 << 30})
    health = devices.device_health(frame_from_rows("devices", rows)).set_index("rank")
    assert health.loc[0, "throttled_frac"] == 0.5 and health.loc[0, "reasons"] == "sw_thermal"
    assert health.loc[1, "throttled_frac"] == 0.0        # GPU idle is not throttling
    found = {(f.code, f.ranks) for f in devices.detect_device_health(health.reset_index())}
    assert found == {("DEVICE_THROTTLE", (0,)), ("MEMORY_PRESSURE", (0,)), ("DEVICE_XID", (1,))}


def test_device_health_has_no_gpu_verdicts_on_host_only_samples():
    rows = [{"rank": 0, "time_ns": T0 + i, "source": "host", "cpu_frac": 0.9, "rss_bytes": 1 << 30} for i in range(5)]
    health = devices.device_health(frame_from_rows("devices", rows))
    assert devices.detect_device_health(health) == []


# ---------------------------------------------------------------------------------------------------- MFU


def test_preset_flops_match_the_runtime_model_formula():
    h, f, n, v, s = 128, 512, 4, 256, 64
    expected = 3.0 * (2 * n * (4 * h * h + 2 * h * f) + 2 * n * 2 * s * h + 2 * h * v)
    assert peaks.preset_flops_per_token("tiny", 64) == expected


@pytest.mark.parametrize("device,dtype,peak", [("NVIDIA A100-SXM4-80GB", "bf16", 312e12),
                                               ("NVIDIA H100 80GB HBM3", "fp16", 989e12),
                                               ("Tesla V100-SXM2-32GB", "fp32", 15.7e12)])
def test_peak_flops_looked_up_by_device_and_dtype(device, dtype, peak):
    assert peaks.peak_flops(device, dtype)[0] == peak


@pytest.mark.parametrize("device,reason", [("cpu", "CPU"), (None, "unknown"), ("Mystery GPU", "not in")])
def test_peak_flops_is_none_with_a_reason_never_a_guess(device, reason):
    value, why = peaks.peak_flops(device, "bf16")
    assert value is None and reason in why


def test_throughput_and_mfu_per_step():
    steps = frame_from_rows("steps", [{"rank": r, "step": 0, "start_ns": T0, "end_ns": T0 + 500 * MS, "tokens": 1000}
                                      for r in range(2)])
    per = throughput.throughput(steps, flops_per_token=1e9, peak_flops_per_device=1e12, num_devices=2)
    assert per["tokens_per_s"].iloc[0] == pytest.approx(4000)
    assert per["mfu"].iloc[0] == pytest.approx(4000 * 1e9 / 2e12)
    cpu = throughput.throughput(steps, flops_per_token=1e9, peak_flops_per_device=None, num_devices=2)
    summary = throughput.throughput_summary(cpu, step_ids=[0], peak_reason="CPU: no declared peak",
                                            flops_per_token=1e9)
    assert summary["mfu"] is None and "CPU" in summary["mfu_reason"]


# ---------------------------------------------------------------------------------------------------- exposure


def test_comm_exposure_separates_the_tail_from_straggler_wait():
    t = dp_tables(straggler=2, delay_ms=20, num_steps=5, jitter_ms=0.0, num_buckets=1, xfer_ms=3.0)
    skew = stragglers.collective_skew(t["collectives"])
    e = exposed_comm.comm_exposure(t["collectives"], t["steps"], skew).set_index(["rank", "step"])
    # victims: 20 ms waiting for rank 2 + 3 ms transfer in the tail; the culprit only the 3 ms transfer
    assert e.loc[(0, 3), "exposed_ns"] == pytest.approx(23 * MS, abs=0.01 * MS)
    assert e.loc[(0, 3), "straggler_wait_ns"] == pytest.approx(20 * MS, abs=0.01 * MS)
    assert e.loc[(2, 3), "exposed_net_ns"] == pytest.approx(3 * MS, abs=0.01 * MS)
    by_rank = exposed_comm.exposure_by_rank(e.reset_index())
    assert exposed_comm.detect_exposed_comm(by_rank) == []          # 3 ms of 100+ ms: hidden enough


def test_a_pipeline_stage_waiting_in_its_recv_for_the_next_stage_is_not_exposed_communication():
    # stage 0 sends activations at 10 ms, posts its recv of the gradients at 20 ms; stage 1 sends them at 60 ms
    def call(rank: int, op: str, peer: int, seq: int, at_ms: float, end_ms: float) -> dict:
        return {"rank": rank, "pg": "pp", "pg_ranks": "0,1", "pg_size": 2, "seq": seq, "op": op, "peer": peer,
                "num_bytes": 1 << 20, "dtype": "float32", "enqueue_ns": T0 + int(at_ms * MS),
                "end_ns": T0 + int(end_ms * MS), "step": 0, "restart": 0, "timing": "host"}

    colls = frame_from_rows("collectives", [call(0, "send", 1, 1, 10, 12), call(1, "recv", 0, 1, 8, 12),
                                            call(1, "send", 0, 1, 60, 62), call(0, "recv", 1, 1, 20, 62)])
    steps = frame_from_rows("steps", [{"rank": r, "step": 0, "start_ns": T0, "end_ns": T0 + 100 * MS}
                                      for r in (0, 1)])
    e = exposed_comm.comm_exposure(colls, steps, stragglers.collective_skew(colls)).set_index("rank")
    assert e.loc[0, "exposed_ns"] == pytest.approx(42 * MS)              # from its last call (20 ms) to 62 ms
    assert e.loc[0, "straggler_wait_ns"] == pytest.approx(40 * MS)       # 40 ms of it waiting for stage 1's send
    assert e.loc[0, "exposed_net_ns"] == pytest.approx(2 * MS)
    assert (e.loc[1, "exposed_ns"], e.loc[1, "straggler_wait_ns"]) == (2 * MS, 0)   # its recv came after the send


def test_exposed_comm_finding_when_the_tail_is_long():
    t = dp_tables(num_steps=5, jitter_ms=0.0, num_buckets=1, xfer_ms=40.0)
    skew = stragglers.collective_skew(t["collectives"])
    by_rank = exposed_comm.exposure_by_rank(exposed_comm.comm_exposure(t["collectives"], t["steps"], skew))
    [f] = exposed_comm.detect_exposed_comm(by_rank)
    assert f.code == "EXPOSED_COMM" and f.ranks == (0, 1, 2, 3)
    assert f.predicted_gain.frac == pytest.approx(40 / 136, abs=0.02)
    assert f.evidence["slow_links"] == [] and f.recommendation.startswith("Hide communication behind compute")
    # a link that slowed down comes first in the advice: overlap does not undo it
    [f] = exposed_comm.detect_exposed_comm(by_rank, slow_links=[{"nodes": ["n0", "n1"], "changed_at_step": 3}])
    assert f.evidence["slow_links"] == [{"nodes": ["n0", "n1"], "changed_at_step": 3}]
    assert f.recommendation.startswith("The link n0 <-> n1 slowed down from step 3 (SLOW_LINK)")


def test_a_collective_missed_by_a_crashed_rank_is_reported_as_rank_crash_not_hang():
    from dtprobe.analysis import crashes, liveness

    coll = _hang_coll(missing_rank=3, seq=5)
    skew = stragglers.collective_skew(coll)
    missing = hangs.missing_arrivals(skew, coll, now_ns=T0 + 900 * MS, min_wait_ns=0)
    attempts = [{"attempt": 0, "result": "failed", "ranks": [
        {"rank": 3, "exit_code": -9, "signal": "SIGKILL", "first_failure": True, "time_ns": T0 + 480 * MS}]
        + [{"rank": r, "exit_code": -15, "signal": "SIGTERM", "time_ns": T0 + 600 * MS} for r in range(3)]}]
    exits = liveness.rank_exits(attempts, frame_from_rows("lifecycle", []))
    activity = liveness.Activity({"collectives": coll})
    faults = frame_from_rows("faults", [])
    assert hangs.detect_hangs(missing, faults, activity=activity, exits=exits) == []
    events = crashes.crash_events(exits, activity=activity, collectives=coll, steps=frame_from_rows("steps", []),
                                  devices=frame_from_rows("devices", []), restarts=[], status="crashed",
                                  attempts_known=True, stale_ns=60 * 10**9, now_ns=T0 + 900 * MS)
    [f] = crashes.detect_crashes(events, missing=missing)
    assert (f.code, f.ranks, f.severity) == ("RANK_CRASH", (3,), "critical")
    assert [(w["op"], w["seq"], w["arrived_ranks"]) for w in f.evidence["waited_at"]] == [("allreduce", 5, [0, 1, 2])]


def test_group_codes_of_a_collectives_frame_are_computed_once_and_not_for_its_copies(monkeypatch):
    from dtprobe.analysis import tables

    c = dp_tables(world=3, num_steps=4)["collectives"]
    calls = []
    real = tables.group_codes
    monkeypatch.setattr(tables, "group_codes", lambda pg, pr: calls.append(len(pg)) or real(pg, pr))
    every = pd.Series(True, index=c.index)
    first = tables.coded_rows(c, every, ["rank", "seq"])
    again = tables.coded_rows(c, c["rank"] == 1, ["rank", "seq"])
    assert calls == [len(c)]                                        # the second analysis reused the codes
    assert (again[1] == first[1][(c["rank"] == 1).to_numpy()]).all() and list(again[2]) == list(first[2])
    expected = c["pg"].astype(str) + "|" + c["pg_ranks"].astype(str)  # one code per (pg, pg_ranks) pair
    assert pd.Series(first[1]).groupby(expected.to_numpy()).nunique().eq(1).all()
    tables.coded_rows(c.iloc[:5], every.iloc[:5], ["rank"])
    tables.coded_rows(c.copy(), every, ["rank"])
    assert calls == [len(c), 5, len(c)]                             # a slice or a copy is coded afresh


def test_last_seen_names_each_ranks_latest_arrival_whatever_the_row_order():
    def row(rank, step, seq, enqueue):
        return {"rank": rank, "step": step, "pg": "dp", "pg_ranks": "0,1,2", "seq": seq, "op": "allreduce",
                "enqueue_ns": enqueue}

    coll = frame_from_rows("collectives", [
        row(1, 5, 11, T0 + 50 * MS), row(0, 4, 10, T0 + 40 * MS), row(1, 4, 10, T0 + 41 * MS),
        row(0, 3, 9, T0 + 45 * MS),                   # recorded after step 4's row, but arrived later
        row(0, 5, 11, None),                          # never enqueued (a row without timing): not an arrival
        row(2, 2, 7, T0 + 9 * MS), row(2, 3, 8, T0 + 9 * MS)])     # equal arrivals: the later row
    seen = hangs.last_seen(frame_from_rows("steps", []), coll).set_index("rank")
    assert seen["last_collective"].to_dict() == {0: "dp#9 allreduce", 1: "dp#11 allreduce", 2: "dp#8 allreduce"}
    assert seen["last_step"].to_dict() == {0: 3, 1: 5, 2: 3}
