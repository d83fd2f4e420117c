"""``dtprobe serve-metrics ROOT``: the running runs under ROOT as Prometheus gauges, read at every scrape
(``dtprobe.export.prometheus``); SIGTERM or Ctrl-C stops it."""

from __future__ import annotations

import argparse
import signal
import threading

from dtprobe.export.gauges import DEFAULT_WINDOW_STEPS, METRICS


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "serve-metrics", help="serve the running runs under a folder as Prometheus metrics",
        description="Serve the runs under ROOT (ROOT itself if it is a run, else each subdirectory that is) at "
                    "http://HOST:PORT/metrics in the Prometheus text format, read fresh at every scrape: "
                    + ", ".join(f"{name}{{{','.join(labels)}}}" for name, (_, labels) in METRICS.items())
                    + ". Running runs only, unless --all. SIGTERM or Ctrl-C stops the server. Needs "
                      "pip install dtprobe[prometheus].",
        epilog="Gauges and their meaning: docs/exporters.md. Example: dtprobe serve-metrics runs --port 9464",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("root", metavar="ROOT", help="folder of runs (or one run directory)")
    parser.add_argument("--port", type=int, default=9464, help="TCP port to listen on (0: any free port)")
    parser.add_argument("--host", default="127.0.0.1",
                        help="address to listen on (0.0.0.0 exposes the metrics to the network)")
    parser.add_argument("--window-steps", type=int, default=DEFAULT_WINDOW_STEPS,
                        help="newest steps of a running run analysed at each scrape")
    parser.add_argument("--all", action="store_true",
                        help="also serve finished and crashed runs (analysed whole)")
    parser.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    from rich.console import Console

    from dtprobe.export.prometheus import RunsCollector, serve

    console = Console(stderr=True, highlight=False, soft_wrap=True)
    collector = RunsCollector(args.root, window_steps=args.window_steps, include_finished=args.all,
                              on_event=lambda line: console.print(f"dtprobe serve-metrics: {line}"))
    server = serve(collector, host=args.host, port=args.port)
    stop = threading.Event()
    previous = {sig: signal.signal(sig, lambda *_: stop.set()) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        with console.status(f"Reading the runs under {args.root} ..."):
            num_runs = len(collector.samples())
        console.print(f"dtprobe serve-metrics: serving {num_runs} run(s) under {args.root} at "
                      f"http://{args.host}:{server.server_port}/metrics "
                      f"({'all runs' if args.all else 'running runs'}; SIGTERM or Ctrl-C stops)")
        while not stop.wait(0.5):
            pass
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        server.shutdown()
        server.server_close()
    console.print("dtprobe serve-metrics: stopped")
    return 0
