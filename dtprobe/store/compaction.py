"""Compaction of a run's events files into ``tables/<table>.parquet``; called by the runtime at the end of a run
and by ``dtprobe compact RUN`` for a run that crashed.

Choice made here (the reader is consistent with it): the Parquet files hold **clock-aligned** times (rank 0's
clock), all ranks of a table in one file, sorted like ``RunStore.table``. ``tables/_compacted.json``, written
last, records the clock offsets used, the rows per table and how many bytes (and lines) of each events file went
into the Parquet files, so lines appended later (e.g. after a restart) are tailed from there, and an offset that
changes later shifts the compacted rows by the difference. The events files are never modified or deleted:
compaction can be rerun at any time and rebuilds everything from the store's current content.

The new ``tables/`` is built in a temporary directory and swapped in with renames, so a crash mid-compaction
leaves either the old compaction or none (then the reader uses the events files).
"""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

import orjson
import pyarrow.parquet as pq

from dtprobe.store.reader import COMPACTED_FORMAT, COMPACTED_MARKER, TABLES_DIR, RunStore
from dtprobe.store.schema import COMPACT_FILE, SCHEMA_VERSION, SCHEMAS


def compact(run_dir: str | os.PathLike) -> dict[str, int]:
    """Write ``tables/<table>.parquet`` for every table with rows; returns ``{table: rows}`` (non-empty only)."""
    run_dir = Path(run_dir)
    store = RunStore.open(run_dir)
    offsets = store.manifest.clock_offsets_ns
    stamp = f"{os.getpid()}-{time.time_ns()}"
    tmp = run_dir / f".{TABLES_DIR}.tmp-{stamp}"
    tmp.mkdir()
    rows: dict[str, int] = {}
    try:
        for name in SCHEMAS:
            table = store.aligned_arrow(name)
            if not table.num_rows:
                continue
            table = table.replace_schema_metadata({
                "dtprobe.schema_version": str(SCHEMA_VERSION), "dtprobe.table": name,
                "dtprobe.clock_aligned": "true",
            })
            pq.write_table(table, tmp / Path(COMPACT_FILE.format(table=name)).name, compression="zstd")
            rows[name] = table.num_rows
        marker = {
            "format": COMPACTED_FORMAT,
            "schema_version": SCHEMA_VERSION,
            "compacted_ns": time.time_ns(),
            "clock_aligned": True,
            "clock_offsets_ns": {str(r): o for r, o in sorted(offsets.items())},
            "clock_samples": store.clock_model().marker(),
            "tables": {name: {"rows": n} for name, n in rows.items()},
            "events": {rel: [offset, lines] for rel, (offset, lines) in sorted(store.cursors().items())},
        }
        (tmp / Path(COMPACTED_MARKER).name).write_bytes(orjson.dumps(marker, option=orjson.OPT_INDENT_2))
        _swap_in(tmp, run_dir / TABLES_DIR, run_dir / f".{TABLES_DIR}.old-{stamp}")
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return rows


def _swap_in(new: Path, target: Path, graveyard: Path) -> None:
    if target.exists():
        os.rename(target, graveyard)
    os.rename(new, target)
    shutil.rmtree(graveyard, ignore_errors=True)
