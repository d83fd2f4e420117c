"""dtprobe at cluster scale (issue 17, item 5): synthetic tp8 x dp runs of 100 collectives per step per rank (60 on
tp, 40 on dp groups) at several world sizes, and a foreign Kineto trace set, timed phase by phase.

    python benchmarks/scale.py [--ranks 64 256 1024] [--steps 200] [--traces 64x50] [--browser] [--json scale.json]
    python benchmarks/scale.py --ranks 1024 --traces none --phases live      # the write and the live Overview only
    python benchmarks/scale.py --ranks --traces 64x50 --trace-layout dp --trace-seq   # a pure dp trace set with Seq
    PYTHONPATH=/path/to/old/checkout python benchmarks/scale.py ...     # the same figures for another dtprobe

Per world size (data written by ``benchmarks/scale_data.py``; every phase runs in a fresh process, whose peak
memory is reported: ``ru_maxrss`` of that process and, when larger, the sampled sum of RSS over it and its
children):
- write: the run's events (a fast path in the documented store format) while the run is ``running``;
- open events: ``RunStore.open`` of the running run's JSONL events (every table);
- live: one step appended to every rank's events (starting about now, so the run looks alive), the dashboard's
  Overview of the running run (``dtprobe.dashboard.data.live_overview``, what the live page calls: its newest
  ``DTPROBE_LIVE_WINDOW`` steps) the first time, until drawn (the steps' key figures alone when the analysis takes
  longer) and until analyzed, then one more step appended and the refresh timed: until it is shown (a slow
  re-analysis runs in the background meanwhile: the steps' key figures of now beside the previous findings; the
  goal row counts it only when the new step is among them) and until the new rows are analyzed (store tail +
  Overview);
- compact: what ``dtprobe compact`` does once the run is ``finished`` (``dtprobe.store.compact`` with the
  analysis's derived per-step tables, where the dtprobe measured has them); disk bytes per rank-step of the events
  and of ``tables/``;
- open: ``RunStore.open`` of the compacted run;
- analyze: what ``dtprobe analyze --format json`` does (``open_source``, ``RunAnalysis.report``,
  ``render_json``), and whether a STRAGGLER finding names the planted rank;
- overview: what the Overview page computes of a finished run without a stored summary, in-process: until first
  drawn (``data.finished_overview``: a large run's steps' key figures while it is analyzed in the background) and
  until analyzed (its summary made and stored);
- with ``--browser``: `dtprobe dashboard` started on the finished run without a stored summary, to its Overview
  drawn in Chromium (Playwright, ``/usr/bin/chromium``; the browser open and idle before the server starts): first
  drawn (key figures) and whole (the STRAGGLER finding shown).
Growth exponent between consecutive sizes: log(t2 / t1) / log(n2 / n1) (1.0: linear in the ranks).

The trace set (``--traces RANKSxMB``, e.g. 64x50; ``--traces none`` skips it; its groups by ``--trace-layout``,
one of ``scale_data.TRACE_LAYOUTS``, and with ``--trace-seq`` each collective's ``Seq`` arg): written once, then
``dtprobe analyze``'s work and HTA 0.5.0's (load, temporal breakdown, comm/comp overlap, kernel breakdown, as
``benchmarks/analysis_vs_hta.py``) side by side, on the first 16 files and on all of them (peak memory against the
raw JSON: flat in the number of ranks?). HTA's memory is predicted from its peak on the smaller subset (7x the raw
JSON before any measurement): when the larger one would not fit in ``--hta-mem-gb`` it runs on as many files as
fit and its time is scaled to all of them, which the output says.

A phase that exceeds ``--timeout-s`` or ``--mem-cap-gb`` is stopped and reported as "did not finish"; the sizes
after it still run. Goals (issue 17): 1,024 ranks x 200 steps analyzed in <= 10 s with <= 4 GB peak, growth
exponent <= 1.0 from 64 to 1,024 ranks; the Overview first drawn <= 3 s and a live refresh <= 200 ms at
that size; on the trace set, peak memory <= 0.5x the raw JSON, flat in the ranks, and at least 9x HTA's speed.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

HTA_MEMORY_PER_RAW_BYTE = 7.0
"""HTA's peak memory per byte of raw JSON assumed until it was measured on the set (6-7x on the shared traces)."""
HTA_MARGIN = 1.25
"""Head room on HTA's predicted memory when choosing how many files it runs on."""
FLAT_RANKS = 16
"""The smaller trace subset peak memory is compared at."""


def bind_checkout_packages() -> Path:
    """Import ``dtprobe.dashboard`` and ``dtprobe.collectors`` from the checkout ``dtprobe`` itself comes from, and
    return that checkout. They are top-level folders of a checkout that pyproject maps into ``dtprobe``; under
    ``PYTHONPATH=<another checkout>`` plain imports would find ``dtprobe`` there but these two in the installed
    dtprobe. A dtprobe installed from a wheel has them inside ``dtprobe/`` and is left as it is."""
    import importlib.util

    import dtprobe

    root = Path(dtprobe.__file__).resolve().parent.parent
    for name in ("dashboard", "collectors"):
        folder, full = root / name, f"dtprobe.{name}"
        if full in sys.modules or not (folder / "__init__.py").is_file():
            continue
        spec = importlib.util.spec_from_file_location(full, folder / "__init__.py",
                                                      submodule_search_locations=[str(folder)])
        module = importlib.util.module_from_spec(spec)
        sys.modules[full] = module
        setattr(dtprobe, name, module)
        spec.loader.exec_module(module)
    return root


