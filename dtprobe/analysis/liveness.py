"""How each rank's attempts ended and whether it was alive at a moment: per-rank exits (from the launcher's
``attempts`` in run.json, else the probe's ``lifecycle`` rows), signs of life (any row a rank wrote), and the
liveness verdict of a stuck rank (``dead``, ``exited``, ``stopped``, ``waiting``, ``alive``). Read by the HANG
and RANK_CRASH detectors (``hangs.py``, ``crashes.py``) through the facade."""

from __future__ import annotations

from typing import Any, Callable, Iterable

import numpy as np
import pandas as pd

from dtprobe.analysis.fault_detail import split_injected

WATCHDOG_EXIT_CODE = 124
"""Exit code of a rank whose hang watchdog fired (``dtprobe.runtime.hang.HANG_EXIT_CODE``, as ``timeout(1)``):
the end of a hang, not a crash."""
CONSEQUENCE_REASONS = frozenset({"SIGTERM", "watchdog"})
"""``lifecycle`` close reasons of a rank ended from outside (torchrun's SIGTERM after another rank failed) or by
its own watchdog (a hang): never the first failure of an attempt."""
LIVE_GRACE_NS = 1_000_000_000
"""A row must be this much later than a stall's start to prove its rank alive after the stall (rows written
just after it may have been produced before it)."""

EXIT_COLUMNS = ["rank", "restart", "exit_ns", "exit_code", "signal", "first_failure", "status", "reason",
                "error_type", "error_message", "traceback", "stderr_tail", "oom_kill", "closed", "close_ns", "source",
                "interrupted"]
EXITED_AT_STALL_NS = 1_000_000_000
"""A rank whose process exited (launcher's exit time) without closing at most this long after a stall began died
then; one that exits later was frozen in the stall (a stopped rank is killed once the others give up)."""
LIVENESS = ("dead", "exited", "stopped", "waiting", "alive", "unknown")
"""Liveness verdicts of a stuck rank (docs/findings.md, HANG)."""


def attempts_of(manifest: Any) -> list[dict]:
    """run.json ``attempts`` (the launcher's per-attempt, per-node record of every rank's exit); [] when the run
    has none (plain torchrun with ``dtprobe.attach``, or an older run)."""
    if manifest is None:
        return []
    attempts = getattr(manifest, "attempts", None)
    if attempts is None:
        attempts = (getattr(manifest, "extra", None) or {}).get("attempts")
    return [dict(a) for a in attempts or ()]


def rank_exits(attempts: list[dict], lifecycle: pd.DataFrame) -> pd.DataFrame:
    """Per (rank, restart): how that incarnation ended. From ``attempts`` when the launcher recorded them (exit
    code, signal, ``first_failure``, the Python error), with the ``lifecycle`` close row's status/reason merged in;
    else from ``lifecycle`` alone (a rank with an ``attach`` row and no ``close`` row: ``closed`` False).
    ``source``: ``attempts`` or ``lifecycle``; ``interrupted``: its node's launcher recorded the attempt as
    stopped on an interrupt (Ctrl-C or SIGTERM to the launcher: whatever SIGTERM its ranks got came from there).
    Columns: ``EXIT_COLUMNS``."""
    rows: dict[tuple[int, int], dict] = {}
    for a in attempts:
        restart = int(a.get("attempt") or 0)
        for r in a.get("ranks") or ():
            err = r.get("error") or {}
            rows[(int(r["rank"]), restart)] = {
                "rank": int(r["rank"]), "restart": restart, "exit_ns": r.get("time_ns") or a.get("ended_ns"),
                "exit_code": r.get("exit_code"), "signal": r.get("signal"),
                "first_failure": bool(r.get("first_failure")), "status": None, "reason": None,
                "error_type": err.get("type"), "error_message": err.get("message"),
                "traceback": err.get("traceback"), "stderr_tail": r.get("stderr_tail"),
                "oom_kill": r.get("oom_kill"), "closed": None, "close_ns": None, "source": "attempts",
                "interrupted": a.get("result") == "interrupted"}
    if lifecycle is not None and not lifecycle.empty:
        lc = lifecycle.assign(restart=lifecycle["restart"].fillna(0).astype("int64"))
        for (rank, restart), g in lc.groupby(["rank", "restart"]):
            key = (int(rank), int(restart))
            close = g[g["event"] == "close"]
            c = close.iloc[-1] if not close.empty else None
            row = rows.setdefault(key, {
                "rank": key[0], "restart": key[1], "exit_ns": None, "exit_code": None, "signal": None,
                "first_failure": False, "status": None, "reason": None, "error_type": None, "error_message": None,
                "traceback": None, "stderr_tail": None, "oom_kill": None, "closed": None, "close_ns": None,
                "source": "lifecycle", "interrupted": False})
            row["closed"] = c is not None
            if c is not None:
                row["status"], row["reason"] = _str(c["status"]), _str(c["reason"])
                row["close_ns"] = int(c["time_ns"]) if pd.notna(c["time_ns"]) else None
                if row["exit_ns"] is None and pd.notna(c["time_ns"]):
                    row["exit_ns"] = int(c["time_ns"])
    if not rows:
        return pd.DataFrame({c: [] for c in EXIT_COLUMNS})
    return pd.DataFrame(list(rows.values()))[EXIT_COLUMNS].sort_values(["restart", "rank"]).reset_index(drop=True)


