"""``dtprobe analyze PATH``: findings with evidence and recommendations for a run or a Kineto trace folder.

Exit codes: 0 no critical finding, 1 at least one critical finding, 2 unusable input (the message names the
file and what is wrong).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from dtprobe.analysis.render import render_json, render_markdown, render_text
from dtprobe.commands.common import check_not_empty


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "analyze", help="diagnose a run or a folder of Kineto traces: findings, evidence, recommendations",
        description=(
            "Analyse PATH, a dtprobe run directory (running, finished or crashed) or a folder of Kineto traces "
            "(torch.profiler *.pt.trace.json[.gz], one file per rank), and report findings: stragglers (culprit "
            "vs victims per parallel group), exposed communication, pipeline bubbles, AMP overflows, checkpoint "
            "stalls, inefficient collectives, hangs, crashes (which rank died first, how, and the recovery), "
            "collective mismatches, corrupt checkpoints, device throttling, compression, MFU. Every crash and "
            "restart is named at the top. Exit code 0: no critical finding; 1: critical findings; 2: unusable "
            "input."),
        epilog=("Codes and the JSON shape are documented in docs/findings.md. Example: "
                "dtprobe analyze runs/dp4 --format json > findings.json"),
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("path", metavar="PATH", help="run directory or Kineto trace folder")
    parser.add_argument("--format", choices=("text", "json", "md"), default="text",
                        help="text: tables for a terminal; json: the dtprobe.findings/1 document; md: Markdown")
    parser.add_argument("--baseline", metavar="RUN", default=None,
                        help="a comparable run (e.g. without compression) for the loss gap and comparisons")
    parser.add_argument("-o", "--output", metavar="FILE", default=None, help="write the report here instead of stdout")
    parser.add_argument("--mtbf-hours", type=float, default=24.0,
                        help="mean time between failures assumed for the Young/Daly checkpoint interval")
    parser.add_argument("--window-steps", type=int, default=20,
                        help="sliding window (steps) over which a straggler must persist; longer when "
                             "that many steps last under 0.5 s")
    parser.add_argument("--skip-steps", type=int, default=1,
                        help="warm-up steps left out of step-time metrics")
    parser.add_argument("--link-gbps", type=float, default=None,
                        help="link peak bus bandwidth in Gb/s to judge large collectives against (off when unset)")
    parser.add_argument("--hang-timeout-s", type=float, default=60.0,
                        help="while a run is running, a collective waited on this long counts as a hang")
    add_trace_reading_flags(parser)
    parser.set_defaults(func=main)


def _workers(text: str) -> int | None:
    if text == "auto":
        return None
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of processes or 'auto', got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1 (1 reads the files in this process), got {value}")
    return value


def add_trace_reading_flags(parser: argparse.ArgumentParser) -> None:
    """``--workers`` and ``--dask``: where the per-rank files of a Kineto trace folder are reduced."""
    parser.add_argument("--workers", metavar="N", type=_workers, default="auto",
                        help="for a Kineto trace folder: processes that stream and reduce the rank files in parallel "
                             "(each holds one file's reduction at a time; 1 reads them in this process); auto: one "
                             "per CPU, at most one per file")
    parser.add_argument("--dask", metavar="ADDRESS", default=None,
                        help="for a Kineto trace folder: reduce the rank files on the workers of this existing Dask "
                             "scheduler (e.g. tcp://127.0.0.1:8786; they must see the files at the same paths) "
                             "instead of local --workers; needs pip install 'dtprobe[dask]'")


def main(args: argparse.Namespace) -> int:
    from rich.console import Console

    from dtprobe.analysis.facade import AnalysisOptions, RunAnalysis, open_source
    from dtprobe.commands.compact import missing_derived_hint
    from dtprobe.store.errors import ConfigError

    err = Console(stderr=True)
    try:
        options = AnalysisOptions(window_steps=args.window_steps, skip_first_steps=args.skip_steps,
                                  mtbf_hours=args.mtbf_hours, peak_busbw_gbps=args.link_gbps,
                                  hang_timeout_s=args.hang_timeout_s)
    except ValueError as exc:
        raise ConfigError(f"{exc}. Fix the flag (see dtprobe analyze --help).") from None
    with err.status(f"Reading {args.path} ...") as status:
        def progress(done: int, total: int, path: str) -> None:
            status.update(f"Reduced trace {done}/{total}: {Path(path).name}")

        reading = {"workers": None if args.dask else args.workers, "dask_address": args.dask}
        source = open_source(args.path, progress=progress, **reading)
        baseline = None
        if args.baseline:
            status.update(f"Reading baseline {args.baseline} ...")
            baseline = open_source(args.baseline, **reading)
        analysis = RunAnalysis(source, baseline=baseline, options=options)
        check_not_empty(analysis)
        hint = missing_derived_hint(source)
        if hint is not None:
            err.print(hint, highlight=False, soft_wrap=True)   # one line: a path must stay whole to copy
        status.update("Analysing ...")
        report = analysis.report()
    render = {"json": render_json, "md": render_markdown}.get(args.format)
    if render is not None:
        text = render(report)
        if args.output:
            Path(args.output).write_text(text)
            err.print(f"Wrote {args.output}")
        else:
            sys.stdout.write(text)
    else:
        out = Console(file=open(args.output, "w"), width=140) if args.output else Console()
        render_text(report, out)
        if args.output:
            out.file.close()
            err.print(f"Wrote {args.output}")
    return 1 if any(f["severity"] == "critical" for f in report["findings"]) else 0

