"""Crashes and restarts from telemetry: per failed attempt, the rank that died first, when, at which step, how
(exit code, signal, Python exception), a cause class, what it was doing, and how the job recovered; detector
RANK_CRASH and the run's crash/restart summary (``metrics.run.crashes``/``restarts``). Read by the facade, the
report header and the dashboard's Overview."""

from __future__ import annotations

import functools
import re
from typing import Any, Callable

import pandas as pd

from dtprobe.analysis.arrivals import ATTEMPT_SEQ_STRIDE
from dtprobe.analysis.fault_detail import fault_detail, is_injected
from dtprobe.analysis.findings import Finding, jsonable
from dtprobe.analysis.liveness import (CONSEQUENCE_REASONS, WATCHDOG_EXIT_CODE, Activity, exited_after,
                                      first_sigterm_ns, is_missing, is_own_failure)
from dtprobe.analysis.phases import phase_at
from dtprobe.stack_frames import DATALOADER_WORKER_DIED, FRAME, location
from dtprobe.store.columns import require_columns

CRASH_COLUMNS = [
    "restart", "rank", "time_ns", "step", "last_step", "exit_code", "signal", "error_type", "error_message",
    "stderr_tail", "oom_kill", "cause", "doing_pg", "doing_seq", "doing_op", "doing_peer", "doing_step",
    "doing_open", "phase", "also_lost", "recovered", "resumed_from_step", "steps_lost", "time_to_recover_s", "source",
]
"""``crash_events()``: one row per failed attempt (its first failure)."""
CAUSES = ("out_of_memory", "device", "communication", "user_exception", "killed_by_signal", "unknown")
"""Cause classes of RANK_CRASH, in the order they are tested."""

_OOM = re.compile(r"out of memory|OutOfMemory|MemoryError|\bOOM\b|Cannot allocate memory", re.I)
_DEVICE = re.compile(r"\bXid\b|CUDA error|cudaError|CUBLAS_STATUS|CUDNN_STATUS|ECC error|device-side assert|"
                     r"illegal memory access|uncorrectable", re.I)
_COMM = re.compile(r"DistBackendError|DistNetworkError|ProcessGroup|\bgloo\b|\bNCCL\b|c10d|Connection (closed|reset|"
                   r"refused)|closed by peer|Broken pipe|Timed out|timeout|socket", re.I)
_SIZE_MISMATCH = re.compile(r"op\.preamble\.length <= op\.nbytes")
"""gloo's check that a message fits the buffer its collective posted: it fails when the peers issued a different
collective or size at the same point (one rank skipped or reordered one), aborting the receiver."""
SELF_SIGNALS = ("SIGABRT", "SIGSEGV", "SIGBUS", "SIGFPE", "SIGILL")
"""Signals a process raises on itself (an abort, a fault in native code): its stderr says why, unlike a kill's."""
_ERROR_LINE = re.compile(r"what\(\)|error|exception|terminate called|abort|fail", re.I)


def _error_lines(tail: Any) -> list[str]:
    """The lines of a crash's stderr excerpt (``runtime.attempts.stderr_excerpt``) that name an error, exception
    or abort, stripped: no stack frames, no faulthandler header."""
    if is_missing(tail):
        return []
    return [line.strip() for line in str(tail).splitlines() if not FRAME.match(line)
            and not line.startswith("Fatal Python error:") and _ERROR_LINE.search(line)]


def stderr_errors(tail: Any) -> str:
    """The error lines of a crash's stderr excerpt (``_error_lines``), joined."""
    return " ".join(_error_lines(tail))


_SOURCE_PREFIX = re.compile(r"^\[(?:enforce fail at )?[^\]]*\.(?:cc|cpp|cu|h|hpp):\d+\]\s*")
"""The native source location a C++ exception's message starts with (``[enforce fail at .../pair.cc:456] ``):
no help to the user, and it would push the message out of a title's quote."""


