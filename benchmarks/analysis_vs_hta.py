"""dtprobe vs Holistic Trace Analysis 0.5.0, timed on large Kineto trace sets grown from the checked-in DLRM traces.

Launch:  python benchmarks/analysis_vs_hta.py --ranks 64 --mb-per-rank 50
(builds the set once under --work-dir, then runs each tool in a fresh process, side by side, and prints ratios).

The set: rank r of N is DLRM rank r % 8 (8x V100, NCCL) with its events replicated with shifted timestamps and
correlation ids until the files hold about --mb-per-rank MB of JSON (~17k GPU events and ~180k events per 50 MB,
real kernel names), the same number of replicas on every rank (so every collective has all its members and the
matching pairs them), the replicas grouped into --steps ProfilerSteps. Files are plain ``.json`` written with Python's
default spacing (HTA finds ranks with the regex ``"rank":\\s+(\\d+)``).

Measured per tool, same work: parse every file, temporal breakdown, comm/comp overlap, kernel breakdown
(kernel-type split + per-rank top kernels); dtprobe also its per-step tables and the device-clock arrivals
(collectives matched across ranks, clock offsets, per-rank arrival table). HTA runs with
``include_last_profiler_step=True`` (the semantics dtprobe matches) and its default fork pool,
without the extra tracemalloc parse of the first file it runs by default for > 8 ranks (that would only slow
HTA down). dtprobe uses 2 worker processes.
CPU time (user + system of the tool's process tree, sampled every 50 ms beside the memory, so that workers of a
pool or fork server the tool never reaped count too) is printed beside wall time: on a shared, oversubscribed
machine it is the steadier measure of work. Peak memory = the largest sum of RSS over the tool's process and its
children, sampled every 50 ms (forked workers share pages with their parent, so this over-counts both tools
alike).

Goal (issue 15): dtprobe at least 9x faster than HTA (wall time) on the same work, with the matching on, and a peak
memory at most 1x the raw JSON; the printed ratios are those figures (CPU time and wall time of each tool,
measured in the same invocation). Wall time needs a quiet machine; on a shared, oversubscribed one decide on the
CPU-time ratio.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_SOURCE = ROOT / "tests" / "data" / "traces" / "dlrm_8rank_v100"


# ---------------------------------------------------------------- build the trace set

def _load(path: Path) -> dict:
    opener = gzip.open if path.name.endswith(".gz") else open
    with opener(path, "rb") as fh:
        return json.loads(fh.read())


def _events_bytes(doc: dict) -> int:
    """Size of the JSON text of one copy of ``traceEvents``."""
    return len(json.dumps(doc["traceEvents"]).encode())


def _replicated_events(doc: dict, replicas: int, num_steps: int) -> bytes:
    """The JSON text of ``traceEvents`` replicated ``replicas`` times.

    Replicas are grouped into ``num_steps`` ProfilerSteps: the first replica of each group keeps the
    ``ProfilerStep#N`` annotation, stretched over the group; the others drop it.
    """
    events = doc["traceEvents"]
    timed = [e for e in events if "ts" in e]
    t0 = min(e["ts"] for e in timed)
    span = max(e["ts"] + e.get("dur", 0) for e in timed) - t0 + 1000
    max_corr = max((e.get("args", {}).get("correlation", 0) for e in events), default=0) + 1
    max_id = max((e.get("id", 0) for e in events if isinstance(e.get("id"), int)), default=0) + 1
    per_step = -(-replicas // max(1, num_steps))
    parts = []
    for i in range(replicas):
        for e in events:
            if i and (e.get("ph") == "M" or e.get("cat") == "Trace"):
                continue
            name = e.get("name", "")
            is_step = isinstance(name, str) and name.startswith("ProfilerStep#")
            if is_step and i % per_step:
                continue
            e2 = dict(e)
            if "ts" in e2 and e2.get("ph") != "M":
                e2["ts"] = e2["ts"] + i * span
            args = e2.get("args")
            if isinstance(args, dict) and "correlation" in args:
                e2["args"] = dict(args, correlation=args["correlation"] + i * max_corr)
            if isinstance(e2.get("id"), int):
                e2["id"] = e2["id"] + i * max_id
            if is_step:
                e2["name"] = f"ProfilerStep#{int(name.split('#')[1]) + i // per_step}"
                e2["dur"] = e2["dur"] + (min(per_step, replicas - i) - 1) * span
            parts.append(json.dumps(e2))
    return ("[" + ", ".join(parts) + "]").encode()


def build_set(source: Path, out: Path, *, num_ranks: int, mb_per_rank: float, num_steps: int) -> Path:
    """Write ``num_ranks`` trace files of about ``mb_per_rank`` MB under ``out`` (reused when already built)."""
    stamp = out / "BUILT"
    built = f"{source} {num_ranks} {mb_per_rank:g} {num_steps} same-replicas"
    if stamp.exists() and stamp.read_text() == built:
        return out
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("*.json"):
        old.unlink()
    sources = sorted(p for p in source.iterdir() if p.name.endswith((".json", ".json.gz")))
    bodies: dict[int, tuple[dict, bytes]] = {}
    docs = [_load(path) for path in sources]
    # every rank gets the same number of replicas (so the same collectives): the matching then pairs them all
    replicas = max(1, round(mb_per_rank * 1e6 / (sum(_events_bytes(d) for d in docs) / len(docs))))
    for i, (path, doc) in enumerate(zip(sources, docs)):
        text = _replicated_events(doc, replicas, num_steps)
        head = {k: v for k, v in doc.items() if k not in ("traceEvents", "distributedInfo")}
        bodies[i] = (head, text)
        print(f"  source {path.name}: {replicas} replicas, {len(text) / 1e6:.1f} MB", flush=True)
    for rank in range(num_ranks):
        head, text = bodies[rank % len(sources)]
        info = {"backend": "nccl", "rank": rank, "world_size": num_ranks}
        prefix = json.dumps({"distributedInfo": info, **head})[:-1] + ', "traceEvents": '
        with open(out / f"rank{rank:05d}.pt.trace.json", "wb") as fh:
            fh.write(prefix.encode())
            fh.write(text)
            fh.write(b"}")
    stamp.write_text(built)
    return out


# ---------------------------------------------------------------- the measured work (child processes)

def cpu_seconds() -> float:
    """User + system CPU time of this process and its reaped children (the tool's worker pool)."""
    import resource
    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def run_dtprobe(trace_dir: str) -> dict:
    t0 = time.perf_counter()
    from dtprobe.analysis.trace_metrics import analyze_traces
    from dtprobe.store.kineto import load_trace_dir
    run = load_trace_dir(trace_dir, workers=2)
    t1 = time.perf_counter()
    metrics = analyze_traces(run)
    from dtprobe.analysis import RunAnalysis
    arrivals = RunAnalysis(run).arrival_summary()   # device-clock matching, clock offsets and arrivals
    t2 = time.perf_counter()
    if arrivals.empty:      # the set is built so that every collective matches: no rows means no matching work
        raise SystemExit(f"dtprobe matched no collective on {trace_dir} ({RunAnalysis(run).clock_alignment()})")
    temporal = metrics.temporal.set_index("rank")
    return {"parse_s": t1 - t0, "analyze_s": t2 - t1, "total_s": t2 - t0, "cpu_s": cpu_seconds(),
            "idle_pct": (temporal["idle_frac"] * 100).round(4).to_dict(),
            "overlap_pct": (metrics.overlap.set_index("rank")["overlap_frac"] * 100).round(4).to_dict(),
            "num_kernels": int(len(run.kernels)), "num_steps": len(metrics.steps_analyzed),
            "num_arrival_rows": int(len(arrivals))}


def run_hta(trace_dir: str) -> dict:
    import logging
    import warnings
    warnings.simplefilter("ignore")
    t0 = time.perf_counter()
    from hta.common.trace import Trace
    from hta.trace_analysis import TraceAnalysis
    logging.disable(logging.WARNING)
    # = TraceAnalysis(trace_dir, include_last_profiler_step=True) minus the extra tracemalloc parse of the first
    # file that HTA runs for > 8 ranks to size its pool (left out so the comparison does not favour dtprobe)
    analysis = TraceAnalysis.__new__(TraceAnalysis)
    analysis.t = Trace(trace_dir=trace_dir)
    analysis.t.load_traces(include_last_profiler_step=True, use_memory_profiling=False)
    t1 = time.perf_counter()
    temporal = analysis.get_temporal_breakdown(visualize=False).set_index("rank")
    overlap = analysis.get_comm_comp_overlap(visualize=False).set_index("rank")
    analysis.get_gpu_kernel_breakdown(visualize=False)
    t2 = time.perf_counter()
    return {"parse_s": t1 - t0, "analyze_s": t2 - t1, "total_s": t2 - t0, "cpu_s": cpu_seconds(),
            "idle_pct": temporal["idle_time_pctg"].to_dict(),
            "overlap_pct": overlap["comp_comm_overlap_pctg"].to_dict()}


def measure(tool: str, trace_dir: Path, timeout_s: float) -> dict:
    """Run ``tool`` in a fresh interpreter; sample the RSS of its process tree; return its timings + peak."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    proc = subprocess.Popen([sys.executable, __file__, "--child", tool, str(trace_dir)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    root = psutil.Process(proc.pid)
    peak = 0
    cpu: dict[int, float] = {}      # pid -> its user + system CPU at its last sample (children reaped or not)
    deadline = time.monotonic() + timeout_s
    while proc.poll() is None:
        if time.monotonic() > deadline:
            proc.kill()
            raise SystemExit(f"{tool} exceeded {timeout_s:.0f} s")
        try:
            procs = [root] + root.children(recursive=True)
        except psutil.Error:
            procs = []
        rss = 0
        for p in procs:
            try:
                rss += p.memory_info().rss
                times = p.cpu_times()
                cpu[p.pid] = times.user + times.system
            except psutil.Error:    # ended between the listing and the read
                pass
        peak = max(peak, rss)
        time.sleep(0.05)
    out = proc.stdout.read().decode()
    if proc.returncode != 0:
        raise SystemExit(f"{tool} failed with exit code {proc.returncode}")
    result = json.loads(out.strip().splitlines()[-1])
    result["peak_rss_bytes"] = peak
    # The tool's own count (itself and the children it reaped) misses workers a live fork server still held at
    # its end; the samples miss a child's last 50 ms and children shorter than that. Take the larger.
    result["cpu_s"] = max(result["cpu_s"], sum(cpu.values()))
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, default=64, help="trace files (ranks) in the set (default 64)")
    parser.add_argument("--mb-per-rank", type=float, default=50.0, help="JSON MB per file (default 50)")
    parser.add_argument("--steps", type=int, default=3,
                        help="ProfilerSteps per file (default 3, a typical profiler window; HTA's step assignment "
                             "costs events x steps)")
    parser.add_argument("--source", type=Path, default=DEFAULT_SOURCE, help="folder of source traces (DLRM)")
    parser.add_argument("--work-dir", type=Path, default=Path("/tmp/dtprobe_bench_traces"),
                        help="where the set is built (and reused)")
    parser.add_argument("--timeout", type=float, default=3600.0, help="per tool, seconds")
    parser.add_argument("--child", nargs=2, metavar=("TOOL", "DIR"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        tool, trace_dir = args.child
        print(json.dumps(run_dtprobe(trace_dir) if tool == "dtprobe" else run_hta(trace_dir)))
        return 0

    trace_dir = args.work_dir / f"r{args.ranks}_mb{args.mb_per_rank:g}_s{args.steps}"
    print(f"building {args.ranks} ranks x ~{args.mb_per_rank:g} MB in {trace_dir} ...", flush=True)
    build_set(args.source, trace_dir, num_ranks=args.ranks, mb_per_rank=args.mb_per_rank, num_steps=args.steps)
    files = sorted(trace_dir.glob("*.json"))
    raw = sum(f.stat().st_size for f in files)
    print(f"set: {len(files)} files, {raw / 1e6:.0f} MB of JSON (largest {max(f.stat().st_size for f in files) / 1e6:.1f} MB)")

    results = {}
    for tool in ("dtprobe", "hta"):
        print(f"running {tool} ...", flush=True)
        results[tool] = r = measure(tool, trace_dir, args.timeout)
        print(f"  {tool}: {r['total_s']:.2f} s wall, {r['cpu_s']:.1f} s CPU, peak {r['peak_rss_bytes'] / 1e6:.0f} MB",
              flush=True)
    ours, hta = results["dtprobe"], results["hta"]

    print(f"\n{'':10s} {'parse s':>9s} {'analyses s':>11s} {'total s':>9s} {'CPU s':>9s} {'peak MB':>9s} "
          f"{'peak/raw':>9s}")
    for tool, r in results.items():
        print(f"{tool:10s} {r['parse_s']:9.2f} {r['analyze_s']:11.2f} {r['total_s']:9.2f} {r['cpu_s']:9.1f} "
              f"{r['peak_rss_bytes'] / 1e6:9.0f} {r['peak_rss_bytes'] / raw:9.2f}")
    idle_diff = max(abs(ours["idle_pct"][str(k)] - v) for k, v in
                    ((int(k), v) for k, v in hta["idle_pct"].items()))
    print(f"\nCPU-time ratio (HTA / dtprobe, robust on a shared machine): {hta['cpu_s'] / ours['cpu_s']:.1f}x")
    print(f"speed-up (HTA total / dtprobe total): {hta['total_s'] / ours['total_s']:.1f}x "
          f"(parse {hta['parse_s'] / ours['parse_s']:.1f}x, analyses {hta['analyze_s'] / ours['analyze_s']:.1f}x)")
    print(f"peak memory: dtprobe {ours['peak_rss_bytes'] / raw:.2f}x the raw JSON, "
          f"HTA {hta['peak_rss_bytes'] / raw:.2f}x; dtprobe uses {ours['peak_rss_bytes'] / hta['peak_rss_bytes']:.2f}x HTA's")
    print(f"agreement: max |idle % dtprobe - HTA| over ranks = {idle_diff:.3f} points; "
          f"{ours['num_kernels']} GPU events, {ours['num_steps']} steps analysed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
