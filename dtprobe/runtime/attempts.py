"""Each torchrun attempt's per-rank exits on one node, read from what torchrun leaves; written by the launcher into
run.json's ``attempts`` (``store.manifest.record_attempt``) and read by the analysis' crash verdict.

Sources (torch 2.13's elastic agent), most robust first:

1. torchrun's ``--log-dir``: one directory per attempt and local rank, ``<log dir>/<rdzv id>_*/attempt_<n>/<local
   rank>/``, created by the agent when it starts the attempt's workers. In it ``error.json`` is torchelastic's error
   file, written by ``@record`` on the worker's entry point for an uncaught exception (``{"message": {"message":
   "<Type>: <text>", "extraInfo": {"py_callstack": <traceback>, "timestamp": <s>}}}``), and ``worker.json`` is the
   worker's own record of who it is (``runtime.worker.WORKER_FILE``: rank, pid, start, and exit code 0 once it
   returned cleanly).
2. torchrun's log (``logs/torchrun.node<K>.log``, WARNING level and up), glog-prefixed lines (``E1123
   22:27:20.790000 <agent pid> .../api.py:1002] ...``, local time):
   ``failed (exitcode: X) local_rank: L (pid: P) of binary: ...`` once per failed attempt: the first observed
   failure (``first_failure``; torchrun orders failures by the second of their error file's timestamp, or of their
   discovery without one, so two failures within one second are ordered arbitrarily); ``Sending process P closing
   signal S`` for every worker the agent stopped (exit code not reported: ``exit_code`` null, ``signal`` S).
3. The ``ChildFailedError`` summary torchrun prints when it gives up (``Failures:`` ... ``Root Cause (first
   observed failure):``): global rank, local rank, exit code and pid of every failed worker of the last attempt.

4. The launcher's own sight of its node's workers (``ExitWatcher``): it waits on a pidfd of each worker of the
   current attempt (pid from ``worker.json``) and reads ``/proc`` as soon as one exits; a worker that exited is a
   zombie until torchrun's next monitor poll (every 0.5 s) reaps it, and ``/proc/<pid>/stat`` then holds its exit
   status. This gives ``time_ns`` (first seen exited) and the exit code of workers torchrun does not report.

``first_failure`` is the rank torchrun reported, unless the watcher saw another rank of the attempt exit
earlier while torchrun's choice was still alive, that rank not stopped by the agent and not exiting 0:
torchrun ranks failures by whole seconds (and by local rank within one), so a survivor that raised within the
same second as a killed peer can be reported first.

Log lines belong to the attempt that started last before their time. Not used: the agent's restart messages
(``Worker group FAILED. n/m attempts left; will restart worker group``) and start/finish messages, which are
INFO while torchrun logs WARNING and up (the ``attempt_<n>`` folders mark attempts instead); torchelastic's worker
events (``--event-log-handler``), emitted only once, for the final attempt.
"""

from __future__ import annotations

import json
import os
import re
import select
import signal
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dtprobe.runtime.oom_kills import kernel_oom_kill, kernel_oom_kills, memory_cgroup, oom_evidence, oom_kill_count
from dtprobe.stack_frames import FRAME, dataloader_worker_pids, is_library

WORKER_FILE = "worker.json"
"""Name of the worker's own record beside its error file (``runtime.worker.WORKER_FILE``)."""
ERROR_FILE = "error.json"
"""Name of torchelastic's per-worker error file."""
STDERR_FILE = "stderr.log"
"""Name of a worker's stderr in its log directory (torchrun ``--redirects``/``--tee``, which the launchers set)."""
STDERR_TAIL_LINES = 5
"""Lines of a failed worker's stderr kept in its attempt entry when it left no error file."""

_GLOG_RE = re.compile(r"^[IWEF](\d\d)(\d\d) (\d\d):(\d\d):(\d\d)\.(\d{6}) ")
_FAILED_RE = re.compile(r"failed \(exitcode: (-?\d+)\) local_rank: (\d+) \(pid: (\d+)\)")
_CLOSING_RE = re.compile(r"Sending process (\d+) closing signal (SIG[A-Z0-9]+)")
_SUMMARY_RE = re.compile(r"rank\s*:\s*(\d+) \(local_rank: (\d+)\)\s*\n\s*exitcode\s*:\s*(-?\d+) \(pid: (\d+)\)")
_ATTEMPT_RE = re.compile(r"^attempt_(\d+)$")


