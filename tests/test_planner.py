"""Tests for dtprobe.planner: Korthikanti activations, memory totals, the layout search and its JSON."""

from __future__ import annotations

import json

import pandas as pd
import pytest

from dtprobe.planner import (GPU_PRESETS, SCHEMA, Efficiency, ModelSpec, TrainingSpec, candidates, evaluate,
                             make_cluster, model_preset, plan)
from dtprobe.planner.memory import activation_bytes_per_layer
from dtprobe.store.errors import ConfigError

GIB = 1024**3

# Korthikanti et al. 2022, Table 3 shapes: (name, layers, hidden, heads); sequence 2048, TP 8
PAPER_SHAPES = [("22B", 48, 6144, 64), ("175B", 96, 12288, 96), ("530B", 105, 20480, 128), ("1T", 128, 25600, 160)]


@pytest.mark.parametrize("name,layers,h,a", PAPER_SHAPES)
@pytest.mark.parametrize("b", [1, 4])
def test_activations_match_korthikanti_formulas_for_paper_shapes(name, layers, h, a, b):
    s, t = 2048, 8
    sbh = s * b * h
    expected = {
        ("none", 1, False): sbh * (34 + 5 * a * s / h),
        ("none", t, False): sbh * (10 + 24 / t + 5 * a * s / (h * t)),
        ("none", t, True): sbh / t * (34 + 5 * a * s / h),
        ("selective", t, True): 34 * sbh / t,
        ("full", 1, False): 2 * sbh,
        ("full", t, False): 2 * sbh,
    }
    for (rec, tp, sp), want in expected.items():
        got = activation_bytes_per_layer(s=s, b=b, h=h, a=a, t=tp, sp=sp, recompute=rec)
        assert float(got) == pytest.approx(want, rel=1e-12), (name, rec, tp, sp)


def test_planner_activation_memory_is_layers_times_formula_for_a_gpt_shape():
    # GPT-3 175B, no pipeline: activations = L * (s b h / t)(34 + 5 a s / h) with TP8 + SP
    model, training = model_preset("gpt3-175b"), TrainingSpec(global_batch=64, seq_len=2048)
    cluster = make_cluster(gpu="h100-80", num_gpus=64, gpus_per_node=8)
    row = pd.DataFrame([dict(dp=8, tp=8, pp=1, zero=3, micro_batch=1, grad_accum=8, recompute="none",
                             schedule="none", virtual_stages=1)])
    out = evaluate(row, model=model, cluster=cluster, training=training, eff=Efficiency()).iloc[0]
    s, b, h, a, t = 2048, 1, 12288, 96, 8
    assert out["activations_gib"] * GIB == pytest.approx(96 * s * b * h / t * (34 + 5 * a * s / h), rel=1e-9)


