"""``dtprobe run``: train the built-in GPT under torchrun with telemetry (flags override ``--config job.toml``).

Example: ``dtprobe run --nproc 4 --steps 30 --inject straggler:rank=2,delay_ms=40 --profile-steps 10-11``.
Multi-node: run the same command on every node with ``--nnodes N --node-rank K --rdzv-endpoint HOST:PORT`` and
the same ``--run-dir`` on a shared filesystem.
"""

from __future__ import annotations

import argparse
import sys
import tomllib
from typing import Any

_EPILOG = """\
job.toml (every key optional; flags override it):
  run_dir = "runs/exp1"        device = "cpu"      nproc = 4     nnodes = 1     cpu_bind = "auto"
  inject = ["straggler:rank=2,delay_ms=40"]
  [model]   name = "tiny"
  [layout]  dp = -1   tp = 1   pp = 1   zero = 0   pp_schedule = "1f1b"   microbatches = 0
  [train]   steps = 30   batch_size = 8   seq_len = 64   grad_accum = 1   lr = 1e-3   warmup = 5
            lr_scaling = "linear"   reference_batch = 32   clip = 1.0   seed = 0   bucket_mb = 25   data = "synthetic"
  [collect] collectives = true   devices = true   device_interval_s = 1.0   profile_steps = [10, 11]

faults (--inject, repeatable):
  straggler:rank=R,delay_ms=D[,from_step=S]   rank R sleeps D ms in the compute of every step from S on
  straggler:rank=R,slowdown=F[,from_step=S]   ... or computes F x longer (CPU: burns (F-1) x its compute's
                                              CPU time; CUDA: the host sleeps that long)
  crash:rank=R,step=S                         rank R exits (code 1) at the start of step S
  overflow:step=S[,rank=R]                    fp16 loss-scale overflow at step S, any layout (needs
                                              --precision fp16: refused at launch otherwise)
  slow-ckpt, corrupt-ckpt, hang               checkpoint and hang faults (runtime.recovery, runtime.hang)
learning rate: peak lr = --lr x global batch / --reference-batch (linear scaling rule), reached after --warmup
steps; global batch = --batch-size x --grad-accum x dp sequences.
exit code: 0 finished, 1 crashed, 2 bad configuration (nothing launched), 130 interrupted.
"""


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "run", help="train the built-in GPT under torchrun with telemetry and optional injected faults",
        description="Launch an instrumented training job through torchrun (torch.distributed.run): the built-in "
                    "GPT with data parallelism (DDP) or a LAYOUT, telemetry into a run directory "
                    "(steps, collectives, devices, profiler traces, faults). The run directory is printed at the "
                    "end; inspect it with `dtprobe analyze` or `dtprobe dashboard`.",
        epilog=_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    g = p.add_argument_group("launch")
    g.add_argument("--config", metavar="JOB.toml", help="TOML job file; flags given here override its keys")
    g.add_argument("--nproc", type=int, help="worker processes per node (default 1)")
    g.add_argument("--nnodes", type=int, help="number of nodes (default 1)")
    g.add_argument("--node-rank", type=int, help="this node's index, 0..nnodes-1 (node 0 writes the manifest)")
    g.add_argument("--rdzv-endpoint", metavar="HOST:PORT", help="c10d rendezvous address (multi-node)")
    g.add_argument("--max-restarts", type=int, help="torchrun restarts after a worker failure (default 0)")
    g.add_argument("--timeout", type=float, dest="timeout_s", metavar="S",
                   help="process-group timeout in seconds (default 300)")
    g.add_argument("--run-dir", metavar="DIR", help="run directory (default runs/<timestamp>-<model>-dp<N>)")
    g.add_argument("--device", choices=("auto", "cpu", "cuda"), help="default auto: cuda when available")
    g.add_argument("--cpu-bind", choices=("auto", "off"),
                   help="auto (default): on CPU, bind each worker to its own share of the node's cores")
    g = p.add_argument_group("model and layout")
    g.add_argument("--model", help="GPT preset: tiny, small, medium (default tiny)")
    g.add_argument("--dp", type=int, help="data-parallel degree (default -1: all ranks left after tp*pp)")
    g.add_argument("--tp", type=int, help="tensor-parallel degree (default 1)")
    g.add_argument("--pp", type=int, help="pipeline-parallel degree (default 1)")
    g.add_argument("--zero", type=int, help="ZeRO stage 0-3 over dp (default 0)")
    g.add_argument("--pp-schedule", help="pipeline schedule (gpipe, 1f1b, interleaved-1f1b, zero-bubble, zbv)")
    g.add_argument("--microbatches", type=int, help="pipeline micro-batches per step (default 2*pp)")
    g.add_argument("--virtual-stages", type=int, help="pipeline stages per rank (default: the schedule's)")
    g.add_argument("--sequence-parallel", action="store_true", default=None, help="sequence parallel with tp")
    g.add_argument("--activation-checkpointing", help="none, selective or full")
    g.add_argument("--stage-sleep", metavar="fwd_ms=F,bwd_ms=B",
                   help="replace each pipeline stage's compute by a fixed sleep (deterministic bubble demos)")
    g = p.add_argument_group("training")
    g.add_argument("--steps", type=int, help="optimizer steps (default 30)")
    g.add_argument("--batch-size", type=int, help="sequences per micro-batch per dp rank (default 8)")
    g.add_argument("--seq-len", type=int, help="tokens per sequence (default 64)")
    g.add_argument("--grad-accum", type=int, help="micro-batches per optimizer step (default 1)")
    g.add_argument("--lr", type=float, help="peak lr for --reference-batch sequences (default 1e-3)")
    g.add_argument("--lr-scaling", choices=("linear", "none"), help="linear scaling rule (default linear)")
    g.add_argument("--reference-batch", type=int, help="global batch --lr is tuned for (default 32)")
    g.add_argument("--warmup", type=int, help="linear lr warmup steps (default 5)")
    g.add_argument("--clip", type=float, help="max gradient norm, 0 = off (default 1.0)")
    g.add_argument("--seed", type=int, help="seed of weights and data (default 0)")
    g.add_argument("--bucket-mb", type=float, help="DDP bucket_cap_mb (default 25)")
    g.add_argument("--data", choices=("synthetic", "text"), help="token source (default synthetic)")
    g.add_argument("--precision", help="fp32, bf16 or fp16 (runtime.precision)")
    g.add_argument("--compress", metavar="METHOD[:k=v]", help="gradient compression (runtime.compression)")
    g = p.add_argument_group("checkpoints and hangs (runtime.recovery, runtime.hang)")
    g.add_argument("--ckpt-every", type=int, metavar="K", help="DCP checkpoint after every K-th step (default 0: off)")
    g.add_argument("--ckpt-async", action="store_true", default=None,
                   help="save in the background (dcp.async_save on its own process group)")
    g.add_argument("--ckpt-keep", type=int, metavar="N", help="committed checkpoints kept, 0 = all (default 2)")
    g.add_argument("--collective-timeout", type=float, metavar="T",
                   help="hang watchdog: a collective pending T seconds -> faults row 'hang', exit (default 0: off)")
    g = p.add_argument_group("telemetry and faults")
    g.add_argument("--profile-steps", metavar="A-B", help="trace steps A..B with torch.profiler, e.g. 10-11")
    g.add_argument("--no-collect", action="store_true", default=None,
                   help="record nothing (overhead baseline; no progress bar)")
    g.add_argument("--no-collectives", action="store_true", default=None, help="do not record collectives")
    g.add_argument("--no-devices", action="store_true", default=None, help="do not sample devices/host")
    g.add_argument("--device-interval", type=float, metavar="S", help="seconds between device samples")
    g.add_argument("--inject", action="append", metavar="KIND:K=V,...", help="inject a fault (repeatable)")
    g.add_argument("--set", action="append", metavar="SECTION.KEY=VALUE", default=[],
                   help="set any job.toml key, e.g. --set train.weight_decay=0.0 (repeatable)")
    p.set_defaults(func=main)


