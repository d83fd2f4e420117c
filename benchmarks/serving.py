"""What the browser benchmarks share about a server they start: waiting for Streamlit's health check. Imports
nothing from dtprobe, so a benchmark run against another checkout (``scale.py`` under PYTHONPATH) can use it."""

from __future__ import annotations

import subprocess
import time
import urllib.request
from typing import IO


def wait_until_healthy(port: int, proc: subprocess.Popen, errors: IO[bytes], *, name: str,
                       tail_chars: int = 2000) -> None:
    """Return once the Streamlit server on 127.0.0.1:``port`` answers its health check; SystemExit with the
    last ``tail_chars`` of its stderr (``errors``) if ``proc`` exits first."""
    while True:
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/_stcore/health", timeout=1)
            return
        except OSError:
            if proc.poll() is not None:
                errors.seek(0)
                raise SystemExit(f"{name} exited with {proc.returncode}:\n"
                                 + errors.read().decode(errors="replace")[-tail_chars:])
            time.sleep(0.02)