def is_own_failure(exit_row: Any) -> bool:
    """True when this exit is a failure of the rank itself (not the watchdog's exit at a hang, not torchrun's
    SIGTERM after another rank failed, not a clean exit): the attempts' ``first_failure``, a non-zero exit that
    is no consequence, or a probe closed ``crashed`` for its own reason."""
    if exit_row.get("first_failure"):
        return True
    code = exit_row.get("exit_code")
    if exit_row.get("source") == "attempts" and code is not None and not pd.isna(code):
        code = int(code)
        return code > 0 and code != WATCHDOG_EXIT_CODE and exit_row.get("reason") not in CONSEQUENCE_REASONS
    return exit_row.get("status") == "crashed" and exit_row.get("reason") not in CONSEQUENCE_REASONS


def ended_normally(ex: dict | None) -> bool:
    """True when this exit (``exit_of``) is the program's own normal end: its probe closed ``finished``
    (every row it wrote reached disk), or, without a close row, the launcher saw exit code 0; not an end forced
    from outside (SIGTERM, the hang watchdog)."""
    if ex is None or ex.get("reason") in CONSEQUENCE_REASONS or ex.get("signal"):
        return False
    if ex.get("closed") is True:
        return ex.get("status") == "finished"
    code = ex.get("exit_code")
    return ex.get("closed") is None and code is not None and not pd.isna(code) and int(code) == 0


class Activity:
    """Every timestamp a rank wrote (its signs of life), per rank, sorted: sampler rows, steps, collectives
    (incl. pending), non-injected faults (the watchdog's reports and stacks) and lifecycle rows.

    ``tables`` (table name -> frame) may be a function giving them: then they are read, and the timestamps sorted,
    at the first question, which a clean run's verdicts never ask (its four tables are not read).
    ``tables["collectives"]`` may hold only each rank's latest rows: all of its timestamps from
    ``collectives_from[rank]`` on (``failure_reads.FailureRows.recent``); a question about an earlier time then
    reads the rank's other rows once through ``older_collectives(rank)`` (a frame with ``enqueue_ns``,
    ``end_ns``)."""

    def __init__(self, tables: dict[str, pd.DataFrame] | Callable[[], dict[str, pd.DataFrame]], *,
                 collectives_from: dict[int, int] | None = None,
                 older_collectives: Callable[[int], pd.DataFrame] | None = None) -> None:
        self._from = dict(collectives_from or {})
        self._older = older_collectives
        self._tables = tables
        self._built: tuple[set[int], set[int], dict[int, np.ndarray]] | None = None

    def _build(self) -> tuple[set[int], set[int], dict[int, np.ndarray]]:
        if self._built is not None:
            return self._built
        tables = self._tables() if callable(self._tables) else self._tables
        parts: list[pd.DataFrame] = []
        for name, cols in (("devices", ["time_ns"]), ("steps", ["start_ns", "end_ns"]),
                           ("collectives", ["enqueue_ns", "end_ns"]), ("faults", ["time_ns"]),
                           ("lifecycle", ["time_ns"])):
            df = tables.get(name)
            if df is None or df.empty:
                continue
            if name == "faults":
                df = split_injected(df)[0]
            for col in cols:
                part = df[["rank", col]].dropna()
                parts.append(pd.DataFrame({"rank": part["rank"].astype("int64"),
                                           "time_ns": part[col].astype("int64")}))
        has_sampler = {int(r) for r in tables["devices"]["rank"].unique()} if (
            tables.get("devices") is not None and not tables["devices"].empty) else set()
        has_lifecycle = {int(r) for r in tables["lifecycle"]["rank"].unique()} if (
            tables.get("lifecycle") is not None and not tables["lifecycle"].empty) else set()
        ranks = np.concatenate([p["rank"].to_numpy(dtype="int64") for p in parts]) if parts else np.empty(0, "int64")
        times = np.concatenate([p["time_ns"].to_numpy(dtype="int64") for p in parts]) if parts else ranks
        order = np.lexsort((times, ranks))                     # by rank, then time: one sort for every rank
        ranks, times = ranks[order], times[order]
        cuts = np.flatnonzero(np.diff(ranks)) + 1
        by_rank = ({int(r): t for r, t in zip(ranks[np.r_[0, cuts]], np.split(times, cuts))} if len(ranks) else {})
        self._tables, self._built = {}, (has_sampler, has_lifecycle, by_rank)   # (the frames let go)
        return self._built

    @property
    def has_sampler(self) -> set[int]:
        """Ranks with sampler rows (the only rows a rank blocked in a collective keeps writing)."""
        return self._build()[0]

    @property
    def has_lifecycle(self) -> set[int]:
        """Ranks with lifecycle rows."""
        return self._build()[1]

    @property
    def _times(self) -> dict[int, np.ndarray]:
        return self._build()[2]

    def last_ns(self, rank: int, *, before_ns: int | None = None) -> int | None:
        """The rank's last timestamp (before ``before_ns`` if given), None if it wrote nothing (then)."""
        rank = int(rank)
        t = self._times.get(rank, np.empty(0, dtype="int64"))
        if before_ns is None:
            return int(t[-1]) if len(t) else None
        i = int(np.searchsorted(t, before_ns, side="left"))
        if rank in self._from and (not i or t[i - 1] < self._from[rank]) and self._older is not None:
            # no row known between the rank's older collectives and before_ns: they may hold the answer
            older = self._older(rank)
            t = np.sort(np.concatenate([t] + [older[c].dropna().to_numpy(dtype="int64")
                                              for c in ("enqueue_ns", "end_ns")]))
            self._times[rank] = t
            del self._from[rank]
            i = int(np.searchsorted(t, before_ns, side="left"))
        return int(t[i - 1]) if i else None

    def alive_after(self, rank: int, t_ns: int, *, until_ns: int | None = None) -> bool:
        """True if the rank wrote a row later than ``t_ns + LIVE_GRACE_NS`` (and before ``until_ns``: the start
        of the next attempt, whose new process proves nothing about the old one)."""
        last = self.last_ns(rank, before_ns=until_ns)
        return last is not None and last > t_ns + LIVE_GRACE_NS


