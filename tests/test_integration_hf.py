"""The Hugging Face callback (``dtprobe.integrations.hf.DtprobeCallback``) through the real ``Trainer``: a tiny GPT-2
built from a config (random weights, no download, ``HF_HUB_OFFLINE=1``) trains on synthetic tokens, on 2 CPU ranks
under torchrun (gloo, DDP through Accelerate) and in one plain process; the tests read the run it leaves."""

from __future__ import annotations

import json
import subprocess
import textwrap

import pytest

from dtprobe.store import RunStore
from probe_reuse_checks import assert_recorded_after_training, launch_with_callback, one_recorder_steps

NUM_STEPS = 6
"""Optimizer steps of the 2-rank run (``max_steps``)."""
BATCH, ACCUM, SEQ = 2, 2, 16
"""Per-device batch, gradient-accumulation micro-batches per optimizer step, sequence length."""
TOKENS_PER_RANK_STEP = BATCH * ACCUM * SEQ

WORKER = textwrap.dedent(f"""
    import json, sys
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments
    from dtprobe.integrations.hf import DtprobeCallback

    run_dir, out_dir, logging_steps, added_later = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4] == "1"
    own_attach = sys.argv[5:] == ["own_attach"]         # the script attaches first (and inits torch.distributed)
    if own_attach:
        import dtprobe
        probe = dtprobe.attach(run_dir, timeout_s=120, devices=False)
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=64, n_positions={SEQ}, n_embd=32, n_layer=2, n_head=2, bos_token_id=0,
                        eos_token_id=0)
    model = GPT2LMHeadModel(config)

    class Tokens(torch.utils.data.Dataset):
        def __init__(self):
            self.ids = torch.randint(0, 64, (64, {SEQ}), generator=torch.Generator().manual_seed(1))
        def __len__(self):
            return len(self.ids)
        def __getitem__(self, i):
            return {{"input_ids": self.ids[i], "labels": self.ids[i]}}

    args = TrainingArguments(
        output_dir=out_dir, per_device_train_batch_size={BATCH}, gradient_accumulation_steps={ACCUM},
        max_steps={NUM_STEPS}, logging_steps=logging_steps, learning_rate=1e-3, warmup_steps=2, report_to="none",
        use_cpu=True, save_strategy="no", include_num_input_tokens_seen="all", ddp_timeout=120,
        ddp_find_unused_parameters=False, disable_tqdm=True, seed=0)
    callback = DtprobeCallback(run_dir, timeout_s=120, device_interval_s=0.2)
    trainer = Trainer(model=model, args=args, train_dataset=Tokens(), callbacks=None if added_later else [callback])
    if added_later:
        trainer.add_callback(callback)
    trainer.train()
    if own_attach:                                      # still open after train: the script closes what it opened
        torch.distributed.all_reduce(torch.ones(3))
        probe.close()
    if trainer.is_world_process_zero():
        grad_bytes = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
        with open(out_dir + "/trainer.json", "w") as f:
            json.dump({{"log_history": trainer.state.log_history, "global_step": trainer.state.global_step,
                       "grad_bytes": grad_bytes, "backend": torch.distributed.get_backend()
                       if torch.distributed.is_initialized() else None}}, f)
    # Everything is written. The exit hooks run (the probe's close at exit among them), the module teardown does
    # not: there torch's gloo threads, of groups Accelerate never destroys, can abort the process (exit -6,
    # "terminate called without an active exception"), which a fresh-clone CI run hit once after the training.
    from dtprobe.runtime.quick_exit import quick_exit
    quick_exit(0)
""")


def _hf_env(child_env):
    return child_env(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_DATASETS_OFFLINE="1",
                     HF_HUB_DISABLE_TELEMETRY="1", TOKENIZERS_PARALLELISM="false")


