"""``dtprobe launch`` (issue 16 item 2) on unmodified scripts in the style of pytorch/examples
(``examples/launch/train_ddp.py``, ``train_fsdp2.py``; they call ``init_process_group`` themselves): a step per
optimizer step, collectives per step, loss and tokens only from ``dtprobe.record``, skipped GradScaler steps,
the script's exit code, RANK_CRASH."""

from __future__ import annotations

import json

import pytest

from dtprobe.store import RunStore

LAUNCH_TIMEOUT_S = 240
DDP_PARAM_BYTES = (32 * 64 + 64 + 64 * 8 + 8) * 4
"""The gradients DDP all-reduces per backward (examples/launch/train_ddp.py's MLP, fp32)."""


def _launch(run_cli, child_env, run, *script, cwd=None):
    return run_cli("launch", "--nproc", "2", "--run-dir", run, "--no-devices", *script,
                   timeout_s=LAUNCH_TIMEOUT_S, env=child_env(), cwd=cwd)


@pytest.mark.multiproc
def test_launch_ddp_script_records_one_step_per_optimizer_step_with_recorded_loss_and_tokens(
        tmp_path, repo_root, run_cli, child_env):
    run, report = tmp_path / "ddp", tmp_path / "report.json"
    # 256 samples / 2 ranks / batch 16 = 8 micro-batches per rank, an optimizer step every 2
    proc = _launch(run_cli, child_env, run, repo_root / "examples" / "launch" / "train_ddp.py", "--epochs", "1",
                   "--grad-accum", "2", "--record", "--report", report)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1] == str(run.resolve())
    num_opt_steps = json.loads(report.read_text())["optimizer_steps"]
    assert num_opt_steps == 4

    store = RunStore.open(run)
    assert store.manifest.status == "finished" and store.manifest.world_size == 2
    assert store.manifest.config["launch"]["args"] == ["--epochs", "1", "--grad-accum", "2", "--record", "--report",
                                                       str(report)]
    steps = store.table("steps")
    for rank in (0, 1):
        mine = steps[steps["rank"] == rank].sort_values("step")
        assert mine["step"].tolist() == list(range(num_opt_steps))
        assert (mine["fwd_ns"] > 0).all() and (mine["bwd_ns"] > 0).all() and (mine["opt_ns"] > 0).all()
        assert (mine["tokens"] == 2 * 16).all()          # two micro-batches of 16 given to dtprobe.record
        assert mine["loss"].between(0.1, 10).all() and (mine["lr"] == 0.01).all()
        # contiguous steps: each starts where the previous ended
        assert (mine["start_ns"].iloc[1:].values == mine["end_ns"].iloc[:-1].values).all()
    coll = store.table("collectives")
    grads = coll[(coll["op"] == "allreduce") & (coll["step"] >= 0)]
    per_step = grads.groupby(["rank", "step"])["num_bytes"].agg(["size", "sum"])
    # no no_sync in the script: DDP all-reduces after each of the step's two backward passes
    assert per_step["size"].tolist() == [2] * (2 * num_opt_steps)
    assert per_step["sum"].tolist() == [2 * DDP_PARAM_BYTES] * (2 * num_opt_steps)
    assert set(grads["pg"]) == {"world"}


@pytest.mark.multiproc
def test_launch_fsdp2_module_records_all_gathers_and_reduce_scatters_per_step_and_no_loss_without_record(
        tmp_path, repo_root, run_cli, child_env):
    run = tmp_path / "fsdp2"
    proc = _launch(run_cli, child_env, run, "-m", "examples.launch.train_fsdp2", "--steps", "3", cwd=repo_root)
    assert proc.returncode == 0, proc.stderr[-3000:]
    store = RunStore.open(run)
    steps = store.table("steps")
    assert sorted(steps.groupby("rank")["step"].apply(list).tolist()) == [[0, 1, 2], [0, 1, 2]]
    assert steps["loss"].isna().all() and steps["tokens"].isna().all()     # never guessed
    coll = store.table("collectives")
    coll = coll[coll["step"] >= 0]
    ops = coll.groupby(["rank", "step", "op"]).size().unstack("op")
    assert list(ops.columns) == ["allgather", "reduce_scatter"]
    # three FSDP units (two blocks, the root's head): each reduce-scattered once per step; gathered in forward
    # and again in backward for the two resharded blocks (the root stays gathered after forward)
    assert (ops["reduce_scatter"] == 3).all() and (ops.loc[(slice(None), slice(1, None)), "allgather"] == 4).all()
    assert set(coll["pg"]) == {"world"} and set(coll["pg_ranks"]) == {"0,1"}


