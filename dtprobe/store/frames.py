"""Schema-typed pandas/pyarrow frames for the run-store tables; used by the reader, compaction and Kineto ingest.

``SCHEMAS`` dtype names map to pandas dtypes as follows: ``int32``/``int64`` -> nullable ``Int32``/``Int64``,
``boolean`` -> nullable ``boolean``, ``string`` -> ``string`` (``pd.NA`` for null), ``float64`` -> numpy
``float64`` (``NaN`` for null). A group's member list (``pg_ranks`` of the ``GROUPED_TABLES``:
``DICTIONARY_COLUMNS``) repeats on every row of its group: it is an Arrow dictionary column in memory and a pandas
``category`` (null: NaN) in frames, so a row holds a small code, not a copy of a string of up to a few KB.
Analysis and tests that build hand-made tables should use ``frame_from_rows`` or ``conform`` so their frames match
what ``RunStore.table`` returns.
"""

from __future__ import annotations

from typing import Any, Iterable, Mapping

import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc

from dtprobe.store.schema import GROUPED_TABLES, SCHEMAS, TIME_COLUMNS

PANDAS_DTYPES: dict[str, str] = {
    "int32": "Int32", "int64": "Int64", "float64": "float64", "boolean": "boolean", "string": "string",
}
"""Schema dtype name -> pandas dtype of the column in every frame the store returns."""

ARROW_TYPES: dict[str, pa.DataType] = {
    "int32": pa.int32(), "int64": pa.int64(), "float64": pa.float64(), "boolean": pa.bool_(),
    "string": pa.string(),
}
"""Schema dtype name -> Arrow type (JSONL parsing and Parquet files)."""

DICTIONARY_COLUMNS: dict[str, tuple[str, ...]] = {table: ("pg_ranks",) for table in GROUPED_TABLES}
"""Per table, the string columns held dictionary-encoded (Arrow) / ``category`` (pandas): the same long value on
many rows."""
DICTIONARY_TYPE = pa.dictionary(pa.int32(), pa.string())

_TYPES_MAPPER = {
    pa.int32(): pd.Int32Dtype(), pa.int64(): pd.Int64Dtype(), pa.bool_(): pd.BooleanDtype(),
    pa.string(): pd.StringDtype(), pa.large_string(): pd.StringDtype(),
}

SORT_KEYS: dict[str, tuple[str, ...]] = {
    "steps": ("rank", "step", "start_ns"),
    "collectives": ("rank", "enqueue_ns", "seq"),
    "devices": ("rank", "time_ns"),
    "faults": ("time_ns", "rank"),
    "pipeline": ("rank", "start_ns"),
    "amp": ("rank", "step"),
    "checkpoints": ("rank", "step", "start_ns"),
    "memory": ("rank", "step"),
    "compression": ("rank", "step", "bucket"),
    "kernels": ("rank", "start_ns"),
    "lifecycle": ("rank", "restart", "time_ns"),
    "pending": ("rank", "restart", "enqueue_ns", "seq"),
    "groups": ("rank", "restart"),
    "comm_steps": ("rank", "step", "restart", "pg"),
}
"""Row order of each table as returned by the reader (stable: ties keep file order; nulls last)."""


def arrow_schema(table: str) -> pa.Schema:
    """The Arrow schema of ``table`` as written (events lines, Parquet of older dtprobes): every column, nullable,
    plain strings."""
    return pa.schema([(col, ARROW_TYPES[dtype]) for col, dtype in SCHEMAS[table].items()])


def memory_schema(table: str) -> pa.Schema:
    """The Arrow schema of ``table``'s rows held by the reader: ``arrow_schema`` with ``DICTIONARY_COLUMNS``
    dictionary-encoded."""
    encoded = DICTIONARY_COLUMNS.get(table, ())
    return pa.schema([(col, DICTIONARY_TYPE if col in encoded else ARROW_TYPES[dtype])
                      for col, dtype in SCHEMAS[table].items()])