def attempt_at(starts: list[int], t_ns: int) -> tuple[int, int | None]:
    """(the attempt running at ``t_ns``, the start of the next one or None) by ``attempt_starts``' ``starts``."""
    restart = int(np.searchsorted(np.asarray(starts, dtype="int64"), t_ns, side="right"))
    return restart, (starts[restart] if restart < len(starts) else None)


def attempt_starts(attempts: list[dict], tables: dict[str, pd.DataFrame]) -> list[int]:
    """Start (ns) of attempts 1, 2, ... (restart k at index k - 1): the launcher's ``started_ns``, else the first
    row any rank wrote with that ``restart`` (lifecycle attach, step, collective)."""
    firsts: dict[int, int] = {}
    for a in attempts:
        if a.get("attempt") and a.get("started_ns"):
            k = int(a["attempt"])
            firsts[k] = min(firsts.get(k, int(a["started_ns"])), int(a["started_ns"]))
    for name, col in (("lifecycle", "time_ns"), ("steps", "start_ns"), ("collectives", "enqueue_ns")):
        df = tables.get(name)
        if df is None or df.empty or "restart" not in df.columns:
            continue
        d = df[df["restart"].notna() & (df["restart"] > 0) & df[col].notna()]
        for k, t in d.groupby("restart")[col].min().items():
            firsts[int(k)] = min(firsts.get(int(k), int(t)), int(t))
    out, last = [], None
    for k in range(1, max(firsts, default=0) + 1):
        last = firsts.get(k, last)
        if last is None:
            break
        out.append(last)
    return out


