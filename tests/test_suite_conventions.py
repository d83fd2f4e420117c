"""The test suite's own rules, checked on its source text: no test reads a path outside the repository (a fresh
clone must pass without the machine it was written on), and every file that starts a distributed job carries the
``multiproc`` marker (so ``-m "not multiproc"`` really leaves out the multi-process tests)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
REPO_ROOT = TESTS.parent
SOURCES = sorted(p for p in TESTS.rglob("*.py") if "data" not in p.relative_to(TESTS).parts)

OUTSIDE_PATTERNS = {
    "an absolute path under /work": re.compile("/" + r"work/"),
    "a folder beside the checkout": re.compile(r"\.\./" + "shared"),
    "the checkout's parent": re.compile(r"\b(?:REPO|ROOT|REPO_ROOT)\.parent\b"),
}
"""What names a path outside the repository (spelled in pieces so this file does not match itself)."""
PARENTS = re.compile(r"parents\[(\d+)\]")
JOB_STARTERS = ("torch.distributed.run", "start_processes", "mp.spawn", '"dtprobe.cli", "run"', 'run_cli("run"',
                '"run", "--run-dir"', "torchrun_cmd(", "from layouts_launch import", "background_run(")
"""Source text of a test that starts a distributed job: torchrun, a spawn, ``dtprobe run`` (also through ``run_cli``),
the shared launchers."""


def outside_paths(text: str, *, depth: int) -> list[str]:
    """Each line of ``text`` (a file ``depth`` folders below the repository root, so ``parents[depth]`` is the
    root) that names a path outside the repository, with what it names."""
    found = []
    for number, line in enumerate(text.splitlines(), 1):
        found += [f"{number}: {what}: {line.strip()}" for what, pattern in OUTSIDE_PATTERNS.items()
                  if pattern.search(line)]
        found += [f"{number}: parents[{k}] is above the repository: {line.strip()}"
                  for k in map(int, PARENTS.findall(line)) if k > depth]
    return found


@pytest.mark.parametrize("path", [p for p in SOURCES if p != Path(__file__).resolve()],  # this file holds the patterns
                         ids=lambda p: str(p.relative_to(TESTS)))
def test_no_test_file_names_a_path_outside_the_repository(path):
    depth = len(path.relative_to(REPO_ROOT).parts) - 1
    assert outside_paths(path.read_text(), depth=depth) == [], "read test data from tests/data/ or sample_traces/"


def test_the_path_check_flags_work_paths_the_folder_beside_and_parents_above_the_root():
    lines = ['A = Path("/' + 'work/shared/traces")', 'B = REPO.' + 'parent / "x"', 'C = "..' + '/shared/x"',
             "D = Path(__file__).parents[2]", "E = Path(__file__).parents[3]", 'F = TESTS / "data" / "traces"']
    flagged = [line.split(":")[0] for line in outside_paths("\n".join(lines), depth=2)]
    assert flagged == ["1", "2", "3", "5"]


@pytest.mark.parametrize("path", [p for p in SOURCES if p.name.startswith("test_")],
                         ids=lambda p: str(p.relative_to(TESTS)))
def test_a_test_file_that_starts_a_distributed_job_carries_the_multiproc_marker(path):
    text = path.read_text()
    starters = [s for s in JOB_STARTERS if s in text]
    if path == Path(__file__).resolve() or not starters:
        return
    assert "pytest.mark.multiproc" in text, f"starts a job ({starters}) but no test is marked multiproc"


CONFTEST_IMPORT = re.compile(r"^\s*(from conftest import|import conftest\b)", re.MULTILINE)


@pytest.mark.parametrize("path", [p for p in SOURCES if p.name.startswith("test_")],
                         ids=lambda p: str(p.relative_to(TESTS)))
def test_no_test_file_imports_conftest_by_name(path):
    # tests/ and tests/chaos/ both have a conftest.py: in a whole-suite run the module named 'conftest' is whichever
    # was imported last, so helpers come in through conftest's fixtures (repo_root, child_env, run_cli, ...)
    if path == Path(__file__).resolve():
        return
    assert not CONFTEST_IMPORT.search(path.read_text()), "use conftest's fixtures instead of importing conftest"
