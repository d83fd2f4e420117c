"""``dtprobe export tables|perfetto|tensorboard|mlflow RUN``: write a run's tables as CSV/Parquet files, a Perfetto
trace, TensorBoard event files, or an MLflow run (the last two through ``dtprobe.export``)."""

from __future__ import annotations

import argparse
from pathlib import Path

from dtprobe.commands.analyze import add_trace_reading_flags


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "export", help="export a run's tables (CSV/Parquet), a Perfetto trace, TensorBoard scalars or an MLflow run",
        description="Export a run for other tools: `tables` writes one file per non-empty table "
                    "(steps, collectives, devices, faults, ...), clock-aligned; `perfetto` writes a trace for "
                    "ui.perfetto.dev; `tensorboard` writes per-step scalars and the findings for TensorBoard; "
                    "`mlflow` logs the key figures, layout, findings and timeline as an MLflow run. "
                    "See docs/exporters.md.")
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
    tensorboard = sub.add_parser(
        "tensorboard", help="per-step scalars and the findings as TensorBoard event files",
        description="Write one TensorBoard event file into DIR: per step, step_time_ms/rank<R>, tokens_per_s, "
                    "loss, loss_scale, exposed_comm_frac/rank<R>, lateness_frac/<group>/rank<R>; and the findings "
                    "(as `dtprobe analyze --format md` prints them) as the text `findings`. View with "
                    "`tensorboard --logdir DIR`. Needs pip install dtprobe[tensorboard].")
    tensorboard.add_argument("run", metavar="RUN", help="run directory (or Kineto trace folder)")
    tensorboard.add_argument("-o", "--out", required=True, metavar="DIR",
                             help="log directory for the event file (created; must hold no event file yet)")
    add_trace_reading_flags(tensorboard)
    mlflow = sub.add_parser(
        "mlflow", help="the key figures, layout, findings and timeline as an MLflow run",
        description="Log RUN as a new MLflow run: the key figures and finding counts as metrics, the layout as "
                    "params (layout.dp, layout.tp, ...), findings.json (as `dtprobe analyze --format json` prints "
                    "it) and timeline.perfetto.json as artifacts. Works with mlflow-skinny alone against a file "
                    "store (--tracking-uri file:./mlruns, or MLflow's default ./mlruns; dtprobe sets "
                    "MLFLOW_ALLOW_FILE_STORE=true for it, since MLflow keeps that backend in maintenance mode) or an "
                    "MLflow server (http://HOST:5000). "
                    "Needs pip install dtprobe[mlflow].")
    mlflow.add_argument("run", metavar="RUN", help="run directory (or Kineto trace folder)")
    mlflow.add_argument("--tracking-uri", metavar="URI", default=None,
                        help="MLflow tracking URI (default: MLFLOW_TRACKING_URI, else MLflow's default: ./mlruns "
                             "when it holds experiments, else sqlite:///mlflow.db, which mlflow-skinny cannot open)")
    mlflow.add_argument("--experiment", metavar="NAME", default="dtprobe",
                        help="experiment to log into, created if missing (default: dtprobe)")
    mlflow.add_argument("--run-name", metavar="NAME", default=None,
                        help="name of the MLflow run (default: the run directory's name)")
    add_trace_reading_flags(mlflow)
    parser.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    """Dispatch on the sub-command."""
    commands = {"tables": main_tables, "perfetto": main_perfetto, "tensorboard": main_tensorboard,
                "mlflow": main_mlflow}
    return commands[args.what](args)


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


def _analysis(console, path: str, args: argparse.Namespace):
    """The ``RunAnalysis`` of ``path``, key figures and findings computed under a status line; TraceError when the
    run holds no rows at all. ``args.workers`` / ``args.dask``: where a trace folder's files are reduced."""
    from dtprobe.analysis.facade import RunAnalysis, open_source
    from dtprobe.commands.common import check_not_empty

    with console.status(f"Reading {path} ...") as status:
        def progress(done: int, total: int, file: str) -> None:
            status.update(f"Reduced trace {done}/{total}: {Path(file).name}")

        analysis = RunAnalysis(open_source(path, progress=progress, workers=None if args.dask else args.workers,
                                           dask_address=args.dask))
        check_not_empty(analysis)
        status.update(f"Analysing {path} ...")
        analysis.key_figures()
        analysis.findings()
    return analysis


def main_tensorboard(args: argparse.Namespace) -> int:
    from rich.console import Console

    from dtprobe.export.tensorboard import write_tensorboard

    console = Console()
    analysis = _analysis(console, args.run, args)
    with console.status(f"Writing TensorBoard events to {args.out} ..."):
        done = write_tensorboard(analysis, log_dir=Path(args.out))
    console.print(f"Wrote {done.num_points} scalar points ({len(done.tags)} tags) and {done.num_findings} "
                  f"finding(s) to {done.log_dir}; view with: tensorboard --logdir {done.log_dir}", highlight=False,
                  soft_wrap=True)
    return 0


def main_mlflow(args: argparse.Namespace) -> int:
    import os
    from urllib.parse import urlparse

    from rich.console import Console

    from dtprobe.export.mlflow import export_mlflow, tracking_uri_of

    uri = tracking_uri_of(args.tracking_uri)
    if urlparse(uri).scheme in ("", "file"):
        # a folder named on purpose, or the ./mlruns MLflow itself defaults to: MLflow's file store, opted into
        # (a user's own MLFLOW_ALLOW_FILE_STORE=false is kept)
        os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
    console = Console()
    analysis = _analysis(console, args.run, args)
    with console.status(f"Logging to MLflow at {uri} ..."):
        done = export_mlflow(analysis, tracking_uri=args.tracking_uri, experiment=args.experiment,
                             run_name=args.run_name)
    console.print(f"Logged MLflow run {done.run_id} in experiment {args.experiment!r} (id {done.experiment_id}) at "
                  f"{done.tracking_uri}: {len(done.metrics)} metrics, {len(done.params)} params, artifacts "
                  f"{', '.join(done.artifacts)}", highlight=False, soft_wrap=True)
    return 0