def overrides_from_args(args: argparse.Namespace) -> dict[str, Any]:
    """The job keys the flags set (None = not given), as a nested dict shaped like job.toml."""
    from dtprobe.store.errors import ConfigError

    def pick(**names: str) -> dict[str, Any]:
        return {key: getattr(args, attr) for key, attr in names.items() if getattr(args, attr, None) is not None}

    out: dict[str, Any] = pick(nproc="nproc", nnodes="nnodes", node_rank="node_rank", rdzv_endpoint="rdzv_endpoint",
                               max_restarts="max_restarts", timeout_s="timeout_s", run_dir="run_dir",
                               device="device", cpu_bind="cpu_bind")
    sections = {
        "model": pick(name="model"),
        "layout": pick(dp="dp", tp="tp", pp="pp", zero="zero", pp_schedule="pp_schedule",
                       microbatches="microbatches", virtual_stages="virtual_stages",
                       sequence_parallel="sequence_parallel", activation_checkpointing="activation_checkpointing",
                       stage_sleep="stage_sleep"),
        "train": pick(steps="steps", batch_size="batch_size", seq_len="seq_len", grad_accum="grad_accum", lr="lr",
                      lr_scaling="lr_scaling", reference_batch="reference_batch", warmup="warmup", clip="clip",
                      seed="seed", bucket_mb="bucket_mb", data="data"),
        "collect": pick(device_interval_s="device_interval"),
    }
    if args.no_collect:
        sections["collect"]["enabled"] = False
    if args.no_collectives:
        sections["collect"]["collectives"] = False
    if args.no_devices:
        sections["collect"]["devices"] = False
    if args.profile_steps is not None:
        sections["collect"]["profile_steps"] = parse_step_window(args.profile_steps)
    if args.precision is not None:
        sections["precision"] = {"dtype": args.precision}
    ckpt = pick(every="ckpt_every", async_save="ckpt_async", keep="ckpt_keep")   # RELIABILITY
    if ckpt:
        sections["ckpt"] = ckpt
    if args.collective_timeout is not None:
        sections["hang"] = {"collective_timeout_s": args.collective_timeout}
    if args.compress is not None:
        from dataclasses import asdict

        from dtprobe.runtime.compression import CompressionConfig

        sections["compression"] = asdict(CompressionConfig.parse(args.compress))
    for item in args.set:
        dotted, eq, raw = item.partition("=")
        section, dot, key = dotted.strip().partition(".")
        if not eq or not dot or not key:
            raise ConfigError(f"--set {item!r}: write SECTION.KEY=VALUE, e.g. --set train.weight_decay=0.0.")
        sections.setdefault(section, {})[key] = parse_value(raw)
    if args.inject is not None:
        out["inject"] = list(args.inject)
    out.update({name: values for name, values in sections.items() if values})
    return out


