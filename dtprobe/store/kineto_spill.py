"""Each rank's reduced tables written to Arrow IPC files in a temporary folder as soon as the rank is reduced; read
back one rank at a time by ``kineto.py`` when an analysis first asks for a trace folder's ``kernels`` or
``collectives``.

Loading a folder then holds one rank's tables at a time (plus each rank's few-hundred distinct kernel names and
its steps), not every rank's until the last file is read; a table is built only when asked for, straight into
arrays of its final length (no list of per-rank parts next to their concatenation). The folder is removed when
its ``RankSpill`` is garbage-collected (with the ``KinetoRun`` that holds it) or at interpreter exit. A part of the
collectives read in windows (``kineto_group_windows``) also keeps each rank's window keys there (a record per row,
read a stretch at a time).
"""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa

from dtprobe.store.kineto_collective_frame import collective_table
from dtprobe.store.kineto_collectives import P2P_OPS
from dtprobe.store.kineto_events import RankMeta
from dtprobe.store.kineto_reduce import RankTables

KERNEL_COLUMNS = {"name_code": pa.int32(), "stream": pa.int64(), "start_ns": pa.int64(), "dur_ns": pa.int64(),
                  "correlation": pa.int64(), "launch_ns": pa.int64(), "step": pa.int64()}
"""Columns of a spilled rank's GPU events (``RankTables.kernels``; -1 = none in correlation, launch_ns, step)."""


@dataclass(frozen=True, kw_only=True)
class SpilledRank:
    """What stays in memory of one reduced rank: its metadata, distinct kernel names, steps and row counts."""

    meta: RankMeta
    """What the file says about its rank."""
    names: tuple[str, ...]
    """Distinct GPU event names (``name_code`` indexes them)."""
    name_kinds: tuple[str, ...]
    """``kernel_kind`` of each of ``names``."""
    steps: tuple[tuple[int, int, int], ...]
    """(step, start_ns, end_ns) per ``ProfilerStep#N``."""
    num_kernels: int
    """GPU events spilled."""
    num_collectives: int
    """Collectives spilled."""
    num_group_collectives: int
    """Collectives that are not send/recv (``seq`` numbers them)."""
    num_trace_seq: int
    """Of those, how many carry the trace's own ``Seq`` arg."""
    groups: dict[tuple[str | None, str | None], int]
    """Collectives per (``pg``, ``pg_ranks``) pair; None where a row names none."""
    kernels_file: Path
    collectives_file: Path


class RankSpill:
    """A temporary folder of spilled ranks, in the order they were added."""

    def __init__(self) -> None:
        self._dir = tempfile.TemporaryDirectory(prefix="dtprobe-kineto-")
        self.ranks: list[SpilledRank] = []

    @property
    def folder(self) -> Path:
        return Path(self._dir.name)

    def add(self, tables: RankTables) -> SpilledRank:
        """Write ``tables``' GPU events and collectives to the folder; the rank's ``SpilledRank``."""
        stem = self.folder / f"{len(self.ranks):06d}"
        kernels = pa.table({col: pa.array(tables.kernels[col], kind) for col, kind in KERNEL_COLUMNS.items()})
        _write(stem.with_suffix(".kernels.arrow"), kernels)
        collectives = collective_table(tables.collectives)
        _write(stem.with_suffix(".collectives.arrow"), collectives)
        op_codes, ops = tables.collectives.strings["op"]
        group = ~np.isin(op_codes, [i for i, op in enumerate(ops) if op in P2P_OPS])
        with_seq = tables.collectives.ints["trace_seq"][1]
        pg_codes, pg_names = tables.collectives.strings["pg"]
        pr_codes, pr_names = tables.collectives.strings["pg_ranks"]
        pairs, counts = np.unique(np.stack([pg_codes, pr_codes]).astype(np.int64), axis=1, return_counts=True) \
            if len(pg_codes) else (np.empty((2, 0), dtype=np.int64), np.empty(0, dtype=np.int64))
        spilled = SpilledRank(
            meta=tables.meta, names=tuple(tables.names), name_kinds=tuple(tables.name_kinds),
            steps=tuple(tables.steps), num_kernels=kernels.num_rows, num_collectives=collectives.num_rows,
            num_group_collectives=int(group.sum()), num_trace_seq=int((group & with_seq).sum()),
            groups={(None if g < 0 else pg_names[g], None if r < 0 else pr_names[r]): n
                    for (g, r), n in zip(pairs.T.tolist(), counts.tolist())},
            kernels_file=stem.with_suffix(".kernels.arrow"), collectives_file=stem.with_suffix(".collectives.arrow"))
        self.ranks.append(spilled)
        return spilled

    def close(self) -> None:
        """Remove the folder now (it is removed at garbage collection otherwise)."""
        self._dir.cleanup()