def dictionary_encoded(rows: pa.Table, table: str) -> pa.Table:
    """``rows`` of ``table`` with its ``DICTIONARY_COLUMNS`` dictionary-encoded (as ``memory_schema``)."""
    for col in DICTIONARY_COLUMNS.get(table, ()):
        i = rows.schema.get_field_index(col)
        if i < 0 or rows.schema.field(i).type == DICTIONARY_TYPE:
            continue
        column = rows.column(i)
        if pa.types.is_dictionary(column.type):
            column = column.cast(pa.string())   # another index or value type: decode first (small tables only)
        rows = rows.set_column(i, col, pc.dictionary_encode(column).cast(DICTIONARY_TYPE))
    return rows


def pandas_dtypes(table: str) -> dict[str, str]:
    """Column -> pandas dtype of ``table``."""
    encoded = DICTIONARY_COLUMNS.get(table, ())
    return {col: "category" if col in encoded else PANDAS_DTYPES[dtype] for col, dtype in SCHEMAS[table].items()}


def empty_frame(table: str) -> pd.DataFrame:
    """A zero-row frame with every column of ``table`` in its schema dtype."""
    return pd.DataFrame({col: pd.Series([], dtype=_empty_dtype(dtype))
                         for col, dtype in pandas_dtypes(table).items()})


def _empty_dtype(dtype: str) -> Any:
    # a category column's categories are strings, also without rows (as a frame read from Arrow has them)
    return pd.CategoricalDtype(pd.Index([], dtype="str")) if dtype == "category" else dtype


def arrow_to_frame(data: pa.Table, table: str) -> pd.DataFrame:
    """Convert an Arrow table holding ``table``'s columns, or some of them (a projected read), into a frame of
    those columns in their schema dtypes."""
    if not len(data.column_names):
        return empty_frame(table)
    df = dictionary_encoded(data, table).to_pandas(types_mapper=_TYPES_MAPPER.get)
    dtypes = pandas_dtypes(table)
    df = df.astype({col: dtype for col, dtype in dtypes.items() if dtype != "category" and col in df.columns})
    for col in DICTIONARY_COLUMNS.get(table, ()):
        if col in df.columns:
            df[col] = _sorted_categories(df[col])
    return df


def _sorted_categories(values: pd.Series) -> pd.Series:
    """A category column with only the values it holds as categories, in sorted order (so sorting or grouping by
    it orders rows as by the strings; Arrow's dictionaries are in order of appearance and may hold more)."""
    values = values.cat.remove_unused_categories()
    categories = values.cat.categories
    return values if categories.is_monotonic_increasing else values.cat.reorder_categories(categories.sort_values())


def frame_from_rows(table: str, rows: Iterable[Mapping[str, Any]]) -> pd.DataFrame:
    """Build a schema-typed frame of ``table`` from row dicts (missing columns -> null; unknown -> KeyError)."""
    rows = list(rows)
    columns = SCHEMAS[table]
    for row in rows:
        unknown = set(row) - set(columns)
        if unknown:
            raise KeyError(f"unknown columns for table {table!r}: {sorted(unknown)}")
    return arrow_to_frame(pa.Table.from_pylist(rows, schema=arrow_schema(table)), table)


def conform(df: pd.DataFrame, table: str) -> pd.DataFrame:
    """Return ``df`` with exactly ``table``'s columns, in schema order and dtypes (missing columns -> null)."""
    out = pd.DataFrame(index=df.index)
    for col, dtype in pandas_dtypes(table).items():
        out[col] = df[col].astype(dtype) if col in df.columns else pd.Series(
            None, index=df.index, dtype=_empty_dtype(dtype))
    return out.reset_index(drop=True)


def sort_frame(df: pd.DataFrame, table: str) -> pd.DataFrame:
    """Sort ``df`` by ``SORT_KEYS[table]`` (stable, nulls last) and reset the index."""
    keys = [k for k in SORT_KEYS.get(table, ("rank",)) if k in df.columns]
    if len(df) > 1 and keys:
        df = df.sort_values(keys, kind="stable", na_position="last")
    return df.reset_index(drop=True)


def time_columns(table: str) -> tuple[str, ...]:
    """Columns of ``table`` that hold rank-clock timestamps (shifted by the rank's clock offset on read)."""
    return TIME_COLUMNS.get(table, ())
