"""Many compacted partition files of one table read in one Arrow dataset scan: ``read_files_at_once`` gives what
``partitions.read_files`` gives (same rows, columns, types and order) for ``RunStore``'s reads of a table's files.

A compacted table is split by step block and rank block (``partitions.write_partitions``): a 1,024-rank run's
per-step tables are hundreds of files, where a read per file (its schema, its dataset, its cast) costs more than
the rows of a small file, and more than the rows a filter keeps of a large one. One scan opens them all with the
file's schema once (unfiltered large files are read side by side as whole tables); small files' rows are then
merged by one sort of their ranks, large ones' by each rank's stretch of every file (``partitions.interleave``).
Files that are not all alike (a column one of them lacks, a type that differs, a schema version), or a scan that
fails (a missing or damaged file), go through ``read_files`` file by file, which reads such files as before and
names a damaged one and the fix.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as ds

from dtprobe.store.frames import memory_schema
from dtprobe.store.manifest import check_schema_version
from dtprobe.store.partitions import PartFile, interleave, read_files

ONE_SCAN_FILES = 3
"""Fewer files are read one by one (``read_files``): nothing to gain."""
SMALL_FILE_ROWS = 16_384
"""Files of more rows on average are merged by rank stretches (``partitions.interleave``): one sort of every row's
rank and a take of every row cost more there than a slice per rank and file."""
_VERSION_KEY = b"dtprobe.schema_version"


def read_files_at_once(tables_dir: Path, files: list[PartFile], name: str, expr: pc.Expression | None, *,
                       ordered: bool, columns: list[str] | None = None) -> pa.Table:
    """``partitions.read_files(tables_dir, files, name, expr, ordered=ordered, columns=columns)``, in one scan
    when the files are many, small or filtered, and share one schema holding every column of the table (else file
    by file: a whole large file is read as fast alone)."""
    files = list(files)
    small = sum(f.rows for f in files) <= SMALL_FILE_ROWS * len(files)
    scan = len(files) >= ONE_SCAN_FILES and (small or expr is not None)
    parts = _scan(tables_dir, files, name, expr, columns) if scan else None
    if parts is None:
        return read_files(tables_dir, files, name, expr, ordered=ordered, columns=columns)
    if ordered:
        merged = _interleave(parts) if small else interleave(parts)
        return merged if merged is not None else parts[0]
    return pa.concat_tables(parts)


def _interleave(parts: list[pa.Table]) -> pa.Table | None:
    """``partitions.interleave(parts)`` (each part sorted by rank, merged by rank, then part order) with one take:
    the order is a stable sort of the parts' ranks, where the segments' slices cost a table per rank and file."""
    parts = [p for p in parts if p.num_rows]
    if len(parts) < 2:
        return parts[0] if parts else None
    whole = pa.concat_tables(parts)
    rank = whole.column("rank").to_numpy()
    if rank.dtype.kind == "f":      # a null rank (never written by compaction): as partitions.interleave does
        return interleave(parts)
    order = np.argsort(rank, kind="stable")
    if (order == np.arange(len(order))).all():
        return whole.combine_chunks()
    return whole.take(pa.array(order)).combine_chunks()


def _scan(tables_dir: Path, files: list[PartFile], name: str, expr: pc.Expression | None,
          columns: list[str] | None) -> list[pa.Table] | None:
    """Each file's rows, in file order, with the columns and types ``read_files`` gives; None when the files differ
    from one another or from the table's schema, or the scan fails: read them file by file instead."""
    schema = memory_schema(name)
    try:
        data = ds.dataset([str(tables_dir / f.path) for f in files], format="parquet")
        fragments = list(data.get_fragments())
        first = fragments[0].physical_schema
        if any(c not in first.names for c in schema.names) or _VERSION_KEY not in (first.metadata or {}):
            return None
        version = int(first.metadata[_VERSION_KEY])
        if any(not f.physical_schema.equals(first, check_metadata=True) for f in fragments[1:]):
            return None
    except (OSError, ValueError, pa.ArrowException):
        return None
    check_schema_version(version, tables_dir / files[0].path)
    # dictionary columns decoded as such (as ``read_compacted_file``): never a copy of the value per row
    fields = [schema.field(c) if pa.types.is_dictionary(schema.field(c).type) else first.field(c)
              for c in schema.names]
    wanted = schema.names if columns is None else list(columns)
    selected = pa.schema([schema.field(c) for c in wanted])
    paths = [f.path for f in fragments]
    batches: dict[str, list[pa.RecordBatch]] = {p: [] for p in paths}
    try:
        whole = ds.FileSystemDataset(fragments, pa.schema(fields), data.format, data.filesystem)
        # each file's batches apart, in order: ordered files merge by rank as ``read_files`` merges them
        for tagged in whole.scanner(columns=wanted, filter=expr).scan_batches():
            batches[tagged.fragment.path].append(tagged.record_batch)
        read = pa.schema([whole.schema.field(c) for c in wanted])
        parts = [pa.Table.from_batches(batches[p], schema=read) for p in paths]
        return parts if read.equals(selected, check_metadata=True) else [p.cast(selected) for p in parts]
    except (OSError, ValueError, KeyError, pa.ArrowException):
        return None
