"""End to end: ``dtprobe run`` trains the GPT on dp2 x tp2 x pp2 (8 processes, ZeRO-3 on dp, 1F1B) and the run
store says which parallel group every collective belongs to: FSDP all-gather and reduce-scatter on ``dp``,
TP all-reduce on ``tp``, send/recv on ``pp``; plus pipeline actions and per-rank memory. The loss equals a
single process on the same global batch (in-process reference with the same lr schedule and clipping).
"""

from __future__ import annotations


import pytest
import torch

from dtprobe.runtime.config import LayoutConfig
from dtprobe.runtime.data import Sampler, token_stream
from dtprobe.runtime.model import build_model, warmup_lr
from dtprobe.runtime.parallel.hybrid import parallelize_model
from dtprobe.store import RunStore

pytestmark = pytest.mark.multiproc

STEPS = 3
BATCH = 4          # per dp rank and micro-batch; global batch 8
SEQ = 32
FLAGS = ["--nproc", "8", "--dp", "2", "--tp", "2", "--pp", "2", "--zero", "3", "--pp-schedule", "1f1b",
         "--microbatches", "2", "--steps", str(STEPS), "--batch-size", str(BATCH), "--seq-len", str(SEQ),
         "--no-devices", "--timeout", "240"]


@pytest.fixture(scope="module")
def store(tmp_path_factory, run_cli, child_env) -> RunStore:
    run_dir = tmp_path_factory.mktemp("layouts_e2e") / "dp2_tp2_pp2"
    proc = run_cli("run", *FLAGS, "--run-dir", run_dir, timeout_s=1200, env=child_env(PYTHONWARNINGS="ignore"))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return RunStore.open(run_dir)


def single_process_losses() -> list[float]:
    """The same job on one process: global batch 8, same seed, lr schedule (linear scaling, warmup), clip."""
    from dtprobe.runtime.config import TrainConfig

    tcfg = TrainConfig(steps=STEPS, batch_size=BATCH, seq_len=SEQ)
    peak = tcfg.peak_lr(2)   # the 3-D run's dp = 2 -> the same global batch as this single process
    model = build_model("tiny", seed=tcfg.seed)
    par = parallelize_model(model, LayoutConfig().resolve(1), world_size=1, rank=0, device=torch.device("cpu"),
                            optimizer_kwargs={"lr": tcfg.lr, "betas": (0.9, 0.95),
                                              "weight_decay": tcfg.weight_decay}, max_norm=tcfg.clip)
    sampler = Sampler(token_stream(tcfg.data, seed=tcfg.seed), batch_size=2 * BATCH, seq_len=SEQ, grad_accum=1,
                      dp_rank=0, dp_size=1, seed=tcfg.seed)
    losses = []
    for step in range(STEPS):
        for group in par.optimizer.param_groups:
            group["lr"] = warmup_lr(step, base_lr=peak, warmup_steps=tcfg.warmup)
        losses.append(float(par.train_step(sampler.micro_batches(step), step=step)))
    return losses


def test_3d_run_finishes_and_matches_single_process_loss(store):
    assert store.manifest.status == "finished" and store.manifest.world_size == 8
    steps = store.table("steps")
    assert len(steps) == 8 * STEPS
    with_loss = steps[steps["loss"].notna()]
    assert sorted(with_loss["rank"].unique()) == [4, 5, 6, 7]   # the last pipeline stage's ranks
    got = with_loss.groupby("step")["loss"].mean().tolist()
    reference = single_process_losses()
    rel = [abs(g - r) / r for g, r in zip(got, reference)]
    assert max(rel) < 1e-4, (got, reference)


def test_3d_collectives_are_named_by_mesh_axis(store):
    coll = store.table("collectives")
    coll = coll[coll["step"] >= 0]
    ops = {pg: set(g) for pg, g in coll.groupby("pg")["op"]}
    assert set(ops) == {"dp", "tp", "pp"}, ops
    assert {"allgather", "reduce_scatter"} <= ops["dp"]    # FSDP2 (ZeRO-3)
    assert "allreduce" in ops["tp"]                         # Megatron TP
    assert {"send", "recv"} <= ops["pp"]                    # pipeline p2p
    # groups: tp = neighbours, dp = stride tp, pp = stride dp * tp
    ranks = {pg: set(g) for pg, g in coll.groupby("pg")["pg_ranks"]}
    assert ranks["tp"] == {"0,1", "2,3", "4,5", "6,7"}
    assert ranks["dp"] == {"0,2", "1,3", "4,6", "5,7"}
    assert ranks["pp"] == {"0,4", "1,5", "2,6", "3,7"}
    p2p = coll[coll["op"].isin(["send", "recv"])]
    assert (p2p["peer"] - p2p["rank"]).abs().eq(4).all()
    # the members of each dp group issue the same collectives: same count, and the same op and bytes per seq
    dp = coll[coll["pg"] == "dp"]
    for _, group in dp.groupby("pg_ranks"):
        assert group.groupby("rank").size().nunique() == 1
        assert (group.groupby("seq")[["op", "num_bytes"]].nunique() == 1).all().all()


def test_3d_pipeline_and_memory_tables_cover_every_rank_and_step(store):
    pipe = store.table("pipeline")
    counts = pipe.groupby(["rank", "step", "action"]).size()
    assert set(counts.index.get_level_values("rank")) == set(range(8))
    assert (counts == 2).all()          # 2 micro-batches: one F and one B each per step
    assert set(pipe["stage"]) == {0, 1} and (pipe["stage"] == pipe["rank"] // 4).all()
    mem = store.table("memory")
    assert len(mem) == 8 * STEPS and (mem["param_bytes"] > 0).all() and (mem["optim_bytes"] > 0).all()
    assert mem["peak_bytes"].isna().all() and (mem["rss_bytes"] > 0).all()   # CPU: RSS, never a GPU figure