def liveness(rank: int, since_ns: int, *, in_collective: bool, activity: Activity | None,
             exits: pd.DataFrame | None, peers: Iterable[int] = (), starts: list[int] = ()) -> str:
    """The liveness verdict of a rank stuck since ``since_ns``: ``waiting`` (rows continue after the stall and it
    is inside the stuck collective: alive, blocked), ``alive`` (rows continue, it is elsewhere), ``dead`` (no row
    after the stall and its process failed on its own: attempts' first failure / own exit, a probe closed
    crashed, or no close while its ``peers`` were SIGTERMed, which torchrun does when a worker exits (not when an
    operator stops the launcher: an ``interrupted`` peer's SIGTERM says nothing of a death), or raised in
    the collective within ``EXITED_AT_STALL_NS`` of the stall: a broken connection, where a frozen rank's peers
    wait out their timeout; or it exited unclosed or closed on SIGTERM within ``EXITED_AT_STALL_NS`` of the stall:
    torchrun ended it because another rank had died, where a frozen or stuck rank is ended only once its peers
    gave up),
    ``exited`` (no row after the stall and its program ended normally, ``ended_normally``: it never issued the
    call), ``stopped`` (no row after the stall and no own death: frozen, e.g. SIGSTOP), ``unknown`` (no sampler and no
    lifecycle rows to tell). ``starts``: ``attempt_starts`` (the verdict is about the incarnation alive at
    ``since_ns``)."""
    restart, until = attempt_at(starts, since_ns)
    if activity is not None and activity.alive_after(rank, since_ns, until_ns=until):
        return "waiting" if in_collective else "alive"
    ex = exit_of(exits, rank, restart)
    if ex is not None and is_own_failure(ex):
        return "dead"
    if ended_normally(ex):
        return "exited"                   # its program returned: whole records, no call missing from them
    if (ex is not None and ex.get("closed") is False and ex.get("exit_ns") is not None
            and int(ex["exit_ns"]) <= since_ns + EXITED_AT_STALL_NS):
        return "dead"                     # seen exiting unclosed as the stall began: killed, not frozen in it
    if (ex is not None and ex.get("reason") == "SIGTERM" and ex.get("close_ns") is not None
            and int(ex["close_ns"]) <= since_ns + EXITED_AT_STALL_NS):
        return "dead"                     # closed on torchrun's SIGTERM as the stall began: another rank had died
    if ex is not None and ex.get("closed") is False:
        peer_exits = [exit_of(exits, p, restart) or {} for p in peers]
        # a SIGTERM from an interrupted launcher (an operator's stop) says nothing of a death
        peer_reasons = {x.get("reason") for x in peer_exits if not x.get("interrupted")}
        if ("SIGTERM" in peer_reasons and "watchdog" not in peer_reasons
                and not exited_after(ex, first_sigterm_ns(peer_exits))):
            return "dead"                 # torchrun SIGTERMs the others only after a worker exited
        if any(x.get("reason") == "exception" and x.get("close_ns") is not None
               and int(x["close_ns"]) <= since_ns + EXITED_AT_STALL_NS for x in peer_exits):
            return "dead"                 # a peer's collective raised at once: its connection to this rank broke
    if activity is None or (rank not in activity.has_sampler and rank not in activity.has_lifecycle
                            and ex is None):
        return "unknown"
    return "stopped"


def first_sigterm_ns(exits: Iterable[dict]) -> int | None:
    """When the first of ``exits`` (exit rows of one attempt) closed its probe on SIGTERM; None if none did."""
    return min((int(x["close_ns"]) for x in exits if x.get("reason") == "SIGTERM" and x.get("close_ns") is not None),
               default=None)


def exited_after(ex: dict, sigterm_ns: int | None) -> bool:
    """True when the launcher saw this unclosed rank exit after a peer closed on SIGTERM at ``sigterm_ns``
    (``first_sigterm_ns``): it was ended with the job (torchrun's SIGKILL of a worker that did not stop on SIGTERM,
    e.g. a frozen one, or an operator's kill), not the death that made torchrun stop the others. False when either
    time is unknown (a plain torchrun job's killed rank has no exit time)."""
    if sigterm_ns is None or ex.get("exit_ns") is None or ex.get("source") != "attempts":
        return False
    return int(ex["exit_ns"]) > sigterm_ns


def exit_of(exits: pd.DataFrame | None, rank: int, restart: int) -> dict | None:
    """How ``rank``'s incarnation of attempt ``restart`` ended (None when unknown)."""
    if exits is None or exits.empty:
        return None
    mine = exits[(exits["rank"] == rank) & (exits["restart"] == restart)]
    if mine.empty:
        return None
    return {k: (None if is_missing(v) else v) for k, v in mine.iloc[-1].to_dict().items()}


def is_missing(v: Any) -> bool:
    """True for None, NaN and pd.NA (a null cell of a row dict)."""
    return v is None or (not isinstance(v, (str, bool, dict, list)) and pd.isna(v))


def _str(v: Any) -> str | None:
    return None if is_missing(v) else str(v)


def reference_ns(*, status: str, ended_ns: int | None, collectives: pd.DataFrame, steps: pd.DataFrame,
                 clock_ns: int) -> int:
    """Reference time for hang waits: ``clock_ns`` (now) while the run is running, else its end: the latest of
    ``ended_ns`` and the last collective end or enqueue and step end recorded (0 without any)."""
    if status == "running":
        return clock_ns
    ends = [ended_ns] if ended_ns else []
    for df, col in ((collectives, "end_ns"), (collectives, "enqueue_ns"), (steps, "end_ns")):
        if not df.empty and df[col].notna().any():
            ends.append(int(df[col].max()))
    return max(ends) if ends else 0
