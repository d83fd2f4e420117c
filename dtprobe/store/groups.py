"""The ``groups`` table: each process group's members written once per rank, the key rows carry instead, and how
the reader puts the members back into ``collectives`` and ``pending``; used by the recorder, the synthetic writers
and ``store.reader``.

A version-2 events row of a grouped table (``schema.GROUPED_TABLES``) carries ``pg`` only: a key into the rank's
``groups`` rows of the same ``restart``. The key is the group's name, or ``<name>#<k>`` when the rank already
recorded another group (other members) under that name, so every key names one member list. Rows that carry
``pg_ranks`` themselves (version 1) are left as they are.
"""

from __future__ import annotations

from typing import Any, Iterable

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from dtprobe.store.errors import TraceError
from dtprobe.store.frames import dictionary_encoded
from dtprobe.store.schema import GROUPED_TABLES

GROUPS_SINCE_VERSION = 2
"""The schema version from which grouped rows leave their members to ``groups`` (older runs' rows carry them)."""
MEMBER_COLUMNS = ("pg_ranks", "pg_size")
"""Columns of a grouped table that version-2 rows leave to the ``groups`` table."""


class GroupKeys:
    """The ``pg`` key of each group (name, members) of one writer: the name, or ``<name>#<k>`` for a name taken by
    a group with other members. Not thread-safe: callers serialize."""

    def __init__(self) -> None:
        self._keys: dict[tuple[str, Any], str] = {}
        self._taken: set[str] = set()

    def key(self, name: str, pg_ranks: Any) -> tuple[str, bool]:
        """The key of group (``name``, ``pg_ranks``) and whether it is new (its ``groups`` row is still to write)."""
        key = self._keys.get((name, pg_ranks))
        if key is not None:
            return key, False
        key, n = name, 1
        while key in self._taken:
            n += 1
            key = f"{name}#{n}"
        self._keys[(name, pg_ranks)] = key
        self._taken.add(key)
        return key, True


class GroupLayout:
    """Turns row dicts with ``pg``, ``pg_ranks``, ``pg_size`` on every grouped row (the frames' layout) into the
    events layout: a ``groups`` row the first time a (rank, restart) names a group, then rows with the key only.
    Keeps what it has written, so a run written step by step gets each group row once."""

    def __init__(self) -> None:
        self._keys: dict[tuple[int, int | None], GroupKeys] = {}

    def split(self, tables: dict[str, list[dict]]) -> dict[str, list[dict]]:
        """``tables`` in the events layout, ``groups`` first (write them in this order)."""
        groups: list[dict] = []
        out: dict[str, list[dict]] = {"groups": groups}
        for table, rows in tables.items():
            if table not in GROUPED_TABLES:
                out.setdefault(table, []).extend(rows)
                continue
            moved = out.setdefault(table, [])
            for row in rows:
                name = row.get("pg")
                if name is None:
                    moved.append({k: v for k, v in row.items() if k not in MEMBER_COLUMNS})
                    continue
                rank, restart = int(row["rank"]), row.get("restart")
                keys = self._keys.get((rank, restart))
                if keys is None:
                    keys = self._keys[(rank, restart)] = GroupKeys()
                key, new = keys.key(name, row.get("pg_ranks"))
                if new:
                    groups.append({"rank": rank, "restart": restart, "pg": key, "name": name,
                                   "pg_ranks": row.get("pg_ranks"), "pg_size": row.get("pg_size")})
                moved.append({k: (key if k == "pg" else v) for k, v in row.items() if k not in MEMBER_COLUMNS})
        return out


