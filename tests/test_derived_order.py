"""A derived table read in an order (``derived.blocks_frame(order=...)``, ``RunStore.derived_table(order=...)``): the
same frame as pandas' stable sort of the blocks' rows, with text columns read as dictionaries and given back as
plain text."""

from __future__ import annotations

import shutil

import numpy as np
import pandas as pd
import pyarrow as pa
import pytest

from dtprobe.analysis.derived_tables import KEY, LATENESS, ORDER, deriver, read_order
from dtprobe.store import RunStore, compact
from dtprobe.store.derived import blocks_frame
from test_sample_trace_findings import SAMPLES


def _blocks(seed: int) -> list[pd.DataFrame]:
    """Three step blocks of lateness-like rows: groups named out of order, long member lists, ties on every key
    (the ``value`` column tells tied rows apart) and null groups."""
    rng = np.random.default_rng(seed)
    groups = [("tp", "8,9,10,11"), ("dp", ",".join(map(str, range(0, 512, 4)))), ("dp", "1,5"), (None, None)]
    out = []
    for block in range(3):
        picks = rng.integers(0, len(groups), 300)
        out.append(pd.DataFrame({
            "pg": pd.array([groups[i][0] for i in picks], dtype="str"),
            "pg_ranks": pd.array([groups[i][1] for i in picks], dtype="str"),
            "rank": rng.integers(0, 4, 300), "step": block * 20 + rng.integers(0, 20, 300),
            "value": np.arange(300, dtype="float64") + block * 1000}))
    return out


def _text_as_dictionary(table: pa.Table) -> pa.Table:
    for i in (0, 1):
        table = table.set_column(i, table.field(i).name, table.column(i).dictionary_encode())
    return table


@pytest.mark.parametrize("as_dictionary", [False, True])
@pytest.mark.parametrize("seed", [0, 1])
def test_an_ordered_read_equals_pandas_stable_sort_with_nulls_last(seed, as_dictionary):
    frames = _blocks(seed)
    parts = [pa.Table.from_pandas(f, preserve_index=False) for f in frames]
    if as_dictionary:   # as read_derived reads a compacted file's text columns
        parts = [_text_as_dictionary(t) for t in parts]
    by = ["pg", "pg_ranks", "rank", "step"]
    expected = (pd.concat(frames, ignore_index=True).sort_values(by, kind="stable", na_position="last")
                .reset_index(drop=True))
    got = blocks_frame(parts, order=by)
    pd.testing.assert_frame_equal(got, expected)
    window = blocks_frame(parts, (15, 44), order=by)
    pd.testing.assert_frame_equal(window, expected[expected["step"].between(15, 44)].reset_index(drop=True))


def test_a_compacted_runs_lateness_read_in_order_equals_the_unordered_read_sorted(tmp_path):
    run = tmp_path / "run"
    shutil.copytree(SAMPLES / "dp4_straggler_rank2", run)
    compact(run, derive=deriver())
    store = RunStore.open(run)
    assert read_order(LATENESS) == ORDER[LATENESS][0]
    plain = store.derived_table(LATENESS, KEY)
    assert plain["step"].nunique() > 20       # more than one step block, so the blocks' order is not the sort's
    ordered = store.derived_table(LATENESS, KEY, order=read_order(LATENESS))
    expected = plain.sort_values(read_order(LATENESS), kind="stable", na_position="last").reset_index(drop=True)
    assert not plain.equals(expected)
    pd.testing.assert_frame_equal(ordered, expected)
    assert all(ordered[c].dtype == plain[c].dtype for c in plain.columns)