@dataclass
class _LogEvents:
    """What torchrun's log says about one attempt of this node."""

    first_failure: tuple[int, int, int, int | None] | None = None
    """(exit code, local rank, pid, time_ns) of the first observed failure."""
    closed: dict[int, tuple[str, int | None]] = field(default_factory=dict)
    """pid -> (signal name, time_ns) of workers the agent stopped."""


def glog_time_ns(line: str, *, now_ns: int | None = None) -> int | None:
    """Unix ns of a glog-prefixed line (``W1123 22:27:20.726000 ...``, local time, no year: the year that puts
    it at most a day after ``now_ns``); None without that prefix."""
    m = _GLOG_RE.match(line)
    if not m:
        return None
    month, day, hh, mm, ss, us = (int(g) for g in m.groups())
    now_ns = time.time_ns() if now_ns is None else now_ns
    year = time.localtime(now_ns / 1e9).tm_year
    for y in (year, year - 1):
        try:
            t = time.mktime((y, month, day, hh, mm, ss, 0, 0, -1))
        except (OverflowError, ValueError):
            return None
        t_ns = int(t) * 1_000_000_000 + us * 1000
        if t_ns <= now_ns + 86_400 * 1_000_000_000:
            return t_ns
    return None


def attempt_dirs(log_dir: Path) -> dict[int, Path]:
    """attempt number -> ``<log_dir>/<rdzv id>_*/attempt_<n>`` of the newest torchrun run under ``log_dir``."""
    runs = sorted((p for p in log_dir.glob("*") if p.is_dir() and any(p.glob("attempt_*"))),
                  key=lambda p: p.stat().st_mtime_ns) if log_dir.is_dir() else []
    if not runs:
        return {}
    out = {}
    for p in runs[-1].iterdir():
        m = _ATTEMPT_RE.match(p.name)
        if m and p.is_dir():
            out[int(m.group(1))] = p
    return dict(sorted(out.items()))


def read_error_file(path: Path) -> dict[str, str] | None:
    """``{"type", "message", "traceback"}`` from a torchelastic error file; None if absent or unreadable."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    msg = data.get("message") if isinstance(data, dict) else None
    if isinstance(msg, dict):
        text = str(msg.get("message", ""))
        tb = str((msg.get("extraInfo") or {}).get("py_callstack", ""))
    elif isinstance(msg, str):
        text, tb = msg, ""
    else:
        return None
    kind, sep, rest = text.partition(": ")
    if not sep or not kind.replace(".", "").replace("_", "").isalnum():
        kind, rest = "", text
    return {"type": kind, "message": rest, "traceback": tb}


def signal_name(exit_code: int | None) -> str | None:
    """``SIGKILL`` for -9 etc.; None for a non-negative or unknown code."""
    if exit_code is None or exit_code >= 0:
        return None
    try:
        return signal.Signals(-exit_code).name
    except ValueError:
        return None


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _log_events(log_text: str, starts: dict[int, int | None], *, now_ns: int) -> dict[int, _LogEvents]:
    """Assign torchrun's failure and closing lines to attempts by time (a line without a time: the attempt of the
    line before it)."""
    events = {n: _LogEvents() for n in starts}
    order = sorted(starts)
    current = order[0] if order else 0
    for line in log_text.splitlines():
        failed, closing = _FAILED_RE.search(line), _CLOSING_RE.search(line)
        if not failed and not closing:
            continue
        t = glog_time_ns(line, now_ns=now_ns)
        if t is not None:
            started = [n for n in order if starts[n] is not None and starts[n] <= t]
            current = started[-1] if started else (order[0] if order else 0)
        ev = events.setdefault(current, _LogEvents())
        if failed:
            code, local_rank, pid = (int(g) for g in failed.groups())
            if ev.first_failure is None:
                ev.first_failure = (code, local_rank, pid, t)
        else:
            ev.closed.setdefault(int(closing.group(1)), (closing.group(2), t))
    return events


def _summary(log_text: str) -> dict[int, tuple[int, int, int]]:
    """local rank -> (global rank, exit code, pid) from the last ChildFailedError summary in the log."""
    start = log_text.rfind("Failures:")
    if start < 0:
        return {}
    out = {}
    for m in _SUMMARY_RE.finditer(log_text[start:]):
        rank, local_rank, code, pid = (int(g) for g in m.groups())
        out[local_rank] = (rank, code, pid)
    return out


def proc_exit(pid: int) -> tuple[bool, int | None]:
    """(exited, exit code) of ``pid`` from ``/proc``: a zombie's waitpid status (-N for signal N); a pid that is
    gone: (True, None); a live one: (False, None)."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return True, None
    except OSError:
        return False, None
    fields = text[text.rindex(")") + 2:].split()
    if fields[0] not in ("Z", "X"):
        return False, None
    if len(fields) < 50:                                  # kernels before 3.5 do not show the exit status
        return True, None
    status = int(fields[-1])
    return True, (-(status & 0x7F) if status & 0x7F else (status >> 8) & 0xFF)