# ---------------------------------------------------------------------------------------------- child phases
# Each runs in a fresh interpreter (``scale.py --child PHASE ARGS_JSON``) and returns a dict of figures; its last
# stdout line is that dict as JSON.

def phase_write(a: dict) -> dict:
    from scale_data import ScaleRunSpec, events_bytes, write_run

    spec = ScaleRunSpec(world=a["ranks"], steps=a["steps"], straggler_rank=a["straggler"])
    t = time.perf_counter()
    write_run(a["run"], spec, workers=a["workers"], status="running")
    seconds = time.perf_counter() - t
    return {"seconds": seconds, "events_bytes": events_bytes(a["run"])}


def phase_open(a: dict) -> dict:
    from dtprobe.store import RunStore

    t = time.perf_counter()
    store = RunStore.open(a["run"])
    seconds = time.perf_counter() - t
    return {"seconds": seconds, "rows": {k: int(v) for k, v in store.num_rows().items()}}


def phase_live(a: dict) -> dict:
    from scale_data import append_step

    from dtprobe.dashboard import data
    from dtprobe.dashboard.paths import Source

    source = Source(name=Path(a["run"]).name, path=Path(a["run"]).resolve(), kind="run")
    append_step(a["run"], at_ns=time.time_ns() - 1_000_000_000)   # the run is alive: its newest step is recent
    t = time.perf_counter()
    first = data.live_overview(source)    # the live page's first draw (the steps' figures while a slow analysis runs)
    first_s = time.perf_counter() - t
    data.wait_for_refresh(source)
    analyzed_s = time.perf_counter() - t  # the window analyzed: its findings drawn by the next refresh
    append_step(a["run"], at_ns=time.time_ns() - 1_000_000_000)
    t = time.perf_counter()
    shown = data.live_overview(source)           # the refresh: the previous Overview while a slow analysis runs behind
    seen_s = time.perf_counter() - t
    data.wait_for_refresh(source)
    refresh_s = time.perf_counter() - t          # until the new rows are analyzed (the next refresh shows them)
    again = data.live_overview(source).value
    return {"first_s": first_s, "first_pending": first.pending, "analyzed_s": analyzed_s, "seen_s": seen_s,
            "refresh_s": refresh_s, "behind": shown.updating, "window": first.value.window,
            "seen_steps": shown.value.num_steps, "num_steps": again.num_steps,
            "findings": [[f.code, list(f.ranks)] for f in again.findings]}


def phase_compact(a: dict) -> dict:
    from dtprobe.store import compact
    try:        # dtprobe compact's derived tables (older checkouts have none)
        from dtprobe.analysis.derived_tables import deriver
        options = {"derive": deriver()}
    except ImportError:
        options = {}

    t = time.perf_counter()
    rows = compact(a["run"], **options)
    seconds = time.perf_counter() - t
    tables = Path(a["run"]) / "tables"
    return {"seconds": seconds, "rows": {k: int(v) for k, v in rows.items()},
            "tables_bytes": sum(p.stat().st_size for p in tables.rglob("*") if p.is_file())}


def _analyze(path: str) -> tuple[float, dict]:
    """What ``dtprobe analyze PATH --format json`` does, timed; the report as JSON data."""
    from dtprobe.analysis.facade import AnalysisOptions, RunAnalysis, open_source
    from dtprobe.analysis.render import render_json

    t = time.perf_counter()
    source = open_source(path)
    report = RunAnalysis(source, options=AnalysisOptions()).report()
    text = render_json(report)
    return time.perf_counter() - t, json.loads(text)


def phase_analyze(a: dict) -> dict:
    seconds, report = _analyze(a["path"])
    findings = [{"code": f["code"], "ranks": f.get("ranks"), "group": f.get("group"), "title": f.get("title")}
                for f in report["findings"]]
    return {"seconds": seconds, "findings": findings}


def phase_overview(a: dict) -> dict:
    from dtprobe.dashboard import data
    from dtprobe.dashboard.paths import Source

    source = Source(name=Path(a["run"]).name, path=Path(a["run"]).resolve(), kind="run")
    t, started = time.perf_counter(), time.time()
    first = data.finished_overview(source)   # what the page draws first: the steps' figures while it is analyzed
    drawn_s = time.perf_counter() - t
    data.wait_for_refresh(source)
    overview = data.load_overview(source)
    seconds = time.perf_counter() - t
    return {"seconds": seconds, "drawn_s": drawn_s, "drawn_pending": first.pending,
            "stored_summary": overview.made_s < started, "whole": overview.whole,
            "num_steps": overview.num_steps,
            "findings": [[f.code, list(f.ranks)] for f in overview.findings]}


def phase_write_traces(a: dict) -> dict:
    from scale_data import TraceSetSpec, trace_files, write_trace_set

    spec = TraceSetSpec(ranks=a["ranks"], mb_per_rank=a["mb"], steps=a["steps"], gzip=a["gzip"],
                        layout=a["layout"], seq=a["seq"])
    t = time.perf_counter()
    raw = write_trace_set(a["dir"], spec, workers=a["workers"])
    seconds = time.perf_counter() - t
    return {"seconds": seconds, "raw_bytes": raw, "disk_bytes": [p.stat().st_size for p in trace_files(a["dir"])]}


