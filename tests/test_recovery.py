"""Crash, restart and resume through ``dtprobe run`` (2 ranks, torchrun ``--max-restarts``, DCP checkpoints)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest
import torch
from background_run import background_run, wait_for

from dtprobe.store import RunStore

STEPS = 20   # the crash at step 15 resumes from the checkpoint after step 14; the last step, 19, is saved too
COMMON = ("--nproc", "2", "--steps", str(STEPS), "--ckpt-every", "5")


def run_args(run_dir: Path, *flags: str) -> list[str]:
    return ["run", "--run-dir", str(run_dir), "--no-devices", "--timeout", "120", "--batch-size", "2", "--seq-len",
            "16", *flags]


@pytest.fixture(scope="session")
def run_dtprobe(run_cli):
    """``run_dtprobe(run_dir, *flags, timeout=480)``: a small ``dtprobe run`` into ``run_dir`` to its end."""
    def run(run_dir: Path, *flags: str, timeout: float = 480) -> subprocess.CompletedProcess:
        return run_cli(*run_args(run_dir, *flags), timeout_s=timeout)
    return run


def final_params(run_dir: Path, step: int = STEPS - 1) -> dict[str, torch.Tensor]:
    """The model tensors of the checkpoint saved after ``step`` (the last step: the run's final parameters)."""
    import tempfile

    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    with tempfile.TemporaryDirectory() as tmp:          # not in run_dir: a shared run is read by other tests
        out = Path(tmp) / f"final{step}.pt"
        dcp_to_torch_save(run_dir / "checkpoints" / f"step{step:08d}", out)
        state = torch.load(out, weights_only=False)
    return {k: v for k, v in state["app"]["model"].items()}


def faults_of(store: RunStore, kind: str) -> list[dict]:
    df = store.table("faults")
    rows = df[df["kind"] == kind].sort_values("time_ns")
    return [{"rank": int(r.rank), "step": int(r.step), "injected": bool(r.injected), **json.loads(r.detail)}
            for r in rows.itertuples()]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, run_dtprobe) -> Path:
    run_dir = tmp_path_factory.mktemp("recovery") / "baseline"
    proc = run_dtprobe(run_dir, *COMMON)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return run_dir


@pytest.mark.multiproc
def test_crash_at_step_15_resumes_and_ends_bit_identical_to_uninterrupted_run(uninterrupted, crash_restart_run):
    # the shared run is COMMON's job (the uninterrupted run's) with rank 1 crashing at step 15, one restart allowed
    run_dir, proc = crash_restart_run.run_dir, crash_restart_run.proc
    assert (crash_restart_run.steps, crash_restart_run.ckpt_every, crash_restart_run.rank, crash_restart_run.step) == \
        (STEPS, 5, 1, 15)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ref, got = final_params(uninterrupted), final_params(run_dir)
    assert ref.keys() == got.keys() and len(ref) > 10
    assert all(torch.equal(ref[k], got[k]) for k in ref)                # bit-identical
    store = RunStore.open(run_dir)
    assert store.manifest.status == "finished"
    assert [(c["rank"], c["step"], c["injected"]) for c in faults_of(store, "crash")] == [(1, 15, True)]
    (restart,) = faults_of(store, "restart")
    # the checkpoint after step 14 was committed before the crash at the start of step 15: nothing redone
    assert restart["injected"] is False and restart["restart"] == 1
    assert (restart["checkpoint_step"], restart["last_step"], restart["from_step"], restart["steps_lost"]) == \
        (14, 14, 15, 0)
    assert [(r.restart, r.steps_lost, r.from_step) for r in store.manifest.restarts] == [(1, 0, 15)]
    steps = store.table("steps")                                        # telemetry appended in the same run dir
    assert set(steps[steps["restart"] == 0]["step"].dropna()) >= set(range(15))
    assert set(steps[steps["restart"] == 1]["step"]) == set(range(15, STEPS))
    loads = store.table("checkpoints")
    loads = loads[loads["kind"] == "load"]
    assert sorted(loads["rank"]) == [0, 1] and set(loads["step"]) == {14}


@pytest.mark.multiproc
def test_corrupt_newest_checkpoint_then_crash_resumes_from_the_previous_one(tmp_path, uninterrupted, run_dtprobe):
    run_dir = tmp_path / "corrupt"
    proc = run_dtprobe(run_dir, *COMMON, "--max-restarts", "1", "--inject", "corrupt-ckpt:step=14",
                       "--inject", "crash:rank=0,step=15")
    assert proc.returncode == 0, proc.stderr[-3000:]
    store = RunStore.open(run_dir)
    corrupt = faults_of(store, "corrupt-ckpt")
    assert [(c["step"], c["injected"]) for c in corrupt] == [(14, True), (14, False)]
    assert "CRC32" in corrupt[1]["reason"] and "step00000014" in corrupt[1]["reason"]
    (restart,) = faults_of(store, "restart")
    assert (restart["checkpoint_step"], restart["from_step"], restart["steps_lost"]) == (9, 10, 5)
    ref, got = final_params(uninterrupted), final_params(run_dir)
    assert all(torch.equal(ref[k], got[k]) for k in ref)