class ExitWatcher:
    """Watches the workers of this node's current attempt and notes when each exited and how (a thread of the
    launcher; see the module docstring). ``observed()``: pid -> (time_ns first seen exited, exit code or None).

    The thread sleeps in ``poll`` on a pidfd per worker (``os.pidfd_open``: readable once the process has exited),
    so it wakes when a worker exits, not on a timer: it runs beside the ranks on their cores, and a poll loop's
    wake-ups cost them CPU. It looks for new workers every ``scan_interval_s`` only until every local rank of the
    newest attempt has written its pid, and again once none of them is alive (a restart brings a new attempt).
    Without pidfds (another OS, an old kernel) it checks each worker in ``/proc`` every ``interval_s``.
    ``oom_kills()``: pid -> what says the kernel's OOM killer ended it or a process of its cgroup (its DataLoader
    workers) while it ran (``oom_kills.oom_evidence``), for the workers that exited on SIGKILL or with an error
    code: the memory cgroup of each worker and its ``oom_kill`` count are read when it is found."""

    def __init__(self, log_dir: Path, *, interval_s: float = 0.05, scan_interval_s: float = 0.25) -> None:
        self.log_dir = log_dir
        self.interval_s = interval_s
        self.scan_interval_s = scan_interval_s
        self._alive: set[int] = set()
        self._known: set[int] = set()
        self._complete = False                            # every local rank of the newest attempt seen
        self._observed: dict[int, tuple[int, int | None]] = {}
        self._memory: dict[int, tuple[int | None, tuple[Path, int] | None]] = {}  # pid -> (start, cgroup, count)
        self._oom: dict[int, str] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._wake_r, self._wake_w = os.pipe()            # stop() writes a byte: the poll returns at once
        self._thread = threading.Thread(target=self._run, name="dtprobe-exit-watcher", daemon=True)

    def start(self) -> "ExitWatcher":
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._stop.is_set():
            return
        self._stop.set()
        os.write(self._wake_w, b"x")
        self._thread.join(timeout=5)
        self.tick()                                       # a last look: exits since the last tick
        if not self._thread.is_alive():
            os.close(self._wake_r)
            os.close(self._wake_w)

    def observed(self) -> dict[int, tuple[int, int | None]]:
        with self._lock:
            return dict(self._observed)

    def oom_kills(self) -> dict[int, str]:
        with self._lock:
            return dict(self._oom)

    def _run(self) -> None:
        poller = select.poll()
        poller.register(self._wake_r, select.POLLIN)
        pidfds: dict[int, int] = {}                       # pidfd -> pid
        polled: set[int] = set()                          # workers without a pidfd: checked every interval_s
        next_scan = 0.0
        try:
            while not self._stop.is_set():
                scanning = not self._complete or not self._alive
                if scanning and time.monotonic() >= next_scan:
                    for pid in self.scan():
                        fd = open_pidfd(pid)
                        if fd is None:
                            polled.add(pid)
                        else:
                            pidfds[fd] = pid
                            poller.register(fd, select.POLLIN)
                    next_scan = time.monotonic() + self.scan_interval_s
                    scanning = not self._complete or not self._alive
                waits = ([max(0.0, next_scan - time.monotonic())] if scanning else []) + \
                    ([self.interval_s] if polled else [])
                ready = poller.poll(None if not waits else int(min(waits) * 1000) + 1)
                exited = [pidfds[fd] for fd, _ in ready if fd in pidfds]
                for fd in [fd for fd, _ in ready if fd in pidfds]:
                    poller.unregister(fd)
                    os.close(fd)
                    del pidfds[fd]
                self._check(exited + sorted(polled))
                polled &= self._alive
        finally:
            for fd in pidfds:
                os.close(fd)

    def scan(self) -> list[int]:
        """Start watching the workers of the newest attempt that wrote their ``worker.json``; returns the pids
        found new."""
        dirs = attempt_dirs(self.log_dir)
        if not dirs:
            return []
        new, complete = [], True
        for p in dirs[max(dirs)].iterdir():
            if not p.is_dir():
                continue
            info = _read_json(p / WORKER_FILE)
            pid = info.get("pid") if info else None
            if not isinstance(pid, int):
                complete = False                          # this local rank's worker has not started yet
            elif pid not in self._known:
                self._known.add(pid)
                self._alive.add(pid)
                new.append(pid)
                cgroup = memory_cgroup(pid)
                count = oom_kill_count(cgroup) if cgroup is not None else None
                self._memory[pid] = (info.get("started_ns"), (cgroup, count) if count is not None else None)
        self._complete = complete
        return new

    def tick(self) -> None:
        """Check every worker still thought alive."""
        self._check(sorted(self._alive))

    def _check(self, pids: list[int]) -> None:
        now = time.time_ns()
        for pid in pids:
            if pid not in self._alive:
                continue
            exited, code = proc_exit(pid)
            if exited:
                self._alive.discard(pid)
                oom = None
                # the OOM killer's SIGKILL, or an error raised over a DataLoader worker it killed (a SIGTERM, an
                # abort or a fault is neither)
                if code is not None and (code == -signal.SIGKILL or code > 0):
                    since_ns, cgroup = self._memory.get(pid, (None, None))
                    oom = oom_evidence(pid, since_ns=since_ns, cgroup=cgroup)
                with self._lock:
                    self._observed[pid] = (now, code)
                    if oom:
                        self._oom[pid] = oom


