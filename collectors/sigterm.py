"""SIGTERM closes the probe, also while the main thread is blocked in a collective; installed by ``attach``.

torchrun stops the surviving workers of a failed attempt with SIGTERM, whose default action skips ``atexit``,
so without this a survivor's probe never closes: its in-flight collectives and its ``lifecycle`` close row are
lost. A Python signal handler alone is not enough: CPython runs it in the main thread only when that thread
returns to the interpreter, and a main thread blocked in a gloo ``wait()`` does not return until the collective
times out. What does work (torch 2.13, Python 3.11): CPython's C-level handler, which runs at once in whatever
thread the kernel picks, writes the signal number to the ``signal.set_wakeup_fd`` pipe when a Python handler is
installed for the signal; a small daemon thread reads that pipe and closes the probe. ``signal.sigwait`` in a
dedicated thread does not: it needs SIGTERM blocked in every thread, and torch's and gloo's threads exist
(with SIGTERM unblocked) before ``attach`` could block it.

After the close the process ends as SIGTERM would have ended it (killed by the signal: exit status 143 in a
shell, -15 for ``subprocess``), unless a Python SIGTERM handler was installed before ``attach``: that handler
is then called in the main thread (when it gets there) and decides. An ignored SIGTERM stays ignored (nothing
is installed). A wakeup fd set before ``attach`` still receives every signal byte (forwarded).
"""

from __future__ import annotations

import ctypes
import os
import signal
import threading
import time
import warnings
from typing import Any, Callable

_lock = threading.Lock()
_close: Callable[[], None] | None = None
"""What a SIGTERM runs first: the current probe's close (the latest ``install`` wins)."""
_previous: Any = signal.SIG_DFL
"""The SIGTERM handler found at install (``SIG_DFL`` or a Python callable)."""
_installed = False


def install(close: Callable[[], None]) -> bool:
    """Make SIGTERM run ``close`` (then end the process as SIGTERM would, or call the earlier Python handler).

    Call from the main thread. Returns False, with a warning, when it cannot be installed there (another thread)
    and False silently when SIGTERM is ignored or owned by a handler not installed from Python.
    """
    global _close, _previous, _installed
    if threading.current_thread() is not threading.main_thread():
        warnings.warn("dtprobe.attach ran outside the main thread, so SIGTERM will not close the probe (a killed "
                      "worker keeps the rows flushed so far). Call attach from the main thread, or pass "
                      "close_on_sigterm=False to silence this.", stacklevel=3)
        return False
    with _lock:
        _close = close
        if _installed:
            return True
        previous = signal.getsignal(signal.SIGTERM)
        if previous is signal.SIG_IGN or previous is None:
            return False
        _previous = previous
        read_fd, write_fd = os.pipe()
        os.set_blocking(write_fd, False)             # set_wakeup_fd requires a non-blocking fd
        signal.signal(signal.SIGTERM, _handle_in_main_thread)
        forward_fd = signal.set_wakeup_fd(write_fd)
        threading.Thread(target=_watch, args=(read_fd, forward_fd), name="dtprobe-sigterm", daemon=True).start()
        _installed = True
        return True


def _run_close() -> None:
    close = _close
    if close is not None:
        close()


def _handle_in_main_thread(signum: int, frame: Any) -> None:
    """The Python-level handler: runs when the main thread reaches the interpreter (maybe never, if blocked)."""
    _run_close()
    if callable(_previous):
        _previous(signum, frame)
    else:
        die_of(signum)


def _watch(read_fd: int, forward_fd: int) -> None:
    """Read signal numbers from the wakeup pipe; on SIGTERM close, then die unless a Python handler chains."""
    while True:
        try:
            data = os.read(read_fd, 64)
        except InterruptedError:
            continue
        if not data:
            return
        if forward_fd >= 0:
            try:
                os.write(forward_fd, data)
            except OSError:          # a full or closed foreign pipe: its owner's loss, not ours
                pass
        if signal.SIGTERM in data:
            _run_close()
            if not callable(_previous):
                die_of(signal.SIGTERM)


def die_of(signum: int) -> None:
    """End the process with ``signum``'s default action (as if no handler were installed); from any thread.

    ``signal.signal`` works only in the main thread, so another thread resets the disposition through libc.
    """
    if threading.current_thread() is threading.main_thread():
        signal.signal(signum, signal.SIG_DFL)
    else:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.signal.restype = ctypes.c_void_p
        libc.signal.argtypes = (ctypes.c_int, ctypes.c_void_p)
        libc.signal(int(signum), None)               # None = NULL = SIG_DFL
    os.kill(os.getpid(), signum)
    time.sleep(1.0)                                  # delivery is asynchronous when another thread takes it
    os._exit(128 + int(signum))                      # still alive (the signal was blocked everywhere): same status
