"""Warm worker start for ``dtprobe run``: torchrun's agent (``runtime.torchrun_agent``) imports torch,
``torch._dynamo`` (DDP imports it) and the worker's modules once, then starts each ``python -u -m
dtprobe.runtime.worker`` it would have exec'd as a fork of that warm process (through its fork server, below)
running that module in the child, so no worker pays the imports. Read by ``runtime.torchrun_agent``; chosen by
``runtime.launcher`` (``--worker-start``).

The child gets what torchrun's ``SubprocessHandler`` gives a Popen'd worker, observable the same way (but for its
parent process, the agent's fork server, see below):
- torchrun's environment for its rank (``os.environ`` replaced, C ``environ`` too), ``sys.argv`` =
  ``[<worker.py>, *args]`` (``runpy``, ``__name__ == "__main__"``), stdout/stderr on torchrun's per-rank files
  (``dup2``) written through as under ``-u``, stdin inherited, every other descriptor closed (``close_fds``), its
  own session (``start_new_session``: torchrun stops a worker with ``killpg``);
- signal handlers of a fresh interpreter (torchrun's handlers in the agent are reset), no ``atexit`` functions but
  those the warm imports registered (``multiprocessing``'s, ``logging.shutdown``), loggers with the handlers and
  levels they had before torchrun ran;
- its exit status as torchrun reads it (``poll``/``wait`` on a ``waitpid`` status; -N when signal N killed it): the
  module's return through ``runtime.quick_exit``, ``SystemExit``'s code, 1 after an uncaught exception (the
  worker's ``@record`` has written torchelastic's error file), death by SIGINT after an uncaught
  ``KeyboardInterrupt``, as the interpreter does.

Why forking is safe: workers are not forked from the agent but from its fork server, a child the agent forks at
``install``, right after the warm imports and before torchrun runs: it has the agent's modules but never any of the
threads torchrun starts later (the rendezvous store's server loop, the keep-alive). Forking the agent itself, a
worker could inherit a lock that the store's server thread held at that instant, serving the workers already
started: once in a few hundred starts, a worker then blocked for ever in its own store client (seen with 8 ranks
on 2 cores). The server does nothing but fork on request and, when torchrun polls a worker, ``waitpid`` it
without blocking (so a dead worker stays a zombie until that poll, as a Popen'd one does); it ends when the
agent's end of their socket pair closes. A worker closes every inherited descriptor (so neither the
agent's store socket nor the server's socket is kept open by workers), builds its own process group and store
client from the environment, writes through new ``sys.std*`` objects and freezes the inherited objects for the
cycle collector (no finalizer of an agent object runs in the child and closes a descriptor number the worker
reuses). CPython re-initializes its own locks after ``fork`` (GIL, import lock, ``logging``'s locks, ``random``'s
seed). CUDA cannot be used in a forked child once the parent initialized it: neither the agent nor its server
does, and if the agent had, the start falls back to exec. OpenMP: no tensor operation ran before the fork, so no
thread pool exists to be inherited. The exec start (torchrun's own) stays: ``DTPROBE_WORKER_START=exec``.

Only our worker module is forked (``WORKER_MODULE``); ``dtprobe launch`` runs user scripts, whose import-time
behaviour (environment read at import, modules already imported by the agent) we cannot vouch for, so it execs.
"""

from __future__ import annotations

import atexit
import contextlib
import faulthandler
import gc
import importlib
import io
import logging
import os
import pickle
import runpy
import select
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
import warnings
from typing import Any, Callable, Sequence

from dtprobe.collectors import torch_internals
from dtprobe.runtime.config import WORKER_START_ENV, WORKER_STARTS
from dtprobe.runtime.quick_exit import quick_exit
from dtprobe.store.errors import ConfigError

WORKER_MODULE = "dtprobe.runtime.worker"
"""The only entrypoint started by fork (``python -u -m WORKER_MODULE ...``)."""
WARM_MODULES = ("torch", "torch.distributed", "torch._dynamo", "torch.nn.parallel", "dtprobe.collectors.attach",
                WORKER_MODULE)
"""Imported by the agent before torchrun starts: torch, what DDP's ``__init__`` imports, what ``dtprobe.attach``
imports when called (the collectors, the store, pandas), and the worker with everything it imports (the train
loop, the layouts). The worker module's own top level runs again as ``__main__`` in every child, so it only
defines things."""

_WARM_ATEXIT: list[tuple[Callable, tuple, dict]] = []
_WARM_LOGGERS: dict[str, tuple[list[logging.Handler], int, bool, bool]] = {}
_KEEP_ALIVE: list[Any] = []     # the agent's sys.std* objects, replaced in the child but never finalized there
_FORKED = False
_HANDLER: type | None = None    # ForkHandler over this torch's SubprocessHandler, once installed
_SERVER: "ForkServer | None" = None     # the agent's fork server, started by install