def open_pidfd(pid: int) -> int | None:
    """A pidfd of ``pid`` (readable once it has exited; the caller closes it), None where there are none (not
    Linux >= 5.3) or the process is already gone (the next check finds it exited)."""
    try:
        return os.pidfd_open(pid)
    except (AttributeError, OSError):
        return None


def read_attempts(log_dir: Path, torchrun_log: Path, *, node_rank: int, nproc: int, final: bool,
                  exit_code: int | None = None, ended_ns: int | None = None, interrupted: bool = False,
                  observed: dict[int, tuple[int, int | None]] | None = None,
                  oom_kills: dict[int, str] | None = None) -> list[dict[str, Any]]:
    """run.json ``attempts`` entries of this node (shape: ``store.manifest.Manifest.attempts``).

    ``final``: torchrun has exited with ``exit_code`` at ``ended_ns`` (``interrupted``: stopped by Ctrl-C), so
    the last attempt is complete too; otherwise the last attempt (still running) is left out. ``observed``:
    ``ExitWatcher.observed()``; ``oom_kills``: ``ExitWatcher.oom_kills()``.
    """
    observed, oom_kills = observed or {}, oom_kills or {}
    dirs = attempt_dirs(log_dir)
    if not dirs:
        return []
    workers = {n: {int(p.name): (_read_json(p / WORKER_FILE), read_error_file(p / ERROR_FILE),
                                 (p / ERROR_FILE).stat().st_mtime_ns if (p / ERROR_FILE).is_file() else None, p)
                   for p in d.iterdir() if p.is_dir() and p.name.isdigit()}
               for n, d in dirs.items()}
    starts: dict[int, int | None] = {}
    for n, d in dirs.items():
        known = [w["started_ns"] for w, _, _, _ in workers[n].values() if w and w.get("started_ns")]
        starts[n] = min(known) if known else d.stat().st_mtime_ns
    now_ns = ended_ns or time.time_ns()
    log_text = torchrun_log.read_text(errors="replace") if torchrun_log.is_file() else ""
    events = _log_events(log_text, starts, now_ns=now_ns)
    last = max(dirs)
    summary = _summary(log_text) if final else {}
    out = []
    for n in sorted(dirs):
        if n == last and not final:
            break
        ev = events.get(n, _LogEvents())
        is_last = n == last
        ranks = []
        for local_rank, (info, error, error_mtime, worker_dir) in sorted(workers[n].items()):
            ranks.append(_rank_entry(local_rank, info, error, error_mtime, ev,
                                     summary.get(local_rank) if is_last else None,
                                     node_rank=node_rank, nproc=nproc, observed=observed, worker_dir=worker_dir,
                                     oom_kills=oom_kills))
        ranks = [r for r in ranks if r is not None]
        _correct_first_failure(ranks, ev, observed)
        result = _result(ranks, ev, is_last=is_last, exit_code=exit_code, interrupted=interrupted)
        next_start = starts.get(n + 1)
        times = [r["time_ns"] for r in ranks if r["time_ns"] is not None]
        end = ended_ns if is_last else (ev.first_failure[3] if ev.first_failure and ev.first_failure[3]
                                        else (max(times) if times else next_start))
        out.append({"attempt": n, "node_rank": node_rank, "started_ns": starts[n], "ended_ns": end,
                    "result": result, "ranks": ranks})
    return out


