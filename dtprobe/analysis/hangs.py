"""Hang forensics: collectives some members never arrived at, hang reports of the watchdog (``faults`` rows of
kind ``hang``), crashes; detectors HANG and RANK_CRASH. Read by the facade and the dashboard."""

from __future__ import annotations

import json
from collections.abc import Callable

import pandas as pd

from dtprobe.analysis.findings import Finding
from dtprobe.analysis.stragglers import SKEW_COLUMNS
from dtprobe.analysis.tables import axis_of, group_members, require_columns

MISSING_COLUMNS = ["pg", "pg_ranks", "seq", "op", "step", "arrived_ranks", "missing_ranks", "first_enqueue_ns",
                   "waited_ns"]


def missing_arrivals(skew: pd.DataFrame, collectives: pd.DataFrame, *, now_ns: int, min_wait_ns: int) -> pd.DataFrame:
    """Per group, its first collective that some members never arrived at and some arrived member never finished,
    if the arrived ones have waited at least ``min_wait_ns`` by ``now_ns`` (the run's last timestamp, or the
    current time while it runs).
    Columns: ``MISSING_COLUMNS``."""
    require_columns(skew, SKEW_COLUMNS, table="collective_skew")
    open_ = skew[~skew["complete"].astype(bool) & (skew["num_members"] > 1)]
    # A collective every arrived rank finished did not wait for the missing ones: they took part, and their rows
    # were lost (a rank killed before its buffered rows were written) or are not written yet. A hang leaves at
    # least one arrived rank's row unfinished (written at close, end_ns null).
    def keys(frame: pd.DataFrame):
        return zip(frame["pg"], frame["pg_ranks"].fillna(""), frame["seq"].astype("int64"))

    unfinished = set(keys(collectives.loc[collectives["end_ns"].isna()]))
    open_ = open_[[key in unfinished for key in keys(open_)]]
    if open_.empty:
        return pd.DataFrame({col: [] for col in MISSING_COLUMNS})
    first = open_.sort_values("seq").drop_duplicates(["pg", "pg_ranks"], keep="first")
    rows = []
    for r in first.itertuples(index=False):
        arrived = sorted(int(x) for x in collectives.loc[
            (collectives["pg"] == r.pg) & (collectives["pg_ranks"].fillna("") == r.pg_ranks)
            & (collectives["seq"] == r.seq), "rank"].unique())
        members = group_members(r.pg_ranks)
        missing = [m for m in members if m not in arrived]
        waited = now_ns - int(r.first_enqueue_ns)
        if missing and waited >= min_wait_ns:
            rows.append({"pg": r.pg, "pg_ranks": r.pg_ranks, "seq": int(r.seq), "op": r.op, "step": int(r.step),
                         "arrived_ranks": ",".join(map(str, arrived)), "missing_ranks": ",".join(map(str, missing)),
                         "first_enqueue_ns": int(r.first_enqueue_ns), "waited_ns": int(waited)})
    if not rows:
        return pd.DataFrame({col: [] for col in MISSING_COLUMNS})
    return pd.DataFrame(rows)[MISSING_COLUMNS]


def _detail(raw) -> dict:
    if raw is None or raw is pd.NA:
        return {}
    try:
        value = json.loads(str(raw))
    except ValueError:
        return {"raw": str(raw)}
    return value if isinstance(value, dict) else {"value": value}


def _ints(value) -> list[int]:
    if value is None:
        return []
    if isinstance(value, (int, float)):
        return [int(value)]
    if isinstance(value, str):
        return [int(x) for x in value.replace(" ", "").split(",") if x.lstrip("-").isdigit()]
    return [int(x) for x in value]


def detect_hangs(missing: pd.DataFrame, faults: pd.DataFrame, *, last_seen: pd.DataFrame | None = None,
                 axis_of_pg: Callable[[str], str | None] = axis_of) -> list[Finding]:
    """HANG for each group whose members wait at a collective others never reached (the missing ranks are named),
    unless every missing rank crashed (a ``crash`` fault) by then: RANK_CRASH reports those;
    and for each watchdog/injected hang fault not already explained (ranks from its detail's
    ``waiting_for_ranks`` (``runtime.hang``'s watchdog) / ``missing_ranks`` / ``culprit`` keys, else the
    reporting rank: an injected hang row is written by the rank that hangs). ``last_seen``: per rank its last step and collective."""
    findings: list[Finding] = []
    named: set[int] = set()
    last = {int(r.rank): r for r in last_seen.itertuples(index=False)} if last_seen is not None else {}
    crashed = crash_steps(faults)
    for r in missing.itertuples(index=False):
        miss = _ints(r.missing_ranks)
        if all(m in crashed and crashed[m] <= r.step + 1 for m in miss):
            continue                                  # they died: RANK_CRASH reports it (with this wait)
        named.update(miss)
        findings.append(Finding(
            code="HANG", severity="critical", ranks=tuple(miss), group=axis_of_pg(r.pg),
            title=(f"rank(s) {miss} never arrived at {r.op} #{r.seq} on group {r.pg} {list(group_members(r.pg_ranks))}"
                   f" (step {r.step}); {r.arrived_ranks} waited {r.waited_ns / 1e9:.1f} s"),
            evidence={
                "pg": r.pg, "pg_ranks": list(group_members(r.pg_ranks)), "seq": r.seq, "op": r.op, "step": r.step,
                "arrived_ranks": _ints(r.arrived_ranks), "missing_ranks": miss, "waited_s": r.waited_ns / 1e9,
                "missing_last_seen": {str(m): ({"step": _int_or_none(last[m].last_step),
                                                "last_collective": last[m].last_collective}
                                               if m in last else None) for m in miss},
            },
            recommendation=(f"Look at what rank(s) {miss} were doing at step {r.step}: py-spy dump --pid on their "
                            f"host, their stderr, a dataloader or checkpoint stuck, or an exception that killed "
                            f"them. Set a finite collective timeout (init_process_group(timeout=...)) so the job "
                            f"fails fast and torchrun can restart it."),
            predicted_gain=None, rows=missing,
        ))
    if faults is not None and not faults.empty:
        require_columns(faults, ["rank", "time_ns", "step", "kind", "injected", "detail"], table="faults")
        hangs = faults[faults["kind"] == "hang"]
        for r in hangs.itertuples(index=False):
            d = _detail(r.detail)
            ranks = (_ints(d.get("waiting_for_ranks")) or _ints(d.get("missing_ranks")) or _ints(d.get("culprit"))
                     or [int(r.rank)])
            if set(ranks) <= named:
                continue
            named.update(ranks)
            where = ", ".join(f"{k}={d[k]}" for k in ("pg", "op", "seq") if k in d)
            findings.append(Finding(
                code="HANG", severity="critical", ranks=tuple(ranks),
                group=axis_of_pg(d["pg"]) if d.get("pg") else None,
                title=(f"rank(s) {ranks} hung at step {_int_or_none(r.step)}"
                       + (f" ({where})" if where else "") + (" [injected]" if r.injected is True else "")),
                evidence={"reported_by": int(r.rank), "step": _int_or_none(r.step), "injected": r.injected is True,
                          "detail": d, "missing_ranks": ranks},
                recommendation=("Inspect the stacks of the named ranks (py-spy dump) and the collective they "
                                "stopped at; set a finite collective timeout so the job fails fast."),
                predicted_gain=None,
            ))
    return findings


