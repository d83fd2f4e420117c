"""Dashboard load benchmark: a synthetic 64-rank x 1,000-step run written with the store's writer; time from
server start (the `dtprobe dashboard` server command) until the Overview is fully drawn in Chromium, and the cost
of one live refresh after one more step at several run lengths (it should not grow with the run's length).

"Drawn" is checked inside the page at every animation frame (fonts loaded, no script running, the page's own
elements present), so a time is the frame the page was complete in. The browser is open and idle before the
server starts. Measured side by side in one run:
- live: the run is still running, so the Overview analyzes its newest ``--live-window`` steps (the default of
  `dtprobe dashboard`);
- finished: the same run finished, compacted and its summary stored (what `dtprobe run` leaves);
- floor: a page holding one metric, served by plain `streamlit run` the same way;
- live refresh: what one refresh of the Overview does after one more step (``dtprobe.dashboard.data.load_overview``:
  tail the new lines, re-analyze the window, summarize it), for runs of 100, 1,000 and 3,000 steps.

    python benchmarks/dashboard_load.py [--ranks 64] [--steps 1000] [--repeats 3]

It measures the dtprobe installed in this checkout (``pip install -e .``): the server it starts imports the same.
Goals: the Overview drawn within 3 s of the server's start; a live refresh that does not grow with the run.
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import dtprobe.dashboard
from dtprobe import summary_store
from dtprobe.commands.dashboard import APP, streamlit_argv
from dtprobe.dashboard.paths import ROOT_ENV, Source
from dtprobe.synthetic import SyntheticRun

CHECKOUT = Path(__file__).resolve().parents[1]
if Path(dtprobe.dashboard.__file__).resolve().parent != CHECKOUT / "dashboard":
    raise SystemExit(f"dtprobe is imported from {Path(dtprobe.__file__).parent.parent}, not from this checkout "
                     f"({CHECKOUT}): run `pip install -e {CHECKOUT}` first, so that the server measured is this one.")


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


BROWSER_SETTLE_S = 1.0
"""Pause between opening the browser and starting the server: Chromium keeps finishing its own start after
``new_page()``, which on a machine with few cores would otherwise be charged to the server's start."""

DRAWN_JS = """() => {
  const q = (selector) => document.querySelector(selector);
  if (document.fonts.status !== "loaded" || q("[data-testid=stStatusWidget]")) return false;  // fonts; script done
  return %s;
}"""
"""A page is drawn when its fonts are loaded, no script is running and its own condition holds (checked in the
page at every animation frame, so the time is the frame it was drawn in, not the next tick of a poller)."""

OVERVIEW_DRAWN = DRAWN_JS % """!!q("[data-testid=stSelectbox]") && !!q("[data-testid=stMetricValue]")
    && document.body.innerText.includes("STRAGGLER")
    && [...document.querySelectorAll("img[alt^='step time over']")].some(
      (img) => img.complete && img.naturalWidth > 0)"""
"""The Overview: run picker, key figures, the STRAGGLER finding and the step-time trend drawn."""

FLOOR_DRAWN = DRAWN_JS % """!!q("[data-testid=stMetricValue]")"""


def _server_to_drawn_s(argv_for_port, env: dict, cwd: Path, path: str, drawn_js: str) -> float:
    """Seconds from starting the server process ``argv_for_port(port)`` until ``drawn_js`` holds for ``path`` in
    Chromium (launched beforehand; the page is requested as soon as the server answers its health check)."""
    from playwright.sync_api import sync_playwright

    port = _port()
    argv = argv_for_port(port)
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path="/usr/bin/chromium", args=["--no-sandbox", "--disable-gpu"])
        page = browser.new_page()
        time.sleep(BROWSER_SETTLE_S)  # a browser that is open already, as the user's is: not still starting
        t0 = time.perf_counter()
        errors = tempfile.TemporaryFile()
        proc = subprocess.Popen(argv, env=env, cwd=cwd, stdout=subprocess.DEVNULL, stderr=errors,
                                start_new_session=True)
        try:
            while True:
                try:
                    urllib.request.urlopen(f"http://127.0.0.1:{port}/_stcore/health", timeout=1)
                    break
                except OSError:
                    if proc.poll() is not None:
                        errors.seek(0)
                        raise SystemExit(f"the server exited with {proc.returncode}: {' '.join(argv)}\n"
                                         + errors.read().decode(errors="replace")[-2000:])
                    time.sleep(0.02)
            page.goto(f"http://127.0.0.1:{port}/{path}", wait_until="commit")
            page.wait_for_function(drawn_js, polling="raf", timeout=600_000)
            return time.perf_counter() - t0
        finally:
            proc.terminate()
            proc.wait(20)
            errors.close()
            browser.close()


