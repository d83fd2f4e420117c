"""Layouts (dtprobe.runtime.parallel): validation, stage split, and multi-process correctness on CPU/gloo.

Correctness: each layout trains the tiny GPT for 5 steps (AdamW, global-norm clipping) on the same global batch
and seed as a single process; the global loss of every step must match within 1e-4 relative. Several layouts
share one launch (2 ranks, then 4) to keep the test short. ZeRO memory: per-rank optimizer-state bytes fall
~N-fold from zero 0 to zero 1, parameter bytes ~N-fold with zero 3 (N = 4 ranks).
"""

from __future__ import annotations

import functools
import sys
from pathlib import Path

import pytest

from dtprobe.runtime.config import LayoutConfig
from dtprobe.runtime.parallel.mesh import ParallelDims, check_layout, loss_rank
from dtprobe.runtime.parallel.pp import stage_layers
from dtprobe.runtime.parallel.stage_sleep import parse_stage_sleep
from dtprobe.store.errors import ConfigError

sys.path.insert(0, str(Path(__file__).parent))
from layouts_launch import launch  # noqa: E402

REQUIRED = ["dp2", "zero1_dp2", "zero2_dp2", "zero3_dp2", "tp2", "tp2_sp", "pp2_gpipe", "pp2_1f1b",
            "pp2_interleaved-1f1b", "pp2_zero-bubble", "dp2_tp2", "dp2_pp2", "tp2_pp2"]
"""The layouts dtprobe supports: each one must run."""
EXTRA = ["tp2_sp_ac_full", "pp2_zbv", "dp2_tp2_zero3_sp", "dp2_pp2_zero2_interleaved", "single_ac_selective",
         "zero1_dp2_accum2", "zero3_dp2_accum2", "zero3_dp2_ac_full", "dp2_pp2_zero1"]
"""Also covered: activation checkpointing, ZBV, ZeRO-1/2/3 on the dp axis of hybrids, gradient accumulation
(2 micro-batches of half the batch: reduced once per step)."""
LAUNCHES = {
    1: ["single", "single_ac_selective"],
    2: ["dp2", "zero1_dp2", "zero2_dp2", "zero3_dp2", "tp2", "tp2_sp", "tp2_sp_ac_full", "pp2_gpipe", "pp2_1f1b",
        "pp2_interleaved-1f1b", "pp2_zero-bubble", "pp2_zbv", "zero1_dp2_accum2", "zero3_dp2_accum2",
        "zero3_dp2_ac_full", "pp2_1f1b_fp16", "zero3_dp2_fp16"],
    4: ["dp2_tp2", "dp2_pp2", "tp2_pp2", "dp2_tp2_zero3_sp", "dp2_pp2_zero2_interleaved", "dp2_pp2_zero1",
        "zero0_dp4", "zero1_dp4", "zero3_dp4"],
}


@pytest.fixture(scope="module")
def results(free_port, child_env):
    """``results(world_size)``: one launch of ``world_size`` ranks (cached across tests), its cases by name."""
    @functools.cache
    def run(world_size: int) -> dict[str, dict]:
        cases = ",".join(LAUNCHES[world_size])
        out = launch(world_size, "--cases", cases, port=free_port(), env=child_env(PYTHONWARNINGS="ignore"),
                     timeout_s=900)
        return {r["case"]: r for r in out}
    return run


@functools.cache
def single_results() -> dict[str, dict]:
    import layouts_worker

    return {name: {"losses": layouts_worker.run_case(name, rank=0, world_size=1)[0]} for name in LAUNCHES[1]}


def world_of(case: str) -> int:
    return next(w for w, names in LAUNCHES.items() if case in names)


# ---------------------------------------------------------------------------------------------- validation


def _layout(world: int, **kw) -> LayoutConfig:
    return LayoutConfig(**kw).resolve(world)


@pytest.mark.parametrize("kw,world,match", [
    (dict(dp=3, tp=2), 8, r"WORLD_SIZE = 8"),
    (dict(tp=2, pp=2, pp_schedule="zbv", virtual_stages=3), 4, r"exactly 2 stages per rank"),
    (dict(pp=2, pp_schedule="gpipe", virtual_stages=2), 2, r"holds one stage per rank"),
    (dict(dp=2, tp=2, zero=1), 4, r"zero = 1 with tensor parallelism"),
    (dict(pp=4, pp_schedule="interleaved-1f1b", microbatches=8), 4,
     r"4 layers but the pipeline has 8 stages.*--model small"),
    (dict(pp=2, microbatches=3), 2, r"not divisible by layout.microbatches = 3"),
    (dict(tp=8), 8, r"4 attention heads, not divisible by layout.tp = 8"),
    (dict(tp=2, sequence_parallel=True), 2, r"sequence length that is a multiple of 2"),
])
def test_check_layout_rejects_bad_combinations_with_a_fix(kw, world, match):
    with pytest.raises(ConfigError, match=match):
        check_layout(_layout(world, **kw), world_size=world, num_layers=4, num_heads=4, batch_size=8, seq_len=63)


def test_parallel_dims_rejects_degrees_that_do_not_multiply_to_world_size():
    with pytest.raises(ConfigError, match=r"layout.dp\(2\) \* layout.tp\(2\) \* layout.pp\(1\) = 4, but WORLD_SIZE = 8 "
                                          r".*Set --dp -1 \(or --dp 4\) .*--nproc 4"):
        ParallelDims(dp=2, tp=2, pp=1, world_size=8)


