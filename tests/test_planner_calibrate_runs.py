"""Calibration on runs made here by `dtprobe run` (CPU, gloo, 4 ranks): after refitting, the predicted step time of
the run's own layout is within 25% of the measured one for dp4, dp2 x tp2 and pp4. Each run is a real 4-process
job."""

from __future__ import annotations


import pytest

from dtprobe.planner.calibrate import calibrate

pytestmark = [pytest.mark.multiproc, pytest.mark.exclusive]

LAYOUTS = {"dp4": [], "dp2tp2": ["--tp", "2"], "pp4": ["--pp", "4"]}


@pytest.fixture(scope="module")
def runs(tmp_path_factory, run_cli, clean_dp4_run):
    root = tmp_path_factory.mktemp("planner_runs")
    # dp4 is the shared clean dp4 run (conftest; 21 steps of this job); the other layouts run 10 steps
    assert clean_dp4_run.proc.returncode == 0, f"dp4: {clean_dp4_run.proc.stderr[-2000:]}"
    assert clean_dp4_run.flags[:6] == ("--nproc", "4", "--device", "cpu", "--model", "tiny")
    out = {"dp4": clean_dp4_run.run_dir}
    for name, flags in LAYOUTS.items():
        if name == "dp4":
            continue
        run_dir = root / name
        proc = run_cli("run", "--nproc", "4", "--device", "cpu", "--model", "tiny", "--steps", "10", "--timeout",
                       "120", "--run-dir", run_dir, *flags, timeout_s=600)
        assert proc.returncode == 0, f"{name}: {proc.stderr[-2000:]}"
        out[name] = run_dir
    return out


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_calibrated_prediction_matches_the_run_within_25pct(runs, name):
    from dtprobe.store import RunStore

    cal = calibrate(RunStore.open(runs[name]), warmup_steps=3)
    cmp = cal.comparison.set_index("term")
    print(f"{name}: predicted {cmp.loc['step_time_s', 'predicted_s'] * 1e3:.1f} ms, measured "
          f"{cmp.loc['step_time_s', 'measured_s'] * 1e3:.1f} ms ({cal.step_time_error_frac:+.1%})")
    assert cal.setup.cluster.device.is_cpu
    assert abs(cal.step_time_error_frac) <= 0.25
    if name == "pp4":
        assert cal.efficiency.p2p_latency_s is not None and cmp.loc["pipeline_idle_s", "measured_s"] > 0
    if name == "dp2tp2":
        assert cmp.loc["tp_comm_s", "measured_s"] > 0
