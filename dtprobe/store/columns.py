"""``require_columns``: the one column check on entry of every analyzer and reader of the store's tables.

Raises ``TraceError`` naming the table, the missing columns, the columns the frame has and the fix.
"""

from __future__ import annotations

from typing import Iterable

import pandas as pd

from dtprobe.store.errors import TraceError


def require_columns(df: pd.DataFrame, columns: Iterable[str], *, table: str) -> None:
    """TraceError naming ``table`` and the missing columns unless ``df`` has all of ``columns``."""
    missing = [c for c in columns if c not in df.columns]
    if missing:
        raise TraceError(
            f"table '{table}' lacks the columns {missing} (it has {sorted(df.columns)}); it was not read "
            f"through a dtprobe source or was written by another tool. Read the run with "
            f"RunStore.open(path).table('{table}') (a Kineto trace folder with "
            f"dtprobe.store.kineto.load_trace_dir(path).table('{table}')), or re-collect it with this dtprobe.")
