"""STRAGGLER's victim rule followed up a chain: a rank that waited on another is reported inside the finding of
the rank at the chain's end (``stragglers._follow_chains``), never as a culprit of the ranks that waited on it."""

from __future__ import annotations

import pandas as pd
import pytest

from dtprobe.analysis import straggler_causes as sc
from dtprobe.analysis import straggler_scores as ss
from dtprobe.analysis import stragglers as st


@pytest.mark.parametrize("propagated,expected", [
    ({3: [1], 2: [3]}, {2: [1, 3]}),                              # 1 waited on 3, 3 on 2
    ({1: [0], 2: [1], 3: [2]}, {3: [0, 1, 2]}),                   # a longer chain ends at its root
    ({2: [3, 4], 3: [1, 4]}, {2: [1, 3, 4]}),                     # a victim of both is listed once
    ({0: [1], 1: [0]}, {0: [1], 1: [0]}),                         # each the other's victim: left as it was
    ({1: [2], 2: [1], 0: [1]}, {0: [1, 2]}),                      # a cycle with a way out goes to its root
    ({0: [1], 1: [2], 2: [1]}, {0: [1, 2]}),                      # ... whichever culprit was listed first
    ({0: [1], 2: [3]}, {0: [1], 2: [3]}),                         # two separate culprits
])
def test_follow_chains_gives_each_victim_to_the_root_of_its_chain(propagated, expected):
    st._follow_chains(propagated)
    assert {culprit: sorted(victims) for culprit, victims in propagated.items()} == expected


def _score(pg: str, pg_ranks: str, rank: int, late: float) -> dict:
    flagged = late >= 0.05
    return {"pg": pg, "pg_ranks": pg_ranks, "rank": rank, "num_steps": 39, "window_steps": 20,
            "window_first_step": 1, "window_last_step": 20, "median_lateness_frac": late,
            "positive_frac": 0.9 if late > 0 else 0.1, "median_pre_excess_frac": 0.0, "pre_positive_frac": 0.5,
            "last_frac": 0.9 if late > 0 else 0.1, "mean_lateness_ns": late * 1e9,
            "mean_victims_wait_ns": max(late, 0.0) * 1e9, "mean_step_ns": 1e9,
            "detected_at_step": 20 if flagged else None, "detected_by": "arrival" if flagged else None,
            "gain_first_step": 1, "gain_last_step": 20, "gain_victims_wait_ns": max(late, 0.0) * 1e9,
            "gain_step_ns": 1e9}


def test_the_tp_peer_of_a_rank_under_a_cpu_quota_is_its_victim_not_a_second_straggler():
    # dp2 x tp2 (replicas {0, 1} and {2, 3}), rank 2 held back by a CPU quota: its whole replica is late in the dp
    # groups (rank 3 waited on rank 2 inside their tp collectives), and rank 1, which shares a core with rank 3 on
    # this kind of host, is late in its own tp group behind rank 3. One culprit: rank 2.
    scores = pd.DataFrame([
        _score("dp", "0,2", 2, 0.17), _score("dp", "0,2", 0, -0.17),
        _score("dp", "1,3", 3, 0.29), _score("dp", "1,3", 1, -0.29),
        _score("tp", "0,1", 1, 0.06), _score("tp", "0,1", 0, -0.06),
        _score("tp", "2,3", 2, 0.03), _score("tp", "2,3", 3, -0.03),
    ])[ss.SCORE_COLUMNS]
    links = {frozenset(p) for p in [(0, 2), (1, 3), (0, 1), (2, 3)]}
    found = st.detect_stragglers(scores, pd.DataFrame(columns=sc.CAUSE_COLUMNS), links=links)
    assert [(f.ranks, f.evidence["pg"], f.evidence["propagated_to"]) for f in found] == [((2,), "dp", [1, 3])]