def server_to_overview_s(root: Path, run: str) -> float:
    """Seconds from server process start (the `dtprobe dashboard` server command) until the Overview (run picker,
    key figures with the step-time trend, findings) is drawn in Chromium and no script is running."""
    env = dict(os.environ, **{ROOT_ENV: str(root), summary_store.CACHE_ENV: str(root.parent / "user-cache")})
    return _server_to_drawn_s(lambda port: streamlit_argv(host="127.0.0.1", port=port), env, APP.parent,
                              f"?run={run}", OVERVIEW_DRAWN)


def streamlit_floor_s(folder: Path) -> float:
    """The same measurement for a Streamlit page holding one metric (plain `streamlit run`): the floor set by
    Streamlit's start and the browser on this machine, whatever the page computes."""
    script = folder / "one_metric.py"
    script.write_text("import streamlit as st\nst.metric('steps', 1)\n")

    def argv(port: int) -> list[str]:
        return [sys.executable, "-m", "streamlit", "run", str(script), "--server.address", "127.0.0.1",
                "--server.port", str(port), "--server.headless", "true", "--server.fileWatcherType", "none",
                "--browser.gatherUsageStats", "false"]

    return _server_to_drawn_s(argv, dict(os.environ), folder, "", FLOOR_DRAWN)


def refresh_cost_s(run: SyntheticRun) -> tuple[float, float]:
    """(store tail, whole refresh) seconds of one live page refresh after one more step."""
    from dtprobe.dashboard import data

    source = Source(name=run.run_dir.name, path=run.run_dir.resolve(), kind="run")
    data.load_analysis(source)
    run.write_steps(1)
    store = data.open_store(source)
    t0 = time.perf_counter()
    store.refresh()
    t1 = time.perf_counter()
    run.write_steps(1)
    t2 = time.perf_counter()
    data.load_overview(source)  # what the Overview's refresh does: tail the new lines, re-analyze the window
    return t1 - t0, time.perf_counter() - t2


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", type=int, default=64, help="ranks of the synthetic run (default 64)")
    ap.add_argument("--steps", type=int, default=1000, help="steps of the synthetic run (default 1000)")
    ap.add_argument("--repeats", type=int, default=3, help="server starts per case (the median is printed)")
    args = ap.parse_args()
    from dtprobe.dashboard.data import live_window_steps
    from dtprobe.store import compact
    from dtprobe.store.manifest import set_status

    print(f"machine: {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}; live window {live_window_steps()} steps")
    with tempfile.TemporaryDirectory() as tmp:
        live_root, done_root = Path(tmp) / "live", Path(tmp) / "finished"
        t = time.perf_counter()
        big = SyntheticRun(live_root / "big", num_ranks=args.ranks, straggler_rank=3)
        big.write_steps(args.steps)
        print(f"wrote {args.ranks} ranks x {args.steps} steps in {time.perf_counter() - t:.1f} s")
        shutil.copytree(live_root / "big", done_root / "big")
        set_status(done_root / "big", "finished")
        compact(done_root / "big")
        summary_store.make(done_root / "big")
        cases = [("live (running, newest steps)", lambda: server_to_overview_s(live_root, "big")),
                 ("finished (compacted, whole run)", lambda: server_to_overview_s(done_root, "big")),
                 ("floor: a one-metric Streamlit page", lambda: streamlit_floor_s(Path(tmp)))]
        times: dict[str, list[float]] = {label: [] for label, _ in cases}
        for _ in range(args.repeats):  # interleaved, so that a change in the machine's load hits every case
            for label, measure in cases:
                times[label].append(measure())
        for label, values in times.items():
            print(f"server start -> page drawn, {label}: median {statistics.median(values):.2f} s "
                  f"(runs: {', '.join(f'{x:.2f}' for x in values)})")
        floor = statistics.median(times[cases[2][0]])
        print(f"Overview vs the floor: live {statistics.median(times[cases[0][0]]) / floor:.2f}x, finished "
              f"{statistics.median(times[cases[1][0]]) / floor:.2f}x (goal: Overview drawn within 3 s)")
        lengths = sorted({max(1, args.steps // 10), args.steps, 3 * args.steps})
        for n in lengths:
            run = big if n == args.steps else SyntheticRun(Path(tmp) / f"run{n}", num_ranks=args.ranks,
                                                          straggler_rank=3)
            if run is not big:
                run.write_steps(n)
            costs = [refresh_cost_s(run) for _ in range(args.repeats)]
            tail = statistics.median(c[0] for c in costs)
            whole = statistics.median(c[1] for c in costs)
            print(f"live refresh after one more step, run of {n} steps: store tail {tail * 1e3:.0f} ms, "
                  f"whole refresh (tail + window analysis) {whole * 1e3:.0f} ms")


if __name__ == "__main__":
    main()
