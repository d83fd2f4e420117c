"""The Stragglers heatmap at cluster size (issue 17, item 4): a 1,024-rank x 500-step lateness grid is binned to
at most 128 x 400 cells, each the latest of its block, so the late rank's block still stands out and a marked
rank's block is boxed; a small run is drawn cell for cell as before."""

from __future__ import annotations

import numpy as np
import pandas as pd

from dtprobe.dashboard import charts


def _lateness(num_ranks: int, num_steps: int, *, late_rank: int) -> pd.DataFrame:
    rng = np.random.default_rng(0)
    rank, step = np.meshgrid(np.arange(num_ranks), np.arange(num_steps), indexing="ij")
    frac = rng.uniform(-0.02, 0.02, size=rank.shape)
    frac[late_rank] = 0.30
    frac[7, 3] = np.nan                              # a step a rank did not record
    return pd.DataFrame({"rank": rank.ravel(), "step": step.ravel(), "lateness_frac": frac.ravel()})


def test_a_1024_rank_heatmap_is_binned_to_the_screen_and_the_late_block_stands_out():
    fig = charts.lateness_heatmap(_lateness(1024, 500, late_rank=300), marked=[300])
    heat = fig.data[0]
    z = np.asarray(heat.z, dtype="float64")
    assert z.shape == (128, 250)                      # 8 ranks x 2 steps per cell
    assert list(heat.y[:2]) == ["ranks 0-7", "ranks 8-15"] and heat.y[37] == "ranks 296-303"
    assert list(heat.x[:3]) == [0, 2, 4]
    assert np.allclose(z[37], 0.30)                   # the late rank's block, every step
    others = np.delete(z, 37, axis=0)
    assert np.nanmax(others) < 0.03 and not np.isnan(z).any()    # one NaN in a block does not blank it
    [box] = fig.layout.shapes
    assert (box.y0, box.y1) == (36.5, 37.5)
    assert "latest of 8 rank(s) x 2 step(s)" in fig.layout.title.text


def test_a_small_run_is_drawn_cell_for_cell():
    fig = charts.lateness_heatmap(_lateness(8, 20, late_rank=2), marked=[2])
    heat = fig.data[0]
    assert np.asarray(heat.z).shape == (8, 20)
    assert list(heat.y) == [f"rank {r}" for r in range(8)] and list(heat.x) == list(range(20))
    assert np.isnan(np.asarray(heat.z, dtype="float64")[7, 3])
    assert [(s.y0, s.y1) for s in fig.layout.shapes] == [(1.5, 2.5)]
    assert "latest of" not in fig.layout.title.text
