"""STRAGGLER causes read only the collectives of the candidates' windows (``stragglers.cause_rows``), with the same
result as from every row."""

from __future__ import annotations

import pandas as pd
import pytest

from dtprobe.analysis import straggler_causes as sc
from dtprobe.analysis import RunAnalysis
from dtprobe.analysis import stragglers as st
from dtprobe.store import RunStore
from dtprobe.synthetic import cuda_dp_tables, dp_tables, write_run

LAYOUT = {"layout": {"dp": 4, "tp": 1, "pp": 1}}


def causes_from_every_row(a: RunAnalysis) -> pd.DataFrame:
    return sc.straggler_causes(a.straggler_scores(), a.rank_lateness(), a.table("steps"), a.table("devices"),
                               blocked=sc.blocked_outside_groups(a.arrival_collectives(), a.collective_waits()),
                               min_lateness_frac=a.options.min_lateness_frac)


@pytest.mark.parametrize("clock", ["device", "host"])
def test_causes_equal_those_from_every_row_and_read_only_the_window(tmp_path, clock):
    tables = cuda_dp_tables(clock=clock, num_steps=60, straggler=2, delay_ms=15.0)
    a = RunAnalysis(RunStore.open(write_run(tmp_path / clock, tables, world_size=4, config=LAYOUT)))
    pd.testing.assert_frame_equal(a.straggler_causes(), causes_from_every_row(a), check_exact=True)
    rows = sc.cause_rows(a.arrival_collectives(), a.straggler_scores(), min_lateness_frac=a.options.min_lateness_frac)
    if clock == "device":
        [cand] = sc.cause_candidates(a.straggler_scores(), min_lateness_frac=a.options.min_lateness_frac).itertuples()
        assert cand.rank == 2 and a.straggler_causes()["rank"].tolist() == [2]
        assert set(rows["step"]) == set(range(cand.window_first_step, cand.window_last_step + 1))
        assert len(rows) < len(a.table("collectives")) / 2
    else:
        assert rows.empty == a.straggler_causes().empty


def test_a_collective_whose_rows_name_different_steps_is_read_whole():
    coll = dp_tables(world=2, num_steps=4)["collectives"].reset_index(drop=True)
    first = coll.index[(coll["step"] == 2) & (coll["rank"] == 1)][0]
    coll.loc[first, "step"] = 3                  # rank 1 counted that collective in its next step
    scores = pd.DataFrame({"pg": ["dp"], "pg_ranks": ["0,1"], "rank": [0], "median_lateness_frac": [0.2],
                           "window_first_step": [2], "window_last_step": [2], "detected_at_step": [2]})
    rows = sc.cause_rows(coll, scores)
    assert first in rows.index                   # step 3, but the collective has a row in step 2
    assert set(rows["step"]) == {2, 3} and (rows["step"] == 3).sum() == 1


def test_no_rows_without_candidates():
    coll = dp_tables(world=2, num_steps=4)["collectives"]
    scores = pd.DataFrame({"pg": ["dp"], "pg_ranks": ["0,1"], "rank": [0], "median_lateness_frac": [-0.1],
                           "window_first_step": [0], "window_last_step": [3], "detected_at_step": [None]})
    assert sc.cause_rows(coll, scores).empty
