"""Starts tests/layouts_worker.py on N local processes (gloo, 127.0.0.1, the port and environment the caller
takes from the conftest fixtures) and returns rank 0's JSON lines; shared by the layout and pipeline tests."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

WORKER = Path(__file__).with_name("layouts_worker.py")


def launch(world_size: int, *args: str, port: int, env: dict[str, str], timeout_s: float = 600.0) -> list[dict]:
    """Run the worker on ``world_size`` processes with their rendezvous on ``port`` and environment ``env`` (a
    ``free_port()`` and ``child_env(PYTHONWARNINGS="ignore")``); raise with every rank's stderr tail if one fails."""
    procs = [subprocess.Popen([sys.executable, str(WORKER), "--rank", str(r), "--world-size", str(world_size),
                               "--port", str(port), *args],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
             for r in range(world_size)]
    outputs = []
    try:
        for p in procs:
            outputs.append(p.communicate(timeout=timeout_s))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    failed = [(r, p.returncode, outputs[r][1][-3000:] if r < len(outputs) else "")
              for r, p in enumerate(procs) if p.returncode != 0]
    if failed:
        raise AssertionError("layout worker failed:\n" + "\n".join(f"rank {r} exit {rc}:\n{err}"
                                                                  for r, rc, err in failed))
    return [json.loads(line) for line in outputs[0][0].splitlines() if line.startswith("{")]
