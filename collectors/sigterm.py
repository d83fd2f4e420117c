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
is then called in the main thread (when it gets there) and decides. A handler installed after ``attach``
replaces this one entirely (the probe then closes at exit, as without it). An ignored SIGTERM stays ignored
(nothing is installed). A wakeup fd set before ``attach`` still receives every signal byte (forwarded); one set
after it (an asyncio loop in the main thread) leaves only the Python-level handler.
"""

from __future__ import annotations

import ctypes
import os
import signal
import threading
import time
import warnings
from typing import Any, Callable

_WATCHER_GRACE_S = 1.0
"""How long the main thread's handler waits for the watcher to report a SIGTERM before handling it alone."""
_CLOSE_WAIT_S = 10.0
"""How long the main thread's handler waits for the watcher's close before calling the earlier handler."""

_lock = threading.Lock()
_close: Callable[[], None] | None = None
"""What a SIGTERM runs first: the current probe's close (the latest ``install`` wins)."""
_previous: Any = signal.SIG_DFL
"""The SIGTERM handler found at install (``SIG_DFL`` or a Python callable)."""
_installed = False
_seen = threading.Condition()
_seen_by_watcher = 0                 # SIGTERMs the watcher read from the pipe
_seen_by_handler = 0                 # SIGTERMs the main thread's handler ran for (signals coalesce: <= the above)
_closed = threading.Event()
_forward_fd = -1                     # the wakeup fd set before ours, restored in forked children


def install(close: Callable[[], None]) -> bool:
    """Make SIGTERM run ``close`` (then end the process as SIGTERM would, or call the earlier Python handler).

    Call from the main thread. Returns False, with a warning, when it cannot be installed there (another thread)
    and False silently when SIGTERM is ignored or owned by a handler not installed from Python.
    """
    global _close, _previous, _installed, _forward_fd
    if threading.current_thread() is not threading.main_thread():
        warnings.warn("dtprobe.attach ran outside the main thread, so SIGTERM will not close the probe (a killed "
                      "worker keeps the rows flushed so far). Call attach from the main thread, or pass "
                      "close_on_sigterm=False to silence this.", stacklevel=3)
        return False
    with _lock:
        _close = close
        _closed.clear()
        if _installed:
            return True
        previous = signal.getsignal(signal.SIGTERM)
        if previous is signal.SIG_IGN or previous is None:
            return False
        _previous = previous
        read_fd, write_fd = os.pipe()
        os.set_blocking(write_fd, False)             # set_wakeup_fd requires a non-blocking fd
        signal.signal(signal.SIGTERM, _handle_in_main_thread)
        _forward_fd = signal.set_wakeup_fd(write_fd)
        threading.Thread(target=_watch, args=(read_fd, _forward_fd), name="dtprobe-sigterm", daemon=True).start()
        os.register_at_fork(before=_block_before_fork, after_in_parent=_unblock_after_fork,
                            after_in_child=_uninstall_in_child)
        _installed = True
        return True


_fork_mask = threading.local()


def _block_before_fork() -> None:
    # The child inherits the forking thread's mask: a SIGTERM it gets before it restores its handler stays
    # pending until then, instead of being written to the parent's pipe.
    _fork_mask.old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})


def _unblock_after_fork() -> None:
    old = getattr(_fork_mask, "old", None)
    if old is not None:
        _fork_mask.old = None
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


def _uninstall_in_child() -> None:
    """A forked child (a fork-started DataLoader worker) has no watcher and shares our pipe: a SIGTERM it gets
    must neither reach the parent's watcher nor close the parent's probe. Restore what ``install`` found."""
    global _installed, _close
    try:
        if _installed:
            _installed, _close = False, None
            signal.set_wakeup_fd(_forward_fd)
            signal.signal(signal.SIGTERM, _previous)
    except ValueError:              # forked from a thread other than the main one: nothing to restore from here
        pass
    finally:
        _unblock_after_fork()


def _run_close() -> None:
    try:
        close = _close
        if close is not None:
            close()
    finally:
        _closed.set()


def _handle_in_main_thread(signum: int, frame: Any) -> None:
    """The Python-level handler: runs when the main thread reaches the interpreter (maybe never, if blocked).

    The watcher closes the probe (and, with no earlier handler, ends the process); this thread must not: it may
    be interrupted inside a writer's lock that the close needs. It closes alone only when the watcher never
    reports the signal (another wakeup fd was set after ``attach``).
    """
    global _seen_by_handler
    with _seen:
        _seen_by_handler += 1
        watcher_has_it = _seen.wait_for(lambda: _seen_by_watcher >= _seen_by_handler, timeout=_WATCHER_GRACE_S)
    if not watcher_has_it:
        _run_close()
    if callable(_previous):
        _closed.wait(_CLOSE_WAIT_S)
        _previous(signum, frame)
    elif not watcher_has_it:
        die_of(signum)
    # else: return to the interrupted code; the watcher ends the process once the probe is closed


def _watch(read_fd: int, forward_fd: int) -> None:
    """Read signal numbers from the wakeup pipe; on SIGTERM close, then die unless a Python handler chains."""
    global _seen_by_watcher
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
        if signal.SIGTERM in data and signal.getsignal(signal.SIGTERM) is _handle_in_main_thread:
            with _seen:
                _seen_by_watcher += data.count(signal.SIGTERM)
                _seen.notify_all()
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
