"""The pairs STRAGGLER's victim rule reads: ``stragglers._later_in_shared_groups`` (which of two ranks arrived later
in every group they share) against a pair-by-pair reference, on random groups with shared members and missing
values, and ``stragglers.linked_ranks`` against the set of every linked pair."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from dtprobe.analysis.stragglers import _later_in_shared_groups, linked_ranks
from dtprobe.analysis.tables import group_members
from dtprobe.synthetic import dp_pp_tables, dp_tables


def one_pair_at_a_time(scores: pd.DataFrame) -> dict[tuple[int, int], bool]:
    col = "mean_excess_frac" if "mean_excess_frac" in scores else "median_lateness_frac"
    votes: dict[tuple[int, int], list[bool]] = {}
    for _, g in scores.groupby(["pg", "pg_ranks"], sort=False):
        value = {int(r): float(v) for r, v in zip(g["rank"], g[col]) if pd.notna(v)}
        for a, va in value.items():
            for b, vb in value.items():
                if a != b:
                    votes.setdefault((a, b), []).append(va > vb)
    return {pair: all(v) for pair, v in votes.items()}


def random_scores(rng: np.random.Generator, *, with_excess: bool) -> pd.DataFrame:
    rows = []
    for g in range(int(rng.integers(1, 6))):
        members = sorted(int(r) for r in rng.choice(12, size=int(rng.integers(1, 7)), replace=False))
        for r in members:
            rows.append({"pg": f"pg{g % 2}", "pg_ranks": ",".join(map(str, members)), "rank": r,
                         "median_lateness_frac": rng.choice([np.nan, 0.1, 0.2, float(rng.random())])})
    scores = pd.DataFrame(rows)
    if with_excess:   # the steady view's excess decides when present
        scores["mean_excess_frac"] = scores["median_lateness_frac"].to_numpy()[::-1]
    return scores


@pytest.mark.parametrize("with_excess", [False, True])
def test_later_in_shared_groups_equals_the_pair_by_pair_votes(with_excess):
    rng = np.random.default_rng(17)
    for _ in range(100):
        scores = random_scores(rng, with_excess=with_excess)
        assert _later_in_shared_groups(scores) == one_pair_at_a_time(scores)


def test_later_in_shared_groups_needs_every_shared_group():
    scores = pd.DataFrame({"pg": ["tp", "tp", "dp", "dp"], "pg_ranks": ["0,1", "0,1", "0,1,2", "0,1,2"],
                           "rank": [0, 1, 0, 1], "median_lateness_frac": [0.3, 0.1, 0.05, 0.2]})
    assert _later_in_shared_groups(scores) == {(0, 1): False, (1, 0): False}
    assert _later_in_shared_groups(scores[scores["pg"] == "tp"]) == {(0, 1): True, (1, 0): False}


def every_linked_pair(collectives: pd.DataFrame) -> set[frozenset[int]]:
    pairs = set()
    for pg_ranks in collectives["pg_ranks"].dropna().unique():
        members = group_members(pg_ranks)
        pairs |= {frozenset((a, b)) for a in members for b in members if a < b}
    p2p = collectives[collectives["op"].isin(["send", "recv"]) & collectives["peer"].notna()]
    return pairs | {frozenset((int(a), int(b))) for a, b in zip(p2p["rank"], p2p["peer"]) if int(a) != int(b)}


@pytest.mark.parametrize("tables", [lambda: dp_pp_tables(dp=2, pp=2, num_steps=3),
                                    lambda: dp_tables(world=4, num_steps=3)])
def test_linked_ranks_holds_exactly_the_pairs_of_a_group_or_p2p_link(tables):
    collectives = tables()["collectives"]
    links, pairs = linked_ranks(collectives), every_linked_pair(collectives)
    ranks = range(int(collectives["rank"].max()) + 2)
    assert {frozenset((a, b)) for a in ranks for b in ranks if a < b and frozenset((a, b)) in links} == pairs
    assert frozenset((0,)) not in links and frozenset((0, 1)) not in linked_ranks(collectives.iloc[:0])