def test_total_memory_matches_hand_computation_for_one_layout():
    # GPT-3 175B, dp8 tp8 pp8, ZeRO-1, mb1, selective recompute + SP, 1F1B, bf16 Adam
    model, training = model_preset("gpt3-175b"), TrainingSpec(global_batch=64, seq_len=2048)
    cluster = make_cluster(gpu="h100-80", num_gpus=512, gpus_per_node=8)
    row = pd.DataFrame([dict(dp=8, tp=8, pp=8, zero=1, micro_batch=1, grad_accum=8, recompute="selective",
                             schedule="1f1b", virtual_stages=1)])
    out = evaluate(row, model=model, cluster=cluster, training=training, eff=Efficiency()).iloc[0]
    s, h, V, L, dp, tp, pp = 2048, 12288, 50257, 96, 8, 8, 8
    per_layer = 12 * h * h + 2 * h                          # q k v o (4h^2) + MLP (8h^2) + 2 norms
    first_stage = (L // pp * per_layer + V * h + s * h) / tp   # + token and position embeddings
    weights, grads, optim = 2 * first_stage, 2 * first_stage, 12 * first_stage / dp
    # 1F1B: stage 0 holds pp = 8 micro-batches in flight, 12 layers each, 34 s b h / t bytes per layer
    acts = 8 * (L // pp) * 34 * s * 1 * h / tp
    hand = weights + grads + optim + acts
    assert out["total_gib"] * GIB == pytest.approx(hand, rel=1e-9)
    assert out["weights_gib"] * GIB == pytest.approx(weights, rel=1e-9)
    assert out["optimizer_gib"] * GIB == pytest.approx(optim, rel=1e-9)
    assert out["activations_gib"] * GIB == pytest.approx(acts, rel=1e-9)


@pytest.fixture(scope="module")
def seeds_example():
    """LLaMA-3 70B on 512 A100-80GB, 8 per node, sequence 8192, global batch 1024, bf16, Adam."""
    model = model_preset("llama3-70b")
    cluster = make_cluster(gpu="a100-80", num_gpus=512, gpus_per_node=8)
    training = TrainingSpec(global_batch=1024, seq_len=8192, precision="bf16", optimizer="adam")
    return model, cluster, training, plan(model, cluster, training, top_k=5)


def test_seeds_example_tp8_pp4_dp16_fits_within_15pct_of_best(seeds_example):
    model, cluster, training, result = seeds_example
    table = evaluate(candidates(model, cluster, training), model=model, cluster=cluster, training=training,
                     eff=Efficiency())
    ours = table[(table["tp"] == 8) & (table["pp"] == 4) & (table["dp"] == 16) & table["fits"]]
    assert not ours.empty
    best = result.best["step_time_s"]
    assert ours["step_time_s"].min() <= 1.15 * best
    assert best == result.layouts["step_time_s"].min()


def test_seeds_example_top5_keeps_tp_inside_a_node(seeds_example):
    _, cluster, _, result = seeds_example
    assert len(result.layouts) == 5
    assert (result.layouts["tp"] <= cluster.gpus_per_node).all()
    assert (cluster.gpus_per_node % result.layouts["tp"] == 0).all()
    assert result.layouts["step_time_s"].is_monotonic_increasing


def test_seeds_example_rejects_plain_data_parallel_for_memory(seeds_example):
    _, _, _, result = seeds_example
    rej = result.rejected
    plain = rej[(rej["dp"] == 512) & (rej["tp"] == 1) & (rej["pp"] == 1) & (rej["zero"] == 0)]
    assert not plain.empty
    assert plain["reason"].str.contains(r"GiB per GPU > 72\.0 GiB usable").all()
    assert plain["reason"].str.contains("optimizer state").any()
    # 70.6e9 parameters x 16 bytes: over 1 TiB before activations
    assert (plain["total_gib"] > 1000).all()


def test_plan_json_follows_the_documented_schema(seeds_example):
    _, _, _, result = seeds_example
    doc = json.loads(json.dumps(result.to_json_dict()))
    assert doc["schema"] == SCHEMA == "dtprobe.plan/1"
    keys = {"dp", "tp", "pp", "zero", "micro_batch", "grad_accum", "recompute", "schedule", "virtual_stages",
            "fits", "memory_gib", "step_time_s", "breakdown"}
    for lay in doc["layouts"]:
        assert keys <= set(lay)
        assert lay["fits"] is True
        assert lay["dp"] * lay["tp"] * lay["pp"] == 512
        assert sum(lay["breakdown"].values()) == pytest.approx(lay["step_time_s"], rel=1e-4)
    times = [lay["step_time_s"] for lay in doc["layouts"]]
    assert times == sorted(times)
    assert doc["rejected"] and all(r["fits"] is False and r["reason"] for r in doc["rejected"])


def test_why_names_the_terms_that_make_a_layout_faster(seeds_example):
    _, _, _, result = seeds_example
    assert all("faster than" in w or "ties with" in w for w in result.layouts["why"])


def test_grad_accumulation_times_dp_times_micro_batch_is_the_global_batch(seeds_example):
    model, cluster, training, _ = seeds_example
    c = candidates(model, cluster, training)
    assert (c["dp"] * c["micro_batch"] * c["grad_accum"] == 1024).all()
    assert (c["dp"] * c["tp"] * c["pp"] == 512).all()
    assert (model.num_layers % (c["pp"] * c["virtual_stages"]) == 0).all()
    assert not ((c["dp"] == 1) & (c["zero"] > 0)).any()


def test_more_recompute_trades_memory_for_time():
    model, training = model_preset("llama3-8b"), TrainingSpec(global_batch=64, seq_len=8192)
    cluster = make_cluster(gpu="h100-80", num_gpus=8, gpus_per_node=8)
    rows = pd.DataFrame([dict(dp=8, tp=1, pp=1, zero=3, micro_batch=1, grad_accum=8, recompute=r,
                              schedule="none", virtual_stages=1) for r in ("none", "selective", "full")])
    out = evaluate(rows, model=model, cluster=cluster, training=training, eff=Efficiency())
    assert out["activations_gib"].is_monotonic_decreasing
    assert out["recompute_s"].is_monotonic_increasing
    assert out["zero3_gather_s"].gt(0).all()


def test_tp_across_nodes_costs_more_than_inside_a_node():
    model, training = model_preset("llama3-70b"), TrainingSpec(global_batch=256, seq_len=4096)
    cluster = make_cluster(gpu="h100-80", num_gpus=64, gpus_per_node=8)
    rows = pd.DataFrame([dict(dp=64 // (tp * 4), tp=tp, pp=4, zero=1, micro_batch=1,
                              grad_accum=256 // (64 // (tp * 4)), recompute="selective", schedule="1f1b",
                              virtual_stages=1) for tp in (8, 16)])
    out = evaluate(rows, model=model, cluster=cluster, training=training, eff=Efficiency())
    # per-layer activation bytes halve with tp16, but the network is 9x slower than NVLink
    assert out["tp_comm_s"].iloc[1] > 3 * out["tp_comm_s"].iloc[0]


def test_gpu_presets_are_data_and_cpu_is_marked_as_cpu():
    assert GPU_PRESETS["h100-80"].peak("bf16") == pytest.approx(989e12)
    assert GPU_PRESETS["a100-80"].peak("bf16") == pytest.approx(312e12)
    assert GPU_PRESETS["mi300x"].peak("fp8") == pytest.approx(2614.9e12)
    assert GPU_PRESETS["cpu"].is_cpu and not GPU_PRESETS["h200"].is_cpu
    with pytest.raises(ConfigError, match="no fp8 peak"):
        GPU_PRESETS["a100-40"].peak("fp8")


def test_presets_have_the_published_parameter_counts():
    assert model_preset("llama3-8b").num_params == pytest.approx(8.03e9, rel=0.01)
    assert model_preset("llama3-70b").num_params == pytest.approx(70.6e9, rel=0.01)
    assert model_preset("gpt3-175b").num_params == pytest.approx(175e9, rel=0.01)


@pytest.mark.parametrize("call,match", [
    (lambda: make_cluster(gpu="v100", num_gpus=8, gpus_per_node=8), "not a preset"),
    (lambda: make_cluster(gpu="h100-80", num_gpus=12, gpus_per_node=8), "multiple of --gpus-per-node"),
    (lambda: model_preset("llama9"), "not a preset"),
    (lambda: TrainingSpec(global_batch=8, seq_len=128, precision="int4"), "--precision"),
    (lambda: ModelSpec(name="x", num_layers=2, hidden=100, num_heads=3, ffn_hidden=4, vocab_size=8, seq_len=8),
     "divisible"),
    (lambda: plan(model_preset("tiny"), make_cluster(gpu="cpu", num_gpus=16, gpus_per_node=4),
                  TrainingSpec(global_batch=3, seq_len=64)), "global batch 3"),
])
def test_bad_input_raises_config_error_naming_the_key(call, match):
    with pytest.raises(ConfigError, match=match):
        call()


def test_plan_on_cpu_cluster_for_builtin_model_returns_fitting_layouts():
    result = plan(model_preset("tiny"), make_cluster(gpu="cpu", num_gpus=4, gpus_per_node=4),
                  TrainingSpec(global_batch=16, seq_len=128, precision="fp32"), top_k=3)
    assert len(result.layouts) == 3 and result.to_json_dict()["device_is_cpu"] is True