def _write(path: Path, table: pa.Table) -> None:
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_file(sink, table.schema) as writer:
        writer.write_table(table)


def _read(path: Path, columns: list[str] | None = None) -> pa.Table:
    """A spilled table, memory-mapped (its pages are read from the file as they are used)."""
    table = pa.ipc.open_file(pa.memory_map(str(path), "r")).read_all()   # the map lives as long as its buffers
    return table.select(columns) if columns is not None else table


def kernel_columns(rank: SpilledRank, columns: list[str]) -> dict[str, np.ndarray]:
    """``columns`` of one spilled rank's GPU events as numpy arrays (views of the memory-mapped file)."""
    table = _read(rank.kernels_file, columns)
    return {col: table[col].to_numpy() for col in columns}


def collective_tables(ranks: list[SpilledRank]) -> Iterator[pa.Table]:
    """Each rank's ``collective_table``, memory-mapped, in the order of ``ranks``."""
    for rank in ranks:
        yield _read(rank.collectives_file)


def group_tables(ranks: list[SpilledRank], groups: frozenset[tuple[str | None, str | None]]) -> Iterator[pa.Table]:
    """Each of ``ranks``' ``collective_table`` rows whose (``pg``, ``pg_ranks``) is one of ``groups`` (None: the
    row names none), in their order, in the order of ``ranks``."""
    for table, of_groups in group_masks(ranks, groups):
        yield table.filter(of_groups)


def group_masks(ranks: list[SpilledRank], groups: frozenset[tuple[str | None, str | None]]
                ) -> Iterator[tuple[pa.Table, np.ndarray]]:
    """Each of ``ranks``' ``collective_table``, with which of its rows are of ``groups``."""
    for table in collective_tables(ranks):
        yield table, _of_groups(table, groups)


def collective_rows(rank: SpilledRank, start: int, stop: int) -> pa.Table:
    """Rows [start, stop) of one rank's ``collective_table``."""
    return _read(rank.collectives_file).slice(start, stop - start)


def write_keys(path: Path, keys: np.ndarray) -> None:
    """One rank's per-row keys (a numpy record array) into the spill folder."""
    np.save(path, keys, allow_pickle=False)


def read_keys(path: Path, start: int, stop: int) -> np.ndarray:
    """Records [start, stop) of ``write_keys``' array (memory-mapped: only they are read)."""
    return np.load(path, mmap_mode="r", allow_pickle=False)[start:stop]


def _of_groups(table: pa.Table, groups: frozenset[tuple[str | None, str | None]]) -> np.ndarray:
    """Which rows of a ``collective_table`` have their (``pg``, ``pg_ranks``) in ``groups``."""
    pg, pg_ranks = (table[col].combine_chunks() if table.num_rows else None for col in ("pg", "pg_ranks"))
    if pg is None:
        return np.zeros(0, dtype=bool)

    def codes(column: pa.DictionaryArray) -> tuple[np.ndarray, dict[str | None, int]]:
        at = {value: i for i, value in enumerate(column.dictionary.to_pylist())}
        return column.indices.fill_null(-1).to_numpy(zero_copy_only=False).astype(np.int64), {**at, None: -1}

    (pg_codes, pg_at), (pr_codes, pr_at) = codes(pg), codes(pg_ranks)
    width = len(pr_at)                   # codes + 1: 0 for null
    wanted = [(pg_at[g] + 1) * width + pr_at[r] + 1 for g, r in groups if g in pg_at and r in pr_at]
    return np.isin((pg_codes + 1) * width + pr_codes + 1, np.asarray(wanted, dtype=np.int64))
