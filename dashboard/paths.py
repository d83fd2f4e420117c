"""Which runs the dashboard may show: the root given on the command line, and validation of every choice.

Pure (no streamlit): the run picker lists the root's immediate subdirectories that are dtprobe runs or Kineto
trace folders (symlinks skipped), and every choice, also one from URL parameters, is re-validated to lie
directly under the root: no ``..``, no absolute paths, no symlinks out.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from dtprobe.store.errors import ConfigError

ROOT_ENV = "DTPROBE_DASHBOARD_ROOT"
"""Environment variable through which `dtprobe dashboard` hands the root to the Streamlit process."""

LIVE_WINDOW_ENV = "DTPROBE_LIVE_WINDOW"
"""Steps a live run is analyzed over (`dtprobe dashboard --live-window`); 0 analyzes the whole run."""
DEFAULT_LIVE_WINDOW = 100


def live_window_steps() -> int:
    """The live window in steps (0: live runs are analyzed whole)."""
    return int(os.environ.get(LIVE_WINDOW_ENV, DEFAULT_LIVE_WINDOW))


ROOT_IS_SOURCE = "."
"""The choice that means "the root itself" when the root is one run or one trace folder."""


@dataclass(kw_only=True, frozen=True)
class Source:
    """One thing the dashboard can show."""

    name: str
    """The picker label: a directory name under the root, or ``.`` for the root itself."""
    path: Path
    """Resolved directory."""
    kind: str
    """``run`` (a dtprobe run store) or ``traces`` (a folder of Kineto traces)."""


def root_from_env() -> Path:
    """The root the command line chose; a missing or bad value is a ConfigError naming the variable."""
    raw = os.environ.get(ROOT_ENV)
    if not raw:
        raise ConfigError(f"{ROOT_ENV} is not set: start the dashboard with `dtprobe dashboard ROOT`.")
    root = Path(raw).resolve()
    if not root.is_dir():
        raise ConfigError(f"dashboard root '{raw}' is not a directory: pass a folder of runs, one run, "
                          f"or a folder of Kineto traces to `dtprobe dashboard`.")
    return root


def source_kind(path: Path) -> str | None:
    """``run`` if ``path`` holds a run manifest, ``traces`` if it holds Kineto trace files, else None."""
    if (path / "run.json").is_file():
        return "run"
    for entry in path.iterdir():
        name = entry.name
        if entry.is_file() and (name.endswith(".json") or name.endswith(".json.gz")):
            return "traces"
    return None


def list_sources(root: Path) -> list[Source]:
    """The root itself if it is a run or trace folder, else its immediate subdirectories that are (no symlinks),
    newest first."""
    kind = source_kind(root)
    if kind is not None:
        return [Source(name=ROOT_IS_SOURCE, path=root, kind=kind)]
    found = []
    for entry in root.iterdir():
        if entry.is_symlink() or not entry.is_dir():
            continue
        kind = source_kind(entry)
        if kind is not None:
            found.append((entry.stat().st_mtime, Source(name=entry.name, path=entry.resolve(), kind=kind)))
    return [source for _, source in sorted(found, key=lambda item: item[0], reverse=True)]


def resolve_choice(root: Path, name: str) -> Source:
    """Re-validate a picker or URL choice: it must name the root itself or a directory directly under it.

    Refuses ``..``, absolute paths, nested paths, empty names and symlinks leading out of the root, with a
    ConfigError that says what was refused.
    """
    root = root.resolve()
    if name == ROOT_IS_SOURCE:
        kind = source_kind(root)
        if kind is None:
            raise ConfigError("the dashboard root is not itself a run or a trace folder; pick one of its runs.")
        return Source(name=name, path=root, kind=kind)
    if not name or name in {".", ".."} or "/" in name or "\\" in name or os.path.isabs(name):
        raise ConfigError(f"run '{name}' refused: choose a run directly under the dashboard root.")
    candidate = root / name
    if candidate.is_symlink():
        raise ConfigError(f"run '{name}' refused: it is a symbolic link; the dashboard only opens real "
                          f"directories under its root.")
    resolved = candidate.resolve()
    if resolved.parent != root or not resolved.is_dir():
        raise ConfigError(f"run '{name}' refused: it does not lie directly under the dashboard root.")
    kind = source_kind(resolved)
    if kind is None:
        raise ConfigError(f"'{name}' is neither a dtprobe run (no run.json) nor a folder of Kineto traces.")
    return Source(name=name, path=resolved, kind=kind)