def stderr_quote(tail: Any) -> tuple[str | None, str | None]:
    """(the message, where) a self-inflicted death's stderr excerpt names: the last ``what():`` text (a C++
    exception's message, without its native source location), else the last error line (``stderr_errors``); the
    innermost frame outside the Python installation as ``file.py:line`` (the excerpt's last frame)."""
    if is_missing(tail):
        return None, None
    lines = str(tail).splitlines()
    whats = [_SOURCE_PREFIX.sub("", line.split("what():", 1)[1].strip()) for line in lines if "what():" in line]
    errors = _error_lines(tail)
    message = whats[-1] if whats else errors[-1] if errors else None
    frames = [m for m in map(FRAME.match, lines) if m]
    where = location(frames[-1]) if frames else None
    return message, where


def classify_cause(*, exit_code: Any, signal: Any, error_type: Any, error_message: Any, reason: Any = None,
                   closed: Any = None, xid: bool = False, stderr: Any = None, oom_kill: Any = None) -> str:
    """The cause class (``CAUSES``) of one rank's failure from its exit and Python error (type + message); without a
    Python error, from the error lines of its stderr excerpt (``stderr_errors``) when it ended on its own (a
    non-zero exit code or a ``SELF_SIGNALS`` signal: a kill's stderr says nothing of the kill). ``oom_kill``: the
    launcher's evidence that the kernel's OOM killer sent its SIGKILL (``runtime.oom_kills``)."""
    if _oom_killed(oom_kill):
        return "out_of_memory"
    died = DATALOADER_WORKER_DIED.search(" ".join(str(x) for x in (error_type, error_message) if not is_missing(x)))
    if died and died.group("signal") in ("Killed", "Bus error"):
        # a worker process of its DataLoader was killed (most often by the OOM killer) or hit a bus error (its
        # shared memory, /dev/shm, too small for the batches in flight)
        return "out_of_memory" if died.group("signal") == "Bus error" else "killed_by_signal"
    text = " ".join(str(x) for x in (error_type, error_message) if not is_missing(x))
    own_end = (str(signal) in SELF_SIGNALS if not is_missing(signal)
               else not is_missing(exit_code) and int(exit_code) > 0)
    said = text or (stderr_errors(stderr) if own_end else "")
    if said and _OOM.search(said):
        return "out_of_memory"
    if xid or (said and _DEVICE.search(said)):
        return "device"
    if said and _COMM.search(said):
        return "communication"
    if text or reason == "exception":
        return "user_exception"
    if not is_missing(signal) or (not is_missing(exit_code) and int(exit_code) < 0):
        return "killed_by_signal"
    if is_missing(exit_code) and closed is False:
        return "killed_by_signal"          # no exit status known: a rank ends without its close on a signal
    return "unknown"                       # exited by itself (os._exit, a C library's exit) with no Python error


