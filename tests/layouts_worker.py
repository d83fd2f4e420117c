"""Multi-process worker of the layout tests: trains the tiny GPT for a few steps on several layouts in one launch
and prints, from rank 0, one JSON line per layout with the global loss of every step.

Launched by tests/test_layouts.py and tests/test_pipeline_bubble.py (one process per rank, gloo, 127.0.0.1):
    OMP_NUM_THREADS=1 python tests/layouts_worker.py --rank R --world-size N --port P --cases dp2,tp2,...
        [--optimizer lamb --lr 3e-3]
    OMP_NUM_THREADS=1 python tests/layouts_worker.py --rank R --world-size 4 --port P --bubble gpipe,1f1b
A case name is a key of CASES; the loss of a step is the mean over the ranks that compute a loss (every
rank without PP, the last stage's ranks with PP) of their micro-batch-mean losses: the loss of the global batch.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from dtprobe.runtime.config import LayoutConfig  # noqa: E402
from dtprobe.runtime.data import Sampler, synthetic_tokens  # noqa: E402
from dtprobe.runtime.model import build_model  # noqa: E402
from dtprobe.runtime.parallel.hybrid import parallelize_model  # noqa: E402
from dtprobe.runtime.parallel.memory import memory_row  # noqa: E402
from dtprobe.runtime.parallel.pp import torch_action_order  # noqa: E402
from dtprobe.runtime.parallel.stage_sleep import parse_stage_sleep  # noqa: E402

GLOBAL_BATCH = 8
SEQ_LEN = 32
STEPS = 5
SEED = 3
LR = 3e-3
MAX_NORM = 1.0


def layout(**kw) -> LayoutConfig:
    return LayoutConfig(**kw).resolve(kw.get("dp", 1) * kw.get("tp", 1) * kw.get("pp", 1))


CASES = {
    "single": dict(),
    "dp2": dict(dp=2),
    "zero1_dp2": dict(dp=2, zero=1),
    "zero2_dp2": dict(dp=2, zero=2),
    "zero3_dp2": dict(dp=2, zero=3),
    "tp2": dict(tp=2),
    "tp2_sp": dict(tp=2, sequence_parallel=True),
    "tp2_sp_ac_full": dict(tp=2, sequence_parallel=True, activation_checkpointing="full"),
    "pp2_gpipe": dict(pp=2, pp_schedule="gpipe", microbatches=4),
    "pp2_1f1b": dict(pp=2, pp_schedule="1f1b", microbatches=4),
    "pp2_interleaved-1f1b": dict(pp=2, pp_schedule="interleaved-1f1b", microbatches=4),
    "pp2_zero-bubble": dict(pp=2, pp_schedule="zero-bubble", microbatches=4),
    "pp2_zbv": dict(pp=2, pp_schedule="zbv", microbatches=4),
    "dp2_tp2": dict(dp=2, tp=2),
    "dp2_tp2_zero3_sp": dict(dp=2, tp=2, zero=3, sequence_parallel=True),
    "dp2_pp2": dict(dp=2, pp=2, pp_schedule="1f1b", microbatches=2),
    "dp2_pp2_zero2_interleaved": dict(dp=2, pp=2, zero=2, pp_schedule="interleaved-1f1b", microbatches=2),
    "tp2_pp2": dict(tp=2, pp=2, pp_schedule="gpipe", microbatches=4),
    "dp2_tp2_pp2": dict(dp=2, tp=2, pp=2, zero=3, pp_schedule="1f1b", microbatches=2),
    "single_ac_selective": dict(activation_checkpointing="selective"),
    "zero1_dp2_accum2": dict(dp=2, zero=1, grad_accum=2),
    "zero3_dp2_accum2": dict(dp=2, zero=3, grad_accum=2),
    "zero3_dp2_ac_full": dict(dp=2, zero=3, activation_checkpointing="full"),
    "dp2_pp2_zero1": dict(dp=2, pp=2, zero=1, pp_schedule="gpipe", microbatches=2),
    "pp2_1f1b_fp16": dict(pp=2, pp_schedule="1f1b", microbatches=4, precision="fp16"),
    "zero3_dp2_fp16": dict(dp=2, zero=3, precision="fp16"),
    "zero0_dp4": dict(dp=4),
    "zero1_dp4": dict(dp=4, zero=1),
    "zero3_dp4": dict(dp=4, zero=3),
}
"""Layouts by name (LayoutConfig keys)."""


def run_case(name: str, *, rank: int, world_size: int, optimizer: str = "adamw",
             lr: float = LR) -> tuple[list[float], list[dict]]:
    kw = dict(CASES[name])
    accum = kw.pop("grad_accum", 1)
    precision = kw.pop("precision", "fp32")
    ops = None
    if precision != "fp32":
        from dtprobe.runtime.precision import MixedPrecision, PrecisionConfig

        ops = MixedPrecision(PrecisionConfig(dtype=precision), sharded=True)
    lay = layout(**kw)
    assert lay.world_size == world_size, (name, world_size)
    model = build_model("tiny", seed=SEED)
    par = parallelize_model(model, lay, world_size=world_size, rank=rank, device=torch.device("cpu"),
                      optimizer=optimizer, optimizer_kwargs={"lr": lr, "weight_decay": 0.1}, max_norm=MAX_NORM,
                      global_batch=GLOBAL_BATCH, seq_len=SEQ_LEN)
    sampler = Sampler(synthetic_tokens(SEED, length=1 << 16), batch_size=GLOBAL_BATCH // par.dp_size // accum,
                      seq_len=SEQ_LEN, grad_accum=accum, dp_rank=par.dp_rank, dp_size=par.dp_size, seed=SEED)
    losses = []
    for step in range(STEPS):
        loss = par.train_step(sampler.micro_batches(step), step=step, ops=ops)
        loss = None if loss is None else float(loss)
        if world_size > 1:
            t = torch.tensor([loss if loss is not None else 0.0, 1.0 if loss is not None else 0.0],
                             dtype=torch.float64)
            dist.all_reduce(t)
            losses.append(float(t[0] / t[1]))
        else:
            losses.append(loss)
    memory = memory_row(par.model_parts, par.optimizer, step=STEPS - 1, device=torch.device("cpu"))
    memory["rank"] = rank
    gathered = [None] * world_size
    if world_size > 1:
        dist.all_gather_object(gathered, memory)
    else:
        gathered = [memory]
    return losses, gathered


def run_bubble(schedule: str, *, rank: int, world_size: int, sleep: str, steps: int,
               microbatches: int) -> dict | None:
    """pp = world_size sleep stages; returns (on rank 0) every rank's pipeline rows and torch's action lists."""
    lay = layout(pp=world_size, pp_schedule=schedule, microbatches=microbatches, stage_sleep=sleep)
    model = build_model("tiny", seed=SEED)
    par = parallelize_model(model, lay, world_size=world_size, rank=rank, device=torch.device("cpu"),
                            stage_sleep=parse_stage_sleep(sleep))
    batch = microbatches * 2
    sampler = Sampler(synthetic_tokens(SEED, length=1 << 14), batch_size=batch, seq_len=8, grad_accum=1,
                      dp_rank=0, dp_size=1, seed=SEED)
    rows = []
    for step in range(steps):
        par.train_step(sampler.micro_batches(step), step=step)
        rows += [{**r, "rank": rank} for r in par.timer.rows]
    gathered = [None] * world_size
    dist.all_gather_object(gathered, rows)
    if rank != 0:
        return None
    order = torch_action_order(par.schedule, schedule)
    return {"bubble": schedule, "rows": [r for g in gathered for r in g],
            "order": None if order is None else [[list(a) for a in acts] for acts in order],
            "virtual_stages": len(par.stage_indices)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rank", type=int, default=0)
    ap.add_argument("--world-size", type=int, default=1)
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--cases", default="")
    ap.add_argument("--optimizer", default="adamw", help="runtime.optimizers name for --cases")
    ap.add_argument("--lr", type=float, default=LR)
    ap.add_argument("--bubble", default="", help="schedules to time with sleep stages (pp = world size)")
    ap.add_argument("--sleep", default="fwd_ms=30,bwd_ms=60")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--microbatches", type=int, default=8)
    args = ap.parse_args()
    torch.set_num_threads(1)
    if args.world_size > 1:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{args.port}", rank=args.rank,
                                world_size=args.world_size, timeout=datetime.timedelta(seconds=120))
    for name in filter(None, args.cases.split(",")):
        t0 = time.perf_counter()
        losses, memory = run_case(name, rank=args.rank, world_size=args.world_size, optimizer=args.optimizer,
                                  lr=args.lr)
        if args.rank == 0:
            print(json.dumps({"case": name, "losses": losses, "memory": memory,
                              "seconds": time.perf_counter() - t0}), flush=True)
    for schedule in filter(None, args.bubble.split(",")):
        out = run_bubble(schedule, rank=args.rank, world_size=args.world_size, sleep=args.sleep,
                         steps=args.steps, microbatches=args.microbatches)
        if out is not None:
            print(json.dumps(out), flush=True)
    if args.world_size > 1:
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
    # Every result is printed and the groups are destroyed. Skip the interpreter's teardown: there gloo's threads
    # (of groups the layouts' DeviceMesh and DTensor objects still reference) are destroyed unjoined, and the C++
    # runtime aborts ("terminate called without an active exception", exit -6) after the work is done.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
