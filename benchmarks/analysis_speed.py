"""Analysis speed benchmark: what the dashboard's Overview costs (``RunAnalysis.key_figures()`` + ``findings()``)
on a synthetic data-parallel run with one straggler, whole and over a window of its last steps, and the time of
each analyzer on that run (inputs precomputed; best of ``--repeats``). Tables are read before timing: this
measures the analysis, not the store.

    python benchmarks/analysis_speed.py [--ranks 64] [--steps 100 1000] [--window 200] [--repeats 3]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

import pandas as pd

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dtprobe.synthetic import write_synthetic_run  # noqa: E402
from dtprobe.analysis.facade import RunAnalysis  # noqa: E402
from dtprobe.analysis.window import StepWindow  # noqa: E402
from dtprobe.store import RunStore  # noqa: E402
from dtprobe.store.schema import SCHEMAS  # noqa: E402

TABLES = ("steps", "collectives", "devices", "faults", "pipeline", "amp", "checkpoints", "compression", "kernels")
METHODS = ("collective_skew", "collective_waits", "rank_lateness", "straggler_scores", "straggler_causes",
           "pipeline_own_delay", "comm_exposure", "exposure_by_rank", "collective_bandwidth", "bandwidth_by_size",
           "device_health", "last_seen", "missing_arrivals", "throughput_summary")


class PrecomputedWindow:
    """The newest ``num_steps`` steps of a run (``dtprobe.analysis.window.StepWindow``, what a live dashboard
    analyzes) with every table read before timing."""

    def __init__(self, store: RunStore, num_steps: int) -> None:
        window = StepWindow(store, num_steps)
        self.path, self.info = window.path, window.info
        self._tables = {name: window.table(name) for name in SCHEMAS}

    def table(self, name: str) -> pd.DataFrame:
        """The table's rows of the window."""
        return self._tables[name]


def best_s(fn: Callable[[], object], repeats: int) -> float:
    """Best wall time (s) of ``repeats`` calls."""
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def method_s(source, name: str, repeats: int) -> float:
    """Best time (s) of one facade method alone: its dependencies are computed (memoised) before timing."""
    def once() -> float:
        a = RunAnalysis(source)
        getattr(a, name)()
        del a._cache[list(a._cache)[-1]]            # the method's own result is memoised last
        t0 = time.perf_counter()
        getattr(a, name)()
        return time.perf_counter() - t0
    return min(once() for _ in range(repeats))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=64)
    parser.add_argument("--steps", type=int, nargs="+", default=[100, 1000])
    parser.add_argument("--window", type=int, default=200, help="steps of the live window")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        for num_steps in args.steps:
            path = write_synthetic_run(Path(tmp) / f"run{num_steps}", num_ranks=args.ranks, num_steps=num_steps,
                                       straggler_rank=3)
            store = RunStore.open(path)
            for name in TABLES:
                store.table(name)
            sources = {"whole": store}
            if num_steps > args.window:
                sources[f"last {args.window}"] = PrecomputedWindow(store, args.window)
            for label, source in sources.items():
                overview = best_s(lambda: (lambda a: (a.key_figures(), a.findings()))(RunAnalysis(source)),
                                  args.repeats)
                print(f"{args.ranks} ranks x {num_steps} steps, {label}: "
                      f"key_figures + findings {overview * 1e3:.0f} ms")
                for name in METHODS:
                    print(f"    {name:22s} {method_s(source, name, args.repeats) * 1e3:7.1f} ms")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
