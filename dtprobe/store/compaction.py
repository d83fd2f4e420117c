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
from typing import Callable, Iterable, Iterator

import orjson
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from dtprobe.store.derived import DERIVED_DIR, Deriver, block_inputs, marker_entry, write_derived
from dtprobe.store.manifest import swap_in_dir
from dtprobe.store.partitions import PartFile, write_partitions
from dtprobe.store.rank_blocks import RankBlockSource
from dtprobe.store.reader import COMPACTED_FORMAT, COMPACTED_MARKER, TABLES_DIR, RunStore
from dtprobe.store.schema import (COMPACT_FILE, RANK_BLOCK_RANKS, ROW_GROUP_ROWS, SCHEMA_VERSION, SCHEMAS,
                                  STEP_BLOCK_STEPS, STEP_TABLES)


def compact(run_dir: str | os.PathLike, *, derive: Deriver | None = None,
            observe: Callable[[str, int, int], None] | None = None) -> dict[str, int]:
    """Write the Parquet files of every table with rows; returns ``{table: rows}`` (non-empty only).

    ``derive``: also write the derived per-step tables it computes from each step block's rows
    (``store.derived``; the analysis passes ``dtprobe.analysis.derived_tables.deriver()``), recorded in the
    marker's ``derived`` entry with the deriver's key. ``observe(table, block, rows)`` is called with the rows of
    every batch held in memory: a per-step table's rank block (``block``: its rank block) and each step block handed
    to ``derive`` (``table`` "derived", ``block``: the step block, ``rows``: over its input tables)."""
    run_dir = Path(run_dir)
    store = RunStore.open(run_dir, tables=("clock", "groups"))
    offsets = store.manifest.clock_offsets_ns
    model = store.clock_model()
    stamp = f"{os.getpid()}-{time.time_ns()}"
    tmp = run_dir / f".{TABLES_DIR}.tmp-{stamp}"
    tmp.mkdir()
    previous = _previous_marker(run_dir) if store.is_compacted else None
    source = RankBlockSource(run_dir=run_dir, model=model, groups=_groups_of(store, run_dir),
                             schema_version=store.manifest.schema_version, previous=previous)
    rows: dict[str, int] = {}
    entries: dict[str, dict] = {}
    try:
        for name in SCHEMAS:
            metadata = {"dtprobe.schema_version": str(SCHEMA_VERSION), "dtprobe.table": name,
                        "dtprobe.clock_aligned": "true"}
            if name in STEP_TABLES:
                entry = _write_step_table(source.blocks(name), tmp, name, metadata, observe)
                if entry is not None:
                    entries[name] = entry
                continue
            table = store.aligned_arrow(name)
            if table.num_rows:
                pq.write_table(table.replace_schema_metadata(metadata),
                               tmp / Path(COMPACT_FILE.format(table=name)).name, compression="zstd")
                entries[name] = {"rows": table.num_rows}
        rows = {name: entry["rows"] for name, entry in entries.items()}
        marker = {
            "format": COMPACTED_FORMAT,
            "schema_version": SCHEMA_VERSION,
            "compacted_ns": time.time_ns(),
            "clock_aligned": True,
            "clock_offsets_ns": {str(r): o for r, o in sorted(offsets.items())},
            "clock_samples": model.marker(),
            "partitioning": {"tables": [t for t in STEP_TABLES if t in entries],
                             "step_block_steps": STEP_BLOCK_STEPS, "rank_block_ranks": RANK_BLOCK_RANKS,
                             "row_group_rows": ROW_GROUP_ROWS},
            "tables": entries,
            "events": {rel: [offset, lines] for rel, (offset, lines) in sorted(
                {**(previous or {}).get("events", {}), **store.cursors(), **source.cursors}.items())},
        }
        if derive is not None:
            marker["derived"] = write_derived(derive, tmp, _observed(block_inputs(tmp, entries, derive.inputs),
                                                                     observe))
        (tmp / Path(COMPACTED_MARKER).name).write_bytes(orjson.dumps(marker, option=orjson.OPT_INDENT_2))
        swap_in_dir(tmp, run_dir / TABLES_DIR, run_dir / f".{TABLES_DIR}.old-{stamp}")
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return rows


def _write_step_table(blocks: Iterable[tuple[int, pa.Table]], tmp: Path, name: str, metadata: dict[str, str],
                      observe: Callable[[str, int, int], None] | None) -> dict | None:
    """Write a per-step table's partitions one rank block at a time; its marker entry (None without rows)."""
    files: list[PartFile] = []
    ordered, num_rows, steps = True, 0, set()
    for rank_block, block_rows in blocks:
        if observe is not None:
            observe(name, rank_block, block_rows.num_rows)
        written, in_order = write_partitions(block_rows, tmp, name, metadata)
        files += written
        ordered &= in_order
        num_rows += block_rows.num_rows
        steps.update(pc.unique(pc.drop_null(block_rows.column("step"))).to_pylist())
    if not num_rows:
        return None
    blocks, counts = np.unique([s // STEP_BLOCK_STEPS for s in steps if s >= 0], return_counts=True)
    return {"rows": num_rows, "ordered": ordered, "files": [f.to_json() for f in files],
            "step_blocks": {str(int(b)): int(n) for b, n in zip(blocks, counts)}}


def _observed(blocks: Iterable[tuple[int, dict[str, pa.Table]]], observe: Callable[[str, int, int], None] | None
              ) -> Iterator[tuple[int, dict[str, pa.Table]]]:
    for block, rows in blocks:
        if observe is not None:
            observe("derived", block, sum(t.num_rows for t in rows.values()))
        yield block, rows


def _previous_marker(run_dir: Path) -> dict:
    """The marker of the run's current compaction (``RunStore.open`` checked it)."""
    return orjson.loads((run_dir / COMPACTED_MARKER).read_bytes())


def _groups_of(store: RunStore, run_dir: Path) -> Callable[[bool], pa.Table]:
    """The run's ``groups`` rows as ``store`` read them; read again from the run when asked (a group's line written
    after the store read them, before a line naming it that compaction reads)."""
    def groups(again: bool) -> pa.Table:
        return RunStore.open(run_dir, tables=("groups",)).aligned_arrow("groups") if again \
            else store.aligned_arrow("groups")
    return groups


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
    if marker_entry(marker).get("key") == derive.key:
        return False
    tables = run_dir / TABLES_DIR
    stamp = f"{os.getpid()}-{time.time_ns()}"
    tmp = tables / f".derived.tmp-{stamp}"
    tmp.mkdir()
    try:
        marker["derived"] = write_derived(derive, tmp, block_inputs(tables, marker["tables"], derive.inputs))
        if (tmp / DERIVED_DIR).exists():
            swap_in_dir(tmp / DERIVED_DIR, tables / DERIVED_DIR, tables / f".derived.old-{stamp}")
        else:
            shutil.rmtree(tables / DERIVED_DIR, ignore_errors=True)
        new_marker = tables / f".{Path(COMPACTED_MARKER).name}.tmp-{stamp}"
        new_marker.write_bytes(orjson.dumps(marker, option=orjson.OPT_INDENT_2))
        os.replace(new_marker, marker_path)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return True
