"""Job config, TOML + flag merging, the --inject parser and the linear scaling rule (no processes started)."""

from __future__ import annotations

import argparse

import pytest

from dtprobe.commands import run as run_cmd
from dtprobe.runtime.config import JobConfig, LayoutConfig, TrainConfig, merge
from dtprobe.runtime.faults import FaultSpec, parse_fault
from dtprobe.store.errors import ConfigError


def parse_run_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    run_cmd.add_parser(parser.add_subparsers())
    return parser.parse_args(["run", *argv])


def test_layout_rejects_dp_that_does_not_multiply_to_world_size_and_names_the_fix():
    with pytest.raises(ConfigError) as err:
        JobConfig(nproc=4, layout=LayoutConfig(dp=3)).resolve_layout()
    msg = str(err.value)
    assert "layout.dp(3) * layout.tp(1) * layout.pp(1) = 3, but WORLD_SIZE = 4" in msg
    assert "--dp -1 (or --dp 4)" in msg and "--nproc 3" in msg


def test_layout_dp_minus_one_uses_every_rank_across_nodes():
    job = JobConfig(nproc=2, nnodes=2, rdzv_endpoint="127.0.0.1:29500", run_dir="/tmp/x")
    layout = job.resolve_layout()
    assert (layout.dp, layout.tp, layout.pp, layout.world_size, layout.is_pure_dp) == (4, 1, 1, 4, True)


@pytest.mark.parametrize("dp,grad_accum,batch,scaling,expected", [
    (4, 1, 8, "linear", 1e-3),        # global batch 32 == reference batch
    (2, 1, 8, "linear", 0.5e-3),
    (4, 2, 8, "linear", 2e-3),
    (2, 1, 8, "none", 1e-3),
])
def test_peak_lr_follows_the_linear_scaling_rule(dp, grad_accum, batch, scaling, expected):
    train = TrainConfig(lr=1e-3, batch_size=batch, grad_accum=grad_accum, lr_scaling=scaling, reference_batch=32)
    assert train.peak_lr(dp) == pytest.approx(expected)


@pytest.mark.parametrize("text,kind,params", [
    ("straggler:rank=2,delay_ms=40", "straggler", {"rank": 2, "delay_ms": 40.0}),
    ("straggler:rank=1,slowdown=1.5,from_step=3", "straggler", {"rank": 1, "slowdown": 1.5, "from_step": 3}),
    ("crash:rank=1,step=10", "crash", {"rank": 1, "step": 10}),
])
def test_inject_parser_types_each_key(text, kind, params):
    spec = parse_fault(text)
    assert spec == FaultSpec(kind=kind, params=params)
    assert parse_fault(spec.to_string()) == spec


@pytest.mark.parametrize("text,needle", [
    ("stragler:rank=2,delay_ms=40", "unknown fault kind 'stragler'"),
    ("straggler:rank=2,delay=40", "has no key 'delay'"),
    ("straggler:rank=2", "exactly one of delay_ms"),
    ("straggler:rank=2,delay_ms=40,slowdown=2", "exactly one of delay_ms"),
    ("straggler:rank=2,slowdown=0.5", "must be > 1"),
    ("crash:rank=1", "needs ['step']"),
    ("crash:rank=one,step=3", "rank=one should be a int"),
    ("crash:rank=1,step", "is not key=value"),
])
def test_inject_parser_rejects_bad_specs_with_a_message_naming_the_problem(text, needle):
    with pytest.raises(ConfigError) as err:
        parse_fault(text)
    assert needle in str(err.value) and text in str(err.value)


def test_fault_targeting_a_missing_rank_or_step_is_rejected_before_launch():
    with pytest.raises(ConfigError, match=r"rank 4 does not exist; WORLD_SIZE = 4"):
        JobConfig(nproc=4, faults=(parse_fault("crash:rank=4,step=1"),)).resolve_layout()
    with pytest.raises(ConfigError, match=r"step=30 is outside the run's steps 0..29"):
        JobConfig(nproc=4, faults=(parse_fault("crash:rank=1,step=30"),)).resolve_layout()


def test_job_round_trips_through_json_dict():
    job = JobConfig(nproc=4, run_dir="/tmp/r", train=TrainConfig(steps=7, grad_accum=2),
                    faults=(parse_fault("straggler:rank=2,delay_ms=40"),))
    data = job.to_dict()
    assert JobConfig.from_dict(data) == job
    assert data["precision"]["dtype"] == "fp32"          # plugin sections are recorded with their defaults


def test_toml_file_is_overridden_by_flags(tmp_path):
    toml = tmp_path / "job.toml"
    toml.write_text('nproc = 2\ninject = ["crash:rank=1,step=3"]\n[model]\nname = "tiny"\n'
                    '[train]\nsteps = 12\nbatch_size = 4\nlr = 2e-3\n[collect]\nprofile_steps = [2, 3]\n')
    job = run_cmd.build_job(parse_run_args(["--config", str(toml), "--steps", "5", "--nproc", "4"]))
    assert (job.train.steps, job.nproc, job.train.batch_size, job.train.lr) == (5, 4, 4, 2e-3)
    assert job.collect.profile_steps == (2, 3)
    assert [f.to_string() for f in job.faults] == ["crash:rank=1,step=3"]
    job = run_cmd.build_job(parse_run_args(["--config", str(toml), "--inject", "straggler:rank=0,delay_ms=5",
                                            "--profile-steps", "4-4"]))
    assert [f.kind for f in job.faults] == ["straggler"] and job.collect.profile_steps == (4, 4)