def phase_hta(a: dict) -> dict:
    import logging
    import warnings

    warnings.simplefilter("ignore")
    t = time.perf_counter()
    from hta.common.trace import Trace
    from hta.trace_analysis import TraceAnalysis

    logging.disable(logging.WARNING)
    # TraceAnalysis(dir, include_last_profiler_step=True) without the extra tracemalloc parse of the first file
    # HTA makes for > 8 ranks (left out so that the comparison does not favour dtprobe)
    analysis = TraceAnalysis.__new__(TraceAnalysis)
    analysis.t = Trace(trace_dir=a["path"])
    analysis.t.load_traces(include_last_profiler_step=True, use_memory_profiling=False)
    analysis.get_temporal_breakdown(visualize=False)
    analysis.get_comm_comp_overlap(visualize=False)
    analysis.get_gpu_kernel_breakdown(visualize=False)
    return {"seconds": time.perf_counter() - t, "num_ranks": len(analysis.t.traces)}


DRAWN_JS = """() => {
  const q = (selector) => document.querySelector(selector);
  if (document.fonts.status !== "loaded" || q("[data-testid=stStatusWidget]")) return false;  // fonts; script done
  return !!q("[data-testid=stMetricValue]") && document.body.innerText.includes("STRAGGLER");
}"""
"""The Overview is drawn whole: fonts loaded, no script running, its key figures and the STRAGGLER finding shown
(checked in the page at every animation frame)."""
FIRST_DRAWN_JS = DRAWN_JS.replace(' && document.body.innerText.includes("STRAGGLER")', "")
"""The Overview is first drawn: its key figures (a large run's findings may follow)."""


def phase_browser(a: dict) -> dict:
    """Seconds from starting the `dtprobe dashboard` server on the run until Chromium (open and idle before) shows
    its Overview drawn; no stored summary (a fresh per-user cache), as ``benchmarks/dashboard_load.py`` does."""
    import socket

    from playwright.sync_api import sync_playwright

    from dtprobe.commands.dashboard import APP, streamlit_argv
    from dtprobe.dashboard.paths import ROOT_ENV
    from serving import wait_until_healthy

    served = subprocess.run([sys.executable, "-c", "import dtprobe.dashboard as d; print(d.__file__)"],
                            capture_output=True, text=True, timeout=60).stdout.strip()
    if Path(served).resolve().parent != APP.parent.resolve():
        raise SystemExit(f"not the checkout measured: the server would import {served}, not {APP.parent}; "
                         f"pip install -e that checkout to draw its dashboard")

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, **{ROOT_ENV: a["run"]}, XDG_CACHE_HOME=a["cache"])
    with sync_playwright() as p, tempfile.TemporaryFile() as errors:
        browser = p.chromium.launch(executable_path="/usr/bin/chromium", args=["--no-sandbox", "--disable-gpu"])
        page = browser.new_page()
        time.sleep(1.0)   # a browser that is open already, as the user's is: not still starting
        t0 = time.perf_counter()
        # in this process's group: a phase stopped for its time or memory takes the server with it
        proc = subprocess.Popen(streamlit_argv(host="127.0.0.1", port=port), env=env, cwd=APP.parent,
                                stdout=subprocess.DEVNULL, stderr=errors)
        try:
            wait_until_healthy(port, proc, errors, name="the dashboard server", tail_chars=1000)
            page.goto(f"http://127.0.0.1:{port}/", wait_until="commit")
            page.wait_for_function(FIRST_DRAWN_JS, polling="raf", timeout=a["timeout_s"] * 1000)
            drawn_s = time.perf_counter() - t0
            page.wait_for_function(DRAWN_JS, polling="raf", timeout=a["timeout_s"] * 1000)
            seconds = time.perf_counter() - t0
        finally:
            proc.terminate()
            proc.wait(20)
            browser.close()
    return {"seconds": seconds, "drawn_s": drawn_s}


PHASES = {"write": phase_write, "open": phase_open, "live": phase_live, "compact": phase_compact,
          "analyze": phase_analyze, "overview": phase_overview, "browser": phase_browser,
          "write_traces": phase_write_traces, "hta": phase_hta}


# ---------------------------------------------------------------------------------------------- the parent

@dataclass
class Outcome:
    """One phase run in its own process."""

    ok: bool
    figures: dict = field(default_factory=dict)
    wall_s: float = 0.0
    """Wall time of the process (with interpreter start and imports)."""
    maxrss_bytes: int = 0
    """``ru_maxrss`` of the process (the largest of it and the children it waited for)."""
    tree_peak_bytes: int = 0
    """Largest sampled sum of RSS over the process and its children."""
    why: str | None = None
    """Why it did not finish."""

    @property
    def peak_bytes(self) -> int:
        return max(self.maxrss_bytes, self.tree_peak_bytes)

    def to_dict(self) -> dict:
        return {"ok": self.ok, **self.figures, "wall_s": round(self.wall_s, 3), "maxrss_bytes": self.maxrss_bytes,
                "tree_peak_bytes": self.tree_peak_bytes, "peak_bytes": self.peak_bytes, "why": self.why}


