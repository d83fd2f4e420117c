"""`dtprobe dashboard [ROOT]`: serves the Streamlit dashboard over a folder of runs, one run or a trace folder."""

from __future__ import annotations

import argparse
import importlib.util
import os
import signal
import subprocess
import sys
from pathlib import Path

from dtprobe.store.errors import ConfigError

APP = Path(importlib.util.find_spec("dtprobe.dashboard").origin).parent / "app.py"
"""The dashboard's entry script, wherever ``dtprobe.dashboard`` is installed (the repo's ``dashboard/`` when editable)."""


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "dashboard", help="live and post-mortem dashboard (Streamlit)",
        description="Serve the dashboard on ROOT: a folder of runs, one run, or a folder of Kineto traces. "
                    "Binds 127.0.0.1 by default; pages refresh live while a run is running.")
    p.add_argument("root", nargs="?", default="runs", help="folder of runs, one run, or a trace folder (default: runs)")
    p.add_argument("--port", type=int, default=8501, help="TCP port (default 8501)")
    p.add_argument("--host", default="127.0.0.1",
                   help="address to bind (default 127.0.0.1; anything else exposes your runs to the network)")
    p.add_argument("--refresh-s", type=float, default=2.0, help="live refresh interval in seconds (default 2)")
    p.add_argument("--live-window", type=int, default=100, metavar="STEPS",
                   help="while a run is running, analyze its newest STEPS steps so that refreshes stay fast "
                        "whatever the run's length; the sidebar's 'Whole run' switch analyzes every step "
                        "(default 100; 0 always analyzes the whole run)")
    p.set_defaults(func=main)


def streamlit_argv(*, host: str, port: int) -> list[str]:
    """The exact server command: safe settings on the command line so they hold whatever the CWD's config."""
    allowed = ["127.0.0.1", "localhost"] if host in {"127.0.0.1", "localhost"} else [host]
    return [
        sys.executable, "-m", "dtprobe.dashboard.serve", "run", str(APP),
        "--server.address", host, "--server.port", str(port), "--server.headless", "true",
        "--server.fileWatcherType", "none", "--server.enableStaticServing", "false",
        *[arg for name in allowed for arg in ("--server.allowedHosts", name)],
        "--browser.gatherUsageStats", "false", "--client.showErrorDetails", "type",
        "--client.toolbarMode", "viewer", "--runner.magicEnabled", "false",
    ]


def main(args: argparse.Namespace) -> int:
    root = Path(args.root)
    if not root.is_dir():
        raise ConfigError(f"dashboard root '{args.root}' is not a directory: pass a folder of runs "
                          f"(e.g. runs/), one run, or a folder of Kineto traces.")
    if not 0 < args.port < 65536:
        raise ConfigError(f"--port {args.port} is out of range 1..65535.")
    if args.live_window < 0:
        raise ConfigError(f"--live-window {args.live_window} is negative: pass a number of steps, or 0 to "
                          f"always analyze the whole run.")
    if not args.refresh_s > 0:
        raise ConfigError(f"--refresh-s {args.refresh_s} must be a positive number of seconds.")
    env = dict(os.environ, DTPROBE_DASHBOARD_ROOT=str(root.resolve()), DTPROBE_REFRESH_S=str(args.refresh_s),
               DTPROBE_LIVE_WINDOW=str(args.live_window))
    print(f"dtprobe dashboard: serving {root.resolve()} at http://{args.host}:{args.port}  (Ctrl-C to stop)",
          flush=True)
    previous = {sig: signal.signal(sig, _raise_stopped) for sig in STOP_SIGNALS}
    proc = None
    try:
        proc = subprocess.Popen(streamlit_argv(host=args.host, port=args.port), env=env, cwd=APP.parent)
        return proc.wait()
    except (KeyboardInterrupt, _Stopped):
        return 0
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if proc is not None:
            _stop(proc)


STOP_SIGNALS = (signal.SIGTERM, signal.SIGHUP)
"""Signals that stop the command as Ctrl-C does (a supervisor's SIGTERM, a closed terminal's SIGHUP); the server
is stopped with it, not left holding the port."""


class _Stopped(Exception):
    """This process got one of ``STOP_SIGNALS``."""


def _raise_stopped(signum, frame) -> None:
    raise _Stopped(signal.Signals(signum).name)


def _stop(proc: subprocess.Popen) -> None:
    """Stop the server: SIGTERM (Streamlit shuts down and frees its port), SIGKILL if it is still there 10 s later."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
