"""Titles name a large group by its axis and size, never by listing every member (issue 17, item 4): checked
on the phrase helpers and on a STRAGGLER found in a 16-rank group of hand-made tables. The default group's axis
without a layout."""

from __future__ import annotations

from analysis_synth import MS, lockstep_tables, write_rows_run

from dtprobe.analysis import RunAnalysis
from dtprobe.analysis.tables import LISTED_MEMBERS_MAX, axis_of_group, group_phrase, ranks_phrase, world_is_dp


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


def test_the_default_group_is_called_dp_only_when_the_layout_or_the_run_says_so():
    assert world_is_dp({}, ["world"], pipelined=False) and world_is_dp({}, [], pipelined=False)   # DDP, FSDP2
    assert not world_is_dp({}, ["world"], pipelined=True)               # a pipeline's p2p may run on it
    assert not world_is_dp({}, ["world", "dp"], pipelined=False)   # a 1 x 4 (dp, tp) mesh: tp reuses the default
    assert not world_is_dp({"tp": 2}, ["world"], pipelined=False)
    assert world_is_dp({"dp": 4, "tp": 1}, ["world", "dp"], pipelined=True)   # a layout decides
    assert axis_of_group("world", layout={}, world_is_dp=False) is None
    assert axis_of_group("world", layout={}) == "dp" and axis_of_group("tp", layout={}, world_is_dp=True) == "tp"
