"""Ending a process that imported torch without the interpreter's teardown: ``quick_exit(code)``, used by
``dtprobe run``'s worker (``runtime.worker``) and by the torchrun agent both ``dtprobe run`` and ``dtprobe launch``
start (``runtime.torchrun_agent``).

Clearing torch's modules at interpreter shutdown takes seconds of CPU, and the agent waits for every worker's
exit, then the launcher for the agent's, before a run can be finalized. Everything a normal exit does that can be
observed is still done, in the same order: the threads' own exit hooks and the join of non-daemon threads
(``threading._shutdown``), every ``atexit`` function (the probe's close, ``logging.shutdown``), and a flush of
stdout and stderr; then ``os._exit(code)``. Only the teardown of modules and objects is skipped, so it is meant
for code whose files are closed by then (not for a user's script). Skipping it also avoids a torch trap on gloo:
worker threads of process groups still referenced at teardown can abort it (exit -6, "terminate called without an
active exception") after all work is done.
"""

from __future__ import annotations

import atexit
import os
import sys
import threading


def quick_exit(code: int | None) -> None:
    """Run the exit hooks a normal exit runs, flush stdout/stderr, then ``os._exit(code)`` (None: 0)."""
    shutdown = getattr(threading, "_shutdown", None)
    if shutdown is not None and threading.current_thread() is threading.main_thread():
        shutdown()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (AttributeError, OSError, ValueError):    # closed or replaced streams
            pass
    os._exit(0 if code is None else code)
