"""Listing of the runs under a folder (status, world size, steps, age); used by ``dtprobe runs`` and the dashboard."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import TYPE_CHECKING

from dtprobe.store.errors import TraceError
from dtprobe.store.schema import MANIFEST_FILE

if TYPE_CHECKING:
    import pandas as pd

RUN_COLUMNS = {
    "name": "string", "path": "string", "status": "string", "world_size": "Int64", "num_steps": "Int64",
    "num_restarts": "Int64", "age_s": "float64", "idle_s": "float64", "created_ns": "Int64", "error": "string",
}
"""Columns of ``list_runs``: ``age_s`` = seconds since creation, ``idle_s`` = seconds since anything in the run
was last written (a ``running`` run idle for long probably died without saying so); ``status`` is ``invalid``
(and ``error`` says why) for a run that cannot be read."""


def is_run_dir(path: str | os.PathLike) -> bool:
    """True if ``path`` is a directory holding a ``run.json`` (cheap; does not validate it)."""
    return (Path(path) / MANIFEST_FILE).is_file()


def run_mtime_ns(run_dir: str | os.PathLike) -> int:
    """Latest modification time (Unix ns) of the run's manifest, rank infos, events and compaction marker.

    Cheap (a few ``scandir`` calls); the dashboard uses it to know when cached results are stale.
    """
    run_dir = Path(run_dir)
    latest = 0
    for path in (run_dir / MANIFEST_FILE, run_dir / "tables" / "_compacted.json"):
        try:
            latest = max(latest, path.stat().st_mtime_ns)
        except FileNotFoundError:
            pass
    for folder in [run_dir / "ranks", *_subdirs(run_dir / "events")]:
        try:
            with os.scandir(folder) as entries:
                for e in entries:
                    latest = max(latest, e.stat().st_mtime_ns)
        except FileNotFoundError:
            pass
    return latest


def _subdirs(folder: Path) -> list[Path]:
    try:
        with os.scandir(folder) as entries:
            return [Path(e.path) for e in entries if e.is_dir()]
    except FileNotFoundError:
        return []


def list_runs(root: str | os.PathLike) -> pd.DataFrame:
    """One row per run: ``root`` itself if it is a run, and each immediate subdirectory that is (no symlinks).

    ``num_steps`` counts the distinct steps in the steps table; ``age_s`` is seconds since creation. Sorted
    newest first. TraceError if ``root`` is not a directory.
    """
    from dtprobe.store.reader import RunStore

    root = Path(root)
    if not root.is_dir():
        raise TraceError(f"'{root}' is not a directory. Pass the folder that holds your runs "
                         f"(`dtprobe run` writes them under ./runs by default).")
    candidates = [root] if is_run_dir(root) else []
    candidates += sorted(p for p in root.iterdir() if not p.is_symlink() and p.is_dir() and is_run_dir(p))
    now = time.time_ns()
    records = []
    for path in candidates:
        record = {"name": path.name, "path": str(path)}
        try:
            store = RunStore.open(path, tables=("steps",))
            m = store.manifest
            steps = store.table("steps")["step"]
            record.update(status=m.status, world_size=m.world_size, num_steps=int(steps.nunique()),
                          num_restarts=len(m.restarts), created_ns=m.created_ns,
                          age_s=(now - m.created_ns) / 1e9 if m.created_ns is not None else None,
                          idle_s=max(0, now - run_mtime_ns(path)) / 1e9)
        except TraceError as exc:
            record.update(status="invalid", error=str(exc))
        records.append(record)
    import pandas as pd  # here: the dashboard lists runs and reads run ages on its first page without pandas

    df = pd.DataFrame.from_records(records, columns=list(RUN_COLUMNS)).astype(RUN_COLUMNS)
    return df.sort_values("created_ns", ascending=False, na_position="last", kind="stable").reset_index(drop=True)
