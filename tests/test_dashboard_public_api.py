"""The dashboard builds on Streamlit's public API only: no import of its internals, no import hooks, nothing of
Streamlit's replaced at run time (an AST walk over the installed code)."""

from __future__ import annotations

import ast
from pathlib import Path


ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("dtprobe", "dashboard", "collectors", "benchmarks")
PUBLIC_STREAMLIT = {"streamlit", "streamlit.testing.v1", "streamlit.components.v1", "streamlit.web.cli"}
"""What may be imported of Streamlit: its API, the test harness, components, and the entry of `streamlit run`."""


def _sources() -> list[Path]:
    return sorted(p for package in PACKAGES for p in (ROOT / package).rglob("*.py"))


def _streamlit_imports(tree: ast.AST) -> set[str]:
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.split(".")[0] == "streamlit"}
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "streamlit":
            named = {f"{node.module}.{a.name}" for a in node.names}  # `from streamlit.web import cli`
            if not named <= PUBLIC_STREAMLIT:
                found.add(node.module)
            if node.module == "streamlit":  # `from streamlit import config` imports the module streamlit.config
                found |= {name for name in named if name.split(".")[-1].islower()} - PUBLIC_STREAMLIT
    return found


def test_only_public_streamlit_modules_are_imported() -> None:
    internal = {str(p.relative_to(ROOT)): sorted(found) for p in _sources()
                if (found := _streamlit_imports(ast.parse(p.read_text(), filename=str(p))) - PUBLIC_STREAMLIT)}
    assert internal == {}


def test_public_api_check_catches_an_internal_import() -> None:
    tree = ast.parse("from streamlit import delta_generator\nfrom streamlit.web import cli\n"
                     "from streamlit.components.v2 import manifest_scanner\nimport streamlit as st\n")
    assert _streamlit_imports(tree) - PUBLIC_STREAMLIT == {"streamlit.delta_generator", "streamlit.components.v2"}


def _run_time_replacements(path: Path) -> list[str]:
    """Lines of ``path`` that touch the import system or assign to an attribute of something from Streamlit."""
    tree = ast.parse(path.read_text(), filename=str(path))
    streamlit_names = {a.asname or a.name.split(".")[0] for n in ast.walk(tree)
                       if isinstance(n, ast.Import) or (isinstance(n, ast.ImportFrom) and n.module)
                       for a in n.names
                       if (a.name if isinstance(n, ast.Import) else n.module).split(".")[0] == "streamlit"}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr in {"meta_path", "path_hooks"}:
            found.append(f"{path.relative_to(ROOT)}:{node.lineno} import system")
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
            node, ast.AugAssign) else []
        for target in targets:
            base = target
            while isinstance(base, ast.Attribute):
                base = base.value
            if isinstance(target, ast.Attribute) and isinstance(base, ast.Name) and base.id in streamlit_names:
                found.append(f"{path.relative_to(ROOT)}:{node.lineno} assigns {ast.unparse(target)}")
    return found


def test_no_import_hooks_and_nothing_of_streamlit_replaced() -> None:
    assert [line for p in _sources() for line in _run_time_replacements(p)] == []


def test_replacement_check_catches_a_monkeypatch_and_an_import_hook(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(__import__(__name__), "ROOT", tmp_path)
    (tmp_path / "patch.py").write_text("import sys\nfrom streamlit import delta_generator\n"
                                        "delta_generator._use_warning_has_been_displayed = True\n"
                                        "sys.meta_path.insert(0, object())\n")
    assert _run_time_replacements(tmp_path / "patch.py") == [
        "patch.py:3 assigns delta_generator._use_warning_has_been_displayed", "patch.py:4 import system"]
