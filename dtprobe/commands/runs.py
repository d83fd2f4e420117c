"""``dtprobe runs [ROOT]``: a table of the runs under a folder (status, world size, steps, age)."""

from __future__ import annotations

import argparse
from pathlib import Path


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "runs", help="list the runs under a folder",
        description="List the dtprobe runs in ROOT (ROOT itself if it is a run, and its immediate "
                    "subdirectories), newest first: status, world size, steps recorded, restarts, age and time "
                    "since the last write (a 'running' run that stopped writing long ago probably died).")
    parser.add_argument("root", nargs="?", default="runs", metavar="ROOT",
                        help="folder holding run directories (default: ./runs)")
    parser.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    from dtprobe.store import list_runs

    console = Console()
    runs = list_runs(args.root)
    if runs.empty:
        console.print(f"No dtprobe runs in '{args.root}'. Start one with `dtprobe run` or `dtprobe.attach(...)`.")
        return 0
    colors = {"running": "yellow", "finished": "green", "crashed": "red", "invalid": "magenta"}
    table = Table(title=f"dtprobe runs in {Path(args.root).resolve()}")
    for col, justify in (("run", "left"), ("status", "left"), ("ranks", "right"), ("steps", "right"),
                         ("restarts", "right"), ("age", "right"), ("last write", "right")):
        table.add_column(col, justify=justify, overflow="fold")
    for row in runs.itertuples(index=False):
        status = f"[{colors.get(row.status, 'white')}]{row.status}[/]"
        table.add_row(row.name, status, _fmt_int(row.world_size), _fmt_int(row.num_steps),
                      _fmt_int(row.num_restarts), _fmt_age(row.age_s), _fmt_age(row.idle_s, suffix=" ago"))
    console.print(table)
    for row in runs.itertuples(index=False):
        if row.status == "invalid":
            console.print(f"[magenta]{row.name}[/]: {row.error}", highlight=False)
    return 0


def _fmt_int(value: object) -> str:
    import pandas as pd

    return "-" if value is None or pd.isna(value) else str(int(value))


def _fmt_age(age_s: float | None, *, suffix: str = "") -> str:
    import math

    if age_s is None or math.isnan(age_s):
        return "-"
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if age_s >= size:
            return f"{age_s / size:.1f}{unit}{suffix}"
    return f"{age_s:.0f}s{suffix}"
