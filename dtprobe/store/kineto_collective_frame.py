"""The ranks' collectives (``kineto_collectives.RankCollectives``) -> Arrow tables (``kineto_spill`` writes them)
-> the ``collectives`` columns of a trace folder, ``seq`` numbered as ``kineto_collectives.number_seq`` numbers row
dicts; read by ``kineto.py`` in the main process (the workers that reduce each file import neither pandas nor
pyarrow).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pandas as pd
import pyarrow as pa

from dtprobe.store.frames import DICTIONARY_COLUMNS
from dtprobe.store.kineto_collectives import P2P_OPS, ROW_TYPES, RankCollectives, rank_collectives

_ARROW_INTS = {"int32": pa.int32(), "int64": pa.int64()}


def collective_table(rank: RankCollectives) -> pa.Table:
    """One rank's collectives as an Arrow table, strings dictionary-encoded (what ``kineto_spill`` writes)."""
    arrays = {}
    for col, kind in ROW_TYPES.items():
        if kind is None:
            codes, values = rank.strings[col]
            arrays[col] = pa.DictionaryArray.from_arrays(pa.array(codes, pa.int32(), mask=codes < 0),
                                                         pa.array(values, pa.string()))
        else:
            values, known = rank.ints[col]
            arrays[col] = pa.array(values, _ARROW_INTS[kind], mask=~known)
    return pa.table(arrays)


def _nullable_ints(column: pa.ChunkedArray, dtype: str) -> pd.api.extensions.ExtensionArray:
    values = column.fill_null(0).to_numpy().astype(dtype.lower(), copy=False)
    nulls = np.zeros(len(values), dtype=bool) if column.null_count == 0 else \
        column.is_null().to_numpy(zero_copy_only=False)
    return pd.arrays.IntegerArray(values, nulls)       # built from its parts: no check of every value


def dictionary_codes(column: pa.ChunkedArray) -> tuple[np.ndarray, list[str]]:
    """A dictionary column's codes over one dictionary of all its chunks (-1: null) and that dictionary."""
    if not column.num_chunks:
        return np.empty(0, np.int32), []
    column = column.unify_dictionaries()
    codes = pa.chunked_array([c.indices for c in column.chunks], pa.int32()).fill_null(-1).to_numpy()
    return codes, column.chunk(0).dictionary.to_pylist()


def _strings(codes: np.ndarray, values: list[str]) -> pd.api.extensions.ExtensionArray:
    """``values[codes]`` as a ``string`` array, built from the few distinct values (in Arrow when that is where
    pandas keeps its strings: no Python string per row)."""
    if not len(codes):
        return pd.array([], dtype="string")
    if pd.StringDtype().storage == "pyarrow":
        decoded = pa.DictionaryArray.from_arrays(pa.array(codes, pa.int32(), mask=codes < 0),
                                                 pa.array(values, pa.string())).dictionary_decode()
        return pd.arrays.ArrowStringArray(decoded)
    return pd.Categorical.from_codes(codes, categories=pd.Index(values, dtype=object)).astype("string")


def _category(codes: np.ndarray, values: list[str]) -> pd.Categorical:
    """``values[codes]`` as a ``category`` column whose categories are the values it holds, sorted (what the
    store's reader gives for ``frames.DICTIONARY_COLUMNS``): a small code per row, not a copy of the string."""
    held = np.unique(codes[codes >= 0])
    names = pd.Index([values[i] for i in held], dtype="str")
    order = names.argsort()
    position = np.full(len(values) + 1, -1, dtype=np.int32)      # the last: null
    position[held[order]] = np.arange(len(held), dtype=np.int32)
    return pd.Categorical.from_codes(position[np.where(codes >= 0, codes, len(values))], categories=names[order])


