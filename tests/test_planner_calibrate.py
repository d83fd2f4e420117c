"""Tests for dtprobe.planner.calibrate on run directories written here with the store's own writers."""

from __future__ import annotations

import pytest

from dtprobe.planner import Efficiency, model_preset
from dtprobe.planner.calibrate import calibrate
from dtprobe.store.errors import ConfigError, TraceError
from dtprobe.store.manifest import create_manifest, set_status, write_rank_info
from dtprobe.store.writer import RankWriter

ALPHA_S, BW = 50e-6, 1e9          # the synthetic network: 50 us per hop, 1 GB/s
MS = 1_000_000


def _ring_ns(op: str, n: int, num_bytes: int) -> int:
    hops, factor = (2 * (n - 1), 2 * (n - 1) / n) if op == "allreduce" else (n - 1, (n - 1) / n)
    return int(round((hops * ALPHA_S + factor * num_bytes / BW) * 1e9))


def write_dp2_tp2_run(run_dir, *, steps: int = 8, device: str = "cpu", config: dict | None = None):
    """A 4-rank dp2 x tp2 tiny-GPT run: 24 TP all-reduces per step (2 per layer in forward, 4 in backward: the
    built-in GPT's separate q/k/v linears), 3 DP gradient buckets at the end of backward."""
    cfg = config if config is not None else {
        "model": {"name": "tiny"},
        "layout": {"dp": 2, "tp": 2, "pp": 1, "zero": 0, "pp_schedule": "1f1b", "microbatches": 0,
                   "virtual_stages": 0, "sequence_parallel": False, "activation_checkpointing": "none"},
        "train": {"batch_size": 8, "seq_len": 64, "grad_accum": 1}}
    create_manifest(run_dir, run_id="dp2tp2", command=["dtprobe", "run"], config=cfg, world_size=4)
    t0 = 1_700_000_000 * 10**9
    data, fwd, bwd, opt = 1 * MS, 20 * MS, 40 * MS, 5 * MS
    step_ns = data + fwd + bwd + opt
    tp_bytes = 64 * 8 * 128 * 4
    dp_bytes = 1_000_000
    for rank in range(4):
        write_rank_info(run_dir, rank, host="h0", node_rank=0, local_rank=rank, device=device, pid=100 + rank,
                        clock_offset_ns=0)
        w = RankWriter(run_dir, rank)
        tp_seq = dp_seq = 0
        for step in range(steps):
            start = t0 + step * (step_ns + 2 * MS)
            w.write("steps", {"step": step, "start_ns": start, "end_ns": start + step_ns, "data_ns": data,
                              "fwd_ns": fwd, "bwd_ns": bwd, "opt_ns": opt, "loss": 1.0, "tokens": 512, "lr": 1e-3,
                              "restart": 0})
            for i in range(24):   # TP: inside fwd (8) and bwd (16)
                tp_seq += 1
                enq = start + data + (i * MS if i < 8 else fwd + (i - 8) * 2 * MS)
                w.write("collectives", {"pg": "tp", "pg_ranks": "0,1" if rank < 2 else "2,3", "pg_size": 2,
                                        "seq": tp_seq, "op": "allreduce", "num_bytes": tp_bytes, "dtype": "float32",
                                        "enqueue_ns": enq, "start_ns": None,
                                        "end_ns": enq + _ring_ns("allreduce", 2, tp_bytes), "step": step,
                                        "peer": None, "timing": "host"})
            bwd_end = start + data + fwd + bwd
            for lag in (10 * MS, 5 * MS, 0):   # DP buckets; the last one is issued when backward ends
                dp_seq += 1
                enq = bwd_end - _ring_ns("allreduce", 2, dp_bytes) - lag
                w.write("collectives", {"pg": "dp", "pg_ranks": "0,2" if rank % 2 == 0 else "1,3", "pg_size": 2,
                                        "seq": dp_seq, "op": "allreduce", "num_bytes": dp_bytes, "dtype": "float32",
                                        "enqueue_ns": enq, "start_ns": None,
                                        "end_ns": enq + _ring_ns("allreduce", 2, dp_bytes), "step": step,
                                        "peer": None, "timing": "host"})
        w.close()
    set_status(run_dir, "finished")
    return run_dir


def _open(path):
    from dtprobe.store import RunStore

    return RunStore.open(path)