def run_phase(phase: str, args: dict, *, label: str, timeout_s: float, mem_cap_bytes: int, env: dict) -> Outcome:
    """Run ``phase`` in a fresh interpreter; stop it past ``timeout_s`` or ``mem_cap_bytes`` (sampled RSS of its
    process tree); show its elapsed time and memory while it runs."""
    import psutil

    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        t0 = time.perf_counter()
        proc = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--child", phase, json.dumps(args)],
                                stdout=out, stderr=err, env=env, start_new_session=True)
        root = psutil.Process(proc.pid)
        tree_peak, why, status, usage, last_shown = 0, None, None, None, 0.0
        try:
            while True:
                pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
                if pid:
                    break
                try:
                    rss = sum(p.memory_info().rss for p in [root, *root.children(recursive=True)])
                    tree_peak = max(tree_peak, rss)
                except psutil.Error:
                    rss = 0
                elapsed = time.perf_counter() - t0
                if why is None and elapsed > timeout_s:
                    why = f"timeout {timeout_s:g} s"
                elif why is None and tree_peak > mem_cap_bytes:
                    why = f"memory above {mem_cap_bytes / 2**30:g} GB"
                if why is not None:
                    _kill_group(proc.pid)
                if sys.stderr.isatty() and elapsed - last_shown >= 2.0:
                    print(f"\r  {label}: {elapsed:.0f} s, {rss / 2**30:.2f} GB ", end="", file=sys.stderr,
                          flush=True)
                    last_shown = elapsed
                time.sleep(0.05)
        except BaseException:   # Ctrl-C: the phase runs in its own session, so stop it here
            _kill_group(proc.pid)
            raise
        wall = time.perf_counter() - t0
        proc.returncode = os.waitstatus_to_exitcode(status)
        state = f"stopped, {why}" if why else "done" if proc.returncode == 0 else f"failed (exit {proc.returncode})"
        print(f"\r  {label}: {state} after {wall:.1f} s{' ' * 20}", file=sys.stderr, flush=True)
        outcome = Outcome(ok=False, wall_s=wall, maxrss_bytes=usage.ru_maxrss * 1024, tree_peak_bytes=tree_peak)
        if why is not None:
            outcome.why = why
            return outcome
        out.seek(0)
        lines = out.read().decode(errors="replace").strip().splitlines()
        if proc.returncode != 0 or not lines:
            err.seek(0)
            tail = err.read().decode(errors="replace").strip().splitlines()[-3:]
            outcome.why = " | ".join(tail[::-1]) + f" (exit code {proc.returncode})"   # the error's message first
            return outcome
        outcome.ok, outcome.figures = True, json.loads(lines[-1])
        return outcome