def collective_columns(tables: list[pa.Table], *, seq_source: str | None = None,
                       seq: tuple[np.ndarray, np.ndarray] | None = None) -> tuple[dict[str, Any], int, str]:
    """The ranks' ``collective_table``s (in rank order) as pandas columns, ``seq`` numbered as ``number_seq``
    numbers rows; with the row count and where ``seq`` came from (``trace`` | ``order``: decided on these rows
    unless ``seq_source`` says, as for one process group's rows of a folder). ``seq``: (values, nulls) of the rows
    numbered beforehand (``table_seq`` of each rank's rows, for rows taken out of them). Strings stay codes until
    the end: numbering on them needs no string per row."""
    table = pa.concat_tables(tables) if tables else collective_table(rank_collectives([]))
    coded = {col: dictionary_codes(table[col]) for col, kind in ROW_TYPES.items() if kind is None}
    columns: dict[str, Any] = {
        col: _nullable_ints(table[col], kind.capitalize())
        for col, kind in ROW_TYPES.items() if kind is not None}
    p2p = _p2p(*coded["op"])
    if seq is None:
        values, source = _seq_values(table, p2p, coded["pg"][0], source=seq_source)
        seq = (values, p2p)
    else:
        source = seq_source
    columns["seq"] = pd.arrays.IntegerArray(seq[0], seq[1].copy())
    del table
    for col, (codes, values) in coded.items():
        columns[col] = _category(codes, values) if col in DICTIONARY_COLUMNS["collectives"] else \
            _strings(codes, values)
    return columns, len(p2p), source


def table_seq(table: pa.Table, *, source: str) -> tuple[np.ndarray, np.ndarray]:
    """``seq`` of one rank's ``collective_table`` rows as ``collective_columns`` numbers them (``source``:
    ``trace`` or ``order``): values and nulls (send/recv). Each rank's collectives of a ``pg`` are numbered
    together, so numbering a rank's rows of whole groups alone gives the numbers of the whole table."""
    p2p = _p2p(*dictionary_codes(table["op"]))
    values, _ = _seq_values(table, p2p, dictionary_codes(table["pg"])[0], source=source)
    return values, p2p


def _p2p(op_codes: np.ndarray, op_values: list[str]) -> np.ndarray:
    return np.isin(op_codes, [i for i, v in enumerate(op_values) if v in P2P_OPS])


def _seq_values(table: pa.Table, p2p: np.ndarray, pg: np.ndarray, *, source: str | None = None
                ) -> tuple[np.ndarray, str]:
    """``number_seq`` over the rows of ``table`` (``pg``: the group's code, -1 for none; p2p rows get 0, null in
    the column): the trace's ``Seq`` when every other row has one (or ``source`` is ``trace``), else the 1-based
    order of each (rank, pg)'s collectives by enqueue time (start time when none)."""
    n = len(p2p)
    trace_seq = table["trace_seq"]
    known = ~_nulls(trace_seq, n)
    from_trace = bool((~p2p).any()) and bool(known[~p2p].all()) if source is None else source == "trace"
    if from_trace:
        values = _ints(trace_seq)
    else:
        enqueue, start = _ints(table["enqueue_ns"]), _ints(table["start_ns"])
        # number_seq's key: (no enqueue time, enqueue_ns or start_ns or 0), ties in row order
        key = np.where(enqueue != 0, enqueue, start)
        order = np.lexsort((np.arange(n), key, _nulls(table["enqueue_ns"], n)))
        order = order[~p2p[order]]
        values = np.zeros(n, dtype=np.int64)
        groups = pd.DataFrame({"rank": _ints(table["rank"], null=-1)[order], "pg": pg[order]})
        values[order] = groups.groupby(["rank", "pg"], sort=False).cumcount().to_numpy() + 1
    return np.where(p2p, 0, values).astype(np.int64), "trace" if from_trace else "order"


def _ints(column: pa.ChunkedArray, null: int = 0) -> np.ndarray:
    return column.fill_null(null).to_numpy().astype(np.int64, copy=False) if len(column) else np.empty(0, np.int64)


def _nulls(column: pa.ChunkedArray, n: int) -> np.ndarray:
    return np.zeros(n, dtype=bool) if column.null_count == 0 else column.is_null().to_numpy(zero_copy_only=False)