def _correct_first_failure(ranks: list[dict[str, Any]], ev: _LogEvents,
                           observed: dict[int, tuple[int, int | None]]) -> None:
    """Move ``first_failure`` to the rank the watcher saw exit first, when it saw that one exit strictly before
    torchrun's choice (ranks the agent stopped and clean exits excluded; unseen exits change nothing)."""
    chosen = [r for r in ranks if r["first_failure"]]
    seen = [r for r in ranks if r["pid"] in observed and r["pid"] not in ev.closed and r["exit_code"] != 0]
    if not chosen or not seen:
        return
    earliest = min(seen, key=lambda r: observed[r["pid"]][0])
    first = chosen[0]
    if first["pid"] in observed and observed[earliest["pid"]][0] < observed[first["pid"]][0]:
        first["first_failure"], earliest["first_failure"] = False, True


def _rank_entry(local_rank: int, info: dict[str, Any] | None, error: dict[str, str] | None,
                error_mtime: int | None, ev: _LogEvents, summary: tuple[int, int, int] | None, *,
                node_rank: int, nproc: int, observed: dict[int, tuple[int, int | None]],
                worker_dir: Path | None = None, oom_kills: dict[int, str] | None = None) -> dict[str, Any] | None:
    """One rank's exit in one attempt, or None when nothing is known about it (no worker file, no report). A rank
    that failed on its own (a non-zero exit the agent did not cause) without an error file gets the last lines
    of its stderr (``worker_dir``'s ``stderr.log``: an exit in argparse, a ``sys.exit``, an abort). One that died on
    a SIGKILL the agent did not send gets ``oom_kill`` when the kernel's OOM killer ended it (``oom_kills``: the
    exit watcher's evidence, else the kernel log read now); so does one that raised because a worker process of its
    DataLoader died, when the OOM killer ended that one (the kernel log names its pid, or the rank's memory cgroup
    counted a kill while it ran)."""
    pid = info.get("pid") if info else None
    first = ev.first_failure is not None and ev.first_failure[1] == local_rank and (
        pid is None or ev.first_failure[2] == pid)
    if pid is None:
        pid = ev.first_failure[2] if first else (summary[2] if summary else None)
    exit_code, time_ns, sig = None, None, None
    if first:
        exit_code, time_ns = ev.first_failure[0], ev.first_failure[3]
    elif summary is not None:
        exit_code = summary[1]
    elif info and info.get("exit_code") is not None:
        exit_code = int(info["exit_code"])
    seen = observed.get(pid) if pid is not None else None
    if exit_code is None and seen is not None:
        exit_code = seen[1]
    sig = signal_name(exit_code)
    if pid in ev.closed:                                  # the agent stopped it (after another rank failed)
        closing_sig, closing_t = ev.closed[pid]
        if sig is None or sig == closing_sig:
            sig = closing_sig
            time_ns = time_ns or closing_t
    if error_mtime is not None:
        time_ns = time_ns or error_mtime
    if exit_code == 0 and info:
        time_ns = time_ns or info.get("ended_ns")
    if seen is not None:
        time_ns = seen[0]                                 # the launcher's own sight of the exit
    if info is None and not first and summary is None and error is None and pid not in ev.closed:
        return None
    if info and info.get("rank") is not None:
        rank = int(info["rank"])
    elif summary is not None:
        rank = summary[0]
    else:
        rank = node_rank * nproc + local_rank          # torchrun's order for equal nproc on every node
    entry = {"rank": rank, "local_rank": local_rank, "pid": pid, "exit_code": exit_code, "signal": sig,
             "first_failure": first, "time_ns": time_ns, "error": error}
    if error is None and exit_code not in (None, 0) and pid not in ev.closed and worker_dir is not None:
        tail = stderr_tail(worker_dir / STDERR_FILE)
        if tail:
            entry["stderr_tail"] = tail
    since_ns, seen_oom = (info.get("started_ns") if info else None), (oom_kills or {}).get(pid)
    oom = None
    if sig == "SIGKILL" and pid is not None and pid not in ev.closed:
        oom = seen_oom or kernel_oom_kill(pid, since_ns=since_ns)
    elif error is not None and exit_code not in (None, 0):
        data_workers = dataloader_worker_pids(f"{error.get('type')}: {error.get('message')}")
        lines = kernel_oom_kills(data_workers, since_ns=since_ns) if data_workers else {}
        said = [f"its DataLoader worker {w}: {lines[w]}" for w in data_workers if w in lines]
        if said:
            oom = "; ".join(said)
        elif data_workers and seen_oom:
            oom = f"its DataLoader worker(s) {', '.join(map(str, data_workers))} died, and {seen_oom}"
    if oom:
        entry["oom_kill"] = oom
    return entry


