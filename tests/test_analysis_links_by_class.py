"""SLOW_LINK's change points computed once per set of links crossed by the same groups (``links.changes_of_links``)
equal the per-(link, collective) computation (``link_changes(link_bandwidth(...))``) exactly, also when groups of
one (pg, op, size) class cross different numbers of links."""

from __future__ import annotations

import subprocess
import sys

import pandas as pd
import pytest
from test_analysis_slow_link import two_node_tables

from dtprobe.analysis import RunAnalysis, links
from dtprobe.analysis.comm_efficiency import collective_bandwidth
from dtprobe.analysis.tables import only_steps
from dtprobe.store import RunStore


@pytest.fixture(scope="module")
def scale_run_bandwidth(tmp_path_factory, repo_root) -> tuple[pd.DataFrame, dict[int, str]]:
    """collective_bandwidth of a scale_data run (64 ranks on 8 nodes, tp8 x dp8, 12 steps) and its node names."""
    run = tmp_path_factory.mktemp("scale") / "run"
    subprocess.run([sys.executable, str(repo_root / "benchmarks" / "scale_data.py"), "run", str(run), "--ranks", "64",
                    "--steps", "12"], check=True, timeout=120, capture_output=True)
    analysis = RunAnalysis(RunStore.open(run))
    ranks = pd.DataFrame([{"rank": r.rank, "node_rank": r.node_rank, "host": r.host} for r in analysis.info.ranks])
    return only_steps(analysis.collective_bandwidth(), analysis.steps_analyzed()), links.node_names(ranks)


def per_collective(bw: pd.DataFrame, node_of: dict[int, str]) -> pd.DataFrame:
    return links.link_changes(links.link_bandwidth(bw, node_of))


def test_changes_equal_the_per_collective_rows_on_a_tp8_dp_run(scale_run_bandwidth):
    bw, node_of = scale_run_bandwidth
    got = links.changes_of_links(bw, node_of)
    assert len(got) == 28                                  # every pair of 8 nodes, crossed by the dp groups
    pd.testing.assert_frame_equal(got, per_collective(bw, node_of), check_exact=True)


def test_changes_equal_when_groups_of_one_class_cross_different_numbers_of_links(scale_run_bandwidth):
    bw, node_of = scale_run_bandwidth
    dp = bw[bw["pg"] == "dp"]
    first = dp["pg_ranks"].iloc[0]
    members = [int(r) for r in first.split(",")]
    # the first dp group's collectives of odd steps recorded by a 3-node subgroup of the same name and op size
    narrow = dp[(dp["pg_ranks"] == first) & (dp["step"] % 2 == 1)].index
    mixed = bw.copy()
    mixed.loc[narrow, "pg_ranks"] = ",".join(map(str, members[:3]))
    mixed.loc[narrow, "num_members"] = 3
    mixed.loc[narrow, "busbw_bytes_per_s"] *= 0.5          # a different level, so weighting matters to the medians
    got = links.changes_of_links(mixed, node_of)
    pd.testing.assert_frame_equal(got, per_collective(mixed, node_of), check_exact=True)
    assert got["rel_busbw_ratio"].nunique() > 1            # the three links of the subgroup differ from the others


def test_slowed_link_change_equals_the_per_collective_rows():
    t = two_node_tables(num_buckets=1, xfer_noise=0.3, seed=4)
    bw = collective_bandwidth(t["collectives"])
    node_of = {r.rank: r.host for r in t["ranks"]}
    got = links.changes_of_links(bw, node_of)
    pd.testing.assert_frame_equal(got, per_collective(bw, node_of), check_exact=True)
    assert got["changed_at_step"].tolist() == [20]


def test_no_changes_on_one_node():
    t = two_node_tables(single_node=True)
    bw = collective_bandwidth(t["collectives"])
    assert links.changes_of_links(bw, {r.rank: r.host for r in t["ranks"]}).empty
