"""Titles name a large group by its axis and size, never by listing every member (issue 17, item 4): checked
on the phrase helpers and on a STRAGGLER found in a 16-rank group of hand-made tables."""

from __future__ import annotations

from analysis_synth import MS, lockstep_tables, write_rows_run

from dtprobe.analysis import RunAnalysis
from dtprobe.analysis.tables import LISTED_MEMBERS_MAX, group_phrase, ranks_phrase


def test_small_groups_list_their_members_and_large_ones_give_their_size():
    assert group_phrase("dp", [0, 2]) == "dp group [0, 2]"
    assert group_phrase("dp", range(LISTED_MEMBERS_MAX)) == f"dp group {list(range(LISTED_MEMBERS_MAX))}"
    assert group_phrase("dp", range(128)) == "dp group of 128 ranks"
    assert group_phrase("world", []) == "world group"
    assert ranks_phrase([3]) == "[3]" and ranks_phrase(range(9)) == "(9 ranks)"


def test_a_straggler_in_a_16_rank_group_is_titled_by_the_group_size(tmp_path):
    rows = lockstep_tables(world=16, num_steps=40)
    starts = {(x["rank"], x["step"]): x["start_ns"] for x in rows["steps"]}
    for row in rows["collectives"]:    # every rank arrives 60 ms into the step, a little jitter; rank 5 10 ms later
        r, step = row["rank"], row["step"]
        row["enqueue_ns"] = row["start_ns"] = (starts[(r, step)] + 60 * MS + (r * 7 + step * 3) % 11 * MS // 20
                                               + (10 * MS if r == 5 else 0))
    for row in rows["steps"]:
        if row["rank"] == 5:
            row["fwd_ns"] += 10 * MS
    a = RunAnalysis.open(write_rows_run(tmp_path / "run", rows, world_size=16, status="finished"))
    [f] = [f for f in a.findings() if f.code == "STRAGGLER"]
    assert f.ranks == (5,)
    assert "group of 16 ranks collectives" in f.title, f.title
    assert "[0, 1, 2" not in f.title
    assert f.evidence["pg_ranks"] == list(range(16))     # the evidence still names every member