def _kill_group(pid: int) -> None:
    """SIGKILL a phase's process group (the phase and every process it started)."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, signal.SIGKILL)


def growth(sizes: list[int], values: list[float | None]) -> list[float | None]:
    """log(v2 / v1) / log(n2 / n1) between consecutive sizes (None where either value is missing)."""
    out = []
    for (n1, v1), (n2, v2) in zip(zip(sizes, values), zip(sizes[1:], values[1:])):
        out.append(math.log(v2 / v1) / math.log(n2 / n1) if v1 and v2 and n2 != n1 else None)
    return out


RUN_PHASES = (("write", "write"), ("open_events", "open (events)"), ("live_first", "Overview first drawn, live"),
              ("live_analyzed", "Overview first analyzed, live"), ("live_seen", "live refresh shown"),
              ("live_refresh", "live refresh, new rows analyzed"), ("compact", "compact"), ("open", "open (compacted)"),
              ("analyze", "analyze"), ("overview_drawn", "Overview first drawn, finished"),
              ("overview", "Overview first analyzed, finished"), ("browser_drawn", "server start -> Overview drawn"),
              ("browser", "server start -> findings shown"))


RUN_PHASE_GROUPS = ("open_events", "live", "finished")
"""What ``--phases`` chooses among, after the write."""


def bench_run(ranks: int, cli: argparse.Namespace, env: dict, workdir: Path) -> dict:
    """Every phase at one world size; the figures as JSON data. The run is removed after it unless ``--keep``."""
    run = workdir / f"run{ranks}"
    try:
        return _bench_run(run, ranks, cli, env, workdir)
    finally:
        if not cli.keep:
            shutil.rmtree(run, ignore_errors=True)
            (workdir / f"run{ranks}.scale.json").unlink(missing_ok=True)


def _bench_run(run: Path, ranks: int, cli: argparse.Namespace, env: dict, workdir: Path) -> dict:
    from scale_data import default_straggler

    from dtprobe.store.manifest import set_status

    straggler = default_straggler(ranks)
    common = dict(timeout_s=cli.timeout_s, mem_cap_bytes=int(cli.mem_cap_gb * 2**30), env=env)
    res: dict = {"ranks": ranks, "steps": cli.steps, "straggler_rank": straggler,
                 "collective_rows": ranks * cli.steps * 100, "phases": {}}
    phases = res["phases"]
    print(f"{ranks} ranks x {cli.steps} steps ({ranks * cli.steps * 100:,} collective rows), straggler rank "
          f"{straggler}", file=sys.stderr)
    w = run_phase("write", {"run": str(run), "ranks": ranks, "steps": cli.steps, "straggler": straggler,
                            "workers": cli.workers}, label="write", **common)
    phases["write"] = w.to_dict()
    if not w.ok:
        return res
    res["events_bytes_per_rank_step"] = w.figures["events_bytes"] / (ranks * cli.steps)
    if "open_events" in cli.phases:
        phases["open_events"] = run_phase("open", {"run": str(run)}, label="open events", **common).to_dict()
    if "live" in cli.phases:
        live = run_phase("live", {"run": str(run)}, label="live Overview", **common)
        phases["live_first"] = {**live.to_dict(), "seconds": live.figures.get("first_s")}
        phases["live_analyzed"] = {"ok": live.ok, "seconds": live.figures.get("analyzed_s"), "why": live.why}
        phases["live_seen"] = {"ok": live.ok, "seconds": live.figures.get("seen_s"),
                               "behind": live.figures.get("behind"), "why": live.why,
                               "new_step_shown": live.figures.get("seen_steps") == live.figures.get("num_steps")}
        phases["live_refresh"] = {"ok": live.ok, "seconds": live.figures.get("refresh_s"), "why": live.why}
    if "finished" not in cli.phases:
        return res
    set_status(run, "finished")
    c = run_phase("compact", {"run": str(run)}, label="compact", **common)
    phases["compact"] = c.to_dict()
    if c.ok:   # the run now also holds the steps the live phase appended
        res["tables_bytes_per_rank_step"] = c.figures["tables_bytes"] / c.figures["rows"]["steps"]
    phases["open"] = run_phase("open", {"run": str(run)}, label="open compacted", **common).to_dict()
    an = run_phase("analyze", {"path": str(run)}, label="analyze", **common)
    phases["analyze"] = an.to_dict()
    if an.ok:
        named = [f for f in an.figures["findings"] if f["code"] == "STRAGGLER" and straggler in (f["ranks"] or [])]
        res["straggler_named"] = bool(named)
        res["straggler_titles"] = [f["title"] for f in named]
    ov = run_phase("overview", {"run": str(run)}, label="Overview first", **common)
    phases["overview_drawn"] = {**ov.to_dict(), "seconds": ov.figures.get("drawn_s")}
    phases["overview"] = ov.to_dict()
    if cli.browser:
        cache = workdir / f"cache-browser{ranks}"
        br = run_phase("browser", {"run": str(run), "cache": str(cache), "timeout_s": cli.timeout_s},
                       label="server start -> Overview drawn", **common)
        phases["browser_drawn"] = {**br.to_dict(), "seconds": br.figures.get("drawn_s")}
        phases["browser"] = br.to_dict()
        shutil.rmtree(cache, ignore_errors=True)
    return res


def trace_set_layout(layout: str, seq: bool) -> str:
    """``layout dp, Seq args``: how a trace set's collectives name their groups, for titles."""
    return f"layout {layout}, " + ("Seq args" if seq else "no Seq args (matched by order)")


