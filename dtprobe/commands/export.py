"""``dtprobe export tables|perfetto RUN``: write a run's tables as CSV/Parquet files, or a Perfetto trace."""

from __future__ import annotations

import argparse
from pathlib import Path


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "export", help="export a run's tables (CSV/Parquet) or a Perfetto trace",
        description="Export a run for other tools: `tables` writes one file per non-empty table "
                    "(steps, collectives, devices, faults, ...), clock-aligned; `perfetto` writes a trace for "
                    "ui.perfetto.dev.")
    sub = parser.add_subparsers(dest="what", required=True, metavar="WHAT")
    tables = sub.add_parser(
        "tables", help="one CSV or Parquet file per non-empty table",
        description="Write OUT_DIR/<table>.<format> for every table of RUN that has rows. Times are Unix "
                    "nanoseconds on rank 0's clock; units are in the column names.")
    tables.add_argument("run", metavar="RUN", help="run directory")
    tables.add_argument("-o", "--out", required=True, metavar="OUT_DIR", help="output directory (created)")
    tables.add_argument("--format", choices=("csv", "parquet"), default="csv", help="file format (default: csv)")
    perfetto = sub.add_parser(
        "perfetto", help="a Perfetto / chrome://tracing JSON trace of the run",
        description="Write a trace of RUN (steps, phases, collectives per rank) that ui.perfetto.dev opens.")
    perfetto.add_argument("run", metavar="RUN", help="run directory")
    perfetto.add_argument("-o", "--out", required=True, metavar="FILE", help="output trace file")
    parser.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    """Dispatch on the sub-command."""
    return main_perfetto(args) if args.what == "perfetto" else main_tables(args)


def main_tables(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    from dtprobe.store import RunStore, TraceError

    console = Console()
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise TraceError(f"-o '{out}' exists and is not a directory; pass a directory for the table files.")
    with console.status(f"Reading {args.run} ..."):
        store = RunStore.open(args.run)
    out.mkdir(parents=True, exist_ok=True)
    summary = Table(title=f"Exported {store.path} -> {out}")
    summary.add_column("table")
    summary.add_column("rows", justify="right")
    summary.add_column("file")
    for name in store.tables():
        df = store.table(name)
        if df.empty:
            continue
        path = out / f"{name}.{args.format}"
        if args.format == "csv":
            df.to_csv(path, index=False)
        else:
            df.to_parquet(path, index=False)
        summary.add_row(name, str(len(df)), str(path))
    if not summary.row_count:
        raise TraceError(f"'{store.path}' has no events yet (no table has rows), so there is nothing to export. "
                         f"Check that the run's ranks called dtprobe.attach and wrote steps.")
    console.print(summary)
    return 0


def main_perfetto(args: argparse.Namespace) -> int:
    from rich.console import Console

    from dtprobe.analysis.perfetto import export_perfetto
    from dtprobe.store import RunStore

    console = Console()
    with console.status(f"Writing Perfetto trace of {args.run} ..."):
        store = RunStore.open(args.run)
        summary = export_perfetto(store, Path(args.out))
    num_events = getattr(summary, "num_events", None)
    detail = f" ({num_events} events)" if num_events is not None else ""
    console.print(f"Wrote {args.out}{detail}; open it at https://ui.perfetto.dev", highlight=False)
    return 0
