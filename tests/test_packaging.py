"""The built wheel installs one top-level package, ``dtprobe`` (``collectors/`` and ``dashboard/`` inside it)."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_wheel_holds_only_the_dtprobe_namespace(tmp_path: Path) -> None:
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                    "-w", str(tmp_path), str(ROOT)], check=True, capture_output=True, timeout=300)
    (wheel,) = tmp_path.glob("dtprobe-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert {n.split("/")[0] for n in names} == {"dtprobe", wheel.name.split("-py")[0] + ".dist-info"}
    for needed in ("dtprobe/collectors/attach.py", "dtprobe/dashboard/app.py", "dtprobe/dashboard/views/overview.py",
                   "dtprobe/dashboard/.streamlit/config.toml", "dtprobe/runtime/data/corpus.txt"):
        assert needed in names
