"""``dtprobe launch``: run an unmodified training script under torchrun with dtprobe attached in every worker.

Example: ``dtprobe launch --nproc 2 --run-dir runs/mine train.py --epochs 1`` (or ``dtprobe launch --nproc 2 -m
pkg.train``). The torchrun and telemetry flags are ``dtprobe run``'s (``runtime.config.JobConfig``, spelled by
``runtime.options``); everything after SCRIPT goes to the script.
"""

from __future__ import annotations

import argparse
import sys

LAUNCH_KEYS = ("run_dir", "nproc", "nnodes", "node_rank", "rdzv_endpoint", "max_restarts",
               "collect.enabled", "collect.collectives", "collect.devices", "collect.device_interval_s",
               "collect.profile_steps")
"""The ``dtprobe run`` options that ``dtprobe launch`` takes (the others describe the built-in training)."""
RUNTIME_ONLY_CODES = frozenset({"LOW_MFU", "COMPRESSION"})
"""Findings that need to know the model or the runtime's settings (FLOPs per token, the compression used): not
shown after a launch (``dtprobe analyze`` shows everything the run holds)."""

_DESCRIPTION = """\
Run SCRIPT (or -m MODULE) unchanged under torchrun (torch.distributed.run), with dtprobe attached in every worker
right after the script's own init_process_group: the default group and every group, DeviceMesh, DDP, FSDP2 or
DTensor layout created after it are recorded (collectives table), as are devices, profiler windows, steps and
the script's checkpoint saves and loads (torch.distributed.checkpoint, torch.save to a file).

A step is an optimizer step attempt (torch.optim's global step hooks; with gradient accumulation, one per optimizer
step; a step that GradScaler skips still counts, marked skipped in the amp table). Forward, backward and optimizer
phases come from module, autograd and optimizer hooks. Loss and tokens are recorded only when the script calls
dtprobe.record(loss=..., tokens=...) (a no-op when not run by dtprobe): otherwise they are absent, never guessed.

Shows progress (optimizer steps on rank 0), then the findings that need no knowledge of the model (stragglers,
stalls, exposed or inefficient communication, hangs, crashes, collective mismatches, checkpoint stalls, device
problems; pipeline and AMP findings when the telemetry holds those rows), and prints the run directory on stdout. The
workers' output goes to RUN/logs/. Exit code: the script's (that of the first rank that failed), 130 when interrupted,
2 for a bad command line."""


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    from dtprobe.runtime.config import FLAG_GROUPS, JobConfig
    from dtprobe.runtime.options import LAUNCH_GROUP, add_flags

    p = subparsers.add_parser(
        "launch", help="run your own training script unchanged under torchrun, with dtprobe attached",
        description=_DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="example: dtprobe launch --nproc 2 --run-dir runs/fsdp train_fsdp.py --epochs 1\n"
               "         dtprobe launch --nproc 4 --no-devices -m mypkg.train --config cfg.yaml")
    telemetry = FLAG_GROUPS[-1]
    groups = {LAUNCH_GROUP: p.add_argument_group("torchrun (run directory default: runs/<time>-<script>-n<ranks>)"),
              telemetry: p.add_argument_group("telemetry")}
    add_flags(groups, JobConfig, keys=LAUNCH_KEYS)
    groups[telemetry].add_argument(
        "--stacks-after", dest="stacks_after_s", type=float, default=None, metavar="S",
        help="when a collective or send/recv has been pending S seconds, write every rank's Python stack into the "
             "run (HANG evidence); the script's own process-group timeout still ends the job. Default: half that "
             "timeout, at most 300; 0 = never")
    p.add_argument("-m", dest="as_module", action="store_true",
                   help="run SCRIPT as a module, like python -m (SCRIPT is then the module's name)")
    p.add_argument("target", nargs=argparse.REMAINDER, metavar="SCRIPT [ARGS ...]",
                   help="the script (or, with -m, the module) and its own arguments")
    p.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    from rich.console import Console

    from dtprobe.runtime.config import JobConfig
    from dtprobe.runtime.launch_script import LaunchTarget, launch
    from dtprobe.runtime.options import flag_values
    from dtprobe.store.errors import ConfigError

    if not args.target:
        raise ConfigError("dtprobe launch: no SCRIPT given; e.g. `dtprobe launch --nproc 2 train.py` or "
                          "`dtprobe launch --nproc 2 -m mypkg.train`.")
    name, *script_args = args.target
    target = LaunchTarget(**{"module" if args.as_module else "script": name}, args=tuple(script_args),
                          stacks_after_s=args.stacks_after_s)
    job = JobConfig.from_dict(flag_values(args, JobConfig), source="flags")
    console = Console(stderr=True)
    result = launch(job, target, command=["dtprobe", *sys.argv[1:]], console=console)
    if job.node_rank == 0:
        from dtprobe.commands.compact import store_summary

        store_summary(result.run_dir, console=console)
        print_findings(result.run_dir, console)
    console.print(f"exit code {result.exit_code}; run directory (also on stdout):", highlight=False)
    print(result.run_dir, flush=True)
    return result.exit_code


def print_findings(run_dir, console) -> None:
    """The run's findings (those needing no knowledge of the model), one line each, worst first."""
    from dtprobe.analysis.facade import RunAnalysis, open_source
    from dtprobe.store.errors import TraceError

    try:
        findings = [f for f in RunAnalysis(open_source(str(run_dir))).findings() if f.code not in RUNTIME_ONLY_CODES]
    except TraceError as exc:
        console.print(f"findings: not analyzed ({exc})", highlight=False)
        return
    if not findings:
        console.print("findings: none", highlight=False)
        return
    console.print(f"findings ({len(findings)}; details: dtprobe analyze {run_dir}):", highlight=False)
    for f in sorted(findings, key=lambda f: f.severity_rank):
        where = f" ranks {list(f.ranks)}" if f.ranks else ""
        console.print(f"  {f.severity:<8} {f.code:<20} {f.title}{where}", highlight=False, markup=False)