@pytest.mark.multiproc
def test_rank_killed_during_async_save_resumes_from_newest_complete_checkpoint(tmp_path, child_env):
    run_dir = tmp_path / "killed"
    ckpts = run_dir / "checkpoints"
    # rank 1's background writes take 8 s, so the save after step 9 is still in flight when rank 1 is killed
    cmd = [sys.executable, "-m", "dtprobe.cli", *run_args(run_dir, "--nproc", "2", "--steps", "20", "--ckpt-every",
                                                          "5", "--ckpt-async", "--max-restarts", "1", "--inject",
                                                          "slow-ckpt:rank=1,delay_ms=8000")]
    with background_run(cmd, env=child_env()) as proc:
        wait_for(lambda: (ckpts / "step00000004" / "COMMIT.json").exists() and (ckpts / ".tmp-step00000009").exists(),
                 timeout=300, proc=proc, what="the async save after step 9 to start")
        pid = json.loads((run_dir / "ranks" / "rank00001.json").read_text())["pid"]
        os.kill(pid, signal.SIGKILL)
        killed_at = time.time_ns()
        out, err = proc.communicate(timeout=420)
    assert proc.returncode == 0, err[-3000:]
    assert not (ckpts / "step00000009" / "COMMIT.json").exists() or \
        (ckpts / "step00000009" / "COMMIT.json").stat().st_mtime_ns > killed_at   # only re-saved after the restart
    store = RunStore.open(run_dir)
    (restart,) = faults_of(store, "restart")
    assert restart["checkpoint_step"] == 4 and restart["from_step"] == 5
    loads = store.table("checkpoints")
    loads = loads[loads["kind"] == "load"]
    assert set(loads["step"]) == {4} and sorted(loads["rank"]) == [0, 1] and loads["ok"].all()
    saves = store.table("checkpoints")
    saves = saves[(saves["kind"] == "save") & (saves["rank"] == 1)]
    assert (saves["async_ns"] >= 8e9 * 0.95).all() and (saves["blocking_ns"] < saves["async_ns"]).all()
    assert store.manifest.status == "finished"


@pytest.mark.multiproc
def test_pipeline_stages_resume_from_their_own_checkpoint_shards(tmp_path, run_dtprobe):
    # each pp stage holds different parameters: the optimizer state is saved flattened per parameter, so the
    # stages' param groups do not overwrite each other
    run_dir = tmp_path / "pp"
    proc = run_dtprobe(run_dir, "--nproc", "2", "--pp", "2", "--batch-size", "4", "--steps", "6", "--ckpt-every", "3",
                       "--max-restarts", "1", "--inject", "crash:rank=1,step=4")
    assert proc.returncode == 0, proc.stderr[-3000:]
    store = RunStore.open(run_dir)
    (restart,) = faults_of(store, "restart")
    # the last stage (rank 1) holds the losses: step 3 completed before the crash at the start of step 4
    assert (restart["checkpoint_step"], restart["last_step"], restart["steps_lost"]) == (2, 3, 1)
    assert store.manifest.status == "finished"
    # the redone step's pipeline figures are the second attempt's alone (each action row says its attempt)
    from dtprobe.analysis import bubble
    from dtprobe.analysis.facade import RunAnalysis

    pipe = store.table("pipeline")
    assert set(pipe.loc[pipe["step"] == 3, "restart"]) == {0, 1}
    measured = RunAnalysis(store).pipeline_bubble()
    assert not measured.duplicated(["rank", "step"]).any()
    redone = bubble.pipeline_bubble(pipe[pipe["restart"] == 1])
    pd.testing.assert_frame_equal(measured[measured["step"] == 3].reset_index(drop=True),
                                  redone[redone["step"] == 3].reset_index(drop=True))


def test_last_completed_step_ignores_rows_without_loss_torn_lines_and_the_current_attempt(tmp_path):
    from dtprobe.runtime.recovery import last_completed_step

    steps = tmp_path / "events" / "steps"
    steps.mkdir(parents=True)
    (steps / "rank00000.jsonl").write_bytes(b'{"step": 3, "restart": 0}\n{"step": 2, "restart": 0}\n')
    (steps / "rank00001.jsonl").write_bytes(
        b'{"step": 2, "restart": 0, "loss": 5.0}\n{"step": 3, "restart": 0}\n{"step": 9, "restart": 1, "loss": 4.0}\n'
        b'{"step": 4, "rest')
    assert last_completed_step(tmp_path, before_restart=1) == 2
    assert last_completed_step(tmp_path, before_restart=2) == 9
    assert last_completed_step(tmp_path / "nothing", before_restart=1) == -1


