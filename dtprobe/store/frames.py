"""Schema-typed pandas/pyarrow frames for the run-store tables; used by the reader, compaction and Kineto ingest.

``SCHEMAS`` dtype names map to pandas dtypes as follows: ``int32``/``int64`` -> nullable ``Int32``/``Int64``,
``boolean`` -> nullable ``boolean``, ``string`` -> ``string`` (``pd.NA`` for null), ``float64`` -> numpy
``float64`` (``NaN`` for null). Analysis and tests that build hand-made tables should use ``frame_from_rows`` or
``conform`` so their frames match what ``RunStore.table`` returns.
"""

from __future__ import annotations

from typing import Any, Iterable, Mapping

import pandas as pd
import pyarrow as pa

from dtprobe.store.schema import SCHEMAS, TIME_COLUMNS

PANDAS_DTYPES: dict[str, str] = {
    "int32": "Int32", "int64": "Int64", "float64": "float64", "boolean": "boolean", "string": "string",
}
"""Schema dtype name -> pandas dtype of the column in every frame the store returns."""

ARROW_TYPES: dict[str, pa.DataType] = {
    "int32": pa.int32(), "int64": pa.int64(), "float64": pa.float64(), "boolean": pa.bool_(),
    "string": pa.string(),
}
"""Schema dtype name -> Arrow type (JSONL parsing and Parquet files)."""

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
}
"""Row order of each table as returned by the reader (stable: ties keep file order; nulls last)."""


def arrow_schema(table: str) -> pa.Schema:
    """The Arrow schema of ``table`` (every column, nullable)."""
    return pa.schema([(col, ARROW_TYPES[dtype]) for col, dtype in SCHEMAS[table].items()])


def pandas_dtypes(table: str) -> dict[str, str]:
    """Column -> pandas dtype of ``table``."""
    return {col: PANDAS_DTYPES[dtype] for col, dtype in SCHEMAS[table].items()}


def empty_frame(table: str) -> pd.DataFrame:
    """A zero-row frame with every column of ``table`` in its schema dtype."""
    return pd.DataFrame({col: pd.Series([], dtype=dtype) for col, dtype in pandas_dtypes(table).items()})


def arrow_to_frame(data: pa.Table, table: str) -> pd.DataFrame:
    """Convert an Arrow table holding exactly ``table``'s columns into a schema-typed frame."""
    df = data.to_pandas(types_mapper=_TYPES_MAPPER.get)
    return df.astype(pandas_dtypes(table)) if len(df.columns) else empty_frame(table)


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
        out[col] = df[col].astype(dtype) if col in df.columns else pd.Series(None, index=df.index, dtype=dtype)
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
