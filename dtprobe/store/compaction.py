"""Compaction of a run's events files into Parquet under ``tables/``; called by the runtime at the end of a run
and by ``dtprobe compact RUN`` for a run that crashed.

Choice made here (the reader is consistent with it): the Parquet files hold **clock-aligned** times (rank 0's
clock), sorted like ``RunStore.table``. The per-step tables (``schema.STEP_TABLES``) are partitioned by step block
and rank block (``store.partitions``), so a step window or a rank subset reads only its files; the others (rare
events, groups, clock samples) are one file each, ``tables/<table>.parquet``. ``tables/_compacted.json``, written
last, records the clock offsets used, every table's rows and files (with each partition's step and rank ranges),
and how many bytes (and lines) of each events file went into the Parquet files, so lines appended later (e.g.
after a restart) are tailed from there, and an offset that changes later shifts the compacted rows by the
difference. The events files are never modified or deleted: compaction can be rerun at any time and rebuilds
everything from the store's current content.

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

from dtprobe.store.derived import DERIVED_DIR, Deriver, write_derived
from dtprobe.store.partitions import steps_per_block, write_partitions
from dtprobe.store.reader import COMPACTED_FORMAT, COMPACTED_MARKER, TABLES_DIR, RunStore
from dtprobe.store.schema import (COMPACT_FILE, RANK_BLOCK_RANKS, ROW_GROUP_ROWS, SCHEMA_VERSION, SCHEMAS,
                                  STEP_BLOCK_STEPS, STEP_TABLES)


def compact(run_dir: str | os.PathLike, *, derive: Deriver | None = None) -> dict[str, int]:
    """Write the Parquet files of every table with rows; returns ``{table: rows}`` (non-empty only).

    ``derive``: also write the derived per-step tables it computes from each step block's rows
    (``store.derived``; the analysis passes ``dtprobe.analysis.derived_tables.deriver()``), recorded in the
    marker's ``derived`` entry with the deriver's key."""
    run_dir = Path(run_dir)
    store = RunStore.open(run_dir)
    offsets = store.manifest.clock_offsets_ns
    stamp = f"{os.getpid()}-{time.time_ns()}"
    tmp = run_dir / f".{TABLES_DIR}.tmp-{stamp}"
    tmp.mkdir()
    rows: dict[str, int] = {}
    entries: dict[str, dict] = {}
    try:
        for name in SCHEMAS:
            table = store.aligned_arrow(name)
            if not table.num_rows:
                continue
            metadata = {"dtprobe.schema_version": str(SCHEMA_VERSION), "dtprobe.table": name,
                        "dtprobe.clock_aligned": "true"}
            rows[name] = table.num_rows
            if name in STEP_TABLES:
                files, ordered = write_partitions(table, tmp, name, metadata)
                entries[name] = {"rows": table.num_rows, "ordered": ordered, "files": [f.to_json() for f in files],
                                 "step_blocks": {str(b): n for b, n in steps_per_block(table).items()}}
            else:
                pq.write_table(table.replace_schema_metadata(metadata),
                               tmp / Path(COMPACT_FILE.format(table=name)).name, compression="zstd")
                entries[name] = {"rows": table.num_rows}
        marker = {
            "format": COMPACTED_FORMAT,
            "schema_version": SCHEMA_VERSION,
            "compacted_ns": time.time_ns(),
            "clock_aligned": True,
            "clock_offsets_ns": {str(r): o for r, o in sorted(offsets.items())},
            "clock_samples": store.clock_model().marker(),
            "partitioning": {"tables": [t for t in STEP_TABLES if t in entries],
                             "step_block_steps": STEP_BLOCK_STEPS, "rank_block_ranks": RANK_BLOCK_RANKS,
                             "row_group_rows": ROW_GROUP_ROWS},
            "tables": entries,
            "events": {rel: [offset, lines] for rel, (offset, lines) in sorted(store.cursors().items())},
        }
        if derive is not None:
            marker["derived"] = write_derived(derive, tmp, store.aligned_arrow)
        (tmp / Path(COMPACTED_MARKER).name).write_bytes(orjson.dumps(marker, option=orjson.OPT_INDENT_2))
        _swap_in(tmp, run_dir / TABLES_DIR, run_dir / f".{TABLES_DIR}.old-{stamp}")
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return rows


def add_derived(run_dir: str | os.PathLike, derive: Deriver) -> bool:
    """Add ``derive``'s derived tables to a run compacted without them (``dtprobe run`` compacts in the launcher,
    which does not import the analysis); True when written. Nothing is done (False) when the run is not
    compacted, already has them under the same key, or changed since its compaction (compact it again then)."""
    run_dir = Path(run_dir)
    store = RunStore.open(run_dir, tables=())
    marker_path = run_dir / COMPACTED_MARKER
    if not store.compaction_is_whole():
        return False
    marker = orjson.loads(marker_path.read_bytes())
    if (marker.get("derived") or {}).get("key") == derive.key:
        return False
    tables = run_dir / TABLES_DIR
    stamp = f"{os.getpid()}-{time.time_ns()}"
    tmp = tables / f".derived.tmp-{stamp}"
    tmp.mkdir()
    try:
        marker["derived"] = write_derived(derive, tmp, store.aligned_arrow)
        if (tmp / DERIVED_DIR).exists():
            _swap_in(tmp / DERIVED_DIR, tables / DERIVED_DIR, tables / f".derived.old-{stamp}")
        else:
            shutil.rmtree(tables / DERIVED_DIR, ignore_errors=True)
        new_marker = tables / f".{Path(COMPACTED_MARKER).name}.tmp-{stamp}"
        new_marker.write_bytes(orjson.dumps(marker, option=orjson.OPT_INDENT_2))
        os.replace(new_marker, marker_path)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return True


def _swap_in(new: Path, target: Path, graveyard: Path) -> None:
    if target.exists():
        os.rename(target, graveyard)
    os.rename(new, target)
    shutil.rmtree(graveyard, ignore_errors=True)
