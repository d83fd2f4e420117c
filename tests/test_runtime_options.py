"""The options of ``dtprobe run``, derived from the config dataclasses (``runtime.options``): every field is a TOML
key, every flagged field a flag with the documented spelling and its docstring as help, and the config modules
import no torch (``dtprobe run --help`` stays fast)."""

from __future__ import annotations

import argparse

import pytest

from dtprobe.commands import run as run_cmd
from dtprobe.runtime.config import JobConfig
from dtprobe.runtime.faults import FAULT_KINDS
from dtprobe.runtime.options import options, toml_value

DOCUMENTED_FLAGS = {
    "--nproc": "nproc", "--nnodes": "nnodes", "--node-rank": "node_rank", "--rdzv-endpoint": "rdzv_endpoint",
    "--max-restarts": "max_restarts", "--timeout": "timeout_s", "--run-dir": "run_dir", "--device": "device",
    "--cpu-bind": "cpu_bind", "--worker-start": "worker_start",
    "--model": "model.name", "--dp": "layout.dp", "--tp": "layout.tp", "--pp": "layout.pp", "--zero": "layout.zero",
    "--pp-schedule": "layout.pp_schedule", "--microbatches": "layout.microbatches",
    "--virtual-stages": "layout.virtual_stages", "--sequence-parallel": "layout.sequence_parallel",
    "--activation-checkpointing": "layout.activation_checkpointing", "--stage-sleep": "layout.stage_sleep",
    "--steps": "train.steps", "--batch-size": "train.batch_size", "--seq-len": "train.seq_len",
    "--grad-accum": "train.grad_accum", "--optimizer": "train.optimizer", "--lr": "train.lr",
    "--lr-scaling": "train.lr_scaling",
    "--reference-batch": "train.reference_batch", "--warmup": "train.warmup", "--clip": "train.clip",
    "--seed": "train.seed", "--bucket-mb": "train.bucket_mb", "--data": "train.data",
    "--precision": "precision.dtype", "--compress": "compression.method",
    "--ckpt-every": "ckpt.every", "--ckpt-async": "ckpt.async_save", "--ckpt-keep": "ckpt.keep",
    "--collective-timeout": "hang.collective_timeout_s",
    "--profile-steps": "collect.profile_steps", "--no-collect": "collect.enabled",
    "--no-collectives": "collect.collectives", "--no-devices": "collect.devices",
    "--device-interval": "collect.device_interval_s", "--inject": "inject",
}
"""Every option flag of ``dtprobe run`` as documented (README.md, ``--help``) -> the job key it sets."""

DOCUMENTED_CHOICES = {"--device": ("auto", "cpu", "cuda"), "--cpu-bind": ("auto", "off"),
                      "--worker-start": ("fork", "exec"),
                      "--lr-scaling": ("linear", "none"), "--data": ("synthetic", "text"),
                      "--optimizer": ("adamw", "lamb", "lars")}
"""Flags whose values argparse itself restricts (the dataclasses validate every other value)."""


def run_parser() -> argparse.ArgumentParser:
    subparsers = argparse.ArgumentParser().add_subparsers()
    run_cmd.add_parser(subparsers)
    return subparsers.choices["run"]


def nested(key: str, value: object) -> dict:
    table, _, leaf = key.rpartition(".")
    return {table: {leaf: value}} if table else {leaf: value}


def test_every_config_field_is_a_toml_key_and_every_flagged_field_a_flag():
    parser = run_parser()
    flags = {a.option_strings[0]: a for a in parser._actions if a.option_strings}   # argparse has no public list
    job_dict = JobConfig().to_dict()
    for opt in options(JobConfig):
        table, _, leaf = opt.key.rpartition(".")
        assert leaf in (job_dict[table] if table else job_dict), opt.key          # written to job.json
        if opt.key != "inject" and opt.default is not None:                      # read back from job.toml
            assert JobConfig.from_dict(nested(opt.key, opt.default), source="t") == JobConfig(), opt.key
        if opt.flag is not None:
            assert flags[opt.flag_name].dest == opt.key and flags[opt.flag_name].help == opt.help
    flagged = {o.flag_name: o.key for o in options(JobConfig) if o.flag is not None}
    assert set(flags) == {"-h", "--config", "--set", *flagged}


def test_flags_keep_their_documented_names_keys_and_choices():
    flagged = {o.flag_name: o for o in options(JobConfig) if o.flag is not None}
    assert {name: o.key for name, o in flagged.items()} == DOCUMENTED_FLAGS
    assert {name: o.flag.choices for name, o in flagged.items() if o.flag.choices} == DOCUMENTED_CHOICES


def test_every_config_field_has_a_docstring_for_its_help():
    assert [o.key for o in options(JobConfig) if not o.doc] == []


@pytest.mark.parametrize("argv,expected", [
    ([], {}),
    (["--timeout", "60", "--node-rank", "0"], {"timeout_s": 60.0, "node_rank": 0}),
    (["--model", "small", "--dp", "2", "--sequence-parallel"],
     {"model": {"name": "small"}, "layout": {"dp": 2, "sequence_parallel": True}}),
    (["--no-collect", "--no-devices", "--device-interval", "0.5", "--profile-steps", "10-11"],
     {"collect": {"enabled": False, "devices": False, "device_interval_s": 0.5, "profile_steps": [10, 11]}}),
    (["--profile-steps", "7"], {"collect": {"profile_steps": [7, 7]}}),
    (["--compress", "topk:ratio=0.05"],
     {"compression": {"method": "topk", "rank": 2, "min_compression_rate": 2.0, "seed": 0, "ratio": 0.05}}),
    (["--precision", "fp16", "--ckpt-every", "5", "--ckpt-async", "--collective-timeout", "30"],
     {"precision": {"dtype": "fp16"}, "ckpt": {"every": 5, "async_save": True},
      "hang": {"collective_timeout_s": 30.0}}),
    (["--inject", "crash:rank=1,step=3", "--inject", "straggler:rank=0,delay_ms=5"],
     {"inject": ["crash:rank=1,step=3", "straggler:rank=0,delay_ms=5"]}),
    (["--set", "train.weight_decay=0.0", "--steps", "4"], {"train": {"steps": 4, "weight_decay": 0.0}}),
])
def test_flags_set_only_their_keys_shaped_like_job_toml(argv, expected):
    parser = argparse.ArgumentParser()
    run_cmd.add_parser(parser.add_subparsers())
    assert run_cmd.overrides_from_args(parser.parse_args(["run", *argv])) == expected


def test_help_epilog_lists_every_toml_key_with_its_default_and_every_fault_kind():
    text = run_parser().format_help()
    for opt in options(JobConfig):
        leaf = opt.key.rpartition(".")[2]
        shown = f"{leaf} = {toml_value(opt.default)}" if opt.default is not None else f"{leaf} (unset)"
        assert shown in text, opt.key
    for kind in FAULT_KINDS.values():
        assert kind.example in text


def test_config_modules_and_the_run_parser_import_no_torch(run_python):
    code = ("import argparse, sys\n"
            "import dtprobe.runtime.config, dtprobe.runtime.config_sections, dtprobe.runtime.layout\n"
            "import dtprobe.runtime.options, dtprobe.runtime.faults, dtprobe.collectors.config\n"
            "from dtprobe.commands import run\n"
            "parser = argparse.ArgumentParser(); run.add_parser(parser.add_subparsers())\n"
            "parser.parse_args(['run', '--nproc', '2']).func\n"
            "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))\n")
    out = run_python(code, timeout_s=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