def bench_traces(num_ranks: int, mb: float, cli: argparse.Namespace, env: dict, workdir: Path) -> dict:
    """The foreign trace set: written once; dtprobe analyze and HTA on subsets of it and on all of it."""
    from scale_data import trace_files

    common = dict(timeout_s=cli.timeout_s, mem_cap_bytes=int(cli.mem_cap_gb * 2**30), env=env)
    folder = workdir / f"traces{num_ranks}x{mb:g}"
    print(f"trace set: {num_ranks} ranks x {mb:g} MB, {trace_set_layout(cli.trace_layout, cli.trace_seq)}",
          file=sys.stderr)
    w = run_phase("write_traces", {"dir": str(folder), "ranks": num_ranks, "mb": mb, "steps": cli.trace_steps,
                                   "gzip": cli.trace_gzip, "layout": cli.trace_layout, "seq": cli.trace_seq,
                                   "workers": cli.workers}, label="write traces", **common)
    res: dict = {"ranks": num_ranks, "mb_per_rank": mb, "layout": cli.trace_layout, "seq": cli.trace_seq,
                 "write": w.to_dict(), "sizes": []}
    if not w.ok:
        return res
    files = trace_files(folder)
    file_bytes = w.figures["raw_bytes"]     # JSON text, before gzip (files are in rank order)
    hta_ratio = HTA_MEMORY_PER_RAW_BYTE    # until HTA was measured on this set
    for k in sorted({min(FLAT_RANKS, num_ranks), num_ranks}):
        raw = sum(file_bytes[:k])
        o = run_phase("analyze", {"path": str(_subset(folder, files, k, workdir))},
                      label=f"dtprobe analyze, {k} trace files", **common)
        size = {"ranks": k, "raw_bytes": raw, "dtprobe": o.to_dict(),
                "peak_over_raw": o.peak_bytes / raw if o.ok else None}
        res["sizes"].append(size)
        if cli.no_hta:
            continue
        fit = int(cli.hta_mem_gb * 2**30 // (HTA_MARGIN * hta_ratio * max(file_bytes)))
        run_k = max(1, min(k, fit))
        h = run_phase("hta", {"path": str(_subset(folder, files, run_k, workdir))},
                      label=f"HTA, {run_k} trace files", **common)
        run_raw = sum(file_bytes[:run_k])
        scaled = h.figures["seconds"] * k / run_k if h.ok else None
        size["hta"] = {**h.to_dict(), "ranks_run": run_k, "scaled_seconds": scaled, "scaled": run_k < k,
                       "peak_over_raw": h.peak_bytes / run_raw if h.ok else None}
        if h.ok:
            hta_ratio = max(h.peak_bytes / run_raw, 0.5)
            if o.ok:
                size["hta_over_dtprobe"] = scaled / o.figures["seconds"]
    if not cli.keep:
        for path in [folder, *workdir.glob(f"{folder.name}_first*")]:
            shutil.rmtree(path, ignore_errors=True)
    return res


def _subset(folder: Path, files: list[Path], k: int, workdir: Path) -> Path:
    """A folder of the first ``k`` trace files (symlinks), or the set itself when ``k`` is all of them."""
    if k == len(files):
        return folder
    sub = workdir / f"{folder.name}_first{k}"
    if not sub.exists():
        sub.mkdir()
        for f in files[:k]:
            (sub / f.name).symlink_to(f)
    return sub


# ---------------------------------------------------------------------------------------------- goals

FLAT_TOLERANCE = 1.25
"""Trace-set peak memory counts as flat when the whole set's is at most this many times the 16-file subset's."""


def _seconds(phase: dict | None) -> float | None:
    return phase.get("seconds") if phase and phase.get("ok") else None


def _goal(goal: str, value: float | None, limit: float, *, at_least: bool = False, unit: str = "",
          ran: bool = True) -> dict:
    """A goal judged: met when ``value`` is within ``limit``; not met when it ran and gave no value (did not
    finish); None when not measured (``ran`` False)."""
    if value is None:
        met = False if ran else None
    else:
        met = value >= limit if at_least else value <= limit
    shown = "did not finish" if value is None else f"{value:.2f}{unit}"
    return {"goal": goal, "value": value, "shown": shown, "met": met}


def goals(doc: dict) -> list[dict]:
    """Issue 17's goals, judged on the largest run measured (they are stated for 1,024 ranks x 200 steps) and on
    the trace set."""
    out = []
    runs = doc["runs"]
    if runs:
        big = runs[-1]
        at = f"at {big['ranks']} ranks x {big['steps']} steps"
        p = big["phases"]
        analyze = p.get("analyze") or {}
        if "analyze" in p:   # (not with --phases without finished)
            out.append(_goal(f"analyze {at} <= 10 s", _seconds(analyze), 10.0, unit=" s", ran=bool(analyze)))
            out.append(_goal(f"analyze peak memory {at} <= 4 GB",
                             analyze["peak_bytes"] / 1e9 if analyze.get("ok") else None, 4.0, unit=" GB",
                             ran=bool(analyze)))
        if len(runs) > 1 and "analyze" in p:
            first = runs[0]
            exp = growth([first["ranks"], big["ranks"]], [_seconds(first["phases"].get("analyze")),
                                                          _seconds(analyze)])[0]
            out.append(_goal(f"analyze growth exponent {first['ranks']} -> {big['ranks']} ranks <= 1.0", exp, 1.0,
                             ran=exp is not None))
        if "overview_drawn" in p:   # a large run's steps' key figures, drawn while it is analyzed
            out.append(_goal(f"Overview first drawn (finished run) {at} <= 3 s", _seconds(p["overview_drawn"]), 3.0,
                             unit=" s"))
        if "overview" in p:
            out.append(_goal(f"Overview first computation (finished run) {at} <= 3 s", _seconds(p["overview"]),
                             3.0, unit=" s"))
        if p.get("browser_drawn"):
            out.append(_goal(f"server start -> Overview drawn {at} <= 3 s", _seconds(p["browser_drawn"]), 3.0,
                             unit=" s"))
        if p.get("live_seen"):   # what the live page waits for: the new step's figures, the previous findings
            seen = p["live_seen"]
            goal = _goal(f"live refresh shown, the new step's figures in it {at} <= 200 ms", _seconds(seen), 0.2,
                         unit=" s")
            if not seen.get("new_step_shown", True):   # (a dtprobe that shows the previous Overview whole)
                goal.update(met=False, shown=f"{goal['shown']}, without the new step")
            out.append(goal)
        if "live_refresh" in p:
            out.append(_goal(f"live refresh {at} <= 200 ms", _seconds(p["live_refresh"]), 0.2, unit=" s"))
    tr = doc.get("traces")
    if tr and tr.get("sizes"):
        for size in tr["sizes"]:
            out.append(_goal(f"trace set, {size['ranks']} files: dtprobe peak memory <= 0.5x the raw JSON",
                             size["peak_over_raw"], 0.5, unit="x"))
        first, last = tr["sizes"][0], tr["sizes"][-1]
        if last is not first and first["dtprobe"]["ok"] and last["dtprobe"]["ok"]:
            out.append(_goal(f"trace set: dtprobe peak flat from {first['ranks']} to {last['ranks']} files "
                             f"(ratio <= {FLAT_TOLERANCE:g})",
                             last["dtprobe"]["peak_bytes"] / first["dtprobe"]["peak_bytes"], FLAT_TOLERANCE, unit="x"))
        if "hta" in last:
            out.append(_goal(f"trace set, {last['ranks']} files: HTA time / dtprobe time >= 9",
                             last.get("hta_over_dtprobe"), 9.0, at_least=True, unit="x",
                             ran=not last["dtprobe"]["ok"]))   # HTA not finishing leaves the ratio unknown
    return out


# ---------------------------------------------------------------------------------------------- output

def _fmt_s(v) -> str:
    return "did not finish" if v is None else f"{v:.2f}"


def _not_finished(phase: dict) -> str:
    """A table cell for a phase that did not finish (the whole reason is in --json)."""
    why = phase.get("why") or ""
    return "did not finish" + (f": {why[:70]}{'...' if len(why) > 70 else ''}" if why else "")


def print_tables(doc: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(width=160)
    runs = doc["runs"]
    if runs:
        table = Table(title=f"synthetic tp8 x dp runs, {doc['steps']} steps, 100 collectives per step per rank: "
                            f"seconds (peak GB)")
        table.add_column("phase")
        for r in runs:
            table.add_column(f"{r['ranks']} ranks", justify="right")
        sizes = [r["ranks"] for r in runs]
        for i in range(len(sizes) - 1):
            table.add_column(f"growth {sizes[i]}->{sizes[i + 1]}", justify="right")
        for key, label in RUN_PHASES:
            if all(r["phases"].get(key) is None for r in runs):
                continue      # a phase not asked for (--browser)
            cells, values = [], []
            for r in runs:
                p = r["phases"].get(key)
                v = p.get("seconds") if p and p.get("ok") else None
                values.append(v)
                peak = p.get("peak_bytes") if p else None
                cells.append("-" if p is None else (f"{v:.2f}" + (f" ({peak / 2**30:.2f})" if peak else ""))
                             if v is not None else _not_finished(p))
            exps = growth(sizes, values)
            table.add_row(label, *cells, *["-" if e is None else f"{e:.2f}" for e in exps])
        table.add_row("events bytes / rank-step",
                      *[f"{r['events_bytes_per_rank_step']:,.0f}" if "events_bytes_per_rank_step" in r else "-"
                        for r in runs], *[""] * (len(sizes) - 1))
        table.add_row("compacted bytes / rank-step",
                      *[f"{r['tables_bytes_per_rank_step']:,.0f}" if "tables_bytes_per_rank_step" in r else "-"
                        for r in runs], *[""] * (len(sizes) - 1))
        table.add_row("straggler named",
                      *[{True: f"yes (rank {r['straggler_rank']})", False: f"NO (rank {r['straggler_rank']})"}.get(
                          r.get("straggler_named"), "-") for r in runs], *[""] * (len(sizes) - 1))
        console.print(table)
    tr = doc.get("traces")
    if tr:
        table = Table(title=f"foreign Kineto trace set: {tr['ranks']} ranks x {tr['mb_per_rank']:g} MB, "
                            f"{trace_set_layout(tr['layout'], tr['seq'])} "
                            f"(written in {_fmt_s(tr['write'].get('seconds'))} s)")
        for col in ("tool", "trace files", "raw MB", "seconds", "peak GB", "peak / raw JSON"):
            table.add_column(col, justify="right")
        scaled_note = []
        for s in tr["sizes"]:
            d = s["dtprobe"]
            table.add_row("dtprobe analyze", str(s["ranks"]), f"{s['raw_bytes'] / 1e6:,.0f}",
                          _fmt_s(d.get("seconds")) if d["ok"] else _not_finished(d),
                          f"{d['peak_bytes'] / 2**30:.2f}", "-" if s["peak_over_raw"] is None
                          else f"{s['peak_over_raw']:.2f}")
            h = s.get("hta")
            if not h:
                continue
            secs = (f"{h['seconds']:.2f}" + (f" -> {h['scaled_seconds']:.1f} scaled to {s['ranks']} files"
                                              if h["scaled"] else "")) if h["ok"] else _not_finished(h)
            table.add_row("HTA 0.5.0", str(h["ranks_run"]), "", secs, f"{h['peak_bytes'] / 2**30:.2f}",
                          "-" if h["peak_over_raw"] is None else f"{h['peak_over_raw']:.2f}")
            if h["scaled"]:
                scaled_note.append(f"HTA ran on {h['ranks_run']} of {s['ranks']} files (all of them would not fit "
                                   f"in --hta-mem-gb); its time is scaled by {s['ranks']}/{h['ranks_run']}.")
        console.print(table)
        for line in scaled_note:
            console.print(line)
        for s in tr["sizes"]:
            if s.get("hta_over_dtprobe"):
                console.print(f"{s['ranks']} trace files: HTA time / dtprobe analyze time = "
                              f"{s['hta_over_dtprobe']:.1f}x")


def print_goals(doc: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    if not doc["goals"]:
        return
    table = Table(title="issue 17 goals")
    for col in ("goal", "measured", "met"):
        table.add_column(col)
    for g in doc["goals"]:
        table.add_row(g["goal"], g["shown"], {True: "yes", False: "NO", None: "-"}[g["met"]])
    Console(width=160).print(table)


def main(argv: list[str] | None = None) -> int:
    from scale_data import TRACE_LAYOUTS, TraceSetSpec

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 epilog="Docstring: the phases, the goals and how peak memory is measured.")
    ap.add_argument("--ranks", type=int, nargs="*", default=[64, 256, 1024],
                    help="world sizes of the synthetic runs (multiples of 8, at least 16); none: only the traces")
    ap.add_argument("--steps", type=int, default=200, help="steps of each run")
    ap.add_argument("--traces", default="64x50", metavar="RANKSxMB",
                    help="foreign trace set: files x MB of JSON per file, or 'none'")
    ap.add_argument("--trace-steps", type=int, default=4, help="ProfilerSteps per trace file")
    ap.add_argument("--trace-gzip", action="store_true", help="write the trace files gzipped")
    ap.add_argument("--trace-layout", choices=sorted(TRACE_LAYOUTS), default=None,
                    help=f"the trace set's process groups (default {TraceSetSpec.layout}): "
                         + "; ".join(f"{k}: {v}" for k, v in TRACE_LAYOUTS.items()))
    ap.add_argument("--trace-seq", action="store_true",
                    help="give the trace set's collectives their group's Seq arg (recent PyTorch), which dtprobe "
                         "matches by; without it they are matched by their order in each ProfilerStep")
    ap.add_argument("--no-hta", action="store_true", help="do not run HTA on the trace set")
    ap.add_argument("--hta-mem-gb", type=float, default=None,
                    help="memory HTA may use; it runs on as many files as fit (default: --mem-cap-gb)")
    ap.add_argument("--timeout-s", type=float, default=3600.0, help="per phase, seconds")
    ap.add_argument("--mem-cap-gb", type=float, default=16.0, help="a phase above this much memory is stopped")
    ap.add_argument("--workers", type=int, default=2, help="processes writing the synthetic data")
    ap.add_argument("--workdir", type=Path, default=None, help="where data is written (default: a temp dir)")
    ap.add_argument("--keep", action="store_true", help="keep the data written (and the workdir)")
    ap.add_argument("--browser", action="store_true",
                    help="also time `dtprobe dashboard` start to the Overview drawn in /usr/bin/chromium (Playwright)")
    ap.add_argument("--json", type=Path, default=None, metavar="PATH", help="write every figure here as JSON")
    ap.add_argument("--phases", nargs="+", choices=RUN_PHASE_GROUPS, default=list(RUN_PHASE_GROUPS),
                    help="which phases run after the write (finished: compact, open, analyze, Overview and --browser)")
    ap.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    cli = ap.parse_args(argv)
    if cli.child:
        phase, args = cli.child
        bind_checkout_packages()
        print(json.dumps(PHASES[phase](json.loads(args))))
        return 0
    for n in cli.ranks:
        if n % 8 or n < 16:
            ap.error(f"--ranks {n}: a tp8 x dp layout needs a multiple of 8, at least 16")
    traces = None
    if cli.traces.lower() != "none":
        try:
            n_text, mb_text = cli.traces.lower().split("x")
            traces = (int(n_text), float(mb_text))
        except ValueError:
            ap.error(f"--traces {cli.traces!r}: expected RANKSxMB, e.g. 64x50, or none")
    if traces is None and (cli.trace_layout is not None or cli.trace_seq):
        given = " and ".join(f for f, on in (("--trace-layout", cli.trace_layout), ("--trace-seq", cli.trace_seq))
                             if on)
        ap.error(f"--traces none skips the foreign trace set, so {given} would have no effect; give --traces "
                 f"RANKSxMB (e.g. 64x50), or leave out {given}")
    cli.trace_layout = cli.trace_layout or TraceSetSpec.layout
    if cli.hta_mem_gb is None:
        cli.hta_mem_gb = cli.mem_cap_gb

    import dtprobe
    from dtprobe.store.schema import SCHEMA_VERSION

    own_workdir = cli.workdir is None
    workdir = cli.workdir or Path(tempfile.mkdtemp(prefix="dtprobe_scale_"))
    workdir.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, XDG_CACHE_HOME=str(workdir / "cache"))   # summaries the dashboard stores stay here
    doc = {"dtprobe": str(Path(dtprobe.__file__).resolve().parent), "dtprobe_version": dtprobe.__version__,
           "schema_version": SCHEMA_VERSION, "cpus": os.cpu_count(), "load1": os.getloadavg()[0],
           "steps": cli.steps, "timeout_s": cli.timeout_s, "mem_cap_gb": cli.mem_cap_gb, "runs": [], "traces": None}
    print(f"dtprobe {doc['dtprobe_version']} from {doc['dtprobe']} (store schema {SCHEMA_VERSION}); "
          f"{doc['cpus']} CPUs, load {doc['load1']:.1f}; data under {workdir}", file=sys.stderr)
    try:
        for n in sorted(cli.ranks):
            doc["runs"].append(bench_run(n, cli, env, workdir))
        sizes = [r["ranks"] for r in doc["runs"]]
        doc["growth"] = {key: growth(sizes, [(r["phases"].get(key) or {}).get("seconds") if
                                             (r["phases"].get(key) or {}).get("ok") else None for r in doc["runs"]])
                         for key, _ in RUN_PHASES}
        if traces is not None:
            doc["traces"] = bench_traces(*traces, cli, env, workdir)
    finally:
        if not cli.keep:   # a workdir given keeps only what was in it before
            shutil.rmtree(workdir if own_workdir else workdir / "cache", ignore_errors=True)
    doc["goals"] = goals(doc)
    print_tables(doc)
    print_goals(doc)
    if cli.json:
        cli.json.write_text(json.dumps(doc, indent=1))
        print(f"wrote {cli.json}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