@pytest.fixture(scope="module")
def ddp_run(tmp_path_factory, torchrun_cmd, child_env):
    """The 2-rank Trainer run with logging_steps=1: (run directory, what the Trainer logged)."""
    root = tmp_path_factory.mktemp("hf")
    (root / "worker.py").write_text(WORKER)
    (root / "out").mkdir()
    cmd = torchrun_cmd(root / "worker.py", root / "run", root / "out", "1", "0", nproc=2)
    proc = subprocess.run(cmd, env=_hf_env(child_env), timeout=600, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return root / "run", json.loads((root / "out" / "trainer.json").read_text())


@pytest.mark.multiproc
def test_hf_callback_writes_one_step_per_optimizer_step_with_the_logged_loss_and_lr_when_ddp_on_2_ranks(ddp_run):
    run, trainer = ddp_run
    logged = {entry["step"]: entry for entry in trainer["log_history"] if "loss" in entry}
    assert trainer["global_step"] == NUM_STEPS and sorted(logged) == list(range(1, NUM_STEPS + 1))

    store = RunStore.open(run)
    assert store.manifest.status == "finished" and store.manifest.world_size == 2
    steps = store.table("steps").sort_values(["rank", "step"])
    assert steps.groupby("rank")["step"].apply(list).to_dict() == {r: list(range(NUM_STEPS)) for r in (0, 1)}
    for row in steps.itertuples():
        log = logged[row.step + 1]                      # dtprobe step n is the Trainer's global_step n + 1
        assert row.loss == pytest.approx(log["loss"], rel=1e-9, abs=0), (row.rank, row.step)
        assert row.lr == pytest.approx(log["learning_rate"], rel=1e-9, abs=1e-15), (row.rank, row.step)
    assert len(set(steps["lr"])) > 2                   # warmup then linear decay: the values really vary
    assert (steps["opt_ns"] > 0).all() and (steps["end_ns"] > steps["start_ns"]).all()


@pytest.mark.multiproc
def test_hf_callback_steps_run_end_to_end_with_their_batches_and_the_collectives_between_them(ddp_run):
    # the Trainer calls on_step_begin after it fetched the step's batches and the ranks exchanged their token
    # counts: a step starts where the previous one ended, so that work, its data phase and that exchange are in it
    run, _ = ddp_run
    store = RunStore.open(run)
    steps = store.table("steps").sort_values(["rank", "step"])
    for _, g in steps.groupby("rank"):
        assert g["start_ns"].iloc[1:].tolist() == g["end_ns"].iloc[:-1].tolist()
    assert (steps["data_ns"] > 0).all()                 # the DataLoader's batches, timed
    coll = store.table("collectives")
    between = coll[coll["enqueue_ns"].between(steps["end_ns"].min(), steps["end_ns"].max()) & (coll["step"] < 0)]
    assert between.empty, between[["rank", "op", "num_bytes", "step"]]


@pytest.mark.multiproc
def test_hf_callback_counts_each_ranks_input_ids_matching_the_trainers_token_count(ddp_run):
    run, trainer = ddp_run
    steps = RunStore.open(run).table("steps")
    assert (steps["tokens"] == TOKENS_PER_RANK_STEP).all()
    seen = [0] + [e["num_input_tokens_seen"] for e in trainer["log_history"] if "loss" in e]
    per_step_all_ranks = steps.groupby("step")["tokens"].sum().tolist()
    assert per_step_all_ranks == [b - a for a, b in zip(seen, seen[1:])]


@pytest.mark.multiproc
def test_hf_callback_run_records_ddp_gradient_allreduces_in_every_step(ddp_run):
    run, trainer = ddp_run
    coll = RunStore.open(run).table("collectives")
    allreduce = coll[(coll["op"] == "allreduce") & (coll["step"] >= 0)]
    per_step = allreduce.groupby(["rank", "step"])["num_bytes"].sum()
    assert sorted(per_step.index) == [(r, s) for r in (0, 1) for s in range(NUM_STEPS)]
    assert set(per_step.tolist()) == {trainer["grad_bytes"]}


@pytest.mark.multiproc
def test_hf_callback_run_is_analyzed_with_tokens_per_second_from_the_recorded_tokens(ddp_run, run_cli):
    run, _ = ddp_run
    proc = run_cli("analyze", run, "--format", "json")
    # exit 1 means a critical finding, which CPU timing on a shared machine may give; 2 would be unusable input
    assert proc.returncode in (0, 1) and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    metrics = json.loads(proc.stdout)["metrics"]
    throughput = metrics["throughput"]
    assert metrics["run"]["world_size"] == 2 and throughput["num_steps"] == NUM_STEPS - 1   # step 0 is warmup
    assert throughput["tokens_per_s"] == pytest.approx(
        2 * TOKENS_PER_RANK_STEP / (throughput["step_time_ms"] / 1e3), rel=1e-6)


def _train_in_one_process(tmp_path, run_python, child_env, *, logging_steps: int, added_later: bool):
    """The worker in a plain process (attach makes a 1-rank group): (its stderr, the steps rows in step order)."""
    (tmp_path / "out").mkdir()
    proc = run_python(WORKER, tmp_path / "run", tmp_path / "out", str(logging_steps), str(int(added_later)),
                      env=_hf_env(child_env), timeout_s=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    trainer = json.loads((tmp_path / "out" / "trainer.json").read_text())
    assert [e["step"] for e in trainer["log_history"] if "loss" in e] == list(range(
        logging_steps, NUM_STEPS + 1, logging_steps))
    steps = RunStore.open(tmp_path / "run").table("steps").sort_values("step")
    assert steps["step"].tolist() == list(range(NUM_STEPS))
    return proc.stderr, steps


def test_hf_callback_leaves_the_loss_absent_and_warns_when_a_log_spans_several_steps(tmp_path, run_python,
                                                                                    child_env):
    stderr, steps = _train_in_one_process(tmp_path, run_python, child_env, logging_steps=2, added_later=False)
    assert "Set TrainingArguments(logging_steps=1)" in stderr
    assert steps["loss"].isna().all()                # a mean over two steps is no step's loss
    assert steps["lr"].notna().all() and (steps["tokens"] == TOKENS_PER_RANK_STEP).all()


def test_hf_callback_added_after_the_trainer_was_built_attaches_at_train_begin_and_warns(tmp_path, run_python,
                                                                                         child_env):
    stderr, steps = _train_in_one_process(tmp_path, run_python, child_env, logging_steps=1, added_later=True)
    assert "attaches at train begin, after the Trainer wrapped the model" in stderr
    assert steps["loss"].notna().all() and (steps["tokens"] == TOKENS_PER_RANK_STEP).all()



def _assert_steps_are_the_callbacks(run, trainer) -> None:
    """One recorder, each step once, with the loss the Trainer logged for it and this rank's tokens."""
    steps = one_recorder_steps(run, num_steps=NUM_STEPS, grad_bytes=trainer["grad_bytes"])
    logged = {entry["step"]: entry["loss"] for entry in trainer["log_history"] if "loss" in entry}
    assert [logged[s + 1] for s in steps["step"]] == pytest.approx(steps["loss"].tolist(), rel=1e-9)
    assert (steps["tokens"] == TOKENS_PER_RANK_STEP).all()


@pytest.mark.multiproc
def test_hf_callback_under_dtprobe_launch_records_through_the_workers_probe_and_leaves_closing_to_it(
        tmp_path, run_cli, child_env):
    # the Trainer also saves a checkpoint every 3 steps (its files through safetensors and torch.save)
    (tmp_path / "worker.py").write_text(WORKER.replace('save_strategy="no"', 'save_strategy="steps", save_steps=3'))
    (tmp_path / "out").mkdir()
    run = tmp_path / "launch-run"
    launch_with_callback(run_cli, _hf_env(child_env), tmp_path / "worker.py", run, tmp_path / "callback-run",
                         tmp_path / "out", "1", "0")
    trainer = json.loads((tmp_path / "out" / "trainer.json").read_text())
    assert trainer["backend"] == "gloo"
    # the launch's hook-driven steps gave way to the callback's: each step once, with the logged loss and tokens
    _assert_steps_are_the_callbacks(run, trainer)
    # each checkpoint's files are rows of the step the Trainer saved after (its global step: the callback's next)
    saves = RunStore.open(run).table("checkpoints")
    written = saves[saves["rank"] == 0].set_index("path")
    for step in (3, 6):
        model = str(tmp_path / "out" / f"checkpoint-{step}" / "model.safetensors")
        assert written.loc[model, "step"] == step and written.loc[model, "num_bytes"] > 0
        assert written.loc[model, "blocking_ns"] > 0 and written.loc[model, "ok"]
    assert set(saves["step"]) == {3, 6} and (saves["kind"] == "save").all()


@pytest.mark.multiproc
def test_hf_callback_after_the_scripts_own_attach_reuses_its_probe_and_does_not_close_it_at_train_end(
        tmp_path, torchrun_cmd, child_env):
    (tmp_path / "worker.py").write_text(WORKER)
    (tmp_path / "out").mkdir()
    run = tmp_path / "run"
    cmd = torchrun_cmd(tmp_path / "worker.py", run, tmp_path / "out", "1", "0", "own_attach", nproc=2)
    proc = subprocess.run(cmd, env=_hf_env(child_env), timeout=600, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-4000:]
    trainer = json.loads((tmp_path / "out" / "trainer.json").read_text())
    assert trainer["backend"] == "gloo"               # attach initialized: Accelerate sees the plain backend
    _assert_steps_are_the_callbacks(run, trainer)
    assert_recorded_after_training(run)