def crash_steps(faults: pd.DataFrame | None) -> dict[int, int]:
    """rank -> the first step at which it crashed (``crash`` faults)."""
    if faults is None or faults.empty:
        return {}
    c = faults[faults["kind"] == "crash"]
    return {int(r): int(s) for r, s in c.groupby("rank")["step"].min().fillna(-1).items()}


def detect_crashes(faults: pd.DataFrame, *, status: str | None, missing: pd.DataFrame | None = None) -> list[Finding]:
    """RANK_CRASH for crash faults: critical if the run ended crashed, warning if it recovered (restarts).
    ``missing``: collectives others waited at because the crashed ranks never arrived (``waited_at``)."""
    if faults is None or faults.empty:
        return []
    crashes = faults[faults["kind"] == "crash"]
    if crashes.empty:
        return []
    ranks = sorted(int(r) for r in crashes["rank"].unique())
    restarts = int((faults["kind"] == "restart").sum())
    recovered = status != "crashed" and (restarts > 0 or status == "finished")
    steps = sorted({int(s) for s in crashes["step"].dropna()})
    return [Finding(
        code="RANK_CRASH", severity="warning" if recovered else "critical", ranks=tuple(ranks), group=None,
        title=(f"rank(s) {ranks} crashed at step(s) {steps}" + (f"; the job recovered ({restarts} restart(s))"
                                                               if recovered else "")),
        evidence={"crash_steps": steps, "num_crashes": int(len(crashes)), "num_restarts": restarts,
                  "waited_at": [] if missing is None or missing.empty else [
                      {"pg": m.pg, "seq": int(m.seq), "op": m.op, "step": int(m.step), "waited_s": m.waited_ns / 1e9,
                       "arrived_ranks": _ints(m.arrived_ranks)}
                      for m in missing.itertuples(index=False) if set(_ints(m.missing_ranks)) <= set(ranks)],
                  "injected": bool(crashes["injected"].fillna(False).astype(bool).all()),
                  "details": [_detail(d) for d in crashes["detail"]], "recovered": recovered},
        recommendation=("Read the crashed ranks' stderr; keep torchrun --max-restarts and frequent enough "
                        "checkpoints (see CHECKPOINT_STALL / Young-Daly) so a crash loses few steps."),
        predicted_gain=None, rows=crashes,
    )]


def last_seen(steps: pd.DataFrame, collectives: pd.DataFrame) -> pd.DataFrame:
    """Per rank: its last recorded step and last collective (``pg#seq op``). Columns: rank, last_step, last_collective."""
    out = {}
    if not steps.empty:
        for rank, s in steps.groupby("rank")["step"].max().items():
            out.setdefault(int(rank), {"rank": int(rank), "last_step": s, "last_collective": None})
    if not collectives.empty:
        arrival = collectives["enqueue_ns"].reset_index(drop=True).dropna().sort_values()  # positions by arrival
        ranks = collectives["rank"].reset_index(drop=True).loc[arrival.index]
        last = ranks.groupby(ranks).tail(1)                                   # each rank's last arrival
        named = collectives[["step", "pg", "seq", "op"]]
        for pos, rank in sorted(last.items(), key=lambda kv: kv[1]):
            x = named.iloc[pos]
            row = out.setdefault(int(rank), {"rank": int(rank), "last_step": x["step"], "last_collective": None})
            row["last_collective"] = f"{x['pg']}#{x['seq']} {x['op']}"
    if not out:
        return pd.DataFrame({"rank": [], "last_step": [], "last_collective": []})
    return pd.DataFrame(list(out.values()))[["rank", "last_step", "last_collective"]]


def _int_or_none(v):
    return None if v is None or pd.isna(v) else int(v)