def parse_step_window(text: str) -> list[int]:
    """``"10-11"`` -> [10, 11]; ``"10"`` -> [10, 10]."""
    from dtprobe.store.errors import ConfigError

    first, _, last = text.partition("-")
    try:
        window = [int(first), int(last or first)]
    except ValueError:
        raise ConfigError(f"--profile-steps {text!r}: write FIRST-LAST step numbers, e.g. 10-11.") from None
    return window


def parse_value(raw: str) -> Any:
    """A TOML scalar (``3``, ``1e-3``, ``true``, ``"x"``); anything else is taken as a plain string."""
    try:
        return tomllib.loads(f"v = {raw.strip()}")["v"]
    except tomllib.TOMLDecodeError:
        return raw.strip()


def build_job(args: argparse.Namespace) -> Any:
    """TOML file (if any) merged with the flags into a validated JobConfig."""
    from dtprobe.runtime.config import JobConfig, load_plugins, merge, read_toml

    load_plugins()
    base = read_toml(args.config) if args.config else {}
    source = f"--config {args.config} + flags" if args.config else "flags"
    return JobConfig.from_dict(merge(base, overrides_from_args(args)), source=source)


def main(args: argparse.Namespace) -> int:
    from dtprobe.runtime.launcher import launch

    job = build_job(args)
    return launch(job, command=["dtprobe", *sys.argv[1:]])
