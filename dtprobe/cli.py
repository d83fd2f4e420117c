"""The ``dtprobe`` command: routes ``run | runs | compact | export | analyze | dashboard | plan`` to their modules.

Each subcommand lives in ``dtprobe/commands/<name>.py`` with ``add_parser(subparsers)`` and ``main(args) -> int``;
those modules import heavy libraries (torch, pandas) inside ``main`` so ``dtprobe --help`` stays fast.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from dtprobe.store.errors import ConfigError, TraceError

COMMANDS = ("run", "launch", "runs", "compact", "export", "analyze", "dashboard", "plan", "serve_metrics")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="dtprobe",
        description="Profiling and diagnostics for distributed PyTorch training.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in COMMANDS:
        module = importlib.import_module(f"dtprobe.commands.{name}")
        module.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except (TraceError, ConfigError) as exc:
        print(f"dtprobe {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"dtprobe {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
