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
- live refresh: one refresh of the Overview after one more step (``dtprobe.dashboard.data.live_overview``, what the
  live page calls): until it is shown (the previous Overview at once while a slow re-analysis runs in the
  background) and until the new rows are analyzed (tail the new lines, re-analyze the window, summarize it), for
  runs of 100, 1,000 and 3,000 steps.

    python benchmarks/dashboard_load.py [--ranks 64] [--steps 1000] [--repeats 3]

With ``--pages``, per page instead (issue 17, item 4): a tp8 x dp run of ``--ranks`` ranks and ``--steps`` steps
(``benchmarks/scale_data.py``: 100 collectives per step per rank, one planted straggler, finished, compacted and
its summary stored, as `dtprobe run` leaves it) beside the same run at 64 ranks, served by one server; for each run
and page, the time from navigating to the page until it is drawn (the Overview is drawn from the stored summary;
the first other page of a run pays for the run's analysis, which the server then keeps), and from a widget change
until it is redrawn: choosing the run in the run picker while the page shows the other run, and on the Timeline
moving its step window; with the kilobytes the server sent the browser for each (its elements and figures).
``--one-host`` writes every rank on one host; ``--root DIR`` measures the runs already in DIR instead (e.g. the
1,024-rank run `scale.py --keep` leaves, moved into a folder of its own).

    python benchmarks/dashboard_load.py --ranks 1024 --steps 20 --pages overview,stragglers,timeline,communication
    python benchmarks/dashboard_load.py --root /tmp/h23/root --pages overview,stragglers,timeline,communication,devices

It measures the dtprobe installed in this checkout (``pip install -e .``): the server it starts imports the same.
Goals: the Overview drawn within 3 s of the server's start; a live refresh shown within 200 ms that does not grow
with the run.
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
from dtprobe.dashboard.nav import PAGES
from dtprobe.dashboard.paths import ROOT_ENV, Source
from dtprobe.synthetic import SyntheticRun
from serving import wait_until_healthy

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
            wait_until_healthy(port, proc, errors, name=f"the server ({' '.join(argv)})")
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


def refresh_cost_s(run: SyntheticRun) -> tuple[float, float, float]:
    """(store tail, refresh shown, new rows analyzed) seconds of one live Overview refresh after one more step:
    ``data.live_overview``, what the live page calls, shows the previous Overview at once while a slow
    re-analysis runs in the background (a fast one is waited for), then the wait until the new rows are analyzed."""
    from dtprobe.dashboard import data

    source = Source(name=run.run_dir.name, path=run.run_dir.resolve(), kind="run")
    data.live_overview(source)
    data.wait_for_refresh(source)   # a large run's first analysis runs behind: its store is open once it is done
    run.write_steps(1)
    store = data.open_store(source)
    t0 = time.perf_counter()
    store.refresh()
    t1 = time.perf_counter()
    data.live_overview(source)   # the tailed step is analyzed, as the page's next refresh would
    data.wait_for_refresh(source)
    run.write_steps(1)
    t2 = time.perf_counter()
    data.live_overview(source)
    t3 = time.perf_counter()
    data.wait_for_refresh(source)
    return t1 - t0, t3 - t2, time.perf_counter() - t2


PAGE_TITLES = {page.url_path: page.title for page in PAGES if page.url_path != "planner"}
"""The pages ``--pages`` can time (a run's pages: not the Planner's form)."""
PAGE_PATHS = {"overview": ""}
"""URL paths that are not the page's name (the Overview is the app's default page, served at the root)."""
PAGE_DRAWN = DRAWN_JS % """!!q("[data-testid=stSelectbox]") && !q("[data-testid=stSkeleton]")
    && new URLSearchParams(location.search).get("run") === %s
    && [...document.querySelectorAll("h1")].some((h) => h.innerText.trim() === %s)
    && [...document.querySelectorAll("[data-testid=stPlotlyChart]")].every((c) => !!c.querySelector(".main-svg"))"""
"""A page of ``--pages`` drawn for a run: run picker, the page's title, every plotly chart drawn, no script running
and the URL naming the run (so a widget change is done only once the page shows the run it asked for)."""


def write_scale_run(run_dir: Path, ranks: int, steps: int, *, one_host: bool) -> float:
    """Write a finished, compacted tp8 x dp run (``benchmarks/scale_data.py``) with every rank on one host when
    ``one_host``; seconds taken."""
    import scale_data
    from dtprobe.store import compact
    from dtprobe.store.manifest import write_rank_info

    t = time.perf_counter()
    spec = scale_data.ScaleRunSpec(world=ranks, steps=steps, straggler_rank=scale_data.default_straggler(ranks))
    scale_data.write_run(run_dir, spec, status="finished")
    scale_data.sidecar_path(run_dir).unlink()  # beside the run, a .json that would make the root a trace folder
    if one_host:
        for rank in range(ranks):
            write_rank_info(run_dir, rank, host="node0", node_rank=0, local_rank=rank, device=f"cuda:{rank % 8}",
                            pid=10_000 + rank, clock_offset_ns=0, device_name="NVIDIA H100 80GB HBM3")
    compact(run_dir)
    took = time.perf_counter() - t
    t = time.perf_counter()
    finish_as_dtprobe_run(run_dir)
    print(f"  {ranks} ranks: derived tables, analysis and stored summary made in {time.perf_counter() - t:.1f} s",
          flush=True)
    return took


def finish_as_dtprobe_run(run_dir: Path) -> None:
    """What `dtprobe run` does after the launcher compacted a finished run: add the analysis' derived per-step
    tables (the pages read lateness, exposure and waits from them) and store the Overview, by the same call."""
    from rich.console import Console

    from dtprobe.commands.compact import store_summary

    if store_summary(run_dir, console=Console(stderr=True)) is None:
        raise SystemExit(f"{run_dir}: no summary stored (see above)")


def measure_pages(root: Path, runs: list[str], pages: list[str]) -> dict[tuple[str, str, str], float]:
    """{(run, page, "draw" | "picker" | "steps"): seconds} on one server over ``root`` and one browser: each run's
    pages in order (navigation to drawn), then per page a run-picker change to each run (and on the Timeline a step
    window change)."""
    from playwright.sync_api import sync_playwright

    port = _port()
    env = dict(os.environ, **{ROOT_ENV: str(root), summary_store.CACHE_ENV: str(root.parent / "user-cache")})
    url = f"http://127.0.0.1:{port}"
    out: dict[tuple[str, str, str], float] = {}
    errors = tempfile.TemporaryFile()
    proc = subprocess.Popen(streamlit_argv(host="127.0.0.1", port=port), env=env, cwd=APP.parent,
                            stdout=subprocess.DEVNULL, stderr=errors, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                urllib.request.urlopen(f"{url}/_stcore/health", timeout=1)
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    errors.seek(0)
                    raise SystemExit("the dashboard server did not start:\n"
                                     + errors.read().decode(errors="replace")[-2000:])
                time.sleep(0.1)
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path="/usr/bin/chromium", args=["--no-sandbox", "--disable-gpu"])
            page = browser.new_page(viewport={"width": 1500, "height": 1100})

            def wait(run: str, name: str) -> None:
                drawn = PAGE_DRAWN.replace("%s", repr(run), 1).replace("%s", repr(PAGE_TITLES[name]), 1)
                try:
                    page.wait_for_function(drawn, polling="raf", timeout=600_000)
                except Exception:
                    if proc.poll() is not None:
                        errors.seek(0)
                        raise SystemExit(f"the dashboard server exited with {proc.returncode} on {run}/{name}:\n"
                                         + errors.read().decode(errors="replace")[-2000:])
                    raise

            received = [0]   # bytes the server sent over the page's WebSocket (the page's elements, figures)
            page.on("websocket", lambda ws: ws.on("framereceived", lambda payload: received.__setitem__(
                0, received[0] + len(payload))))

            def step_window(run: str) -> None:
                """Move the Timeline's step window one step left; time until the Gantt is redrawn."""
                thumb = page.get_by_role("slider").first
                before = page.locator("[data-testid=stPlotlyChart] .main-svg").first.inner_html()
                thumb.focus()
                received[0] = 0
                t = time.perf_counter()
                page.keyboard.press("ArrowLeft")
                page.wait_for_function(
                    "(before) => { const s = document.querySelector('[data-testid=stPlotlyChart] .main-svg');"
                    " return !!s && s.innerHTML !== before"
                    " && !document.querySelector('[data-testid=stStatusWidget]'); }",
                    arg=before, polling="raf", timeout=600_000)
                out[(run, "timeline", "steps")] = time.perf_counter() - t
                out[(run, "timeline", "steps_kb")] = received[0] / 1e3

            for run in runs:
                for name in pages:
                    received[0] = 0
                    t = time.perf_counter()
                    page.goto(f"{url}/{PAGE_PATHS.get(name, name)}?run={run}", wait_until="commit")
                    wait(run, name)
                    out[(run, name, "draw")] = time.perf_counter() - t
                    out[(run, name, "draw_kb")] = received[0] / 1e3
                    print(f"  {run} {name}: drawn in {out[(run, name, 'draw')]:.2f} s "
                          f"({received[0] / 1e3:,.0f} kB sent)", flush=True)
                    if name == "timeline":
                        step_window(run)
                        print(f"  {run} timeline: step window moved, redrawn in "
                              f"{out[(run, name, 'steps')]:.2f} s", flush=True)
            for name in pages if len(runs) > 1 else []:  # a widget change picks the other run
                for run in runs:
                    other = next(r for r in runs if r != run)
                    page.goto(f"{url}/{PAGE_PATHS.get(name, name)}?run={other}", wait_until="commit")
                    wait(other, name)
                    t = time.perf_counter()
                    option = page.get_by_role("option", name=run, exact=True)
                    for _ in range(5):  # a click landing while the page settles may not open the list
                        page.get_by_test_id("stSidebar").get_by_role("combobox").click()
                        try:
                            option.wait_for(state="visible", timeout=2_000)
                            break
                        except Exception:
                            page.keyboard.press("Escape")
                    option.click()
                    wait(run, name)
                    out[(run, name, "picker")] = time.perf_counter() - t
            browser.close()
    finally:
        proc.terminate()
        proc.wait(20)
        errors.close()
    return out


def pages_main(args) -> None:
    """``--pages``: per page draw and widget-change times, the 64-rank run and the ``--ranks`` run side by side."""
    pages = [p.strip() for p in args.pages.split(",") if p.strip()]
    unknown = [p for p in pages if p not in PAGE_TITLES]
    if unknown:
        raise SystemExit(f"--pages: unknown page(s) {', '.join(unknown)}; choose from {', '.join(PAGE_TITLES)}")
    print(f"machine: {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        if args.root is not None:   # runs written before (e.g. `scale.py --keep`), each folder a run
            root = args.root.resolve()
            runs = sorted(p.name for p in root.iterdir() if (p / "run.json").is_file())
            if not runs:
                raise SystemExit(f"--root {root}: no run folder (with a run.json) in it")
        else:
            root = Path(tmp) / "runs"
            for n in sorted({64, args.ranks}):
                took = write_scale_run(root / f"r{n}", n, args.steps, one_host=args.one_host)
                print(f"wrote and compacted {n} ranks x {args.steps} steps x 100 collectives in {took:.1f} s",
                      flush=True)
            runs = [f"r{n}" for n in sorted({64, args.ranks})]
        times = measure_pages(root, runs, pages)
    width = 18
    print(f"\n{'page, time to':32s}" + "".join(f"{run:>{width}s}" for run in runs)
          + (f"{'ratio':>{width}s}" if len(runs) > 1 else ""))
    for name in pages:
        for what, label in (("draw", "navigation -> drawn"), ("draw_kb", "  kB sent"),
                            ("picker", "run picked -> redrawn"), ("steps", "step window -> redrawn"),
                            ("steps_kb", "  kB sent")):
            values = [times.get((r, name, what)) for r in runs]
            if all(v is None for v in values):
                continue
            unit = "" if what.endswith("_kb") else " s"
            row = "".join(f"{v:>{width - len(unit)},.2f}{unit}" if v is not None else f"{'-':>{width}s}"
                          for v in values)
            ratio = (f"{values[-1] / values[0]:>{width - 1}.1f}x" if len(values) > 1 and values[0] else "")
            print(f"{name + ': ' + label:32s}{row}{ratio}")
    print("Goals at 1,024 ranks: each page drawn within 3 s, a widget change redrawn within 1 s (the run's first "
          "page also pays for its analysis).")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", type=int, default=64, help="ranks of the synthetic run (default 64)")
    ap.add_argument("--steps", type=int, default=1000, help="steps of the synthetic run (default 1000)")
    ap.add_argument("--repeats", type=int, default=3, help="server starts per case (the median is printed)")
    ap.add_argument("--pages", default=None,
                    help=f"comma-separated pages ({','.join(PAGE_TITLES)}): time each page's draw "
                         "and widget changes on a tp8 x dp run of --ranks beside one of 64 ranks, instead of the "
                         "server-start benchmark")
    ap.add_argument("--root", type=Path, default=None,
                    help="with --pages: measure the runs already in this folder (e.g. a `scale.py --keep` run moved "
                         "into one) instead of writing them")
    ap.add_argument("--one-host", action="store_true",
                    help="with --pages: every rank on one host (no cross-node links to analyze)")
    args = ap.parse_args()
    if args.pages is not None:
        return pages_main(args)
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
        finish_as_dtprobe_run(done_root / "big")
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
            tail, shown, whole = (statistics.median(c[i] for c in costs) for i in range(3))
            print(f"live refresh after one more step, run of {n} steps: store tail {tail * 1e3:.0f} ms, "
                  f"refresh shown {shown * 1e3:.0f} ms, new rows analyzed (tail + window analysis) "
                  f"{whole * 1e3:.0f} ms (goal: shown <= 200 ms)")


if __name__ == "__main__":
    main()