def started_by() -> str:
    """``fork`` in a worker started by this module, else ``exec`` (recorded in the worker's ``worker.json``)."""
    return "fork" if _FORKED else "exec"


def requested(argv: Sequence[str], environ: dict[str, str] | None = None) -> bool:
    """Whether the agent command ``argv`` runs ``WORKER_MODULE`` and the start is ``fork`` (the default)."""
    environ = os.environ if environ is None else environ
    method = environ.get(WORKER_START_ENV, "fork")
    if method not in WORKER_STARTS:
        raise ConfigError(f"{WORKER_START_ENV}={method!r}; use one of {', '.join(WORKER_STARTS)} (`dtprobe run "
                          f"--worker-start` sets it).")
    argv = list(argv)
    runs_worker = any(a == "-m" and b == WORKER_MODULE for a, b in zip(argv, argv[1:]))
    return method == "fork" and runs_worker


def install() -> bool:
    """Import ``WARM_MODULES`` (recording the ``atexit`` functions and logger state they set up, which a worker's
    own imports would set up too), start the fork server and make torchrun start ``WORKER_MODULE`` with
    ``ForkHandler``. False, and said on stderr, when this torch's worker start lacks the surfaces the handler
    replaces (``collectors.torch_internals``): workers then start by exec, as torchrun starts them."""
    global _HANDLER, _SERVER
    base = torch_internals.subprocess_handler_class()
    if base is None:
        print("dtprobe: this torch's torchrun has no SubprocessHandler._popen to start workers by fork; they "
              "start by exec (--worker-start exec says so explicitly).", file=sys.stderr, flush=True)
        return False
    register = atexit.register

    def recording_register(func: Callable, *args: Any, **kwargs: Any) -> Callable:
        _WARM_ATEXIT.append((func, args, kwargs))
        return register(func, *args, **kwargs)

    atexit.register = recording_register
    try:
        for name in WARM_MODULES:
            importlib.import_module(name)
    finally:
        atexit.register = register
    sys.modules.pop(WORKER_MODULE, None)     # as in a fresh `python -m`: only __main__ runs the worker's code
    for name, logger in [("", logging.getLogger()), *logging.Logger.manager.loggerDict.items()]:
        if isinstance(logger, logging.Logger):
            _WARM_LOGGERS[name] = (list(logger.handlers), logger.level, logger.propagate, logger.disabled)
    _HANDLER = _fork_handler(base)
    if not torch_internals.replace_subprocess_handler(get_subprocess_handler):
        print("dtprobe: this torch's torchrun builds worker handlers without get_subprocess_handler; workers start "
              "by exec (--worker-start exec says so explicitly).", file=sys.stderr, flush=True)
        return False
    _SERVER = ForkServer.start()
    return True


def get_subprocess_handler(entrypoint: str, args: tuple, env: dict[str, str], stdout: str | None,
                           stderr: str | None, local_rank_id: int, numa_options: Any = None) -> Any:
    """torchrun's ``get_subprocess_handler`` (same arguments) returning a ``ForkHandler``."""
    return _HANDLER(entrypoint=entrypoint, args=args, env=env, stdout=stdout, stderr=stderr,
                       local_rank_id=local_rank_id, numa_options=numa_options)


def _fork_handler(base: type) -> type:
    """``ForkHandler`` over torchrun's ``SubprocessHandler`` class ``base``."""
    import torch

    class ForkHandler(base):
        """torchrun's ``SubprocessHandler`` (files, environment, ``close`` by ``killpg``) whose process is a fork
        of the agent running ``WORKER_MODULE`` when the command is ``python -u -m WORKER_MODULE ...`` and CUDA is
        not initialized here; any other command (a numactl wrapper, another module) is Popen'd as torchrun does."""

        def _popen(self, args: tuple, env: dict[str, str]) -> Any:
            module_args = worker_args(args)
            if module_args is None or torch.cuda.is_initialized() or _SERVER is None or not _SERVER.alive:
                return super()._popen(args, env)
            try:
                return ForkedWorker.start(args, env, module_args=module_args, stdout=self._stdout,
                                          stderr=self._stderr)
            except OSError as exc:      # the fork server is gone: this and later workers start by exec
                _SERVER.alive = False
                print(f"dtprobe: the fork server (pid {_SERVER.pid}) is gone ({exc}); workers start by exec.",
                      file=sys.stderr, flush=True)
                return super()._popen(args, env)

    return ForkHandler