def stderr_tail(path: Path, *, lines: int = STDERR_TAIL_LINES) -> str | None:
    """What a worker's stderr log (its last ``STDERR_READ_BYTES``) says of its end, as non-blank lines, or None:
    ``stderr_excerpt`` of its text."""
    try:
        with open(path, "rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - STDERR_READ_BYTES))
            text = f.read().decode(errors="replace")
    except OSError:
        return None
    return stderr_excerpt(text, lines=lines)


def stderr_excerpt(text: str, *, lines: int = STDERR_TAIL_LINES) -> str | None:
    """The lines of a failed worker's stderr that say why it ended. A native abort (``terminate called after
    throwing ...``, as a C++ exception such as NCCL's watchdog timeout or a CUDA error ends a process) gives that
    line and its ``what():`` message, without the C++ backtrace under it; otherwise up to ``lines`` non-blank
    lines. When a fatal-signal dump of faulthandler follows (``Fatal Python error: ...`` and each thread's
    stack), the message is taken from before it, and the dump gives its header line and the failing thread's
    innermost frame and its innermost frame outside the Python installation (the script's line), each as
    faulthandler wrote it (``File "...", line N in f``)."""
    kept = [line.rstrip() for line in text.splitlines() if line.strip()]
    fatal = max((i for i, line in enumerate(kept) if line.startswith(FATAL_HEADER)), default=None)
    body, dump = (kept, []) if fatal is None else (kept[:fatal], kept[fatal:])
    term = max((i for i, line in enumerate(body) if line.startswith("terminate called")), default=None)
    if term is not None:
        message = []
        for line in body[term:]:
            if line.startswith("Exception raised from") or line.lstrip().startswith("frame #"):
                break
            message.append(line[:MESSAGE_LINE_CHARS])
        message = message[:lines]
    else:
        message = [line[:MESSAGE_LINE_CHARS] for line in body if not line.startswith("Extension modules:")][-lines:]
    return "\n".join(message + _fatal_lines(dump)) or None


FATAL_HEADER = "Fatal Python error:"
"""How faulthandler's dump on a fatal signal (SIGSEGV, SIGABRT, SIGBUS, SIGFPE, SIGILL) starts."""
STDERR_READ_BYTES = 32768
"""How much of the end of a failed worker's stderr is read (a fatal-signal dump lists every thread's stack)."""
MESSAGE_LINE_CHARS = 1000
"""A longer stderr line is cut to this many characters in the excerpt."""


def _fatal_lines(dump: list[str]) -> list[str]:
    """The header of a faulthandler dump and the frames ``stderr_excerpt`` keeps: the failing thread's, or, when
    a thread without Python frames failed (a C++ exception in gloo's or NCCL's own thread: faulthandler then marks
    no thread current), the main thread's, which it lists last (where the script waited, e.g. in the collective
    whose peer sent the failing message)."""
    if not dump:
        return []
    blocks: list[tuple[bool, list[str]]] = []           # (current, frames) per thread, in the dump's order
    for line in dump[1:]:
        if line.startswith(("Current thread", "Thread ")):
            blocks.append((line.startswith("Current thread"), []))
        elif blocks and line.lstrip().startswith('File "'):
            blocks[-1][1].append(line.strip())
    frames = next((f for current, f in blocks if current), blocks[-1][1] if blocks else [])
    out = [dump[0]]
    if frames:
        out.append(frames[0])
        own = next((f for f in frames if (m := FRAME.match(f)) and not is_library(m["path"])), None)
        if own is not None and own != frames[0]:
            out.append(own)
    return out


def _result(ranks: list[dict[str, Any]], ev: _LogEvents, *, is_last: bool, exit_code: int | None,
            interrupted: bool) -> str:
    if is_last and exit_code == 0:
        return "succeeded"
    failed = ev.first_failure is not None or any(
        r["error"] is not None or (r["exit_code"] not in (None, 0) and r["pid"] not in ev.closed) for r in ranks)
    if failed:
        return "failed"
    if is_last and not interrupted and exit_code not in (None, 0):
        return "failed"
    return "interrupted"