@pytest.mark.multiproc
def test_launch_counts_a_step_that_the_grad_scaler_skips_and_marks_it_skipped(
        tmp_path, repo_root, run_cli, child_env):
    run = tmp_path / "amp"
    proc = _launch(run_cli, child_env, run, repo_root / "examples" / "launch" / "train_ddp.py", "--amp",
                   "--overflow-step", "1", "--samples", "128")
    assert proc.returncode == 0, proc.stderr[-3000:]
    store = RunStore.open(run)
    steps = store.table("steps")
    assert sorted(steps.groupby("rank").size().tolist()) == [4, 4]     # 128 / 2 / 16 optimizer step attempts
    amp = store.table("amp").sort_values(["rank", "step"])
    assert amp[["rank", "step", "skipped"]].values.tolist() == [[r, s, s == 1] for r in (0, 1) for s in range(4)]
    skipped = steps[steps["step"] == 1]
    assert skipped["opt_ns"].isna().all()                               # the optimizer never ran in it


@pytest.mark.multiproc
@pytest.mark.parametrize("how, code", [(("--fail-step", "2"), 1), (("--fail-step", "2", "--fail-exit", "3"), 3)])
def test_launch_returns_the_failing_scripts_exit_code_and_reports_rank_crash(
        tmp_path, repo_root, run_cli, child_env, how, code):
    run = tmp_path / "crash"
    proc = _launch(run_cli, child_env, run, repo_root / "examples" / "launch" / "train_ddp.py",
                   "--fail-rank", "1", *how)
    assert proc.returncode == code, proc.stderr[-3000:]
    assert "RANK_CRASH" in proc.stderr and "rank 1 died at step 2" in proc.stderr.replace("\n", " ")
    store = RunStore.open(run)
    assert store.manifest.status == "crashed"
    steps = store.table("steps")
    assert steps[steps["rank"] == 1]["step"].tolist() == [0, 1]        # step 2 never reached its optimizer step


LEAVES_ITS_GROUP = """
import atexit, datetime, os, sys
import torch, torch.distributed as dist

dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
dist.all_reduce(torch.ones(4))
out = os.path.join(sys.argv[1], f"rank{dist.get_rank()}.txt")
atexit.register(lambda: open(out, "w").write(str(dist.is_initialized())))   # never destroys its group
"""