@pytest.mark.multiproc
def test_the_restarted_job_s_per_step_summaries_equal_its_raw_rows_attempt_by_attempt(crash_restart_run):
    from comm_summary_checks import assert_summaries_equal_raw_rows

    assert crash_restart_run.proc.returncode == 0, crash_restart_run.proc.stderr[-3000:]
    summaries = assert_summaries_equal_raw_rows(crash_restart_run.run_dir)
    assert set(summaries["restart"]) == {0, 1}
    # the steps after the last checkpoint before the crash are summarized by both attempts, each its own row
    redone = summaries[summaries["rank"] == 0].groupby("step")["restart"].nunique()
    assert (redone[redone > 1].index >= crash_restart_run.step - crash_restart_run.ckpt_every).all()
    assert len(redone[redone > 1]) >= 1


@pytest.mark.multiproc
def test_the_restarted_job_s_step_figures_read_the_attempt_that_redid_each_step(crash_restart_run):
    from dtprobe.analysis.comm_steps import comm_by_rank
    from dtprobe.analysis.facade import RunAnalysis
    from dtprobe.dashboard.summary import steps_overview

    assert crash_restart_run.proc.returncode == 0, crash_restart_run.proc.stderr[-3000:]
    a = RunAnalysis.open(crash_restart_run.run_dir)
    steps = a.table("steps")
    last = steps[steps["restart"] == 1]
    redone = sorted(set(steps.loc[steps["restart"] == 0, "step"]) & set(last["step"]))
    assert redone and redone[0] == crash_restart_run.step       # rank 0 began the crashed step; attempt 1 redid it
    throughput = a.throughput().set_index("step")
    for step in redone:
        rows = last[last["step"] == step]
        # the step's wall time is the attempt's own, not one that spans the restart, and its tokens count once
        assert throughput.loc[step, "step_ns"] == rows["end_ns"].max() - rows["start_ns"].min()
        assert throughput.loc[step, "tokens"] == rows["tokens"].sum()
    exposure = a.comm_exposure()
    assert not exposure.duplicated(["rank", "step"]).any()
    assert set(exposure["step"]) >= set(redone)
    lateness = a.rank_lateness()
    assert not lateness.duplicated(["pg", "pg_ranks", "step", "rank"]).any()
    # the ranks' own summaries give the same communication share as the raw rows, attempts resolved alike
    from_summaries = comm_by_rank(a.table("comm_steps"), steps, step_ids=a.steps_analyzed())
    assert from_summaries["comm_frac"].to_numpy() == pytest.approx(a.exposure_by_rank()["comm_frac"].to_numpy(),
                                                                   rel=1e-9)
    # and a page's quick Overview, which reads only the summaries' columns it needs, the same figure
    quick = steps_overview(RunStore.open(crash_restart_run.run_dir, tables=("steps", "comm_steps")), whole_run=True,
                           window=0, path=str(crash_restart_run.run_dir))
    assert quick.figures["comm_frac"] == pytest.approx(a.key_figures().comm_frac, rel=1e-9)


def test_loss_scale_figures_of_a_redone_step_are_the_attempt_that_redid_it_s(tmp_path):
    # rank 0 overflowed at step 4 in attempt 0, which then died; attempt 1 redid step 4 without an overflow
    import json

    from dtprobe.analysis.facade import RunAnalysis
    from dtprobe.synthetic import write_synthetic_run

    run = write_synthetic_run(tmp_path / "run", num_ranks=2, num_steps=6)
    (run / "events" / "amp").mkdir()
    for rank in (0, 1):
        rows = [{"rank": rank, "step": s, "restart": 0, "scale_before": 1024.0,
                 "scale_after": 512.0 if (rank, s) == (0, 4) else 1024.0, "found_inf": (rank, s) == (0, 4),
                 "skipped": s == 4} for s in range(5)]
        rows += [{"rank": rank, "step": s, "restart": 1, "scale_before": 1024.0, "scale_after": 1024.0,
                  "found_inf": False, "skipped": False} for s in (4, 5)]
        (run / "events" / "amp" / f"rank{rank:05d}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    per_step = RunAnalysis.open(run).amp_steps().set_index("step")
    assert per_step.index.tolist() == [0, 1, 2, 3, 4, 5]
    assert not per_step["overflow"].any() and not per_step["skipped"].any()
