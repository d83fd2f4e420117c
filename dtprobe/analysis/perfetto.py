"""One Perfetto / chrome://tracing timeline of a whole run: every rank's steps and phases, collectives per process
group, pipeline actions, checkpoints, faults and device counters on the store's aligned clock. Written by
``dtprobe export perfetto RUN -o merged.json``.

Layout: one process per rank (``pid`` = rank, named ``rank N (host)``); threads: ``steps``, ``phases``,
``pipeline``, ``checkpoint``, ``faults``, ``exits``; collectives as async slices (they overlap: DDP buckets) in one
track per process group; device samples as counter tracks (``ph: "C"``); faults and the ranks' exits that the
launcher recorded (run.json ``attempts``: a crash shows where the rank died, also in a run whose ranks died before
writing any row) as instant events. Phases are laid out in their order (data, fwd, bwd, opt) from the step start,
since the store keeps their durations, not their starts.
Times are microseconds from the run's first event (``metadata.t0_unix_ns`` gives it in Unix nanoseconds).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd

from dtprobe.analysis.arrivals import unique_seq
from dtprobe.analysis.liveness import attempts_of
from dtprobe.analysis.tables import text_or

TIDS = {"steps": 1, "phases": 2, "pipeline": 3, "checkpoint": 4, "faults": 5, "exits": 6}
PHASES = ("data", "fwd", "bwd", "opt")
COUNTERS = {
    "util_frac": ("gpu util", 1.0), "power_w": ("power W", 1.0), "temp_c": ("temperature C", 1.0),
    "sm_clock_mhz": ("sm clock MHz", 1.0), "mem_used_bytes": ("memory used GB", 1e-9),
    "cpu_frac": ("cpu util", 1.0), "rss_bytes": ("host RSS GB", 1e-9),
}
"""devices column -> (counter track name, scale)."""


@dataclass(frozen=True, kw_only=True)
class PerfettoSummary:
    """What ``export_perfetto`` wrote."""

    path: Path
    """The trace file."""
    num_events: int
    """Trace events written (metadata included)."""
    counts: dict
    """Events per kind: steps, phases, collectives, pipeline, checkpoints, faults, exits, counters."""


def _rows(df: pd.DataFrame, required: list[str]):
    """Rows of ``df`` with every ``required`` column set (nothing for an empty or column-less frame)."""
    if df.empty or any(c not in df.columns for c in required):
        return iter(())
    return df.dropna(subset=required).itertuples(index=False)


def _us(ns: Any, t0: int) -> float:
    return (int(ns) - t0) / 1000.0


def build_trace(tables: dict[str, pd.DataFrame], *, rank_hosts: dict[int, str] | None = None,
                run_id: str = "", attempts: list[dict] = ()) -> tuple[dict, dict]:
    """(Chrome-trace JSON object, event counts per kind) from a run's tables (``RunStore.table`` frames) and the
    launcher's ``attempts`` (run.json; ``liveness.attempts_of``)."""
    rank_hosts = rank_hosts or {}
    exits = [(a, r) for a in attempts for r in a.get("ranks") or () if r.get("time_ns") is not None
             and r.get("rank") is not None]
    starts = [df[c].dropna().astype("int64").min() for name, c in (
        ("steps", "start_ns"), ("collectives", "enqueue_ns"), ("pipeline", "start_ns"), ("devices", "time_ns"),
        ("faults", "time_ns"), ("checkpoints", "start_ns")) if not (df := tables.get(name, pd.DataFrame())).empty
        and c in df and df[c].notna().any()] + [int(r["time_ns"]) for _, r in exits]
    t0 = int(min(starts)) if starts else 0
    events: list[dict] = []
    counts = {k: 0 for k in ("steps", "phases", "collectives", "pipeline", "checkpoints", "faults", "exits",
                             "counters")}
    ranks: set[int] = {int(r["rank"]) for _, r in exits}
    for df in tables.values():
        if not df.empty and "rank" in df:
            ranks.update(int(r) for r in df["rank"].dropna().unique())

    steps = tables.get("steps", pd.DataFrame())
    for r in _rows(steps, ["start_ns", "end_ns"]):
        events.append({"ph": "X", "pid": int(r.rank), "tid": TIDS["steps"], "name": f"step {r.step}",
                       "ts": _us(r.start_ns, t0), "dur": (int(r.end_ns) - int(r.start_ns)) / 1000.0,
                       "args": {"step": int(r.step), "loss": None if pd.isna(r.loss) else float(r.loss),
                                "tokens": None if pd.isna(r.tokens) else int(r.tokens)}})
        counts["steps"] += 1
        t = int(r.start_ns)
        for phase in PHASES:
            dur = getattr(r, f"{phase}_ns")
            if pd.isna(dur) or int(dur) <= 0:
                continue
            events.append({"ph": "X", "pid": int(r.rank), "tid": TIDS["phases"], "name": phase,
                           "ts": _us(t, t0), "dur": int(dur) / 1000.0, "args": {"step": int(r.step)}})
            counts["phases"] += 1
            t += int(dur)

    coll = tables.get("collectives", pd.DataFrame())
    if not coll.empty:
        c = coll.dropna(subset=["enqueue_ns"])
        last = c.groupby([c["pg"].fillna(""), text_or(c["pg_ranks"]), c["seq"]])["enqueue_ns"].transform("max")
        pg_tids: dict[str, int] = {}
        for i, (r, last_enq) in enumerate(zip(c.itertuples(index=False), last)):
            pg = "" if pd.isna(r.pg) else str(r.pg)
            track = f"{pg or 'world'} collectives" if r.op not in ("send", "recv") else f"{pg or 'world'} p2p"
            pg_tids.setdefault(track, 10 + len(pg_tids))
            end = int(r.end_ns) if not pd.isna(r.end_ns) else int(r.enqueue_ns)
            name = f"{r.op}" + (f" #{int(r.seq)}" if not pd.isna(r.seq) else "")
            args = {"pg": pg, "pg_ranks": None if pd.isna(r.pg_ranks) else str(r.pg_ranks),
                    "seq": None if pd.isna(r.seq) else int(r.seq),
                    "num_bytes": None if pd.isna(r.num_bytes) else int(r.num_bytes),
                    "step": None if pd.isna(r.step) else int(r.step),
                    "wait_for_last_arrival_ms": ((int(last_enq) - int(r.enqueue_ns)) / 1e6
                                                 if r.op not in ("send", "recv") else None),
                    "peer": None if pd.isna(r.peer) else int(r.peer),
                    "completed": not pd.isna(r.end_ns)}
            common = {"pid": int(r.rank), "cat": track, "id": i, "name": name}
            events.append({**common, "ph": "b", "ts": _us(r.enqueue_ns, t0), "args": args})
            events.append({**common, "ph": "e", "ts": _us(end, t0)})
            counts["collectives"] += 1

    pipe = tables.get("pipeline", pd.DataFrame())
    for r in _rows(pipe, ["start_ns", "end_ns"]):
        events.append({"ph": "X", "pid": int(r.rank), "tid": TIDS["pipeline"],
                       "name": f"{r.action}{int(r.microbatch) if not pd.isna(r.microbatch) else ''}",
                       "ts": _us(r.start_ns, t0), "dur": (int(r.end_ns) - int(r.start_ns)) / 1000.0,
                       "args": {"stage": None if pd.isna(r.stage) else int(r.stage), "step": int(r.step),
                                "microbatch": None if pd.isna(r.microbatch) else int(r.microbatch)}})
        counts["pipeline"] += 1

    ckpt = tables.get("checkpoints", pd.DataFrame())
    for r in _rows(ckpt, ["start_ns"]):
        dur = r.blocking_ns if not pd.isna(r.blocking_ns) else r.total_ns
        events.append({"ph": "X", "pid": int(r.rank), "tid": TIDS["checkpoint"], "name": f"checkpoint {r.kind}",
                       "ts": _us(r.start_ns, t0), "dur": 0.0 if pd.isna(dur) else int(dur) / 1000.0,
                       "args": {"step": None if pd.isna(r.step) else int(r.step),
                                "async_ms": None if pd.isna(r.async_ns) else int(r.async_ns) / 1e6,
                                "num_bytes": None if pd.isna(r.num_bytes) else int(r.num_bytes)}})
        counts["checkpoints"] += 1

    faults = tables.get("faults", pd.DataFrame())
    for r in _rows(faults, ["time_ns"]):
        events.append({"ph": "i", "s": "p", "pid": int(r.rank), "tid": TIDS["faults"], "name": f"fault: {r.kind}",
                       "ts": _us(r.time_ns, t0),
                       "args": {"injected": None if pd.isna(r.injected) else bool(r.injected),
                                "detail": None if pd.isna(r.detail) else str(r.detail),
                                "step": None if pd.isna(r.step) else int(r.step)}})
        counts["faults"] += 1

    for a, r in exits:
        how = r.get("signal") or (f"exit code {r['exit_code']}" if r.get("exit_code") is not None else "ended")
        error = r.get("error") or {}
        events.append({"ph": "i", "s": "p", "pid": int(r["rank"]), "tid": TIDS["exits"],
                       "name": f"exit: {how}" + (" (first failure)" if r.get("first_failure") else ""),
                       "ts": _us(r["time_ns"], t0),
                       "args": {"attempt": a.get("attempt"), "exit_code": r.get("exit_code"),
                                "signal": r.get("signal"), "first_failure": bool(r.get("first_failure")),
                                "error": (f"{error.get('type')}: {error.get('message')}" if error else None),
                                "stderr_tail": r.get("stderr_tail"), "oom_kill": r.get("oom_kill")}})
        counts["exits"] += 1

    dev = tables.get("devices", pd.DataFrame())
    for col, (label, scale) in COUNTERS.items():
        if dev.empty or col not in dev or dev[col].isna().all():
            continue
        for r in dev.dropna(subset=["time_ns", col]).itertuples(index=False):
            gpu = "" if pd.isna(r.gpu) else f" gpu{int(r.gpu)}"
            events.append({"ph": "C", "pid": int(r.rank), "name": f"{label}{gpu}", "ts": _us(r.time_ns, t0),
                           "args": {"value": float(getattr(r, col)) * scale}})
            counts["counters"] += 1

    meta: list[dict] = []
    for rank in sorted(ranks):
        host = rank_hosts.get(rank)
        meta.append({"ph": "M", "pid": rank, "name": "process_name",
                     "args": {"name": f"rank {rank}" + (f" ({host})" if host else "")}})
        meta.append({"ph": "M", "pid": rank, "name": "process_sort_index", "args": {"sort_index": rank}})
        for tname, tid in TIDS.items():
            meta.append({"ph": "M", "pid": rank, "tid": tid, "name": "thread_name", "args": {"name": tname}})
    trace = {"traceEvents": meta + events, "displayTimeUnit": "ms",
             "metadata": {"producer": "dtprobe export perfetto", "run_id": run_id, "t0_unix_ns": t0,
                          "clock": "rank 0's clock (store-aligned)"}}
    return trace, counts


def export_perfetto(store: Any, out: Path) -> PerfettoSummary:
    """Write ``store``'s run (a ``RunStore``) as one Chrome-trace JSON file at ``out`` (parents created)."""
    names = ("steps", "collectives", "pipeline", "checkpoints", "faults", "devices")
    tables = {name: store.table(name) for name in names}
    if not tables["collectives"].empty:
        tables["collectives"] = unique_seq(tables["collectives"])   # restarts renumber collectives from 1
    manifest = getattr(store, "manifest", None)
    hosts = {info.rank: info.host for info in manifest.ranks} if manifest is not None else {}
    trace, counts = build_trace(tables, rank_hosts=hosts, run_id=manifest.run_id if manifest is not None else "",
                                attempts=attempts_of(manifest))
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out, "w") as f:
        json.dump(trace, f, separators=(",", ":"))
    return PerfettoSummary(path=out, num_events=len(trace["traceEvents"]), counts=counts)
