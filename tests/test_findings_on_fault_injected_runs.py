"""Findings on runs made by `dtprobe run` for each scenario (CPU/gloo, tiny GPT): the pipeline bubble of a pp4
GPipe run with sleep stages, an fp16 overflow, a slow checkpoint, a hang, a straggler in dp2 x pp2, and the
README's main job."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from dtprobe.analysis import RunAnalysis

pytestmark = pytest.mark.multiproc


@pytest.fixture(scope="session")
def dtprobe_run(run_cli):
    """``dtprobe_run(run_dir, *args, ok_codes=(0,))``: ``dtprobe run`` into ``run_dir``, checked to end with one of
    ``ok_codes``; returns ``run_dir``."""
    def run(run_dir: Path, *args: str, ok_codes: tuple[int, ...] = (0,)) -> Path:
        proc = run_cli("run", "--timeout", "120", "--run-dir", run_dir, *args, timeout_s=600)
        assert proc.returncode in ok_codes, f"dtprobe run failed ({proc.returncode}):\n{proc.stderr[-3000:]}"
        return run_dir
    return run


def _codes(a: RunAnalysis) -> list[str]:
    return [f.code for f in a.findings()]


@pytest.mark.exclusive
def test_pipeline_bubble_on_pp4_gpipe_with_4_microbatches(tmp_path, dtprobe_run):
    run = dtprobe_run(tmp_path / "pp4_gpipe", "--nproc", "4", "--pp", "4", "--pp-schedule", "gpipe", "--microbatches",
                      "4", "--stage-sleep", "fwd_ms=10,bwd_ms=20", "--steps", "6")
    a = RunAnalysis.open(run)
    [f] = [f for f in a.findings() if f.code == "PIPELINE_BUBBLE"]
    assert (f.group, f.ranks) == ("pp", (0, 1, 2, 3))
    ev = f.evidence
    assert (ev["schedule"], ev["num_microbatches"], ev["num_pp_ranks"]) == ("gpipe", 4, 4)
    # Sleep stages (F=10, B=20 ms) make the ideal close to GPipe's (p-1)/(m+p-1) = 3/7; the measured costs also
    # hold the last stage's loss and the host's scheduling delays, so the ideal (simulated with them) moves a bit.
    shape = a.pipeline_shape()
    from dtprobe.schedule_sim import simulate

    f_costs = [shape.costs[(s, "F")] for s in range(4)]
    b_costs = [shape.costs[(s, "B")] for s in range(4)]
    sim = simulate("gpipe", num_ranks=4, num_microbatches=4, cost_f=f_costs, cost_b=b_costs)
    assert ev["ideal_bubble_frac"] == pytest.approx(sim.bubble_frac)
    assert ev["ideal_bubble_frac"] == pytest.approx(3 / 7, abs=0.07)
    assert ev["measured_bubble_frac"] >= ev["ideal_bubble_frac"] - 0.02
    assert ev["ideal_bubble_frac_2x_microbatches"] == pytest.approx(3 / 11, abs=0.07)
    assert ev["ideal_bubble_frac_2x_microbatches"] < ev["ideal_bubble_frac"] - 0.1
    assert f.predicted_gain.metric == "step_time" and 0.1 < f.predicted_gain.frac < 0.25
    assert "STRAGGLER" not in _codes(a)


def test_amp_overflow_on_the_fp16_overflow_run(fp16_overflow_run):
    assert fp16_overflow_run.proc.returncode == 0, fp16_overflow_run.proc.stderr[-3000:]
    [f] = [f for f in RunAnalysis.open(fp16_overflow_run.run_dir).findings() if f.code == "AMP_OVERFLOW"]
    assert fp16_overflow_run.step in f.evidence["overflow_steps"]
    assert f.evidence["num_overflows"] >= 1 and f.evidence["final_scale"] < 65536.0


@pytest.mark.exclusive
def test_checkpoint_stall_on_a_slow_checkpoint_run(tmp_path, dtprobe_run):
    run = dtprobe_run(tmp_path / "slow_ckpt", "--nproc", "2", "--ckpt-every", "2", "--inject",
                      "slow-ckpt:rank=1,delay_ms=1500", "--steps", "8")
    [f] = [f for f in RunAnalysis.open(run).findings() if f.code == "CHECKPOINT_STALL"]
    assert 1 in f.ranks                       # DCP saves are collective: every rank waits for the slow writer
    assert f.evidence["per_rank_blocking_ms"]["1"] >= 1500
    assert f.evidence["num_saves"] >= 3 and f.evidence["mean_blocking_ms"] >= 1500
    assert f.evidence["blocking_share_of_wall"] > 0.25 and f.severity == "critical"


@pytest.mark.exclusive
def test_hang_names_the_hung_rank(hang_rank1_run):
    assert hang_rank1_run.proc.returncode in (0, 1), hang_rank1_run.proc.stderr[-3000:]
    a = RunAnalysis.open(hang_rank1_run.run_dir)
    hangs = [f for f in a.findings() if f.code == "HANG"]
    assert hangs and all(f.ranks == (hang_rank1_run.rank,) and f.severity == "critical" for f in hangs)
    assert hangs[0].group == "dp"
    assert hangs[0].evidence.get("step", hang_rank1_run.step) == hang_rank1_run.step


@pytest.mark.exclusive
def test_straggler_in_dp2_pp2_names_the_rank_and_its_dp_group(tmp_path, dtprobe_run):
    run = dtprobe_run(tmp_path / "dp2pp2", "--nproc", "4", "--pp", "2", "--inject", "straggler:rank=2,delay_ms=200",
                      "--steps", "21")
    stragglers = [f for f in RunAnalysis.open(run).findings() if f.code == "STRAGGLER"]
    assert [(f.ranks, f.group) for f in stragglers] == [((2,), "dp")]


def _readme_demo_flags() -> list[str]:
    """The flags of the README's main job (its first ``dtprobe run`` command), without ``--run-dir``."""
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    flags = shlex.split(re.search(r"dtprobe run ([^;\n]*);", readme).group(1))
    at = flags.index("--run-dir")
    return flags[:at] + flags[at + 2:]


