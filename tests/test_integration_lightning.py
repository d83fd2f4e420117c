"""The Lightning callback (``dtprobe.integrations.lightning.DtprobeCallback``) through the real ``lightning.pytorch``
Trainer: a tiny language model trains on synthetic tokens with ``accumulate_grad_batches=2`` over 2 epochs of 5
batches per rank (so each epoch ends on a one-batch step), on 2 CPU ranks under torchrun (DDP, gloo), and in one
plain process that fails mid-run; the tests read the run it leaves and what Lightning logged (CSVLogger)."""

from __future__ import annotations

import csv
import json
import subprocess
import textwrap

import pytest

from dtprobe.store import RunStore
from probe_reuse_checks import assert_recorded_after_training, launch_with_callback, one_recorder_steps

BATCH, SEQ, ACCUM = 2, 16, 2
MICRO_BATCHES = [2, 2, 1, 2, 2, 1]
"""Micro-batches of each optimizer step on a rank: 5 batches per epoch in groups of 2, the last group short."""
NUM_STEPS = len(MICRO_BATCHES)

WORKER = textwrap.dedent(f"""
    import json, os, sys
    import torch
    import torch.nn.functional as F
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import LearningRateMonitor
    from lightning.pytorch.loggers import CSVLogger
    from dtprobe.integrations.lightning import DtprobeCallback

    run_dir, out_dir, devices, fail_at_step, sync_dist = sys.argv[1], sys.argv[2], *map(int, sys.argv[3:6])
    own_attach = sys.argv[6:] == ["own_attach"]         # the script attaches first (and inits torch.distributed)
    if own_attach:
        import dtprobe
        probe = dtprobe.attach(run_dir, timeout_s=120, devices=False)
    VOCAB = 64

    class Tokens(torch.utils.data.Dataset):
        def __init__(self):
            self.ids = torch.randint(0, VOCAB, (10 * devices, {SEQ}), generator=torch.Generator().manual_seed(1))
        def __len__(self):
            return len(self.ids)
        def __getitem__(self, i):
            return {{"input_ids": self.ids[i]}}

    class TinyLM(pl.LightningModule):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.net = torch.nn.Sequential(torch.nn.Embedding(VOCAB, 32), torch.nn.Linear(32, VOCAB))
            self.batch_losses = []
        def training_step(self, batch, batch_idx):
            if self.global_step == fail_at_step:
                raise RuntimeError("injected failure in training_step")
            ids = batch["input_ids"]
            loss = F.cross_entropy(self.net(ids[:, :-1]).reshape(-1, VOCAB), ids[:, 1:].reshape(-1))
            self.batch_losses.append([self.global_step, loss.item()])
            self.log("train_loss", loss, on_step=False, on_epoch=True, sync_dist=bool(sync_dist))
            return loss
        def configure_optimizers(self):
            opt = torch.optim.AdamW(self.parameters(), lr=1e-2)
            sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (s + 1))
            return {{"optimizer": opt, "lr_scheduler": {{"scheduler": sched, "interval": "step"}}}}
        def train_dataloader(self):
            return torch.utils.data.DataLoader(Tokens(), batch_size={BATCH})

    module = TinyLM()
    trainer = pl.Trainer(
        accelerator="cpu", devices=devices, strategy="ddp" if devices > 1 else "auto", max_epochs=2,
        accumulate_grad_batches={ACCUM}, log_every_n_steps=1, logger=CSVLogger(out_dir, name="csv", version=0),
        callbacks=[DtprobeCallback(run_dir, timeout_s=120, device_interval_s=0.2), LearningRateMonitor("step")],
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0)
    try:
        trainer.fit(module)
        if own_attach:                                  # still open after fit: the script closes what it opened
            torch.distributed.all_reduce(torch.ones(3))
            probe.close()
    finally:
        with open(os.path.join(out_dir, f"rank{{trainer.global_rank}}.json"), "w") as f:
            json.dump({{"batch_losses": module.batch_losses, "global_step": trainer.global_step,
                       "grad_bytes": sum(p.numel() * p.element_size() for p in module.parameters())}}, f)
    if os.environ.get("WORKER_QUICK_EXIT"):             # under plain torchrun: skip torch's teardown (seconds)
        from dtprobe.runtime.quick_exit import quick_exit
        quick_exit(0)
""")