def worker_args(args: Sequence[str]) -> list[str] | None:
    """The module's arguments when ``args`` is ``python -u -m WORKER_MODULE ARGS`` (torchrun's command for
    ``-m``), else None."""
    args = [str(a) for a in args]
    python = os.environ.get("PYTHON_EXEC", sys.executable)
    if len(args) >= 4 and args[0] == python and args[1:4] == ["-u", "-m", WORKER_MODULE]:
        return args[4:]
    return None


class ForkServer:
    """The agent's end of its fork server (``_serve``, a child forked by ``install`` before torchrun starts any
    thread): ``fork`` asks it for a worker and returns the worker's pid; ``status`` asks it to ``waitpid`` that
    worker without blocking. The server reaps a worker only when asked, so a worker that died stays a zombie until
    torchrun's next poll, as a Popen'd one does (the launcher's ``ExitWatcher`` reads exit codes from zombies).
    Messages are pickled tuples on a ``SOCK_SEQPACKET`` pair, one per send, each answer carrying its request's
    number: an answer left unread by a request that a signal interrupted (torchrun raises from its SIGTERM
    handler) is skipped by the next one, and the worker of such a fork request is killed (``_stop_unowned``). The
    worker's stdout/stderr descriptors travel with a fork request (``SCM_RIGHTS``)."""

    REPLY_TIMEOUT_S = 60.0
    UNOWNED_ANSWER_S = 5.0
    """How long an interrupted fork request still waits for its worker's pid, to kill the worker."""

    def __init__(self, sock: socket.socket, pid: int) -> None:
        self.sock = sock
        self.pid = pid
        self.alive = True
        self._lock = threading.Lock()
        self._asked = 0

    @classmethod
    def start(cls) -> "ForkServer":
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        _flush()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            pid = os.fork()
        if pid == 0:
            ours.close()
            _serve(theirs)          # never returns
        theirs.close()
        return cls(ours, pid)

    def fork(self, env: dict[str, str], module_args: list[str], out_fd: int | None, err_fd: int | None) -> int:
        fds = [fd for fd in (out_fd, err_fd) if fd is not None]
        return self._ask(("fork", env, module_args, out_fd is not None, err_fd is not None), fds)

    def status(self, pid: int) -> int | None:
        """The worker's ``waitpid`` status once it ended, else None (the server does not block on it)."""
        if self.alive:
            try:
                return self._ask(("poll", pid), [])
            except OSError:
                self.alive = False
        if _exists(pid):
            return None
        print(f"dtprobe: the fork server ended before worker {pid}; its exit status is lost, reported as 1.",
              file=sys.stderr, flush=True)
        return 1 << 8

    def _ask(self, request: tuple, fds: list[int]) -> Any:
        """Send one request, return the server's answer; OSError when the server is gone or does not answer."""
        with self._lock:
            self._asked += 1
            number = self._asked
            socket.send_fds(self.sock, [pickle.dumps((number, *request))], fds)
            try:
                return self._answer(number, request[0], self.REPLY_TIMEOUT_S)
            except BaseException:
                if request[0] == "fork":
                    self._stop_unowned(number)
                raise

    def _answer(self, number: int, kind: str, timeout_s: float) -> Any:
        """The answer to request ``number``, skipping older ones left unread."""
        deadline = time.monotonic() + timeout_s
        while True:
            if not select.select([self.sock], [], [], max(0.0, deadline - time.monotonic()))[0]:
                raise TimeoutError(f"the fork server (pid {self.pid}) did not answer {kind!r} within "
                                   f"{timeout_s:.0f} s")
            data = self.sock.recv(1 << 16)
            if not data:
                raise ConnectionResetError(f"the fork server (pid {self.pid}) ended")
            answered, answer = pickle.loads(data)
            if answered == number:
                return answer

    def _stop_unowned(self, number: int) -> None:
        """A fork request ended before its answer was read (torchrun's SIGTERM handler raised meanwhile): the
        server may have forked the worker, and no handler knows its pid, so nothing would ever stop it. Read the
        pid (briefly) and kill the worker and its process group (its own session, as torchrun's ``close``
        signals)."""
        try:
            pid = self._answer(number, "fork", self.UNOWNED_ANSWER_S)
        except BaseException:       # the server is gone or stuck, or a second signal: nothing more to do here
            return
        for kill in (os.killpg, os.kill):   # its group, once it has made its session; itself, also before that
            with contextlib.suppress(ProcessLookupError, PermissionError):
                kill(pid, signal.SIGKILL)
        print(f"dtprobe: worker {pid} was forked for a start that a signal interrupted; it was killed.",
              file=sys.stderr, flush=True)


