"""LAMB and LARS on every layout: each trains the tiny GPT for 5 steps (tests/layouts_worker.py, global-norm
clipping) and its global loss per step matches a single process with the same optimizer within 1e-5 relative
(fp16 with loss scaling: within 5e-3, as the AdamW layout test allows);
``dtprobe run --optimizer lamb`` trains through pure DDP (``parallel.ddp``) as through FSDP2 resumed from a DCP
checkpoint of its sharded state.

The layouts agree within 4e-6 (measured; float summation order). The tolerance is ten times tighter than the
AdamW layout test's because a trust ratio taken over a shard instead of the whole parameter changes these losses
by as little as 2e-6 to 5e-5 (measured with the norm reduction removed: the tiny GPT's shards have near-equal
norms, so the ratio barely moves). The sensitive check of the reduction is tests/test_optimizers_sharded.py, on
parameters whose shards differ in scale.
"""

from __future__ import annotations

import functools
import json
import sys
from pathlib import Path

import pytest

from dtprobe.store import RunStore

sys.path.insert(0, str(Path(__file__).parent))
from layouts_launch import launch  # noqa: E402

LR = {"lamb": 1e-2, "lars": 3.0}
"""Per optimizer, an lr at which 5 steps move the loss clearly (LARS takes the paper's global lr)."""
FP16 = ["zero3_dp2_fp16", "pp2_1f1b_fp16"]
"""fp16 with loss scaling (the scaler steps the optimizer), compared within fp16 rounding."""
LAUNCHES = {
    2: ["dp2", "zero1_dp2", "zero2_dp2", "zero3_dp2", "tp2", "tp2_sp", "pp2_1f1b", "zero3_dp2_accum2", *FP16],
    4: ["dp2_tp2", "dp2_tp2_zero3_sp", "dp2_pp2_zero1", "dp2_pp2_zero2_interleaved", "tp2_pp2"],
}
"""DDP, ZeRO-1/2/3, TP (+SP), PP, and the hybrids of dp with tp and pp (cases of tests/layouts_worker.py)."""
CASES = [(opt, world, case) for opt in LR for world, cases in LAUNCHES.items() for case in cases if case not in FP16]


@pytest.fixture(scope="module")
def results(free_port, child_env):
    """``results(optimizer, world_size)``: one launch (cached), its cases by name."""
    @functools.cache
    def run(optimizer: str, world_size: int) -> dict[str, dict]:
        out = launch(world_size, "--cases", ",".join(LAUNCHES[world_size]), "--optimizer", optimizer,
                     "--lr", str(LR[optimizer]), port=free_port(), env=child_env(PYTHONWARNINGS="ignore"),
                     timeout_s=600)
        return {r["case"]: r for r in out}
    return run


@functools.cache
def single_losses(optimizer: str) -> list[float]:
    import layouts_worker

    return layouts_worker.run_case("single", rank=0, world_size=1, optimizer=optimizer, lr=LR[optimizer])[0]


@pytest.mark.multiproc
@pytest.mark.parametrize("optimizer,world,case", CASES)
def test_layout_with_large_batch_optimizer_matches_single_process_within_1e5(optimizer, world, case, results):
    reference = single_losses(optimizer)
    got = results(optimizer, world)[case]["losses"]
    assert len(got) == len(reference) == 5
    rel = [abs(g - r) / abs(r) for g, r in zip(got, reference)]
    print(f"{optimizer} {case}: max rel loss diff vs single process {max(rel):.2e}")
    assert max(rel) < 1e-5, f"{optimizer} {case}: losses {got} vs single process {reference} (rel diff {rel})"
    assert reference[-1] < reference[0] - 0.05   # it trained


@pytest.mark.multiproc
@pytest.mark.parametrize("optimizer", list(LR))
@pytest.mark.parametrize("case", FP16)
def test_fp16_loss_scaling_steps_large_batch_optimizers_on_fsdp_and_pipeline(optimizer, case, results):
    reference = single_losses(optimizer)
    got = results(optimizer, 2)[case]["losses"]
    rel = [abs(g - r) / r for g, r in zip(got, reference)]
    assert max(rel) < 5e-3, (optimizer, case, got, reference)


@pytest.mark.multiproc
def test_dtprobe_run_lamb_on_ddp_equals_fsdp2_resumed_from_a_dcp_checkpoint(tmp_path, run_cli):
    """Pure DP builds its optimizer in ``parallel.ddp``, ZeRO-3 in ``parallel.hybrid``; the ZeRO-3 run has rank 1
    crash at step 4 and resumes from the step-3 DCP checkpoint (sharded LAMB state), yet both give the same
    losses."""
    losses = {}
    for label, extra in (("ddp", []), ("zero3_resumed", ["--zero", "3", "--ckpt-every", "2", "--max-restarts", "1",
                                                         "--inject", "crash:rank=1,step=4"])):
        run_dir = tmp_path / label
        proc = run_cli("run", "--nproc", "2", "--optimizer", "lamb", "--lr", "0.04", "--steps", "6",
                       "--warmup", "1", "--seq-len", "32", "--batch-size", "4", "--no-devices",
                       "--run-dir", str(run_dir), *extra, timeout_s=400)
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert json.loads((run_dir / "job.json").read_text())["train"]["optimizer"] == "lamb"
        steps = RunStore.open(run_dir).table("steps")
        done = steps[(steps["rank"] == 0) & steps["loss"].notna()].sort_values("step")   # the crashed step: no loss
        assert done["step"].tolist() == list(range(6)), done
        losses[label] = done["loss"].tolist()
    print(losses)
    assert len(steps[steps["step"] == 4]) > len(steps[steps["step"] == 5])   # step 4 ran twice: crash, then resume
    assert losses["ddp"] == pytest.approx(losses["zero3_resumed"], rel=1e-5)
    assert losses["ddp"][-1] < losses["ddp"][0]
