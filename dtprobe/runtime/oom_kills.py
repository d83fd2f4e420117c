"""Whether the kernel's OOM killer ended a worker: the evidence behind a SIGKILLed rank's cause ``out_of_memory``.

A worker over its memory limit (the machine's, or a container's or cgroup's: a Kubernetes pod's limit) is ended by
the kernel with SIGKILL; torchrun reports only the signal. Two sources, read by the launcher's ``ExitWatcher``
when a worker of its node exits on SIGKILL, and again when it records the attempt:

1. The kernel log (``/dev/kmsg``; readable by root, or with CAP_SYSLOG where ``kernel.dmesg_restrict`` is set): the
   OOM killer's line names the process it killed, ``Memory cgroup out of memory: Killed process 4321 (python)
   total-vm:..., anon-rss:...`` (``Out of memory: Killed process ...`` for the whole machine). Certain, but the pid
   is the one of the kernel's initial pid namespace: a launcher inside a container with its own pid namespace
   does not find its workers there (and usually cannot read the log).
2. The worker's memory cgroup (read while the worker lives; cgroup v1 ``memory.oom_control``, v2
   ``memory.events``): its ``oom_kill`` count grew while the worker ran. The count is of the cgroup, not of the
   process, so this says the worker was most likely the one killed: it is the one that died on SIGKILL then.
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Iterable
from pathlib import Path

KMSG = "/dev/kmsg"
CGROUP_ROOT = "/sys/fs/cgroup"
MAX_KMSG_RECORDS = 100_000
"""At most this many kernel log records are read (the log is a ring buffer of a few MB at most)."""
_KILLED = re.compile(r"Killed process (\d+) \(")


def kernel_oom_kill(pid: int, *, since_ns: int | None = None, kmsg: str | os.PathLike | None = None) -> str | None:
    """The OOM killer's line about ``pid`` (``kernel_oom_kills``), else None."""
    return kernel_oom_kills([pid], since_ns=since_ns, kmsg=kmsg).get(pid)


def kernel_oom_kills(pids: Iterable[int], *, since_ns: int | None = None, kmsg: str | os.PathLike | None = None
                     ) -> dict[int, str]:
    """pid -> the OOM killer's line about it in the kernel log (``kmsg``, default ``KMSG``, read once), logged at
    or after ``since_ns`` (wall clock; a pid reused since an older kill is not mistaken for it), for the ``pids``
    it names (none when the log cannot be read)."""
    wanted = set(pids)
    try:
        fd = os.open(kmsg or KMSG, os.O_RDONLY | os.O_NONBLOCK)
    except OSError:
        return {}
    boot_ns = time.time_ns() - time.monotonic_ns()   # the log's timestamps count from boot (the monotonic clock)
    found: dict[int, str] = {}
    try:
        chunks = []
        for _ in range(MAX_KMSG_RECORDS):            # /dev/kmsg gives one record per read; a file, blocks
            try:
                chunk = os.read(fd, 8192)
            except BlockingIOError:
                break                                # the end of the log
            except OSError:
                continue                             # EPIPE: a record overwritten while read; the next one follows
            if not chunk:
                break
            chunks.append(chunk)
    finally:
        os.close(fd)
    for line in b"".join(chunks).decode(errors="replace").splitlines():
        head, sep, message = line.partition(";")      # "<prio>,<seq>,<usec since boot>,<flags>;<message>"
        match = _KILLED.search(message) if sep else None
        if match is None or int(match.group(1)) not in wanted:
            continue
        fields = head.split(",")
        if since_ns is not None and len(fields) > 2 and fields[2].isdigit():
            if boot_ns + int(fields[2]) * 1000 < since_ns:
                continue
        found[int(match.group(1))] = message.strip()[:300]
    return found


def memory_cgroup(pid: int, *, root: str | os.PathLike | None = None) -> Path | None:
    """The memory cgroup directory of the live process ``pid`` (v1 ``memory`` controller, else the v2 unified
    hierarchy) under ``root`` (default ``CGROUP_ROOT``), or None."""
    root = root or CGROUP_ROOT
    try:
        lines = Path(f"/proc/{pid}/cgroup").read_text().splitlines()
    except OSError:
        return None
    v1 = v2 = None
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(","):
            v1 = Path(root) / "memory" / path.lstrip("/")
        elif controllers == "":
            v2 = Path(root) / path.lstrip("/")
    for candidate in (v1, v2):
        if candidate is not None and oom_kill_count(candidate) is not None:
            return candidate
    return None


def oom_kill_count(cgroup: Path) -> int | None:
    """The ``oom_kill`` count of a memory cgroup directory (v1 ``memory.oom_control``, v2 ``memory.events``), or
    None when it has none."""
    for name in ("memory.oom_control", "memory.events"):
        try:
            text = (cgroup / name).read_text()
        except OSError:
            continue
        for line in text.splitlines():
            key, _, value = line.partition(" ")
            if key == "oom_kill" and value.strip().isdigit():
                return int(value)
    return None


def oom_evidence(pid: int, *, since_ns: int | None, cgroup: tuple[Path, int] | None,
                 kmsg: str | os.PathLike | None = None) -> str | None:
    """What says the kernel's OOM killer ended ``pid`` (a worker that died on SIGKILL): the kernel log's line, else
    its memory cgroup's ``oom_kill`` count grown since ``cgroup`` = (directory, count while it lived); None when
    neither does."""
    line = kernel_oom_kill(pid, since_ns=since_ns, kmsg=kmsg)
    if line:
        return line
    if cgroup is not None:
        now = oom_kill_count(cgroup[0])
        if now is not None and now > cgroup[1]:
            return (f"its memory cgroup {cgroup[0]} counted {now - cgroup[1]} OOM kill(s) while it ran "
                    f"(oom_kill {now})")
    return None