@pytest.mark.multiproc
def test_launch_destroys_the_process_group_a_finished_script_left_before_the_exit(tmp_path, run_cli, child_env):
    # torch's teardown of a gloo group still alive at exit can abort the worker (-6) after its work is done: a
    # script that returned has its groups destroyed first, so its atexit functions find none
    (tmp_path / "leave.py").write_text(LEAVES_ITS_GROUP)
    proc = _launch(run_cli, child_env, tmp_path / "run", tmp_path / "leave.py", tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert [(tmp_path / f"rank{r}.txt").read_text() for r in (0, 1)] == ["False", "False"]
    assert RunStore.open(tmp_path / "run").manifest.status == "finished"


def _failing_script(fault: str, *, timeout_s: int = 60) -> tuple[str, int]:
    """A 2-rank DDP-like loop of 6 steps whose rank 1 runs ``fault`` (one line) at step 2, and that line's number."""
    lines = ["import datetime, os, sys, time", "import torch, torch.distributed as dist", "",
             f'dist.init_process_group("gloo", timeout=datetime.timedelta(seconds={timeout_s}))',
             "model = torch.nn.Linear(16, 16)", "opt = torch.optim.SGD(model.parameters(), lr=0.1)",
             "for step in range(6):", "    model(torch.randn(4, 16)).sum().backward()",
             "    for p in model.parameters():", "        dist.all_reduce(p.grad)", "    opt.step()",
             "    opt.zero_grad()", "    if step == 2 and dist.get_rank() == 1:", f"        {fault}",
             "dist.destroy_process_group()", ""]
    return "\n".join(lines), lines.index(f"        {fault}") + 1


# what libstdc++ prints when a C++ exception escapes a thread, then the abort it calls
ABORTS_IN_NATIVE_CODE = ("sys.stderr.write(\"terminate called after throwing an instance of 'c10::Error'\\n  what():  "
                         "CUDA error: an illegal memory access was encountered\\nException raised from "
                         "c10_cuda_check_implementation (most recent call first):\\nframe #0: c10::Error::Error"
                         "(c10::SourceLocation, std::string) + 0x96\\n\"); sys.stderr.flush(); os.abort()")


@pytest.mark.multiproc
def test_a_rank_that_aborts_in_native_code_is_named_with_its_message_line_and_cause(tmp_path, run_cli, child_env):
    # no Python exception, no error file: the cause and the script's line come from the worker's stderr (the abort
    # message before faulthandler's dump, the dump's frames), the frames of the Python installation skipped
    script = tmp_path / "native.py"
    text, line = _failing_script(ABORTS_IN_NATIVE_CODE)
    script.write_text(text)
    proc = _launch(run_cli, child_env, tmp_path / "run", script)
    assert proc.returncode != 0
    report = json.loads(run_cli("analyze", tmp_path / "run", "--format", "json", timeout_s=120,
                                env=child_env()).stdout)
    [crash] = [f for f in report["findings"] if f["code"] == "RANK_CRASH"]
    assert crash["ranks"] == [1] and crash["evidence"]["signal"] == "SIGABRT"
    assert crash["evidence"]["cause"] == "device"
    assert f"SIGABRT in native.py:{line}" in crash["title"]
    assert 'its stderr: "CUDA error: an illegal memory access was encountered"' in crash["title"]
    tail = crash["evidence"]["stderr_tail"].splitlines()
    assert tail[:2] == ["terminate called after throwing an instance of 'c10::Error'",
                        "  what():  CUDA error: an illegal memory access was encountered"]
    assert tail[2] == "Fatal Python error: Aborted" and not any("frame #" in line for line in tail)




@pytest.mark.multiproc
def test_a_hung_scripts_stacks_are_written_and_its_hang_names_the_line_the_missing_rank_was_at(
        tmp_path, run_cli, child_env):
    # rank 1 sleeps at step 2; rank 0 waits in the next all-reduce. After --stacks-after 2 s every rank writes its
    # stack into the run, and the script's own 12 s timeout ends the job, as without dtprobe
    script = tmp_path / "stuck.py"
    text, line = _failing_script("time.sleep(3600)", timeout_s=12)
    script.write_text(text)
    proc = run_cli("launch", "--nproc", "2", "--run-dir", tmp_path / "run", "--no-devices", "--stacks-after", "2",
                   script, timeout_s=LAUNCH_TIMEOUT_S, env=child_env())
    assert proc.returncode != 0
    report = json.loads(run_cli("analyze", tmp_path / "run", "--format", "json", timeout_s=120,
                                env=child_env()).stdout)
    [hang] = [f for f in report["findings"] if f["code"] == "HANG"]
    assert hang["ranks"] == [1] and f"at stuck.py:{line}" in hang["title"]
    stacks = hang["evidence"]["stacks"]
    assert set(stacks) == {"0", "1"} and f'stuck.py", line {line}' in stacks["1"] and "all_reduce" in stacks["0"]
    assert hang["evidence"]["watchdog_report"]["timeout_s"] == 2.0
    assert hang["evidence"]["waited_s"] >= 10        # the job went on until its own timeout


@pytest.mark.multiproc
@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_launch_times_each_action_of_a_torch_pipelining_schedule_in_its_step(
        tmp_path, repo_root, run_cli, child_env, schedule):
    run = tmp_path / schedule
    proc = _launch(run_cli, child_env, run, repo_root / "examples" / "launch" / "train_pipeline.py", "--steps", "4",
                   "--microbatches", "4", "--schedule", schedule)
    assert proc.returncode == 0, proc.stderr[-3000:]
    store = RunStore.open(run)
    steps, pipe = store.table("steps"), store.table("pipeline")
    # each rank runs its own stage: a forward and a full backward of each micro-batch in each of the 4 steps
    got = pipe.groupby(["rank", "step", "stage", "action"])["microbatch"].apply(sorted)
    assert got.index.tolist() == [(r, s, r, a) for r in (0, 1) for s in range(4) for a in ("B", "F")]
    assert all(mb == [0, 1, 2, 3] for mb in got)
    assert (pipe["clock"] == "host").all() and (pipe["end_ns"] > pipe["start_ns"]).all()
    # every action lies inside the step it is numbered in
    inside = pipe.merge(steps[["rank", "step", "start_ns", "end_ns"]], on=["rank", "step"], suffixes=("", "_step"))
    assert len(inside) == len(pipe)
    assert ((inside["start_ns"] >= inside["start_ns_step"]) & (inside["end_ns"] <= inside["end_ns_step"])).all()
    if schedule == "gpipe":      # every forward before the first backward, on each rank
        for _, mine in pipe.groupby(["rank", "step"]):
            assert mine.loc[mine["action"] == "F", "end_ns"].max() <= mine.loc[mine["action"] == "B",
                                                                                 "start_ns"].min()
