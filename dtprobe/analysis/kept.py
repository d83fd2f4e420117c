"""What the analysis of a finished source keeps beside its stored summary (``dtprobe.summary_store``), so that a
page reads it back instead of computing it again (``is_kept``): every detector's findings with their evidence rows,
and the frames and figures of ``FRAMES`` and ``VALUES``. They are the costliest part of a large run's pages: at
1,024 ranks the straggler scores take seconds, and so do some findings a page shows with their evidence. Format:
docs/run-store.md (``summary.kept/``).

A folder holds one Parquet file per frame (each finding's evidence rows too) and an index, ``kept.json``, naming
them under the summary's key. It is written to a temporary folder and renamed into place, and read only under the
key of the source as it is now. What cannot be read is computed again, never shown.
"""

from __future__ import annotations

import itertools
import json
import os
import shutil
from pathlib import Path
from typing import Any, Mapping

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

from dtprobe.analysis.findings import Finding
from dtprobe.store.manifest import swap_in_dir

SCHEMA = "dtprobe.kept/1"
"""Value of the index's ``schema`` key."""
INDEX = "kept.json"
"""The index file of a kept folder."""
FRAMES = ("scores", "causes", "bw_size", "exposure_rank")
"""The frames kept (``RunAnalysis`` memo names): ``straggler_scores``, ``straggler_causes``, ``bandwidth_by_size``
and ``exposure_by_rank``."""
VALUES = ("bw_fit",)
"""The figures kept (plain JSON, a tuple given back as a tuple): ``bandwidth_fit``."""
NOT_KEPT = object()
"""What ``Kept.get`` gives for a result it does not hold (None is a result: no bandwidth fit)."""
FINDINGS = "f:"
"""The memo names of the detectors' findings start with this (``stragglers`` is ``f:stragglers``)."""


def is_kept(name: str) -> bool:
    """Whether the facade result of memo ``name`` is kept: a frame or figure of ``FRAMES`` and ``VALUES``, or a
    detector's findings."""
    return name in FRAMES or name in VALUES or name.startswith(FINDINGS)


_FRAME_ERRORS = (OSError, ValueError, TypeError, KeyError, pa.ArrowException)
"""What writing or reading one entry may raise: that entry is not kept, or not read."""


def write(folder: Path, values: Mapping[str, Any], *, source: str, key: Any) -> bool:
    """Keep ``values`` (memo name -> a frame, a figure or a list of findings; names not ``is_kept`` are ignored)
    of the run or trace folder ``source`` in ``folder`` under ``key``, replacing what it held. An entry Parquet or
    JSON cannot hold is left out (computed at its next use). False when the folder could not be written (a
    read-only place: it is a cache)."""
    folder = Path(folder)
    tmp = folder.with_name(f".{folder.name}.{os.getpid()}.tmp")
    old = folder.with_name(f".{folder.name}.{os.getpid()}.old")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tmp.mkdir(parents=True)
        files = (f"{n}.parquet" for n in itertools.count())
        entries = {}
        for name in sorted(filter(is_kept, values)):
            try:
                entry = _entry(tmp, name, values[name], files)
            except _FRAME_ERRORS:
                continue
            if entry is not None:
                entries[name] = entry
        (tmp / INDEX).write_text(json.dumps({"schema": SCHEMA, "path": source, "key": key, "entries": entries}))
        swap_in_dir(tmp, folder, old)
        return True
    except OSError:
        return False
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(old, ignore_errors=True)


def _entry(folder: Path, name: str, value: Any, files) -> dict | None:
    if name in VALUES:
        plain = json.loads(json.dumps(value))   # TypeError for anything JSON cannot hold: not kept
        return {"value": plain, "tuple": isinstance(value, tuple)}
    if isinstance(value, pd.DataFrame):
        return {"frame": _write_frame(folder, value, next(files))}
    if isinstance(value, list) and all(isinstance(f, Finding) for f in value):
        return {"findings": [{"finding": f.to_json(),
                              "rows": None if f.rows is None else _write_frame(folder, f.rows, next(files))}
                             for f in value]}
    return None


def _write_frame(folder: Path, frame: pd.DataFrame, name: str) -> str:
    pq.write_table(pa.Table.from_pandas(frame), folder / name)
    return name


class Kept:
    """The entries of a kept folder, valid for the key it was opened with; ``get`` reads one."""

    def __init__(self, folder: Path, entries: Mapping[str, Any]) -> None:
        self.folder = folder
        self._entries = dict(entries)

    def names(self) -> list[str]:
        return sorted(self._entries)

    def get(self, name: str) -> Any:
        """The kept result of memo ``name`` (a frame, a figure, or a list of findings with their rows);
        ``NOT_KEPT`` when it was not kept or cannot be read."""
        entry = self._entries.get(name)
        if not isinstance(entry, dict):
            return NOT_KEPT
        try:
            if "value" in entry:
                return tuple(entry["value"]) if entry.get("tuple") else entry["value"]
            if "frame" in entry:
                return self._frame(entry["frame"])
            return [Finding.from_json(e["finding"], rows=None if e["rows"] is None else self._frame(e["rows"]))
                    for e in entry["findings"]]
        except _FRAME_ERRORS:
            return NOT_KEPT

    def _frame(self, name: str) -> pd.DataFrame:
        if Path(name).name != name:   # only files of the folder itself
            raise ValueError(f"{name!r} is not a file of {self.folder}")
        return pq.read_table(self.folder / name).to_pandas()


def read(folder: Path, *, source: str, key: Any) -> Kept | None:
    """The kept folder at ``folder`` when its index is a ``SCHEMA`` document of ``source`` made under ``key``, else
    None."""
    folder = Path(folder)
    try:
        doc = json.loads((folder / INDEX).read_bytes())
    except (OSError, ValueError):
        return None
    if not isinstance(doc, dict) or doc.get("schema") != SCHEMA or doc.get("path") != source or doc.get("key") != key:
        return None
    entries = doc.get("entries")
    return Kept(folder, entries) if isinstance(entries, dict) else None
