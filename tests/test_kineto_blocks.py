"""A trace folder's kernel-level metrics computed block by block (``KinetoRun.kernel_blocks``) equal those of its
whole ``kernels`` table, and clock offsets come from the matched rows alone (no collectives x ranks matrix)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd

from dtprobe.analysis import trace_metrics
from dtprobe.analysis.clock_alignment import clock_offsets
from dtprobe.analysis.kernel_breakdown import kernel_type_breakdown
from dtprobe.analysis.overlap import comm_comp_overlap
from dtprobe.analysis.temporal import temporal_breakdown
from dtprobe.store import kineto

DLRM = Path(__file__).parent / "data" / "traces" / "dlrm_8rank_v100"


def _plain(frame: pd.DataFrame) -> pd.DataFrame:
    return frame.astype({c: object for c in frame.columns if isinstance(frame[c].dtype, pd.CategoricalDtype)})


def test_kernel_blocks_hold_whole_ranks_and_their_metrics_equal_the_whole_tables(monkeypatch):
    run = kineto.load_trace_dir(DLRM, workers=1)
    whole = run.table("kernels")
    per_rank = whole.groupby("rank").size()
    limit = int(per_rank.iloc[:3].sum())                  # the first block: ranks 0-2, then blocks of ranks
    monkeypatch.setattr(kineto, "KERNEL_BLOCK_ROWS", limit)
    blocks = list(run.kernel_blocks())
    assert [sorted(b["rank"].unique()) for b in blocks][0] == [0, 1, 2] and len(blocks) >= 3
    assert all(len(b) <= limit or b["rank"].nunique() == 1 for b in blocks)
    pd.testing.assert_frame_equal(_plain(pd.concat(blocks, ignore_index=True)), _plain(whole))

    got = trace_metrics.kernel_breakdowns(run, run.table)
    pd.testing.assert_frame_equal(got.temporal, temporal_breakdown(whole))
    pd.testing.assert_frame_equal(got.overlap, comm_comp_overlap(whole))
    pd.testing.assert_frame_equal(got.kernel_types, kernel_type_breakdown(whole))
    assert trace_metrics.kernel_breakdowns(run, run.table) is got          # once per source


def test_clock_offsets_chain_groups_and_leave_a_rank_sharing_nothing_unplaced():
    # groups {0, 1}, {1, 2}, {2, 5} and {7, 9} (none shared with the others): clocks shifted by known amounts
    clock = {0: 0, 1: 1_500, 2: -40_000, 5: 7_000_000, 7: 3, 9: 11}
    rows, coll = [], 0
    for members, count in (((0, 1), 5), ((1, 2), 3), ((2, 5), 4), ((7, 9), 6)):
        for i in range(count):
            end = 1_000_000 * (coll + 1)
            rows += [{"coll_id": coll, "rank": r, "end_ns": end - clock[r] + (i % 2) * (r == members[1]),
                      "status": "matched"} for r in members]
            coll += 1
    rows.append({"coll_id": coll, "rank": 0, "end_ns": 5, "status": "op_mismatch"})
    out = clock_offsets(pd.DataFrame(rows).sample(frac=1.0, random_state=3)).set_index("rank")
    assert out.loc[[0, 1, 2, 5], "offset_ns"].tolist() == [0, 1_500, -40_000, 7_000_000 - 1]
    assert out.loc[[7, 9], "offset_ns"].isna().all() and out.loc[[7, 9], "residual_us"].isna().all()
    assert out["num_collectives"].to_dict() == {0: 5, 1: 8, 2: 7, 5: 4, 7: 6, 9: 6}
    assert np.isclose(out.loc[5, "residual_us"], 0.00025)      # |end - the pair's mean|: 0.5 ns in half of them