def crash_events(exits: pd.DataFrame, *, activity: Activity, collectives: pd.DataFrame, steps: pd.DataFrame,
                 devices: pd.DataFrame | Callable[[], pd.DataFrame], restarts: list[dict], status: str,
                 attempts_known: bool, stale_ns: int, now_ns: int, stalls: pd.DataFrame | None = None,
                 starts: list[int] = ()) -> pd.DataFrame:
    """Per failed attempt, its first failure. Which attempts failed: with the launcher's ``attempts``
    (``attempts_known``) the ranks' exits say it (the ``first_failure`` rank; a watchdog exit is a hang, not a
    crash); else a rank whose probe closed ``crashed`` for its own reason, or never closed although its attempt is
    over (a later restart, or the run is no longer running) or its rows stopped ``stale_ns`` before the others';
    without any ``lifecycle`` rows, an attempt followed by a restart (``restarts``: the runtime's ``restart``
    rows) is a failure too. The first to die is the first failure, else the lost rank whose rows stopped first;
    the others lost in that attempt are ``also_lost`` (consequences: torchrun ends the survivors). ``stalls``
    (``hangs.stalls``): a collective the others entered and the dead rank never did bounds its step from below
    (its last rows may have been lost with it). ``devices`` (or a function giving it: read only when an attempt
    failed) says whether the culprit's device reported an Xid. ``starts``: ``liveness.attempt_starts`` (a rank's
    rows of an attempt end where the next one starts). Columns: ``CRASH_COLUMNS``."""
    # the attempt of a collective row: its restart column, else (older runs) the attempt unique_seq numbered
    require_columns(collectives, ["rank", "pg", "seq", "op", "peer", "step", "enqueue_ns", "end_ns", "restart"],
                    table="collectives")
    require_columns(steps, ["rank", "step", "start_ns", "end_ns", "restart"], table="steps")
    coll = collectives.assign(restart=collectives["restart"].fillna(
        collectives["seq"].fillna(0).astype("int64") // ATTEMPT_SEQ_STRIDE).astype("int64")) \
        if not collectives.empty else collectives
    st = steps.assign(restart=steps["restart"].fillna(0).astype("int64")) if not steps.empty else steps
    rows = []
    candidates = _failed_attempts(exits, activity=activity, restarts=restarts, status=status, st=st, coll=coll,
                                  attempts_known=attempts_known, stale_ns=stale_ns, now_ns=now_ns,
                                  starts=starts)
    for restart, lost, culprit, ex in candidates:
        t_end = _attempt_end_ns(st, coll, restart, starts)
        died_ns = ex.get("exit_ns") if ex and not is_missing(ex.get("exit_ns")) else activity.last_ns(culprit,
                                                                                                  before_ns=t_end)
        mine_c = coll[(coll["rank"] == culprit) & (coll["restart"] == restart)] if not coll.empty else coll
        if t_end is not None and not mine_c.empty:
            mine_c = mine_c[mine_c["enqueue_ns"] < t_end]
        open_ = mine_c[mine_c["end_ns"].isna()] if not mine_c.empty else mine_c
        doing = (open_ if not open_.empty else mine_c)
        doing = doing.sort_values("enqueue_ns").iloc[-1] if not doing.empty else None
        st_r = st[st["restart"] == restart] if not st.empty else st
        mine_s = st[(st["rank"] == culprit) & (st["restart"] == restart) & st["end_ns"].notna()] if not st.empty \
            else st
        last_step = int(mine_s["step"].max()) if not mine_s.empty else None
        step = (int(doing["step"]) if doing is not None and not open_.empty and not is_missing(doing["step"])
                else last_step + 1 if last_step is not None else None)
        waited = ([int(x.step) for x in stalls.itertuples(index=False) if not is_missing(x.step)
                   and int(x.seq) // ATTEMPT_SEQ_STRIDE == restart and str(culprit) in str(x.missing_ranks).split(",")
                   and (t_end is None or int(x.first_enqueue_ns) < t_end)
                   and (died_ns is None or is_missing(died_ns) or int(x.first_enqueue_ns) >= int(died_ns) - stale_ns)]
                  if stalls is not None and not stalls.empty else [])
        if waited and (step is None or min(waited) > step):
            step = min(waited)
        if callable(devices):
            devices = devices()
        xid = bool(not devices.empty and "xid" in devices.columns and
                   (devices[(devices["rank"] == culprit)]["xid"].fillna(0) > 0).any())
        cause = classify_cause(exit_code=ex.get("exit_code"), signal=ex.get("signal"),
                               error_type=ex.get("error_type"), error_message=ex.get("error_message"),
                               reason=ex.get("reason"), closed=ex.get("closed"), xid=xid,
                               stderr=ex.get("stderr_tail"), oom_kill=ex.get("oom_kill")) if ex else "unknown"
        inside = doing is not None and not open_.empty
        if inside and not is_missing(doing["step"]) and not is_missing(doing["enqueue_ns"]):
            phase = phase_at(st_r, culprit, int(doing["step"]), int(doing["enqueue_ns"]))
        elif step is not None and not is_missing(died_ns):   # not inside a collective: the phase it died in
            phase = phase_at(st_r, culprit, step, int(died_ns))
        else:
            phase = None
        rec = _recovery(restart, st, restarts, died_ns, last_step)
        rows.append({
            "restart": restart, "rank": culprit, "time_ns": died_ns, "step": step, "last_step": last_step,
            "exit_code": ex.get("exit_code") if ex else None, "signal": ex.get("signal") if ex else None,
            "error_type": ex.get("error_type") if ex else None,
            "error_message": ex.get("error_message") if ex else None,
            "stderr_tail": ex.get("stderr_tail") if ex else None, "oom_kill": ex.get("oom_kill") if ex else None,
            "cause": cause,
            "doing_pg": doing["pg"] if doing is not None else None,
            "doing_seq": int(doing["seq"]) % ATTEMPT_SEQ_STRIDE if doing is not None else None,
            "doing_op": doing["op"] if doing is not None else None,
            "doing_peer": None if doing is None or is_missing(doing["peer"]) else int(doing["peer"]),
            "doing_step": None if doing is None or is_missing(doing["step"]) else int(doing["step"]),
            "doing_open": bool(doing is not None and not open_.empty), "phase": phase,
            "also_lost": sorted(r for r in lost if r != culprit), **rec,
            "source": ex.get("source") if ex else "restart",
        })
    if not rows:
        return pd.DataFrame({c: [] for c in CRASH_COLUMNS})
    return pd.DataFrame(rows)[CRASH_COLUMNS]


def _failed_attempts(exits: pd.DataFrame, *, activity: Activity, restarts: list[dict], status: str,
                     st: pd.DataFrame, coll: pd.DataFrame, attempts_known: bool, stale_ns: int,
                     now_ns: int, starts: list[int] = ()) -> list[tuple[int, list[int], int, dict | None]]:
    """[(restart, lost ranks, culprit, culprit's exit row)] per failed attempt."""
    out = []
    restart_ids = sorted({int(r["restart"]) for r in restarts})
    if not exits.empty:
        latest = int(exits["restart"].max())
        for restart, g in exits.groupby("restart"):
            restart = int(restart)
            recs = [{k: (None if is_missing(v) else v) for k, v in r.items()} for r in g.to_dict("records")]
            end = _attempt_end_ns(st, coll, restart, starts)   # a later attempt's rows say nothing of this one

            def last_ns(rank: int) -> int | None:
                return activity.last_ns(rank, before_ns=end)
            over = restart < latest or restart + 1 in restart_ids or status != "running"
            if attempts_known and any(r["source"] == "attempts" for r in recs):
                lost = [r for r in recs if is_own_failure(r)]
                firsts = [r for r in lost if r.get("first_failure")] or lost
                if firsts:
                    first = min(firsts, key=lambda r: (r.get("exit_ns") or 0, r["rank"]))
                    if first.get("exit_code") is not None and int(first["exit_code"]) == WATCHDOG_EXIT_CODE:
                        continue                   # the watchdog ended a hang: HANG reports it
                    first = _silent_before(first, recs, last_ns) or first
                    lost_ranks = [int(r["rank"]) for r in recs if r.get("exit_code") not in (None, 0)]
                    out.append((restart, lost_ranks, int(first["rank"]), first))
                    continue
                # the exits name no failure of a rank's own (its status was never reported, only the others'
                # SIGTERMs): judge the attempt from the telemetry below, as without attempts
            if any(r.get("reason") == "watchdog" for r in recs):
                continue                           # the attempt ended on a hang: HANG reports it

            @functools.cache
            def newest() -> int:   # the attempt's newest row: read only when a rank may have gone silent
                return max((last_ns(r["rank"]) or 0 for r in recs), default=0)
            # a peer closed crashed (SIGTERMed, an exception): the attempt is ending, also when the run.json of a
            # plain torchrun job still says running because its leader was the rank killed
            ending = any(r.get("closed") and r.get("status") == "crashed" for r in recs)
            # a rank the launcher saw exit after a peer closed on SIGTERM was ended with the job, not lost first
            sigterm_ns = first_sigterm_ns(recs)
            lost = [r for r in recs if (r.get("closed") is False and not exited_after(r, sigterm_ns) and (
                        over or ending or newest() - (last_ns(r["rank"]) or 0) > stale_ns))
                    or (r.get("closed") and r.get("status") == "crashed"
                        and r.get("reason") not in CONSEQUENCE_REASONS)]
            if not lost:
                continue
            if all(r.get("exit_ns") is not None for r in lost):   # the launcher saw each exit: the first to go
                first = min(lost, key=lambda r: (int(r["exit_ns"]), r["rank"]))
            else:
                own = [r for r in lost if r.get("closed")] or lost  # an exception closes first; else the first silent
                first = min(own, key=lambda r: (last_ns(r["rank"]) or 0, r["rank"]))
                first = _silent_before(first, lost, last_ns) or first
            gone = [int(r["rank"]) for r in recs if r.get("closed") is False or r.get("status") == "crashed"]
            out.append((restart, gone, int(first["rank"]), first))
        return out
    # no lifecycle rows at all (an older run): a restart says its previous attempt failed
    for restart in restart_ids:
        prev = restart - 1
        t_end = _attempt_end_ns(st, coll, prev, starts)
        ranks = sorted({int(r) for r in st[st["restart"] == prev]["rank"].unique()}) if not st.empty else []
        if not ranks:
            continue
        first = min(ranks, key=lambda r: (activity.last_ns(r, before_ns=t_end) or 0, r))
        out.append((prev, ranks, first, None))
    return out


def _silent_before(first: dict, recs: list[dict], last_ns: Callable[[int], int | None]) -> dict | None:
    """A rank of the attempt that went silent (never closed, not stopped by torchrun's SIGTERM) before ``first``
    closed its probe on an exception: ``first`` was still running after that rank's last row, so its exception
    (typically the lost connection to that rank) is the consequence and the silent rank died first. torchrun's
    own choice can name the survivor: it orders failures by whole seconds, an error file's timestamp before a
    signal's discovery. None when nothing contradicts ``first``. ``last_ns``: a rank's last row in the attempt."""
    if not first.get("closed") or first.get("status") != "crashed" or first.get("reason") in CONSEQUENCE_REASONS:
        return None
    closed_at = first.get("close_ns")
    if closed_at is None:
        return None
    silent = [r for r in recs if r is not first and r.get("closed") is False and r.get("signal") != "SIGTERM"
              and r.get("exit_code") != 0 and last_ns(r["rank"]) is not None and last_ns(r["rank"]) < int(closed_at)]
    return min(silent, key=lambda r: (last_ns(r["rank"]), r["rank"])) if silent else None


def _attempt_end_ns(st: pd.DataFrame, coll: pd.DataFrame, restart: int, starts: list[int] = ()) -> int | None:
    """The first row of a later attempt (a step's start, a collective's enqueue, or its start in ``starts``,
    ``liveness.attempt_starts``: the launcher's, else its first attach): rows before it belong to ``restart`` or
    earlier. None when no later attempt wrote a row."""
    firsts = [starts[restart]] if restart < len(starts) else []
    if not st.empty:
        firsts.append(st[st["restart"] > restart]["start_ns"].dropna().min())
    if not coll.empty:
        firsts.append(coll[coll["restart"] > restart]["enqueue_ns"].dropna().min())
    firsts = [int(t) for t in firsts if not is_missing(t)]
    return min(firsts) if firsts else None


def _recovery(restart: int, st: pd.DataFrame, restarts: list[dict], died_ns: Any, last_step: int | None) -> dict:
    """recovered, resumed_from_step, steps_lost, time_to_recover_s of the attempt after ``restart``."""
    rec = next((r for r in restarts if int(r["restart"]) == restart + 1), None)
    nxt = st[st["restart"] == restart + 1] if not st.empty else st
    if rec is None and nxt.empty:
        return {"recovered": False, "resumed_from_step": None, "steps_lost": None, "time_to_recover_s": None}
    from_step = rec.get("from_step") if rec else None
    if from_step is None and not nxt.empty:
        from_step = int(nxt["step"].min())
    lost = rec.get("steps_lost") if rec else None
    if lost is None and from_step is not None and last_step is not None:
        lost = max(0, last_step - int(from_step) + 1)
    first_ns = nxt["start_ns"].dropna().min() if not nxt.empty else None
    ttr = ((int(first_ns) - int(died_ns)) / 1e9 if first_ns is not None and not is_missing(first_ns)
           and died_ns is not None and not is_missing(died_ns) else None)
    return {"recovered": not nxt.empty or rec is not None, "resumed_from_step": from_step, "steps_lost": lost,
            "time_to_recover_s": ttr}


def how(e: Any) -> str:
    """``SIGKILL``, ``exit code 1``, ``RuntimeError: ...`` or ``no close`` for one crash row."""
    if not is_missing(e.error_type):
        msg = "" if is_missing(e.error_message) else f": {str(e.error_message).splitlines()[0][:120]}"
        return f"{e.error_type}{msg}"
    if not is_missing(e.signal):
        if _oom_killed(e.oom_kill):
            return f"{e.signal} from the kernel's OOM killer"
        if str(e.signal) not in SELF_SIGNALS:
            return str(e.signal)
        message, where = stderr_quote(e.stderr_tail)
        return (str(e.signal) + (f" in {where}" if where else "")
                + (f", its stderr: \"{message[:120]}\"" if message else ""))
    if not is_missing(e.exit_code):
        last = ("" if is_missing(e.stderr_tail)
                else f", its stderr ending \"{str(e.stderr_tail).splitlines()[-1][:120]}\"")
        return f"exit code {int(e.exit_code)}{last}"
    if e.source == "attempts":
        return "exited, status not reported; its probe never closed"
    return "its probe never closed" if e.source == "lifecycle" else "stopped writing (the job restarted)"


def crash_title(e: Any) -> str:
    """One line naming a crash and its recovery (also the line the report header and the Overview show)."""
    if not is_missing(e.step):
        where = f" at step {int(e.step)}"
    elif is_missing(e.last_step):   # no step of its attempt ended on it: e.g. a restart that failed to start
        where = " before completing a step" + (f" of attempt {int(e.restart)}" if int(e.restart) else "")
    else:
        where = ""
    doing = (f" in {e.doing_op} #{int(e.doing_seq)} on {e.doing_pg}" if e.doing_open and not is_missing(e.doing_op)
             else "")
    head = f"rank {int(e.rank)} died{where}{doing} ({how(e)}; cause {e.cause})"
    if e.recovered:
        tail = f"; the job restarted (attempt {int(e.restart) + 1})"
        if not is_missing(e.resumed_from_step):
            tail += f" from step {int(e.resumed_from_step)}"
        if not is_missing(e.steps_lost):
            tail += f", {int(e.steps_lost)} step(s) lost"
        if not is_missing(e.time_to_recover_s):
            tail += f", {e.time_to_recover_s:.1f} s to recover"
        return head + tail
    return head + "; the job did not recover"


def detect_crashes(events: pd.DataFrame, *, num_restarts: int = 0, missing: pd.DataFrame | None = None,
                   injected_ranks: frozenset = frozenset(), explained_ranks: frozenset = frozenset(),
                   waited: Callable[[Any], int] = lambda stall: int(stall.waited_ns)) -> list[Finding]:
    """RANK_CRASH per crash event (``crash_events``): critical when the job did not recover, warning when it
    resumed. A first failure among ``explained_ranks`` (ranks a HANG or COLLECTIVE_MISMATCH already names or
    holds waiting) is not reported unless it has a cause of its own (out of memory, a device error, a Python
    exception with its type known): a waiter's collective timeout is the hang's consequence. ``missing``: stalls
    whose missing ranks include the crashed one, in its attempt (``waited_at``), each waited for ``waited(stall)``
    ns. ``injected_ranks``: ranks with an injected ``crash`` row (cross-check only)."""
    findings = []
    for e in events.itertuples(index=False):
        specific = e.cause in ("out_of_memory", "device") or (e.cause == "user_exception"
                                                               and not is_missing(e.error_type))
        if int(e.rank) in explained_ranks and not specific:
            continue                       # e.g. a waiter's collective timeout, or its probe closed on it
        waited_at = [] if missing is None or missing.empty else [
            {"pg": m.pg, "seq": int(m.seq) % ATTEMPT_SEQ_STRIDE, "op": m.op, "step": m.step,
             "waited_s": waited(m) / 1e9, "arrived_ranks": [int(x) for x in str(m.arrived_ranks).split(",") if x]}
            for m in missing.itertuples(index=False)
            if int(m.seq) // ATTEMPT_SEQ_STRIDE == int(e.restart) and (
                str(int(e.rank)) in str(m.missing_ranks).split(",")
                or (not m.missing_ranks and str(int(e.rank)) in str(m.arrived_ranks).split(",")))]
        findings.append(Finding(
            code="RANK_CRASH", severity="warning" if e.recovered else "critical", ranks=(int(e.rank),), group=None,
            title=crash_title(e),
            evidence={
                "rank": int(e.rank), "restart": int(e.restart), "step": e.step, "last_step": e.last_step,
                "time_ns": e.time_ns, "exit_code": e.exit_code, "signal": e.signal, "error_type": e.error_type,
                "error_message": e.error_message, "stderr_tail": e.stderr_tail,
                "oom_kill": None if is_missing(e.oom_kill) else e.oom_kill, "cause": e.cause,
                "doing": None if is_missing(e.doing_op) else {
                    "pg": e.doing_pg, "seq": e.doing_seq, "op": e.doing_op, "peer": e.doing_peer,
                    "step": e.doing_step, "open": bool(e.doing_open)},
                "phase": e.phase, "also_lost": list(e.also_lost), "recovered": bool(e.recovered),
                "resumed_from_step": e.resumed_from_step, "steps_lost": e.steps_lost,
                "time_to_recover_s": e.time_to_recover_s, "num_restarts": int(num_restarts), "waited_at": waited_at,
                "source": e.source, "injected": int(e.rank) in injected_ranks,
            },
            recommendation=_advice(e.cause, int(e.rank), signal=e.signal, oom_killed=_oom_killed(e.oom_kill),
                                   said=" ".join(
                str(x) for x in (e.error_message, stderr_errors(e.stderr_tail)) if not is_missing(x))),
            predicted_gain=None,
        ))
    return findings


CRASH_KEYS = ("restart", "step", "cause", "signal", "exit_code", "error_type", "recovered", "resumed_from_step",
              "steps_lost", "time_to_recover_s")
"""The keys of a ``metrics.run.crashes`` entry besides ``rank``, ``title`` and ``explained_by``."""


def crash_entries(events: pd.DataFrame, findings: list[Finding]) -> list[dict]:
    """``metrics.run.crashes``: one entry per RANK_CRASH finding, then one per crash event (``crash_events``) that
    no RANK_CRASH names because a HANG or COLLECTIVE_MISMATCH of ``findings`` explains it (the rank that failed
    first was waiting in it, or aborted on it), with ``explained_by`` that finding's code and the title saying so:
    the header names how every failed attempt ended."""
    named = [f for f in findings if f.code == "RANK_CRASH"]
    out = [{"rank": f.ranks[0], **{k: f.evidence.get(k) for k in CRASH_KEYS}, "title": f.title,
            "explained_by": None} for f in named]
    told = {(f.ranks[0], int(f.evidence["restart"])) for f in named}
    for e in events.itertuples(index=False):
        if (int(e.rank), int(e.restart)) in told:
            continue
        code = _explaining_code(int(e.rank), int(e.restart), findings)
        if code is None:    # a crash no finding reports (e.g. at the edge of a profiler window): not a failure seen
            continue
        out.append({"rank": int(e.rank), **{k: jsonable(getattr(e, k)) for k in CRASH_KEYS},
                    "title": f"{crash_title(e)} (a consequence of the {code})", "explained_by": code})
    return sorted(out, key=lambda c: (int(c["restart"]), c["explained_by"] is not None))


def _explaining_code(rank: int, restart: int, findings: list[Finding]) -> str | None:
    """COLLECTIVE_MISMATCH when ``rank`` is a member of a group one names in attempt ``restart``, else HANG when
    one names the rank or holds it waiting (as ``failures.detect_failures`` leaves the crash out), else None."""
    for f in findings:
        if (f.code == "COLLECTIVE_MISMATCH" and int(f.evidence.get("restart") or 0) == restart
                and rank in f.evidence["pg_ranks"]):
            return f.code
    for f in findings:
        if f.code == "HANG" and (rank in f.ranks or rank in (f.evidence.get("arrived_ranks") or [])):
            return f.code
    return None


def _oom_killed(oom_kill: Any) -> bool:
    """The launcher recorded evidence that the kernel's OOM killer ended the rank or its DataLoader worker."""
    return not is_missing(oom_kill) and bool(oom_kill)


def _advice(cause: str, rank: int, *, signal: Any = None, said: str = "", oom_killed: bool = False) -> str:
    tail = (" Keep torchrun --max-restarts and frequent enough checkpoints (see CHECKPOINT_STALL / Young-Daly) so "
            "a crash loses few steps.")
    if cause == "communication" and _SIZE_MISMATCH.search(said):
        return (f"Rank {rank} received a message larger than the collective it had posted (gloo's size check): its "
                f"peers issued another collective or another size at the same point, so one rank skipped or "
                f"reordered a collective (a branch on the rank or the data, a parameter without a gradient). "
                f"Compare the ranks' code paths before this step; the network is not at fault.")
    died = DATALOADER_WORKER_DIED.search(said)
    if died and oom_killed:
        return (f"The kernel's OOM killer ended a DataLoader worker of rank {rank}: the rank's processes went over "
                f"the memory limit of its machine or container. Lower num_workers or prefetch_factor, or find what "
                f"grows in the workers (a dataset of Python objects each worker copies as it reads them).")
    if died and died.group("signal") == "Bus error":
        return (f"A DataLoader worker of rank {rank} died of a bus error: its shared memory (/dev/shm) is too small "
                f"for the batches in flight. Give the container more (docker --shm-size, a memory-backed emptyDir "
                f"on Kubernetes) or lower num_workers or prefetch_factor.")
    if died and died.group("signal") == "Killed":
        return (f"A DataLoader worker of rank {rank} was killed (SIGKILL), most often by the kernel's OOM killer "
                f"(dmesg says so): lower num_workers or prefetch_factor, or find what grows in the workers' memory.")
    if oom_killed:
        return (f"The kernel's OOM killer ended rank {rank}: its process went over the memory limit of its machine "
                f"or container (host memory). Look for what grows in it (tensors kept across steps, dataloader "
                f"workers and prefetch, pinned buffers) in its memory rows, lower the micro-batch, or give it a "
                f"higher limit.")
    return {
        "out_of_memory": f"Rank {rank} ran out of memory: lower the micro-batch or sequence length, shard more "
                         f"(ZeRO/FSDP), or enable activation checkpointing.",
        "device": f"Rank {rank} hit a device error: check its GPU (nvidia-smi -q, dmesg for Xid) and drain the "
                  f"node if it repeats.",
        "communication": f"Rank {rank} failed first in communication: check its node's network (link, NIC, "
                         f"firewall) and the peers it talked to.",
        "user_exception": f"Rank {rank} raised an exception: read the traceback in its stderr (or the error above).",
        "killed_by_signal": (f"Rank {rank} ended on {signal} in native code (a C++ abort or a memory fault): read "
                             f"its stderr above the fault dump, and check the native libraries and extensions it "
                             f"ran (versions, custom kernels)." if str(signal) in SELF_SIGNALS else
                             f"Rank {rank} was killed by a signal: look for the OOM killer (dmesg), a scheduler "
                             f"preemption or an operator's kill."),
    }.get(cause, f"Read rank {rank}'s stderr.") + tail


def restart_summary(restarts: list[dict]) -> list[dict]:
    """The run's restarts (``metrics.run.restarts``): restart, time_ns, from_step, checkpoint_step, steps_lost."""
    return [{k: r.get(k) for k in ("restart", "time_ns", "from_step", "checkpoint_step", "steps_lost")}
            for r in sorted(restarts, key=lambda r: int(r["restart"]))]


def restarts_of(manifest: Any, faults: pd.DataFrame) -> list[dict]:
    """Restarts from the manifest, completed by the runtime's ``restart`` fault rows (non-injected; detail:
    from_step, checkpoint_step, last_step, steps_lost)."""
    out: dict[int, dict] = {}
    for r in getattr(manifest, "restarts", None) or ():
        out[int(r.restart)] = {"restart": int(r.restart), "time_ns": r.time_ns, "from_step": r.from_step,
                               "steps_lost": r.steps_lost}
    if faults is not None and not faults.empty:
        rows = faults[(faults["kind"] == "restart") & ~is_injected(faults)]
        for f in rows.itertuples(index=False):
            d = fault_detail(f.detail)
            if d.get("restart") is None:
                continue
            rec = out.setdefault(int(d["restart"]), {"restart": int(d["restart"]), "time_ns": int(f.time_ns)})
            for k in ("from_step", "checkpoint_step", "last_step", "steps_lost"):
                if rec.get(k) is None and d.get(k) is not None:
                    rec[k] = d[k]
    return [out[k] for k in sorted(out)]
