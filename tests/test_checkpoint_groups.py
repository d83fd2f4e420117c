"""A checkpoint group (``pg`` ``ckpt``: ``--ckpt-async`` saves on one) runs beside the training steps: a member late
there is no straggler, and its collectives count in no step figure; on the run's events and on its compacted derived
tables alike (``tables.step_collectives``)."""

from __future__ import annotations

import pandas as pd
import pytest

from dtprobe.analysis import RunAnalysis
from dtprobe.analysis.derived_tables import deriver
from dtprobe.store import compact
from dtprobe.synthetic import dp_tables, write_run


def _run(tmp_path, pg: str, *, compacted: bool) -> RunAnalysis:
    """Two ranks in lockstep on ``world``, and on group ``pg`` rank 0 arriving 30 ms late at every collective."""
    base = dp_tables(world=2, num_steps=25, pg="world")
    late = dp_tables(world=2, num_steps=25, pg=pg, straggler=0, delay_ms=30)
    tables = {"steps": base["steps"], "devices": base["devices"],
              "collectives": pd.concat([base["collectives"], late["collectives"]], ignore_index=True)}
    run = write_run(tmp_path / pg, tables, world_size=2)
    if compacted:
        compact(run, derive=deriver())
    return RunAnalysis.open(run)


@pytest.mark.parametrize("compacted", [False, True], ids=["events", "compacted"])
def test_a_member_late_on_a_checkpoint_group_is_no_straggler(tmp_path, compacted):
    same_rows_on_dp = _run(tmp_path, "dp", compacted=compacted)
    assert [(f.code, f.ranks) for f in same_rows_on_dp.findings() if f.code == "STRAGGLER"] == [("STRAGGLER", (0,))]
    a = _run(tmp_path, "ckpt", compacted=compacted)
    assert [f for f in a.findings() if f.code == "STRAGGLER"] == []
    assert set(a.rank_lateness()["pg"].astype(str)) == {"world"}
    assert set(a.collective_skew()["pg"].astype(str)) == {"world"}
    # its time in collectives is the world group's alone: the same as a run without the checkpoint group
    alone = RunAnalysis.open(write_run(tmp_path / "alone", dp_tables(world=2, num_steps=25, pg="world"),
                                       world_size=2))
    pd.testing.assert_frame_equal(a.exposure_by_rank(), alone.exposure_by_rank())
    # the checkpoint group's rows are still read where every group counts
    assert "ckpt" in set(a.table("collectives")["pg"].astype(str))
