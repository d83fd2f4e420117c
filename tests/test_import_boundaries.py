"""Data flows one way (STYLE.md): collectors -> store -> analysis -> dashboard. An AST walk enforces it."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def imported_modules(package: str) -> set[str]:
    """Every module imported anywhere under ``package`` (a folder or a module file, relative to the repo root)."""
    names: set[str] = set()
    root = ROOT / package
    assert root.exists(), f"{root} does not exist: a boundary over a missing folder would check nothing"
    for path in ([root] if root.is_file() else root.rglob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names.add(node.module)
    return names


def _banned_hits(package: str, banned: str) -> list[str]:
    return sorted(m for m in imported_modules(package) if m == banned or m.startswith(banned + "."))


@pytest.mark.parametrize(
    "package,banned",
    [
        ("dtprobe/store", "torch"),
        ("dtprobe/store", "dtprobe.collectors"),
        ("dtprobe/store", "dtprobe.dashboard"),
        ("dtprobe/store", "dtprobe.analysis"),
        ("dtprobe/store", "dtprobe.runtime"),
        ("dtprobe/store", "streamlit"),
        ("collectors", "dtprobe.analysis"),
        ("collectors", "dtprobe.dashboard"),
        ("dtprobe/runtime", "dtprobe.analysis"),
        ("dtprobe/runtime", "dtprobe.dashboard"),
        ("dtprobe/analysis", "torch"),
        ("dtprobe/analysis", "dtprobe.collectors"),
        ("dtprobe/analysis", "streamlit"),
        ("dtprobe/analysis", "dtprobe.runtime"),
        # the leaf module of interval arithmetic (runtime and analysis share it): numpy and pandas only
        ("dtprobe/intervals.py", "dtprobe.analysis"),
        ("dtprobe/intervals.py", "dtprobe.runtime"),
        ("dtprobe/intervals.py", "dtprobe.store"),
        ("dtprobe/intervals.py", "torch"),
        # the leaf module of stack frames (the launcher and the analysis share it): the standard library only
        ("dtprobe/stack_frames.py", "dtprobe.analysis"),
        ("dtprobe/stack_frames.py", "dtprobe.runtime"),
        ("dtprobe/stack_frames.py", "dtprobe.store"),
        ("dtprobe/stack_frames.py", "torch"),
        ("dtprobe/planner", "torch"),
        ("dtprobe/planner", "dtprobe.collectors"),
        ("dtprobe/planner", "streamlit"),
        ("dashboard", "dtprobe.collectors"),
        ("dashboard", "dtprobe.runtime"),
        ("dashboard", "torch"),
    ],
)
def test_import_boundaries_hold(package: str, banned: str) -> None:
    assert _banned_hits(package, banned) == [], f"{package} imports {banned}"


@pytest.mark.parametrize("package", ["dtprobe", "collectors", "dashboard", "tests", "benchmarks"])
@pytest.mark.parametrize("old_top_level", ["collectors", "dashboard"])
def test_no_import_of_the_old_top_level_packages(package: str, old_top_level: str) -> None:
    """``collectors`` and ``dashboard`` install as ``dtprobe.collectors`` and ``dtprobe.dashboard`` only."""
    assert _banned_hits(package, old_top_level) == []


def test_streamlit_cache_only_in_dashboard_data() -> None:
    offenders = [
        str(p.relative_to(ROOT))
        for p in (ROOT / "dashboard").rglob("*.py")
        if "cache_data" in p.read_text() and p.name != "data.py"
    ]
    assert (ROOT / "dashboard" / "data.py").is_file()
    assert offenders == []
