"""Dashboard load benchmark: a synthetic 64-rank x 1,000-step run written with the store's writer; time from
server start (`dtprobe dashboard` flags) until the Overview is fully drawn in Chromium, and the cost of one live
refresh after one more step, at two run lengths (the refresh should not grow with the run's length).

    python benchmarks/dashboard_load.py [--ranks 64] [--steps 1000]
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dashboard.paths import ROOT_ENV  # noqa: E402
from dashboard.synthetic import SyntheticRun  # noqa: E402
from dtprobe.commands.dashboard import APP, streamlit_argv  # noqa: E402


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_to_overview_s(root: Path, run: str) -> float:
    """Seconds from server process start until the Overview (metrics + chart) is drawn in Chromium."""
    from playwright.sync_api import expect, sync_playwright

    port = _port()
    env = dict(os.environ, **{ROOT_ENV: str(root)})
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path="/usr/bin/chromium", args=["--no-sandbox", "--disable-gpu"])
        page = browser.new_page()
        t0 = time.perf_counter()
        proc = subprocess.Popen(streamlit_argv(host="127.0.0.1", port=port), env=env, cwd=APP.parent,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        try:
            while True:
                try:
                    urllib.request.urlopen(f"http://127.0.0.1:{port}/_stcore/health", timeout=1)
                    break
                except OSError:
                    time.sleep(0.05)
            page.goto(f"http://127.0.0.1:{port}/?run={run}")
            expect(page.get_by_test_id("stMetricValue").first).to_be_visible(timeout=600_000)
            expect(page.locator("[data-testid=stPlotlyChart] .main-svg").first).to_be_visible(timeout=600_000)
            expect(page.get_by_test_id("stStatusWidget")).to_have_count(0, timeout=600_000)
            return time.perf_counter() - t0
        finally:
            proc.terminate()
            proc.wait(20)
            browser.close()


def refresh_cost_s(run: SyntheticRun) -> tuple[float, float]:
    """(store tail, full Overview analysis) seconds after one more step of a live run."""
    from dtprobe.analysis.facade import RunAnalysis, open_source

    store = open_source(run.run_dir)
    RunAnalysis(store).findings()
    run.write_steps(1)
    t0 = time.perf_counter()
    store.refresh()
    store.num_rows()
    t1 = time.perf_counter()
    a = RunAnalysis(store)
    a.key_figures()
    a.findings()
    return t1 - t0, time.perf_counter() - t1


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=64)
    ap.add_argument("--steps", type=int, default=1000)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        t = time.perf_counter()
        big = SyntheticRun(root / "big", num_ranks=args.ranks, straggler_rank=3)
        big.write_steps(args.steps)
        print(f"wrote {args.ranks} ranks x {args.steps} steps in {time.perf_counter() - t:.1f} s")
        load = server_to_overview_s(root, "big")
        print(f"server start -> Overview drawn: {load:.2f} s (goal <= 3 s)")
        small = SyntheticRun(root / "small", num_ranks=args.ranks, straggler_rank=3)
        small.write_steps(max(1, args.steps // 10))
        for name, run in ((f"{args.steps // 10} steps", small), (f"{args.steps} steps", big)):
            tail, full = refresh_cost_s(run)
            print(f"live refresh after one more step, run of {name}: store tail {tail * 1e3:.1f} ms, "
                  f"re-analysis {full * 1e3:.0f} ms")


if __name__ == "__main__":
    main()