def _fit_on_2_ranks(root, torchrun_cmd, child_env, *, sync_dist: bool, own_attach: bool = False):
    """Run the worker under torchrun: (run directory, each rank's own record, the rows Lightning logged to CSV)."""
    (root / "worker.py").write_text(WORKER)
    (root / "out").mkdir()
    cmd = torchrun_cmd(root / "worker.py", root / "run", root / "out", "2", "-1", str(int(sync_dist)),
                       *(["own_attach"] if own_attach else []), nproc=2)
    proc = subprocess.run(cmd, env=child_env(WORKER_QUICK_EXIT="1"), timeout=600, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return _read_outputs(root)


def _read_outputs(root):
    """(``root``/run, each rank's own record, the rows Lightning logged to CSV) of a finished worker."""
    ranks = {r: json.loads((root / "out" / f"rank{r}.json").read_text()) for r in (0, 1)}
    with open(root / "out" / "csv" / "version_0" / "metrics.csv") as f:
        logged = list(csv.DictReader(f))
    return root / "run", ranks, logged


def _epoch_mean_losses(steps, rank: int) -> list[float]:
    """Each epoch's mean over its micro-batches on ``rank``, from the steps rows (3 optimizer steps per epoch)."""
    means = []
    for first in (0, 3):
        weights = MICRO_BATCHES[first:first + 3]
        means.append(sum(steps.loc[(rank, first + i), "loss"] * w for i, w in enumerate(weights)) / sum(weights))
    return means


@pytest.fixture(scope="module")
def ddp_run(tmp_path_factory, torchrun_cmd, child_env):
    """The 2-rank fit, the epoch loss logged without sync_dist (rank 0's own)."""
    return _fit_on_2_ranks(tmp_path_factory.mktemp("lightning"), torchrun_cmd, child_env, sync_dist=False)


@pytest.mark.multiproc
def test_lightning_callback_writes_one_step_per_optimizer_step_when_accumulating_2_batches_on_2_ranks(ddp_run):
    run, ranks, _ = ddp_run
    assert {r: rec["global_step"] for r, rec in ranks.items()} == {0: NUM_STEPS, 1: NUM_STEPS}
    store = RunStore.open(run)
    assert store.manifest.status == "finished" and store.manifest.world_size == 2
    steps = store.table("steps").sort_values(["rank", "step"])
    assert steps.groupby("rank")["step"].apply(list).to_dict() == {r: list(range(NUM_STEPS)) for r in (0, 1)}
    tokens = [n * BATCH * SEQ for n in MICRO_BATCHES]
    assert steps.groupby("rank")["tokens"].apply(list).to_dict() == {0: tokens, 1: tokens}
    assert (steps["end_ns"] > steps["start_ns"]).all()


@pytest.mark.multiproc
def test_lightning_callback_records_each_ranks_mean_micro_batch_loss_and_the_logged_epoch_loss_agrees(ddp_run):
    run, ranks, logged = ddp_run
    steps = RunStore.open(run).table("steps").set_index(["rank", "step"])
    for rank, record in ranks.items():
        by_step: dict[int, list[float]] = {}
        for global_step, loss in record["batch_losses"]:
            by_step.setdefault(global_step, []).append(loss)
        assert [len(by_step[s]) for s in range(NUM_STEPS)] == MICRO_BATCHES
        for step, losses in by_step.items():
            assert steps.loc[(rank, step), "loss"] == pytest.approx(sum(losses) / len(losses), rel=1e-6)
    assert steps.loc[(0, 0), "loss"] != pytest.approx(steps.loc[(1, 0), "loss"], rel=1e-6)   # each rank's own

    # Lightning's logged epoch loss (rank 0 logs): rank 0's mean over the epoch's micro-batches.
    epoch_losses = [float(row["train_loss"]) for row in logged if row["train_loss"]]
    assert epoch_losses == pytest.approx(_epoch_mean_losses(steps, 0), rel=1e-6)


@pytest.mark.multiproc
def test_lightning_callback_keeps_sync_dist_logging_working_and_its_epoch_loss_is_the_ranks_mean(
        tmp_path, torchrun_cmd, child_env):
    # sync_dist=True reduces with "mean", which Lightning runs as a SUM plus a division when
    # dist.get_backend(group) == "gloo" (gloo has no AVG), also on integer tensors (the batch-size count).
    run, _, logged = _fit_on_2_ranks(tmp_path, torchrun_cmd, child_env, sync_dist=True)
    steps = RunStore.open(run).table("steps").set_index(["rank", "step"])
    epoch_losses = [float(row["train_loss"]) for row in logged if row["train_loss"]]
    per_rank = [_epoch_mean_losses(steps, r) for r in (0, 1)]
    assert epoch_losses == pytest.approx([(a + b) / 2 for a, b in zip(*per_rank)], rel=1e-6)


@pytest.mark.multiproc
def test_lightning_callback_records_the_learning_rate_lightnings_monitor_logged_at_each_step(ddp_run):
    run, _, logged = ddp_run
    lr_logged = {int(row["step"]): float(row["lr-AdamW"]) for row in logged if row["lr-AdamW"]}
    steps = RunStore.open(run).table("steps")
    assert sorted(lr_logged) == list(range(NUM_STEPS))
    for row in steps.itertuples():
        assert row.lr == pytest.approx(lr_logged[row.step], rel=1e-12), (row.rank, row.step)
    assert len(set(steps["lr"])) == NUM_STEPS              # the scheduler moves it every step


@pytest.mark.multiproc
def test_lightning_callback_run_records_ddp_gradient_allreduces_once_per_optimizer_step(ddp_run):
    run, ranks, _ = ddp_run
    coll = RunStore.open(run).table("collectives")
    allreduce = coll[(coll["op"] == "allreduce") & (coll["step"] >= 0)]
    per_step = allreduce.groupby(["rank", "step"])["num_bytes"].sum()
    assert sorted(per_step.index) == [(r, s) for r in (0, 1) for s in range(NUM_STEPS)]
    assert set(per_step.tolist()) == {ranks[0]["grad_bytes"]}     # no sync on the accumulating micro-batch


@pytest.mark.multiproc
def test_lightning_callback_run_is_analyzed_with_tokens_per_second_from_the_recorded_tokens(ddp_run, run_cli):
    run, _, _ = ddp_run
    proc = run_cli("analyze", run, "--format", "json")
    # exit 1 means a critical finding, which CPU timing on a shared machine may give; 2 would be unusable input
    assert proc.returncode in (0, 1) and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    metrics = json.loads(proc.stdout)["metrics"]
    assert metrics["run"]["world_size"] == 2 and metrics["steps_analyzed"]["count"] == NUM_STEPS - 1
    # tokens/s per step is both ranks' tokens over the step's wall time (first start to last end); the median of
    # the analyzed steps (step 0 is warmup), where the short last step of an epoch holds half the tokens
    g = RunStore.open(run).table("steps").query("step >= 1").groupby("step")
    per_step = g["tokens"].sum() / ((g["end_ns"].max() - g["start_ns"].min()) / 1e9)
    assert g["tokens"].sum().tolist() == [2 * n * BATCH * SEQ for n in MICRO_BATCHES[1:]]
    assert metrics["throughput"]["tokens_per_s"] == pytest.approx(per_step.median(), rel=1e-6)


def test_lightning_callback_closes_the_run_as_crashed_when_training_step_raises(tmp_path, run_python, child_env):
    (tmp_path / "out").mkdir()
    proc = run_python(WORKER, tmp_path / "run", tmp_path / "out", "1", "3", "0", env=child_env(), timeout_s=300)
    assert proc.returncode != 0 and "injected failure in training_step" in proc.stderr

    store = RunStore.open(tmp_path / "run")
    assert store.manifest.status == "crashed"
    steps = store.table("steps").sort_values("step")
    assert steps["step"].tolist() == [0, 1, 2, 3]
    assert steps["loss"].notna().tolist() == [True, True, True, False]    # step 3 broke: no values
    close = store.table("lifecycle").query("event == 'close'")
    assert close[["status", "reason"]].values.tolist() == [["crashed", "exception"]]




def _assert_steps_are_the_callbacks(run, ranks) -> None:
    """One recorder, each step once, with this rank's tokens and loss."""
    steps = one_recorder_steps(run, num_steps=NUM_STEPS, grad_bytes=ranks[0]["grad_bytes"])
    tokens = [n * BATCH * SEQ for n in MICRO_BATCHES]
    assert steps.groupby("rank")["tokens"].apply(list).to_dict() == {0: tokens, 1: tokens}
    assert steps["loss"].notna().all()


@pytest.mark.multiproc
def test_lightning_callback_under_dtprobe_launch_records_through_the_workers_probe_and_leaves_closing_to_it(
        tmp_path, run_cli, child_env):
    # Lightning's default ModelCheckpoint also saves at each epoch's end (rank 0: a torch.save into a buffer, then
    # written through fsspec)
    (tmp_path / "worker.py").write_text(WORKER.replace("enable_checkpointing=False", "enable_checkpointing=True"))
    (tmp_path / "out").mkdir()
    run = tmp_path / "launch-run"
    launch_with_callback(run_cli, child_env(), tmp_path / "worker.py", run, tmp_path / "callback-run",
                         tmp_path / "out", "2", "-1", "0")
    _, ranks, _ = _read_outputs(tmp_path)
    # the launch's hook-driven steps gave way to the callback's: each step once, with the callback's tokens
    _assert_steps_are_the_callbacks(run, ranks)
    saves = RunStore.open(run).table("checkpoints").sort_values("start_ns")
    assert saves["rank"].tolist() == [0, 0] and (saves["kind"] == "save").all() and saves["ok"].all()
    assert all(p.endswith(".ckpt") and p.startswith(str(tmp_path / "out")) for p in saves["path"])
    assert (saves["blocking_ns"] > 0).all() and (saves["num_bytes"] > 0).all()
    assert saves["step"].tolist() == sorted(saves["step"]) and saves["step"].between(1, NUM_STEPS).all()


@pytest.mark.multiproc
def test_lightning_callback_after_the_scripts_own_attach_reuses_its_probe_and_sync_dist_sees_gloo(
        tmp_path, torchrun_cmd, child_env):
    # attach initializes torch.distributed before Lightning; Lightning's sync_dist "mean" takes its gloo path
    # (a SUM and a division) only if dist.get_backend() answers "gloo"
    run, ranks, logged = _fit_on_2_ranks(tmp_path, torchrun_cmd, child_env, sync_dist=True, own_attach=True)
    _assert_steps_are_the_callbacks(run, ranks)
    steps = RunStore.open(run).table("steps").set_index(["rank", "step"])
    epoch_losses = [float(row["train_loss"]) for row in logged if row["train_loss"]]
    per_rank = [_epoch_mean_losses(steps, r) for r in (0, 1)]
    assert epoch_losses == pytest.approx([(a + b) / 2 for a, b in zip(*per_rank)], rel=1e-6)
    assert_recorded_after_training(run)