@pytest.mark.exclusive
def test_the_readme_main_job_finds_its_injected_straggler(tmp_path, dtprobe_run):
    # the demo a new user runs first: 4 ranks on this machine's cores, a sleep injected on rank 2. A sleep hands
    # the rank's core to its core-mate meanwhile, so one no longer than the core-mates' compute hides (it did at
    # 40 ms: "No findings")
    flags = _readme_demo_flags()
    assert "--inject" in flags and flags[flags.index("--inject") + 1].startswith("straggler:rank=2,")
    run = dtprobe_run(tmp_path / "demo", *flags)
    verdicts = [f for f in RunAnalysis.open(run).findings() if f.severity != "info"]
    assert [(f.code, f.ranks) for f in verdicts if f.code == "STRAGGLER"] == [("STRAGGLER", (2,))], verdicts
    assert not [f for f in verdicts if f.code in ("HANG", "RANK_CRASH", "RANK_STALL", "COLLECTIVE_MISMATCH")]
    # it sleeps: late by most of its step while its process uses no more CPU than its peers', which the finding
    # tells from the host samples (not from the injector's row) and says
    [f] = [f for f in verdicts if f.code == "STRAGGLER"]
    ev = f.evidence
    assert ev["off_cpu"] is True and "off the CPU" in f.recommendation, (f.title, ev)
    late = ev["mean_lateness_ms"] / ev["step_time_ms"]
    assert ev["cpu_busy_frac"] - ev["peer_cpu_busy_frac"] < late / 3, ev


@pytest.mark.exclusive
def test_a_rank_that_computes_slower_is_not_called_off_the_cpu(tmp_path, dtprobe_run):
    # the counterpart of the README's sleeping rank: rank 1 burns half its compute's CPU time again, so it is late
    # by work it does on the CPU
    run = dtprobe_run(tmp_path / "burn", "--nproc", "2", "--steps", "30", "--inject",
                      "straggler:rank=1,slowdown=1.5")
    stragglers = [f for f in RunAnalysis.open(run).findings() if f.code == "STRAGGLER"]
    assert [f.ranks for f in stragglers] == [(1,)], stragglers
    ev = stragglers[0].evidence
    assert ev["cause"] == "compute" and ev["off_cpu"] is False, ev
    late = ev["mean_lateness_ms"] / ev["step_time_ms"]
    assert ev["cpu_busy_frac"] - ev["peer_cpu_busy_frac"] >= late / 3, ev
    assert "off the CPU" not in stragglers[0].title + stragglers[0].recommendation


def test_compression_report_against_a_baseline_run(tmp_path, dtprobe_run):
    base = dtprobe_run(tmp_path / "base", "--nproc", "2", "--steps", "8")
    run = dtprobe_run(tmp_path / "fp16c", "--nproc", "2", "--steps", "8", "--compress", "fp16")
    [f] = [f for f in RunAnalysis.open(run, baseline=base).findings() if f.code == "COMPRESSION"]
    ev = f.evidence
    assert ev["method"] == "fp16" and ev["ratio"] == pytest.approx(2.0)
    assert abs(ev["loss_gap_frac"]) < 0.01            # fp16 gradients: same loss curve within 1%
    assert ev["measured_transfer_saved_ms_per_step"] is not None


def test_powersgd_run_with_one_bucket_finishes_and_reports_its_ratio(tmp_path, dtprobe_run):
    # the built-in model's gradients fit one 25 MB bucket, which DDP refills in another order after the first
    # step: the hook's memory must start again there (a crash at step 2 when it did not)
    run = dtprobe_run(tmp_path / "psgd", "--nproc", "2", "--steps", "4", "--compress", "powersgd:rank=2")
    analysis = RunAnalysis.open(run)
    assert analysis.source.manifest.status == "finished"
    [f] = [f for f in analysis.findings() if f.code == "COMPRESSION"]
    assert f.evidence["method"] == "powersgd:rank=2" and f.evidence["ratio"] > 10, f.evidence
    assert not [f for f in analysis.findings() if f.code == "RANK_CRASH"]


def test_crash_with_restart_is_a_recovered_rank_crash_not_a_hang(crash_restart_run):
    assert crash_restart_run.proc.returncode == 0, crash_restart_run.proc.stderr[-3000:]
    assert crash_restart_run.rank == 1
    findings = RunAnalysis.open(crash_restart_run.run_dir).findings()
    assert "HANG" not in [f.code for f in findings]
    [f] = [f for f in findings if f.code == "RANK_CRASH"]
    assert (f.ranks, f.severity, f.evidence["recovered"]) == ((1,), "warning", True)
    # Restarted collectives are not compared across attempts: had the attempts' collectives been matched by seq,
    # the crashed rank would arrive "late" by the whole restart (seconds: the new workers' start, the checkpoint
    # load), far beyond a step. A STRAGGLER finding on a 2-rank CPU run can still come from CPU contention, on
    # either rank: whichever rank is late, it is late by a fraction of a step, never by the restart.
    restart_s = 1.0
    for f in (f for f in findings if f.code == "STRAGGLER"):
        assert f.evidence["mean_lateness_ms"] < min(f.evidence["step_time_ms"], restart_s * 1e3), f.evidence