def _exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _serve(sock: socket.socket) -> None:
    """The fork server's loop, one request at a time: ``fork`` (a worker, ``_child``; answers its pid) or ``poll``
    (``waitpid`` of one of its workers without blocking; answers the status or None); exit when the agent's end
    closes. Single-threaded by construction. SIGINT, SIGTERM and SIGHUP (a Ctrl-C or a stop may reach the agent's
    whole process group) are ignored, so that the server outlives the agent's own handling of them and torchrun
    can still poll the workers it then stops; each worker gets the dispositions back."""
    code = 0
    try:
        gc.freeze()
        stopping = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
        dispositions = {sig: signal.signal(sig, signal.SIG_IGN) for sig in stopping}
        reaped: dict[int, int] = {}      # pid -> status: asked again when the answer was not read
        while True:
            data, fds, _, _ = socket.recv_fds(sock, 1 << 20, 2)
            if not data:
                break
            number, kind, *request = pickle.loads(data)
            if kind == "poll":
                (pid,) = request
                if pid not in reaped:
                    try:
                        ended, status = os.waitpid(pid, os.WNOHANG)
                    except ChildProcessError:      # not a worker of this server: Popen reports such a pid as 0
                        ended, status = pid, 0
                    if ended == pid:
                        reaped[pid] = status
                sock.send(pickle.dumps((number, reaped.get(pid))))
                continue
            env, module_args, has_out, has_err = request
            received = iter(fds)
            out_fd = next(received) if has_out else None
            err_fd = next(received) if has_err else None
            pid = os.fork()
            if pid == 0:
                sock.close()
                for sig, disposition in dispositions.items():
                    signal.signal(sig, disposition)
                _child(env, module_args, out_fd=out_fd, err_fd=err_fd)     # never returns
            for fd in fds:
                os.close(fd)
            sock.send(pickle.dumps((number, pid)))
    except BrokenPipeError:         # the agent is gone
        pass
    except BaseException:
        traceback.print_exc()
        code = 1
    os._exit(code)


class ForkedWorker:
    """The part of ``subprocess.Popen`` torchrun uses (``pid``, ``args``, ``returncode``, ``poll``, ``wait``,
    ``send_signal``, ``terminate``, ``kill``) for a worker forked by the agent's ``ForkServer``; the status is the
    server's ``waitpid``'s, decoded as Popen does (-N for death by signal N)."""

    def __init__(self, pid: int, args: tuple, server: ForkServer) -> None:
        self.pid = pid
        self.args = args
        self.server = server
        self.returncode: int | None = None

    @classmethod
    def start(cls, args: tuple, env: dict[str, str], *, module_args: list[str], stdout: io.IOBase | None,
              stderr: io.IOBase | None) -> "ForkedWorker":
        out_fd = stdout.fileno() if stdout is not None else None
        err_fd = stderr.fileno() if stderr is not None else None
        return cls(_SERVER.fork(env, module_args, out_fd, err_fd), args, _SERVER)

    def poll(self) -> int | None:
        if self.returncode is None:
            status = self.server.status(self.pid)
            if status is not None:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        delay = 0.0005
        while self.poll() is None:
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(list(self.args), timeout)
            time.sleep(delay if deadline is None else min(delay, max(0.0, deadline - time.monotonic())))
            delay = min(delay * 2, 0.05)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def _child(env: dict[str, str], module_args: list[str], *, out_fd: int | None, err_fd: int | None) -> None:
    """In the forked child: become what a Popen'd ``python -u -m WORKER_MODULE`` would be, run it, exit."""
    global _FORKED
    _FORKED = True
    code = 1
    try:
        gc.freeze()                 # the agent's objects: never collected (nor finalized) here
        os.setsid()
        _reset_signals()
        _redirect(out_fd, err_fd)
        _reset_interpreter_state(env)
        sys.argv = [WORKER_MODULE, *module_args]
        sys.orig_argv = [os.environ.get("PYTHON_EXEC", sys.executable), "-u", "-m", WORKER_MODULE, *module_args]
        code = _run_worker()
    except BaseException:           # the child's own setup failed: report it as a worker that failed
        try:
            traceback.print_exc()
        finally:
            os._exit(1)
    quick_exit(code)