@pytest.mark.parametrize("body,needle", [
    ("[train]\nstepz = 3\n", "unknown key 'train.stepz'"),
    ("[trian]\nsteps = 3\n", "unknown key 'trian'"),
    ("[train]\nsteps = \"many\"\n", "train.steps = 'many' should be a int"),
    ("[model]\nname = \"huge\"\n", "model.name = 'huge' is not a preset"),
    ("[train\n", "not valid TOML"),
])
def test_bad_toml_is_a_config_error_naming_the_key(tmp_path, body, needle):
    toml = tmp_path / "job.toml"
    toml.write_text(body)
    with pytest.raises(ConfigError) as err:
        run_cmd.build_job(parse_run_args(["--config", str(toml)]))
    assert needle in str(err.value)


def test_set_flag_reaches_any_section_and_merge_is_one_level_deep():
    job = run_cmd.build_job(parse_run_args(["--set", "train.weight_decay=0.0", "--set", "layout.dp=2",
                                            "--nproc", "2"]))
    assert job.train.weight_decay == 0.0 and job.layout.dp == 2
    assert merge({"train": {"steps": 3, "seed": 1}}, {"train": {"steps": 4}}) == {"train": {"steps": 4, "seed": 1}}


def test_seq_len_beyond_the_preset_is_rejected():
    with pytest.raises(ConfigError, match=r"--seq-len <= 256"):
        JobConfig(train=TrainConfig(seq_len=300))


def test_multi_node_needs_endpoint_and_run_dir():
    with pytest.raises(ConfigError, match=r"--rdzv-endpoint"):
        JobConfig(nnodes=2, run_dir="/tmp/r")
    with pytest.raises(ConfigError, match=r"--run-dir"):
        JobConfig(nnodes=2, rdzv_endpoint="127.0.0.1:29500")


def test_cpu_bind_is_auto_by_default_takes_off_from_flag_or_toml_and_rejects_other_values(tmp_path):
    assert run_cmd.build_job(parse_run_args([])).cpu_bind == "auto"
    assert run_cmd.build_job(parse_run_args(["--cpu-bind", "off"])).cpu_bind == "off"
    toml = tmp_path / "job.toml"
    toml.write_text('cpu_bind = "off"\n')
    assert run_cmd.build_job(parse_run_args(["--config", str(toml)])).cpu_bind == "off"
    with pytest.raises(ConfigError, match=r"--cpu-bind auto or off"):
        JobConfig(cpu_bind="numa")


@pytest.mark.parametrize("local_rank,world,cores,want", [
    (0, 2, [0, 1], [0]), (1, 2, [0, 1], [1]),                        # one core each
    (1, 2, [4, 5, 6, 7], [6, 7]), (2, 3, [0, 1, 2, 3, 4, 5, 6], [4, 5]),   # contiguous blocks, a remainder left
    (2, 4, [0, 1], [0]), (3, 4, [0, 1], [1]),                        # more workers than cores: round-robin
])
def test_cores_for_gives_each_worker_its_own_block_or_round_robin_cores(local_rank, world, cores, want):
    from dtprobe.runtime.worker import cores_for

    assert cores_for(local_rank, world, cores) == want


@pytest.mark.parametrize("layout,want", [
    ({"pp": 2}, [[0], [0], [1], [1]]),          # dp2 x pp2: stage 0 (ranks 0, 1) on core 0, stage 1 on core 1
    ({"tp": 2}, [[0], [1], [0], [1]]),          # dp2 x tp2: tp rank 0 (ranks 0, 2) on core 0
    ({}, [[0], [1], [0], [1]]),                 # dp4: round-robin by local rank
    ({"tp": 2, "pp": 2}, [[0], [1], [0], [1]]),  # one replica: its 4 ranks spread over both cores
])
def test_more_workers_than_cores_put_a_replica_s_ranks_on_different_cores(layout, want):
    # the ranks of one model replica compute concurrently (a pipeline's two stages overlap), and the same rank of
    # every replica shares a core: a sleeping rank hands its core to another replica, not to its own stage peer
    from dtprobe.runtime.layout import LayoutConfig
    from dtprobe.runtime.worker import cores_for, model_position_of

    config = LayoutConfig(**layout)
    got = [cores_for(r, 4, [0, 1], model_position=model_position_of(config, rank=r, world_size=4)) for r in range(4)]
    assert got == want
    if layout == {"pp": 2}:
        from dtprobe.runtime.parallel.mesh import ParallelDims

        dims = ParallelDims(dp=2, tp=1, pp=2, world_size=4)
        pipelines = [[r for r in range(4) if dims.coords(r)["dp"] == d] for d in range(2)]
        assert pipelines == [[0, 2], [1, 3]] and all(got[a] != got[b] for a, b in pipelines)


def test_bind_cores_binds_existing_and_later_threads_of_the_process(run_python):
    code = """
import os, threading, time, json
from dtprobe.runtime.worker import bind_cores
early = threading.Thread(target=time.sleep, args=(1,), daemon=True); early.start()
cores = bind_cores(1, 2)
seen = {}
late = threading.Thread(target=lambda: seen.update(late=sorted(os.sched_getaffinity(0)))); late.start(); late.join()
print(json.dumps({"cores": cores, "main": sorted(os.sched_getaffinity(0)),
                  "early": sorted(os.sched_getaffinity(early.native_id)), **seen}))
"""
    cores = sorted(__import__("os").sched_getaffinity(0))
    out = run_python(code, timeout_s=120)
    assert out.returncode == 0, out.stderr
    got = __import__("json").loads(out.stdout.strip().splitlines()[-1])
    want = cores[len(cores) // 2:2 * (len(cores) // 2)] if len(cores) >= 2 else cores
    assert got == {"cores": want, "main": want, "early": want, "late": want}
