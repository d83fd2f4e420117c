"""``stragglers._step_rank_grid``, the step x rank grid ``peer_noise`` reads per group: the same steps, ranks and
cells as the ``pivot_table(aggfunc="first", dropna=False)`` it replaces (a cell's first non-null value)."""

from __future__ import annotations

import numpy as np
import pandas as pd

from dtprobe.analysis.straggler_scores import _step_rank_grid


def test_grid_equals_pivot_table_with_missing_cells_nulls_and_repeated_rows():
    g = pd.DataFrame({"step": [3, 1, 1, 3, 2, 1, 2], "rank": [5, 0, 5, 0, 5, 0, 9],
                      "x": [0.5, np.nan, 0.25, 1.0, 0.75, 2.0, np.nan]})
    grid, members, values = _step_rank_grid(g, "x")
    m = g.pivot_table(index="step", columns="rank", values="x", aggfunc="first", dropna=False)
    assert grid.tolist() == [1, 2, 3] and members.tolist() == [0, 5, 9]
    # (1, 0): its first row is null, the second (2.0) counts; rank 9 has only a null cell
    assert values[0].tolist()[:2] == [2.0, 0.25] and np.isnan(values[:, 2]).all()
    assert m.columns.tolist() == [0, 5, 9]             # dropna=False keeps the all-null rank
    np.testing.assert_array_equal(values, m.to_numpy(dtype="float64"))