def fill_members(rows: pa.Table, groups: pa.Table,
                 table: str) -> tuple[pa.Table, list[tuple[int, int | None, str]]]:
    """``rows`` of the grouped table ``table`` with ``pg`` (the group's name), ``pg_ranks`` and ``pg_size`` taken
    from ``groups`` for every row that names a group (``pg`` set) without members (``pg_ranks`` null); other rows
    keep theirs. ``pg_ranks`` comes back dictionary-encoded (``frames.memory_schema``). Also returns the (rank,
    restart, pg) keys no ``groups`` row has (those rows are left unfilled).

    Identical repeated ``groups`` rows (a rank that attached twice) count once; two rows of one key with different
    members are damage (TraceError)."""
    rows = dictionary_encoded(rows, table)
    need = pc.and_(pc.is_null(rows.column("pg_ranks")), pc.is_valid(rows.column("pg")))
    if not rows.num_rows or not pc.any(need).as_py():
        return rows, []
    groups = _unique_keys(groups)
    names = pc.unique(groups.column("pg").combine_chunks()) if groups.num_rows else pa.array([], pa.string())
    index = pc.index_in(_codes(rows, names), value_set=_codes(groups, names))
    found = pc.and_(need, pc.is_valid(index))
    if pc.any(found).as_py():
        # the members taken as dictionary codes: a row gets a code, not a copy of its group's member list (a
        # 128-rank group's is ~560 bytes: copies on millions of rows overflow an Arrow string array's 2 GB)
        members = dictionary_encoded(groups.select(["name", *MEMBER_COLUMNS]), table).take(index)
        for column in ("pg", *MEMBER_COLUMNS):
            source = members.column("name" if column == "pg" else column)
            filled = pc.if_else(found, source, rows.column(column))
            filled = filled.cast(rows.schema.field(column).type)
            rows = rows.set_column(rows.schema.get_field_index(column), column, filled)
    lost = pc.and_(need, pc.is_null(index))
    if not pc.any(lost).as_py():
        return rows, []
    keys = rows.filter(lost).select(["rank", "restart", "pg"]).group_by(["rank", "restart", "pg"]).aggregate([])
    return rows, sorted(zip(*(keys.column(c).to_pylist() for c in ("rank", "restart", "pg"))),
                        key=lambda k: (k[0], -1 if k[1] is None else k[1], k[2]))


def _codes(table: pa.Table, names: pa.Array) -> pa.Array:
    """One int64 per row for (rank, restart, pg): null when ``pg`` is not among ``names``."""
    n = max(len(names), 1)
    pg = pc.index_in(table.column("pg"), value_set=names).cast(pa.int64())
    restart = pc.add(pc.fill_null(table.column("restart"), -1).cast(pa.int64()), 1)
    rank = table.column("rank").cast(pa.int64())
    return pc.add_checked(pc.multiply_checked(pc.add_checked(pc.multiply_checked(rank, 1 << 21), restart), n), pg)


def _unique_keys(groups: pa.Table) -> pa.Table:
    """``groups`` with one row per (rank, restart, pg): the first; TraceError if a later one differs from it."""
    if groups.num_rows < 2:
        return groups
    names = pc.unique(groups.column("pg").combine_chunks())
    codes = _codes(groups, names).to_numpy(zero_copy_only=False)
    _, first = np.unique(codes, return_index=True)
    if len(first) == groups.num_rows:
        return groups
    first.sort()
    kept = groups.take(pa.array(first))
    by_code = dict(zip(codes[first].tolist(), kept.select(["name", *MEMBER_COLUMNS]).to_pylist()))
    for code, row in zip(codes.tolist(), groups.to_pylist()):
        were = by_code[code]
        if were != {c: row[c] for c in were}:
            raise TraceError(
                f"rank {row['rank']} has two 'groups' rows for group '{row['pg']}' (restart {row['restart']}) with "
                f"different members ({were['pg_ranks']!r} and {row['pg_ranks']!r}), so the rows naming it cannot "
                f"be told apart. A rank's recorder gives each member list its own key: the events file "
                f"events/groups/rank{row['rank']:05d}.jsonl was written by something else or edited. Restore it "
                f"or re-collect the run.")
    return kept


def missing_groups_error(table: str, run_dir: Any, missing: Iterable[tuple[int, int | None, str]]) -> TraceError:
    """The error for rows of ``table`` whose groups rows are missing: which file lacks what, and the fix."""
    missing = list(missing)
    rank, restart, pg = missing[0]
    more = f" (and {len(missing) - 1} more groups)" if len(missing) > 1 else ""
    return TraceError(
        f"'{run_dir}/events/{table}/rank{rank:05d}.jsonl' has rows of group '{pg}' (restart {restart}){more}, "
        f"but '{run_dir}/events/groups/rank{rank:05d}.jsonl' has no row for it, so their members (pg_ranks, "
        f"pg_size) are unknown. A rank hands a group's row to the OS before any row naming it, so that file lost "
        f"lines (truncated, deleted, or the run was copied without it). Restore events/groups/ from the original "
        f"run directory, or re-collect the run.")