def _reset_signals() -> None:
    """Dispositions of a fresh interpreter: SIGINT raises KeyboardInterrupt, torchrun's Python handlers (and any
    other) back to the default, ignored signals stay ignored (exec keeps them too); no wakeup fd, no
    faulthandler unless the worker's environment asks for it."""
    signal.set_wakeup_fd(-1)
    for sig in signal.valid_signals():
        if sig in (signal.SIGKILL, signal.SIGSTOP):
            continue
        try:
            handler = signal.getsignal(sig)
        except (OSError, ValueError):
            continue
        if sig == signal.SIGINT:
            signal.signal(sig, signal.default_int_handler)
        elif callable(handler):
            signal.signal(sig, signal.SIG_DFL)


def _redirect(out_fd: int | None, err_fd: int | None) -> None:
    """stdout/stderr onto torchrun's files, every descriptor above 2 closed, and ``sys.std*`` made anew over
    0-2 (written through, as ``-u`` makes them)."""
    if out_fd is not None:
        os.dup2(out_fd, 1)
    if err_fd is not None:
        os.dup2(err_fd, 2)
    fds = [int(fd) for fd in os.listdir("/proc/self/fd")] if os.path.isdir("/proc/self/fd") else []
    for fd in fds:
        if fd > 2:
            try:
                os.close(fd)
            except OSError:         # the descriptor of the listing itself, already closed
                pass
    if not fds:
        os.closerange(3, os.sysconf("SC_OPEN_MAX"))
    _KEEP_ALIVE.extend([sys.stdin, sys.stdout, sys.stderr])
    old_out = sys.stdout
    encoding = getattr(old_out, "encoding", None) or "utf-8"
    errors = getattr(old_out, "errors", None) or "strict"
    sys.stdin = sys.__stdin__ = io.TextIOWrapper(io.BufferedReader(io.FileIO(0, "r", closefd=False)),
                                                 encoding=encoding, errors=errors)
    sys.stdout = sys.__stdout__ = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), encoding=encoding,
                                                   errors=errors, write_through=True)
    sys.stderr = sys.__stderr__ = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), encoding=encoding,
                                                   errors="backslashreplace", write_through=True)


def _reset_interpreter_state(env: dict[str, str]) -> None:
    """torchrun's environment for this rank, the warm imports' ``atexit`` functions and logger state, this process's
    own main-thread id (the host sampler reads its schedstat), and what a fresh process would derive from its
    environment (OpenMP threads, numpy's global seed)."""
    main = threading.main_thread()
    if main.native_id != threading.get_native_id():     # CPython < 3.12 keeps the agent's thread id after fork
        main._set_native_id()
    agent_threads = os.environ.get("OMP_NUM_THREADS")
    os.environ.clear()
    os.environ.update(env)
    atexit._clear()
    for func, args, kwargs in _WARM_ATEXIT:
        atexit.register(func, *args, **kwargs)
    old_streams = {id(s): new for s, new in zip(_KEEP_ALIVE, (sys.stdin, sys.stdout, sys.stderr))}
    for name, logger in [("", logging.getLogger()), *logging.Logger.manager.loggerDict.items()]:
        if not isinstance(logger, logging.Logger):
            continue
        handlers, level, propagate, disabled = _WARM_LOGGERS.get(name, ([], logging.NOTSET, True, False))
        for handler in handlers:        # e.g. torch's log handler: onto the new stream, not the agent's object
            if isinstance(handler, logging.StreamHandler) and id(handler.stream) in old_streams:
                handler.stream = old_streams[id(handler.stream)]
        logger.handlers[:] = handlers
        logger.setLevel(level)
        logger.propagate, logger.disabled = propagate, disabled
    if faulthandler.is_enabled() and not env.get("PYTHONFAULTHANDLER"):
        faulthandler.disable()
    threads = env.get("OMP_NUM_THREADS")
    if threads != agent_threads and threads and threads.isdigit() and int(threads) > 0:
        import torch

        torch.set_num_threads(int(threads))    # OpenMP read the agent's value when torch was imported
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()


def _run_worker() -> int:
    """Run ``WORKER_MODULE`` as ``__main__``; the exit code the interpreter would end with."""
    try:
        runpy.run_module(WORKER_MODULE, run_name="__main__", alter_sys=True)
        return 0
    except SystemExit as exc:
        return _exit_code(exc.code)
    except KeyboardInterrupt:
        traceback.print_exc()
        _flush()
        signal.signal(signal.SIGINT, signal.SIG_DFL)      # the interpreter ends by SIGINT after an uncaught one
        os.kill(os.getpid(), signal.SIGINT)
        return 130
    except BaseException:
        sys.excepthook(*sys.exc_info())
        return 1


def _exit_code(code: object) -> int:
    """``SystemExit.code`` as the interpreter turns it into a status: None 0, an int itself, else printed and 1."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    print(code, file=sys.stderr)
    return 1


def _flush() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
