"""``file_scan.read_files_at_once`` reads a compacted table's partition files in one scan and gives what
``partitions.read_files`` gives file by file: rows, columns, types and order, with filters and projections; files
that differ or are damaged go file by file (the same rows, the same error)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest

from dtprobe.store import TraceError, compact, file_scan, partitions
from dtprobe.store.partitions import PartFile
from dtprobe.store.reader import COMPACTED_MARKER
from dtprobe.synthetic import dp_tables, write_run


@pytest.fixture(scope="module")
def compacted(tmp_path_factory) -> tuple[Path, dict]:
    """A compacted 4-rank, 120-step run (6 step blocks per per-step table) and its marker."""
    run = write_run(tmp_path_factory.mktemp("scan") / "run", dp_tables(world=4, num_steps=120), world_size=4)
    compact(run)
    return run, json.loads((run / COMPACTED_MARKER).read_text())


def files_of(marker: dict, name: str) -> list[PartFile]:
    return [PartFile.from_json(f) for f in marker["tables"][name]["files"]]


@pytest.mark.parametrize("name", ["collectives", "steps"])
@pytest.mark.parametrize("expr,columns", [
    (None, None),
    (pc.field("step") >= 50, None),
    ((pc.field("rank") == 2) & (pc.field("step") < 30), ["rank", "step"]),
    (pc.field("step") > 10_000, None),                        # no row
])
def test_one_scan_equals_the_file_by_file_read(compacted, name, expr, columns):
    run, marker = compacted
    files = files_of(marker, name)
    assert len(files) >= file_scan.ONE_SCAN_FILES
    for ordered in (True, False):
        want = partitions.read_files(run / "tables", files, name, expr, ordered=ordered, columns=columns)
        got = file_scan.read_files_at_once(run / "tables", files, name, expr, ordered=ordered, columns=columns)
        assert got.schema.equals(want.schema)
        assert got.equals(want)
    if expr is None:
        assert got.num_rows == marker["tables"][name]["rows"] > 0


def test_files_in_reverse_order_merge_by_rank_as_read_files_merges_them(compacted):
    run, marker = compacted
    files = files_of(marker, "collectives")[::-1]      # rows of each rank then come in this file order
    want = partitions.read_files(run / "tables", files, "collectives", None, ordered=True)
    got = file_scan.read_files_at_once(run / "tables", files, "collectives", None, ordered=True)
    assert got.equals(want)
    assert pc.all(pc.greater_equal(pc.pairwise_diff(got.column("rank").combine_chunks()).slice(1), 0)).as_py()


def test_a_file_lacking_a_column_is_read_file_by_file_with_nulls(compacted, tmp_path):
    run, marker = compacted
    tables = tmp_path / "tables"
    shutil.copytree(run / "tables", tables)
    files = files_of(marker, "steps")
    path = tables / files[1].path
    old = pq.read_table(path)
    pq.write_table(old.drop_columns([old.column_names[-1]]).replace_schema_metadata(old.schema.metadata), path)
    want = partitions.read_files(tables, files, "steps", None, ordered=True)
    got = file_scan.read_files_at_once(tables, files, "steps", None, ordered=True)
    assert got.equals(want)
    assert got.column(old.column_names[-1]).null_count >= old.num_rows


def test_a_damaged_file_is_named_as_the_file_by_file_read_names_it(compacted, tmp_path):
    run, marker = compacted
    tables = tmp_path / "tables"
    shutil.copytree(run / "tables", tables)
    files = files_of(marker, "collectives")
    (tables / files[2].path).write_bytes(b"not parquet")
    with pytest.raises(TraceError, match=str(tables / files[2].path)):
        file_scan.read_files_at_once(tables, files, "collectives", None, ordered=True)
    (tables / files[2].path).unlink()
    with pytest.raises(TraceError, match="is missing"):
        file_scan.read_files_at_once(tables, files, "collectives", None, ordered=True)


def test_a_newer_schema_version_is_refused(compacted, tmp_path):
    run, marker = compacted
    tables = tmp_path / "tables"
    shutil.copytree(run / "tables", tables)
    files = files_of(marker, "steps")
    for f in files:
        t = pq.read_table(tables / f.path)
        meta = {**t.schema.metadata, b"dtprobe.schema_version": b"999"}
        pq.write_table(t.replace_schema_metadata(meta), tables / f.path)
    with pytest.raises(TraceError, match="schema_version 999"):
        file_scan.read_files_at_once(tables, files, "steps", None, ordered=True)
