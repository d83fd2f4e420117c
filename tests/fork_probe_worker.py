"""Stands in for ``dtprobe.runtime.worker`` in ``test_fork_start.py``: a forked worker that prints what it was
given (argv, environment, session, parent, signal handlers, descriptors, loggers, whether a lock an agent thread
holds is free) as one JSON line on stdout, a line on stderr, then ends as ``sys.argv[1]`` says (return, exit3,
raise, sigkill, interrupt, sleep)."""

from __future__ import annotations

import ctypes
import json
import logging
import os
import signal
import sys
import threading
import time

import fork_probe_warm     # imported by the agent before the fork: a forked worker has the agent's module


def c_getenv(name: str) -> str | None:
    getenv = ctypes.CDLL(None).getenv
    getenv.restype = ctypes.c_char_p
    value = getenv(name.encode())
    return value.decode() if value is not None else None


def report() -> dict:
    return {"name": __name__, "argv": sys.argv, "pid": os.getpid(), "sid": os.getsid(0), "pgid": os.getpgid(0),
            "rank": os.environ.get("RANK"), "c_rank": c_getenv("RANK"), "extra": os.environ.get("EXTRA"),
            "handlers": {name: repr(signal.getsignal(getattr(signal, name))) for name in ("SIGTERM", "SIGINT",
                                                                                       "SIGHUP", "SIGPIPE")},
            "fds": sorted(int(fd) for fd in os.listdir("/proc/self/fd")),
            "root_handlers": len(logging.getLogger().handlers), "stdin": os.readlink("/proc/self/fd/0"),
            "main_native_id": threading.main_thread().native_id, "ppid": os.getppid(),
            "grandparent": int(open(f"/proc/{os.getppid()}/stat").read().rsplit(")", 1)[1].split()[1]),
            "warm_lock_free": fork_probe_warm.LOCK.acquire(timeout=2)}


if __name__ == "__main__":
    print(json.dumps(report()))
    print("a line on stderr", file=sys.stderr)
    behaviour = sys.argv[1]
    if behaviour == "exit3":
        sys.exit(3)
    elif behaviour == "raise":
        raise ValueError("boom")
    elif behaviour == "sigkill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif behaviour == "interrupt":
        raise KeyboardInterrupt
    elif behaviour == "sleep":
        time.sleep(120)
