"""The shared harness (``tests/conftest.py``): a child that outlives its limit is stopped with what it started."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import pytest

def test_run_python_returns_the_childs_code_and_output(run_python):
    done = run_python("import sys; print('hi'); sys.exit(3)", timeout_s=60)
    assert (done.returncode, done.stdout) == (3, "hi\n")


def test_run_python_stops_the_childs_own_children_when_it_times_out(run_python, tmp_path):
    pid_file = tmp_path / "grandchild.pid"
    code = ("import subprocess, sys, time; "
            "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)']); "
            f"open({str(pid_file)!r}, 'w').write(str(p.pid)); time.sleep(600)")
    with pytest.raises(subprocess.TimeoutExpired):
        run_python(code, timeout_s=5)
    status = Path(f"/proc/{int(pid_file.read_text())}/status")
    deadline = time.monotonic() + 10
    while status.exists() and "State:\tZ" not in status.read_text() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not status.exists() or "State:\tZ" in status.read_text()   # gone, or dead and awaiting its reaper
