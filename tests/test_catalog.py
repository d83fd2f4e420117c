"""Tests for dtprobe.catalog: a leaf module whose presets and hardware agree with the runtime, planner and analysis."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest
import torch

from dtprobe import catalog
from dtprobe.catalog import BUILTIN_MODELS, DEVICES, GPU_MODELS, MODEL_SHAPES, UnknownNameError, lookup, match_gpu
from dtprobe.planner import GPU_PRESETS, MODEL_PRESETS, device_preset, model_preset
from dtprobe.runtime.model import GPT, model_config
from dtprobe.store.errors import ConfigError

CATALOG_PATH = Path(catalog.__file__)


def _imported_modules(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            names.add("." * node.level + (node.module or ""))
    return names


def test_catalog_imports_only_the_standard_library():
    imported = _imported_modules(CATALOG_PATH)
    assert not [m for m in imported if m.startswith((".", "dtprobe"))], imported
    assert {m.split(".")[0] for m in imported} <= sys.stdlib_module_names, imported


def test_catalog_import_loads_no_torch_and_no_other_dtprobe_module(run_python):
    code = ("import sys, dtprobe; before = set(sys.modules); import dtprobe.catalog; "
            "print(sorted(m for m in set(sys.modules) - before if m.startswith(('dtprobe', 'torch'))))")
    done = run_python(code)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "['dtprobe.catalog']"


@pytest.mark.parametrize("name", list(BUILTIN_MODELS))
def test_runtime_model_built_from_each_preset_has_the_catalog_parameter_count(name):
    cfg = model_config(name)
    with torch.device("meta"):
        params = dict(GPT(cfg).named_parameters())
    weights = sum(p.numel() for n, p in params.items() if not n.endswith(".bias"))
    # the catalog and the planner count weights only; the runtime's own count adds the biases
    assert weights == BUILTIN_MODELS[name].num_params == model_preset(name).num_params
    assert sum(p.numel() for p in params.values()) == cfg.num_params
    assert cfg.max_seq_len == BUILTIN_MODELS[name].seq_len


def test_planner_presets_are_the_catalog_entries():
    assert list(MODEL_PRESETS) == list(MODEL_SHAPES) and list(GPU_PRESETS) == list(DEVICES)
    assert MODEL_PRESETS["llama3-70b"].num_params == MODEL_SHAPES["llama3-70b"].num_params
    assert GPU_PRESETS["h100-80"].peak("bf16") == GPU_MODELS["h100-sxm"].peak_flops["bf16"]
    assert GPU_PRESETS["h100-80"].inter_bw_bytes_per_s == DEVICES["h100-80"].inter_bw_bytes_per_s


@pytest.mark.parametrize("device_name,key", [
    ("NVIDIA H100 80GB HBM3", "h100-sxm"),
    ("NVIDIA H100 PCIe", "h100-pcie"),
    ("NVIDIA GH200 480GB", "gh200"),
    ("NVIDIA H200", "h200"),
    ("NVIDIA A100-SXM4-80GB", "a100"),
    ("NVIDIA A10G", "a10g"),
    ("NVIDIA A10", "a10"),
    ("NVIDIA L4", "l4"),
    ("AMD Instinct MI300X", "mi300x"),
    ("Mystery GPU", None),
])
def test_match_gpu_finds_the_model_by_driver_name(device_name, key):
    assert match_gpu(device_name) == key


def test_lookup_of_an_unknown_name_names_the_key_and_lists_the_known_ones():
    with pytest.raises(UnknownNameError, match=r"--gpu 'v100' is not a preset; choose one of a100-40, a100-80, "):
        lookup(DEVICES, "v100", key="--gpu")


@pytest.mark.parametrize("call,match", [
    (lambda: model_preset("gpt5"), r"--model 'gpt5' is not a preset; choose one of tiny, small, medium, llama3-8b"),
    (lambda: device_preset("tpu"), r"--gpu 'tpu' is not a preset; choose one of a100-40"),
    (lambda: model_config("llama3-8b"), r"model 'llama3-8b' is not a preset; choose one of tiny, small, medium\."),
])
def test_unknown_preset_is_a_config_error_for_the_cli(call, match):
    with pytest.raises(ConfigError, match=match):
        call()
