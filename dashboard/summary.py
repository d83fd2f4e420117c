"""What the dashboard analyzes of a source (a running run's newest steps, anything else whole), and
``python -m dtprobe.dashboard.summary [PATH]``: print the Overview of a run or trace folder (default: the newest
under the dashboard's root) as one ``dtprobe.overview/1`` JSON document.

No Streamlit here; the analysis modules (pandas) are imported inside the functions.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from dtprobe.overview import SCHEMA


def analyze(store: Any, kind: str, *, whole_run: bool, window: int):
    """The ``RunAnalysis`` the dashboard shows of an opened source: a running run's newest ``window`` steps unless
    ``whole_run`` (or ``window`` is 0), anything else whole; nothing computed yet (each page asks for what it
    draws). Reads a tail-opened run's skipped head when more than the tail is needed."""
    from dtprobe.analysis.facade import RunAnalysis
    from dtprobe.analysis.window import StepWindow

    live = kind == "run" and store.manifest.status == "running" and window > 0
    src = store
    if live and not whole_run:
        newest = StepWindow(store, window)
        if not newest.is_whole_run:  # older steps exist: analyze the window only
            src = newest
    needed = src.first_step if isinstance(src, StepWindow) else 0
    tail = store.tail_from_step if kind == "run" else None
    if tail is not None and needed < tail:
        store.load_head()  # the whole run (or a wider window) was asked for: read the skipped part
    return RunAnalysis(src)


def steps_overview(store: Any, *, whole_run: bool, window: int, path: str):
    """The Overview a live page shows while the first analysis of a large run is still running: the key figures of
    the ``steps`` table (steps, step time, tokens/s, MFU) and their trends, and the communication share of the
    ranks' own per-step summaries (``comm_steps``, when the run has them); the others unknown, no findings
    (``store`` holds these two tables only: nothing else is read)."""
    import time
    from dataclasses import fields

    from dtprobe.analysis.comm_steps import SUMMARY_COLUMNS, comm_by_rank, mean_comm_frac
    from dtprobe.analysis.key_figures import KeyFigures
    from dtprobe.analysis.window import StepWindow
    from dtprobe.overview import STEP_FIGURES, Overview, trends

    analysis = analyze(store, "run", whole_run=whole_run, window=window)
    source = analysis.source
    k = analysis.throughput_summary()
    figures = {**{f.name: None for f in fields(KeyFigures)},
               **{key: k.get(key) for key in STEP_FIGURES if key != "num_steps"}, "num_steps": store.num_steps()}
    # the step totals' columns the share needs, read apart: the whole frame of a 1,024-rank window costs more
    rows = store.arrow("comm_steps", columns=SUMMARY_COLUMNS, ordered=False,
                       steps=(source.first_step, None) if isinstance(source, StepWindow) else None)
    if rows.num_rows:
        figures["comm_frac"] = mean_comm_frac(comm_by_rank(rows.to_pandas(), analysis.table("steps"),
                                                           step_ids=analysis.steps_analyzed() or None))
    window_of = source if isinstance(source, StepWindow) else None
    return Overview(path=path, whole=window_of is None, figures=figures, num_steps=store.num_steps(),
                    trends=trends(analysis), findings=(), made_s=time.time(),
                    window=window_of.describe() if window_of is not None else None,
                    clock_aligned=analysis.clock_alignment(), arrival_clock=None)


def main(argv: list[str] | None = None) -> int:
    from dtprobe import summary_store
    from dtprobe.dashboard.paths import list_sources, live_window_steps, root_from_env, source_kind
    from dtprobe.overview import summarize
    from dtprobe.store.errors import ConfigError, TraceError

    ap = argparse.ArgumentParser(
        prog="python -m dtprobe.dashboard.summary",
        description=f"Print the dashboard Overview of a run or trace folder as one {SCHEMA} JSON document (a "
                    f"finished run's stored summary when it is valid, else made and stored in the per-user cache). Exit 0 (nothing printed when the root "
                    f"holds no run), 2 unusable input (message on stderr).")
    ap.add_argument("path", nargs="?", help="run or trace folder (default: the newest under the dashboard's root, "
                                            "DTPROBE_DASHBOARD_ROOT)")
    args = ap.parse_args(argv)
    try:
        if args.path is None:
            sources = list_sources(root_from_env())
            if not sources:
                return 0
            path = sources[0].path
        else:
            path = Path(args.path).resolve()
        kind = source_kind(path) if path.is_dir() else None
        if kind is None:
            raise ConfigError(f"'{path}' is neither a run (no run.json) nor a folder of Kineto traces.")
        if summary_store.is_finished(path):
            overview = summary_store.load(path) or summary_store.make(path, in_run_dir=False)
        else:
            from dtprobe.analysis.facade import open_source

            window = live_window_steps()
            store = open_source(path, live_tail_steps=window or None)
            overview = summarize(analyze(store, kind, whole_run=False, window=window), path=str(path))
        sys.stdout.write(overview.to_json())
    except (ConfigError, TraceError) as exc:
        print(f"dtprobe dashboard: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