def test_calibrate_recovers_alpha_beta_overlap_and_compute_of_a_written_run(tmp_path):
    cal = calibrate(_open(write_dp2_tp2_run(tmp_path / "run")), warmup_steps=2)
    dev = cal.setup.cluster.device
    assert dev.is_cpu and cal.num_steps == 6
    assert dev.intra_latency_s == pytest.approx(ALPHA_S, rel=1e-3)
    assert cal.efficiency.bw_intra * dev.intra_bw_bytes_per_s == pytest.approx(BW, rel=1e-3)
    # 3 buckets of 1.1 ms, the last one fully exposed
    assert cal.efficiency.dp_overlap == pytest.approx(1 - 1 / 3, abs=0.01)
    assert cal.efficiency.overhead_s == pytest.approx(1e-3)
    cmp = cal.comparison.set_index("term")
    tp_measured = 24 * _ring_ns("allreduce", 2, 64 * 8 * 128 * 4) / 1e9
    assert cmp.loc["tp_comm_s", "measured_s"] == pytest.approx(tp_measured, rel=1e-6)
    # compute = fwd + bwd - TP collectives - the exposed DP tail
    compute = 0.060 - tp_measured - _ring_ns("allreduce", 2, 1_000_000) / 1e9
    assert cmp.loc["compute_s", "measured_s"] == pytest.approx(compute, rel=1e-6)
    assert cmp.loc["compute_s", "predicted_s"] == pytest.approx(compute, rel=1e-6)
    # the model's TP traffic for tiny (4 layers x (2 forward + 4 backward)) is the 24 written here
    assert cmp.loc["tp_comm_s", "predicted_s"] == pytest.approx(tp_measured, rel=0.01)
    assert abs(cal.step_time_error_frac) < 0.25
    assert cmp.loc["step_time_s", "measured_s"] == pytest.approx(0.066)


def test_calibrated_efficiency_is_usable_by_plan(tmp_path):
    from dtprobe.planner import TrainingSpec, plan

    cal = calibrate(_open(write_dp2_tp2_run(tmp_path / "run")), warmup_steps=2)
    assert isinstance(cal.efficiency, Efficiency)
    result = plan(model_preset("tiny"), cal.setup.cluster, TrainingSpec(global_batch=16, seq_len=64),
                  efficiency=cal.efficiency, top_k=3)
    assert len(result.layouts) == 3


def test_calibrate_names_the_missing_config_key(tmp_path):
    run = write_dp2_tp2_run(tmp_path / "run", config={"layout": {"dp": 2, "tp": 2}})
    with pytest.raises(TraceError, match=r"config\.model\.name is missing"):
        calibrate(_open(run))


def test_calibrate_asks_for_the_gpu_preset_when_ranks_ran_on_cuda(tmp_path):
    run = write_dp2_tp2_run(tmp_path / "run", device="cuda:0")
    with pytest.raises(ConfigError, match="--gpu"):
        calibrate(_open(run))


def write_pp2_run(run_dir, *, f_s=0.010, b_s=0.020, hop_s=0.005, opt_s=0.005, steps=6):
    """A 2-rank pp2 1F1B run (4 micro-batches) whose pipeline rows are a simulated timeline with a known hop."""
    from dtprobe.schedule_sim import simulate

    cfg = {"model": {"name": "tiny"},
           "layout": {"dp": 1, "tp": 1, "pp": 2, "zero": 0, "pp_schedule": "1f1b", "microbatches": 4,
                      "virtual_stages": 0, "sequence_parallel": False, "activation_checkpointing": "none"},
           "train": {"batch_size": 4, "seq_len": 64, "grad_accum": 1}}
    create_manifest(run_dir, run_id="pp2", command=["dtprobe", "run"], config=cfg, world_size=2)
    sim = simulate("1f1b", num_ranks=2, num_microbatches=4, cost_f=f_s, cost_b=b_s, p2p_latency=hop_s)
    step_ns = int((sim.makespan + opt_s) * 1e9)
    t0 = 1_700_000_000 * 10**9
    for rank in range(2):
        write_rank_info(run_dir, rank, host="h0", node_rank=0, local_rank=rank, device="cpu", pid=200 + rank,
                        clock_offset_ns=0)
        w = RankWriter(run_dir, rank)
        mine = [r for r in sim.records if r[0] == rank]
        fwd = int(sum(e - s for _, _, _, k, s, e in mine if k == "F") * 1e9)
        bwd = int(sum(e - s for _, _, _, k, s, e in mine if k != "F") * 1e9)
        for step in range(steps):
            start = t0 + step * (step_ns + MS)
            w.write("steps", {"step": step, "start_ns": start, "end_ns": start + step_ns, "data_ns": 0,
                              "fwd_ns": fwd, "bwd_ns": bwd, "opt_ns": int(opt_s * 1e9), "loss": 1.0,
                              "tokens": 256, "lr": 1e-3, "restart": 0})
            for _, stage, mb, kind, s0, s1 in mine:
                w.write("pipeline", {"stage": stage, "step": step, "microbatch": mb, "action": kind,
                                     "start_ns": start + int(round(s0 * 1e9)), "end_ns": start + int(round(s1 * 1e9))})
        w.close()
    set_status(run_dir, "finished")
    return run_dir, sim


def test_calibrate_recovers_the_pipeline_hop_of_a_simulated_pp2_run(tmp_path):
    run, sim = write_pp2_run(tmp_path / "run")
    cal = calibrate(_open(run), warmup_steps=2)
    assert cal.efficiency.p2p_latency_s == pytest.approx(0.005, rel=0.02)
    cmp = cal.comparison.set_index("term")
    assert cmp.loc["compute_s", "measured_s"] == pytest.approx(4 * 0.030, rel=1e-6)   # 4 micro-batches x (F + B)
    assert cmp.loc["step_time_s", "predicted_s"] == pytest.approx(sim.makespan + 0.005, rel=0.02)
    assert "no collectives recorded: bandwidth and latency left at the preset" in cal.notes
