"""``dtprobe run``: train the built-in GPT under torchrun with telemetry (flags override ``--config job.toml``).

Example: ``dtprobe run --nproc 4 --steps 30 --inject straggler:rank=2,delay_ms=40 --profile-steps 10-11``.
Multi-node: run the same command on every node with ``--nnodes N --node-rank K --rdzv-endpoint HOST:PORT`` and
the same ``--run-dir`` on a shared filesystem.
"""

from __future__ import annotations

import argparse
import sys
import textwrap
import tomllib
from typing import Any

_NOTES = """\
learning rate: peak lr = --lr x global batch / --reference-batch (linear scaling rule), reached after --warmup
steps; global batch = --batch-size x --grad-accum x dp sequences.
exit code: 0 finished, 1 crashed, 2 bad configuration (nothing launched), 130 interrupted.
"""


def epilog() -> str:
    """Every job.toml key with its default and every fault kind, from the config dataclasses and the fault table."""
    from dtprobe.runtime.config import JobConfig
    from dtprobe.runtime.faults import FAULT_KINDS
    from dtprobe.runtime.options import toml_reference

    faults = [f"  {kind.example:<34} {line}" if i == 0 else f"  {'':<34} {line}"
              for kind in FAULT_KINDS.values()
              for i, line in enumerate(textwrap.wrap(kind.help, width=80, break_on_hyphens=False))]
    return ("job.toml (every key optional, defaults shown; flags override it, --set SECTION.KEY=VALUE sets any "
            "key):\n" + toml_reference(JobConfig) + "\n\nfaults (--inject, repeatable; e.g.):\n" + "\n".join(faults)
            + "\n" + _NOTES)


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    from dtprobe.runtime.config import FLAG_GROUPS, JobConfig
    from dtprobe.runtime.options import add_flags

    p = subparsers.add_parser(
        "run", help="train the built-in GPT under torchrun with telemetry and optional injected faults",
        description="Launch an instrumented training job through torchrun (torch.distributed.run): the built-in "
                    "GPT with data parallelism (DDP) or a LAYOUT, telemetry into a run directory "
                    "(steps, collectives, devices, profiler traces, faults). The run directory is printed at the "
                    "end; inspect it with `dtprobe analyze` or `dtprobe dashboard`.",
        epilog=epilog(), formatter_class=argparse.RawDescriptionHelpFormatter)
    groups = {title: p.add_argument_group(title) for title in FLAG_GROUPS}
    groups["launch"].add_argument("--config", metavar="JOB.toml",
                                  help="TOML job file; flags given here override its keys")
    add_flags(groups, JobConfig)
    groups[FLAG_GROUPS[-1]].add_argument("--set", action="append", metavar="SECTION.KEY=VALUE", default=[],
                                         help="set any job.toml key, e.g. --set train.weight_decay=0.0 "
                                              "(repeatable)")
    p.set_defaults(func=main)


def overrides_from_args(args: argparse.Namespace) -> dict[str, Any]:
    """The job keys the flags set (None = not given), as a nested dict shaped like job.toml; ``--set`` last."""
    from dtprobe.runtime.config import JobConfig
    from dtprobe.runtime.options import flag_values
    from dtprobe.store.errors import ConfigError

    out = flag_values(args, JobConfig)
    for item in args.set:
        dotted, eq, raw = item.partition("=")
        section, dot, key = dotted.strip().partition(".")
        if not eq or not dot or not key:
            raise ConfigError(f"--set {item!r}: write SECTION.KEY=VALUE, e.g. --set train.weight_decay=0.0.")
        out.setdefault(section, {})[key] = parse_value(raw)
    return out


def parse_value(raw: str) -> Any:
    """A TOML scalar (``3``, ``1e-3``, ``true``, ``"x"``); anything else is taken as a plain string."""
    try:
        return tomllib.loads(f"v = {raw.strip()}")["v"]
    except tomllib.TOMLDecodeError:
        return raw.strip()


def build_job(args: argparse.Namespace) -> Any:
    """TOML file (if any) merged with the flags into a validated JobConfig."""
    from dtprobe.runtime.config import JobConfig, merge, read_toml

    base = read_toml(args.config) if args.config else {}
    source = f"--config {args.config} + flags" if args.config else "flags"
    return JobConfig.from_dict(merge(base, overrides_from_args(args)), source=source)


def main(args: argparse.Namespace) -> int:
    from dtprobe.runtime.launcher import launch

    job = build_job(args)
    rc = launch(job, command=["dtprobe", *sys.argv[1:]])
    if job.node_rank == 0:  # the leader's launcher compacted the run: store its summary for the dashboard
        from pathlib import Path

        from dtprobe.commands.compact import store_summary

        store_summary(Path(job.run_dir))
    return rc