def test_parallel_dims_coords_put_tp_innermost_and_pp_outermost():
    dims = ParallelDims(dp=2, tp=2, pp=2, world_size=8)
    assert dims.axes == ("pp", "dp", "tp")
    assert dims.coords(0) == {"pp": 0, "dp": 0, "tp": 0}
    assert dims.coords(1) == {"pp": 0, "dp": 0, "tp": 1}
    assert dims.coords(2) == {"pp": 0, "dp": 1, "tp": 0}
    assert dims.coords(7) == {"pp": 1, "dp": 1, "tp": 1}
    assert ParallelDims(dp=4, tp=1, pp=1, world_size=4).axes == ("dp",)


@pytest.mark.parametrize("layout,world,expected", [
    (dict(), 2, 0), (dict(pp=2), 2, 1), (dict(pp=2, pp_schedule="zbv"), 2, 0),
    (dict(pp=2, dp=2), 4, 2), (dict(pp=2, tp=2, pp_schedule="interleaved-1f1b"), 4, 2), (dict(pp=4), 4, 3)])
def test_loss_rank_is_the_first_rank_of_the_last_stage(layout, world, expected):
    lay = LayoutConfig(**layout).resolve(world)
    rank = loss_rank(lay)
    assert rank == expected
    coords = ParallelDims(dp=lay.dp, tp=lay.tp, pp=lay.pp, world_size=world).coords(rank)
    assert coords["dp"] == 0 and coords["tp"] == 0


def test_stage_layers_split_blocks_evenly_and_cover_all():
    assert [list(r) for r in stage_layers(8, 4)] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    split = stage_layers(5, 2)
    assert sorted(i for r in split for i in r) == list(range(5)) and [len(r) for r in split] == [2, 3]


def test_stage_sleep_parses_and_rejects_bad_text():
    sleep = parse_stage_sleep("fwd_ms=10,bwd_ms=20.5")
    assert (sleep.fwd_ms, sleep.bwd_ms) == (10.0, 20.5)
    assert parse_stage_sleep("") is None
    with pytest.raises(ConfigError, match="give both fwd_ms and bwd_ms"):
        parse_stage_sleep("fwd_ms=10")
    with pytest.raises(ConfigError, match="is not a number"):
        parse_stage_sleep("fwd_ms=x,bwd_ms=1")


def test_layout_config_rejects_bad_stage_sleep_flag():
    with pytest.raises(ConfigError, match="--stage-sleep"):
        LayoutConfig(pp=2, stage_sleep="fwd=3")


# ---------------------------------------------------------------------------------------------- correctness


@pytest.mark.multiproc
@pytest.mark.parametrize("case", REQUIRED + EXTRA)
def test_layout_loss_matches_single_process_within_1e4(case, results):
    reference = single_results()["single"]["losses"]
    got = (single_results() if world_of(case) == 1 else results(world_of(case)))[case]["losses"]
    assert len(got) == len(reference) == 5
    rel = [abs(g - r) / abs(r) for g, r in zip(got, reference)]
    print(f"{case}: max rel loss diff vs single process {max(rel):.2e}")
    assert max(rel) < 1e-4, f"{case}: losses {got} vs single process {reference} (rel diff {rel})"
    assert got[0] != got[-1]   # it trained


@pytest.mark.multiproc
@pytest.mark.parametrize("case", ["pp2_1f1b_fp16", "zero3_dp2_fp16"])
def test_fp16_loss_scaling_trains_on_pipeline_and_fsdp_layouts(case, results):
    """fp16 autocast + ShardedGradScaler (runtime.precision) through the layout's train step: the scaler is
    initialised on pipeline ranks without a loss, and the loss stays within fp16 rounding of fp32."""
    reference = single_results()["single"]["losses"]
    got = results(2)[case]["losses"]
    rel = [abs(g - r) / r for g, r in zip(got, reference)]
    assert max(rel) < 5e-3, (case, got, reference)


@pytest.mark.multiproc
def test_zero_shards_optimizer_states_and_parameters_about_n_fold_over_4_ranks(results):
    by_case = results(4)
    mem = {c: by_case[c]["memory"] for c in ("zero0_dp4", "zero1_dp4", "zero3_dp4")}
    assert all(len(rows) == 4 for rows in mem.values())
    optim0 = [r["optim_bytes"] for r in mem["zero0_dp4"]]
    optim1 = [r["optim_bytes"] for r in mem["zero1_dp4"]]
    param0 = [r["param_bytes"] for r in mem["zero0_dp4"]]
    param3 = [r["param_bytes"] for r in mem["zero3_dp4"]]
    assert len(set(optim0)) == 1 and len(set(param0)) == 1   # plain DP: full replicas
    ratio_optim = optim0[0] / (sum(optim1) / 4)
    ratio_param = param0[0] / (sum(param3) / 4)
    print(f"zero0 -> zero1 optimizer bytes/rank ratio {ratio_optim:.2f}; zero0 -> zero3 param bytes ratio "
          f"{ratio_param:.2f} (4 ranks)")
    assert 3.6 <= ratio_optim <= 4.4, (optim0, optim1)
    assert 3.6 <= ratio_param <= 4.4, (param0, param3)
    # ZeRO-1 partitions whole tensors: no rank holds much more than its share
    assert max(optim1) < 1.35 * optim0[0] / 4, optim1
    # ZeRO-3 also shards the optimizer states (over sharded parameters)
    assert 3.6 <= optim0[0] / (sum(r["optim_bytes"] for r in mem["zero3_dp4"]) / 4) <= 4.4
