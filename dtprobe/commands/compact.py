"""``dtprobe compact RUN``: rebuild a run's Parquet tables from its events files (for a run that crashed)."""

from __future__ import annotations

import argparse
from pathlib import Path


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "compact", help="compact a run's events into Parquet tables",
        description="Compact the per-rank events files of RUN into RUN/tables/<table>.parquet (all ranks, "
                    "clock-aligned) so it loads fast. `dtprobe run` compacts a run when it ends; "
                    "use this for a run that crashed or was killed. Safe to rerun; the run status is not changed.")
    parser.add_argument("run", metavar="RUN", help="run directory (made by `dtprobe run` or `dtprobe.attach`)")
    parser.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    from dtprobe.store import compact

    console = Console()
    with console.status(f"Compacting {args.run} ..."):
        rows = compact(args.run)
    if not rows:
        console.print(f"{args.run}: no events recorded yet; wrote an empty compaction marker.")
        return 0
    console.print(f"Compacted {args.run} into {Path(args.run) / 'tables'}:", highlight=False)
    table = Table()
    table.add_column("table")
    table.add_column("rows", justify="right")
    for name, n in rows.items():
        table.add_row(name, str(n))
    console.print(table)
    return 0
