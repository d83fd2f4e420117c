"""Mixed precision across layouts: fp16 loss scaling and ``--inject overflow`` on pipeline and tensor-parallel
layouts (every rank's ``amp`` row agrees), bf16 with pipeline stages, overflow without fp16 refused at launch, and
the loss shown by the launcher coming from the rank that computes it (the last pipeline stage).

The 2-rank runs go through ``dtprobe run`` with a tiny batch (2 sequences x 16 tokens) and 4 steps.
"""

from __future__ import annotations

import math
import re
import subprocess

import pytest

from dtprobe.store.errors import ConfigError

OVERFLOW_STEP = 2
STEPS = 4


@pytest.fixture
def run_dtprobe(run_cli):
    """``run_dtprobe(run_dir, *flags, timeout=300)``: a 4-step ``dtprobe run`` into ``run_dir`` to its end."""
    def run(run_dir, *flags: str, timeout: float = 300) -> subprocess.CompletedProcess:
        return run_cli("run", "--run-dir", run_dir, "--no-devices", "--timeout", "120", "--device", "cpu",
                       "--batch-size", "2", "--seq-len", "16", "--steps", str(STEPS), *flags, timeout_s=timeout)
    return run


def _tables(run_dir):
    from dtprobe.store import RunStore

    store = RunStore.open(run_dir)
    return store.table("amp"), store.table("steps"), store.table("faults")


PP = ("--nproc", "2", "--pp", "2", "--microbatches", "2")


@pytest.mark.multiproc
@pytest.mark.parametrize("target", [0, 1], ids=["first-stage-rank0", "loss-rank1"])
def test_fp16_overflow_on_pipeline_halves_every_ranks_scale_and_skips_the_step_when_injected_on(tmp_path, target,
                                                                                               run_dtprobe):
    """rank 1 holds the last stage (the loss: 1e38 x loss), rank 0 the first (no loss: its gradients become inf);
    either way found_inf is all-reduced over the world, so both stages skip step 2 and halve the scale."""
    run = tmp_path / "run"
    proc = run_dtprobe(run, *PP, "--precision", "fp16", "--inject", f"overflow:step={OVERFLOW_STEP},rank={target}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    amp, steps, faults = _tables(run)
    assert sorted(amp["rank"].unique()) == [0, 1] and len(amp) == 2 * STEPS   # a row per step on every rank
    at = amp[amp["step"] == OVERFLOW_STEP].sort_values("rank")
    assert list(at["scale_before"]) == [65536.0, 65536.0]
    assert list(at["scale_after"]) == [32768.0, 32768.0]
    assert at["found_inf"].all() and at["skipped"].all()
    others = amp[amp["step"] != OVERFLOW_STEP]
    assert not others["found_inf"].any() and not others["skipped"].any()
    assert list(amp[amp["step"] == OVERFLOW_STEP + 1]["scale_before"]) == [32768.0, 32768.0]
    injected = faults[faults["kind"] == "overflow"]
    assert list(injected["rank"]) == [target] and list(injected["step"]) == [OVERFLOW_STEP]
    assert injected["injected"].all()
    # the loss is the last stage's (rank 1), finite on every step, the injected one included; rank 0 has none
    last = steps[steps["rank"] == 1].sort_values("step")
    assert len(last) == STEPS and all(math.isfinite(x) and 4.0 < x < 7.0 for x in last["loss"])
    assert steps[steps["rank"] == 0]["loss"].isna().all()
    # the launcher shows that loss, not rank 0's (none: it would print nan)
    final = float(last["loss"].iloc[-1])
    assert f"final loss (rank 1, last pipeline stage) {final:.4f}" in " ".join(proc.stderr.split())
    assert re.search(r"loss \d+\.\d{3}", proc.stderr) and "loss nan" not in proc.stderr


@pytest.mark.multiproc
def test_fp16_overflow_on_tensor_parallel_skips_the_step_on_both_ranks(tmp_path, run_dtprobe):
    """TP mixes DTensor (sharded) and plain (LayerNorm) gradients, on which torch's ShardedGradScaler fails
    ("got mixed torch.Tensor and DTensor"); each rank unscales its local shards and agrees on found_inf."""
    run = tmp_path / "run"
    proc = run_dtprobe(run, "--nproc", "2", "--tp", "2", "--precision", "fp16",
                       "--inject", f"overflow:step={OVERFLOW_STEP},rank=1")
    assert proc.returncode == 0, proc.stderr[-3000:]
    amp, steps, faults = _tables(run)
    assert len(amp) == 2 * STEPS
    at = amp[amp["step"] == OVERFLOW_STEP]
    assert list(at["scale_after"]) == [32768.0, 32768.0] and at["skipped"].all() and at["found_inf"].all()
    assert not amp[amp["step"] != OVERFLOW_STEP]["skipped"].any()
    assert list(faults[faults["kind"] == "overflow"]["rank"]) == [1]
    assert all(math.isfinite(x) for x in steps["loss"])


@pytest.mark.multiproc
def test_bf16_with_pipeline_trains_without_a_scaler(tmp_path, run_dtprobe):
    run = tmp_path / "run"
    proc = run_dtprobe(run, *PP, "--precision", "bf16")
    assert proc.returncode == 0, proc.stderr[-3000:]
    amp, steps, _ = _tables(run)
    assert amp.empty                                            # bf16 has no loss scaling
    losses = steps[steps["rank"] == 1].sort_values("step")["loss"]
    assert len(losses) == STEPS and all(math.isfinite(x) and 4.0 < x < 7.0 for x in losses)


@pytest.mark.parametrize("precision", [None, "bf16"])
def test_overflow_without_fp16_is_refused_at_launch_before_any_process(tmp_path, precision, run_dtprobe):
    run = tmp_path / "run"
    flags = ["--nproc", "2", "--inject", "overflow:step=1"] + (["--precision", precision] if precision else [])
    proc = run_dtprobe(run, *flags, timeout=60)
    assert proc.returncode == 2
    message = " ".join(proc.stderr.split())
    assert "dtprobe run: error: --inject overflow:step=1" in message
    assert f"--precision {precision or 'fp32'}" in message and "Add --precision fp16" in message
    assert "Traceback" not in proc.stderr
    assert not run.exists()                                     # nothing prepared, nothing launched


def test_overflow_with_fp16_passes_launch_validation():
    from dtprobe.runtime.config import JobConfig

    job = JobConfig.from_dict({"nproc": 2, "inject": ["overflow:step=1"], "precision": {"dtype": "fp16"}})
    assert job.resolve_layout().dp == 2
    with pytest.raises(ConfigError, match="needs fp16 loss scaling"):
        JobConfig.from_dict({"nproc": 2, "inject": ["overflow:step=1"]}).resolve_layout()
