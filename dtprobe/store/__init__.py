"""The run store: manifest, per-rank event files, incremental clock-aligned reader, Parquet compaction, run listing.

Public names (imported lazily so ``import dtprobe.store.errors`` stays cheap for the CLI): ``RunStore``,
``compact``, ``list_runs``, ``is_run_dir``, ``run_mtime_ns``, ``Manifest``, ``RankInfo``, ``Restart``, ``RankWriter``,
``NullWriter``, ``TraceError``, ``ConfigError``, ``SCHEMAS``, ``TIME_COLUMNS``, ``SCHEMA_VERSION``.
Format: docs/run-store.md.
"""

from __future__ import annotations

import importlib
from typing import Any

from dtprobe.store.errors import ConfigError, TraceError

_LAZY = {
    "RunStore": "dtprobe.store.reader",
    "run_mtime_ns": "dtprobe.store.runs",
    "compact": "dtprobe.store.compaction",
    "list_runs": "dtprobe.store.runs",
    "is_run_dir": "dtprobe.store.runs",
    "Manifest": "dtprobe.store.manifest",
    "RankInfo": "dtprobe.store.manifest",
    "Restart": "dtprobe.store.manifest",
    "read_manifest": "dtprobe.store.manifest",
    "RankWriter": "dtprobe.store.writer",
    "NullWriter": "dtprobe.store.writer",
    "SCHEMAS": "dtprobe.store.schema",
    "TIME_COLUMNS": "dtprobe.store.schema",
    "SCHEMA_VERSION": "dtprobe.store.schema",
}

__all__ = ["ConfigError", "TraceError", *_LAZY]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'dtprobe.store' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
