"""Data flows one way (STYLE.md): collectors -> store -> analysis -> dashboard. An AST walk enforces it."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def imported_modules(package: str) -> set[str]:
    """Every module imported anywhere under ``package`` (a path relative to the repo root)."""
    names: set[str] = set()
    for path in (ROOT / package).rglob("*.py"):
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
        ("dtprobe/store", "collectors"),
        ("dtprobe/store", "dashboard"),
        ("dtprobe/store", "dtprobe.analysis"),
        ("dtprobe/store", "dtprobe.runtime"),
        ("dtprobe/store", "streamlit"),
        ("collectors", "dtprobe.analysis"),
        ("collectors", "dashboard"),
        ("dtprobe/runtime", "dtprobe.analysis"),
        ("dtprobe/runtime", "dashboard"),
        ("dtprobe/analysis", "torch"),
        ("dtprobe/analysis", "collectors"),
        ("dtprobe/analysis", "streamlit"),
        ("dtprobe/analysis", "dtprobe.runtime"),
        ("dtprobe/planner", "torch"),
        ("dtprobe/planner", "collectors"),
        ("dtprobe/planner", "streamlit"),
        ("dashboard", "collectors"),
        ("dashboard", "dtprobe.runtime"),
        ("dashboard", "torch"),
    ],
)
def test_import_boundaries_hold(package: str, banned: str) -> None:
    assert _banned_hits(package, banned) == [], f"{package} imports {banned}"


def test_streamlit_cache_only_in_dashboard_data() -> None:
    offenders = [
        str(p.relative_to(ROOT))
        for p in (ROOT / "dashboard").rglob("*.py")
        if "cache_data" in p.read_text() and p.name != "data.py"
    ]
    assert offenders == []
