"""The STRAGGLER noise rule: a rank's lateness is judged against how late its peers got in the same window
(``peer_noise``), on hand-made lateness tables with known answers and on the checked-in dp4 scenarios."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from dtprobe.analysis import straggler_causes as sc
from dtprobe.analysis import straggler_scores as ss
from dtprobe.analysis import RunAnalysis
from dtprobe.analysis import stragglers as st

SAMPLES = Path(__file__).resolve().parents[1] / "sample_traces"
STEP_NS = 100e6


def _lateness(fracs: dict[int, list[float]], *, pg: str = "dp", pre: dict[int, list[float]] | None = None,
              comm: dict[int, list[float]] | None = None) -> pd.DataFrame:
    """A ``rank_lateness`` table: rank -> lateness_frac per step (steps 1..n); pre_excess_frac from ``pre`` and
    comm_excess_frac from ``comm`` (unknown without)."""
    members = ",".join(map(str, sorted(fracs)))
    rows = [{"pg": pg, "pg_ranks": members, "step": i + 1, "rank": r, "lateness_ns": f * STEP_NS,
             "victims_wait_ns": max(f, 0.0) * STEP_NS, "is_last": False, "step_ns": STEP_NS, "lateness_frac": f,
             "pre_excess_frac": pre[r][i] if pre else np.nan,
             "comm_excess_frac": comm[r][i] if comm else np.nan}
            for r, series in fracs.items() for i, f in enumerate(series)]
    return pd.DataFrame(rows)[st.LATENESS_COLUMNS]


def _detect(lateness: pd.DataFrame, **kw) -> list:
    scores = ss.straggler_scores(lateness, **kw)
    return st.detect_stragglers(scores, pd.DataFrame({c: [] for c in sc.CAUSE_COLUMNS}), lateness=lateness, **kw)


def _reference_noise(lateness: pd.DataFrame, rank: int, first: int, last: int) -> float:
    peers = lateness[(lateness["rank"] != rank) & lateness["step"].between(first, last)]["lateness_frac"].to_numpy()
    mad = 1.4826 * np.median(np.abs(peers - np.median(peers)))
    return max(mad, float(np.quantile(peers, 0.9)))


def test_peer_noise_pools_the_other_ranks_over_the_window_steps():
    rng = np.random.default_rng(3)
    lateness = _lateness({r: list(rng.normal(0.0, 0.05 * (r + 1), 12)) for r in range(4)})
    windows = pd.DataFrame({"pg": "dp", "pg_ranks": "0,1,2,3", "rank": [0, 2, 3], "first_step": [1, 4, 3],
                            "last_step": [12, 9, 3]})
    got = ss.peer_noise(lateness, windows)
    want = [_reference_noise(lateness, r, a, b) for r, a, b in zip(windows["rank"], windows["first_step"],
                                                                   windows["last_step"])]
    assert got.tolist() == pytest.approx(want, rel=1e-12)


def test_peer_noise_of_a_large_group_pools_every_member_once_per_step_span():
    rng = np.random.default_rng(5)
    n_ranks = ss.MAX_PEERS_EXCLUDED + 4
    lateness = _lateness({r: list(rng.normal(0.0, 0.05, 30)) for r in range(n_ranks)})
    members = ",".join(map(str, range(n_ranks)))
    windows = pd.DataFrame({"pg": "dp", "pg_ranks": members, "rank": [0, 5, 7, 9], "first_step": [1, 3, 1, 11],
                            "last_step": [20, 22, 20, 30]})
    got = ss.peer_noise(lateness, windows)

    def everyone(a: int, b: int) -> float:
        v = lateness[lateness["step"].between(a, b)]["lateness_frac"].to_numpy()
        return max(1.4826 * np.median(np.abs(v - np.median(v))), float(np.quantile(v, 0.9)))
    assert got.tolist() == pytest.approx([everyone(1, 20), everyone(3, 22), everyone(1, 20), everyone(11, 30)],
                                         rel=1e-12)


def test_a_rank_late_by_chance_as_its_peers_are_is_no_straggler():
    # rank 0 is 15% late in every step, but ranks 1 and 2 take turns being 25% late in the same window: on a
    # busy host any rank gets that late. The fixed thresholds alone would name rank 0.
    n = 20
    fracs = {0: [0.15] * n, 1: [0.25] * 10 + [-0.30] * 10, 2: [-0.30] * 10 + [0.25] * 10,
             3: [(-0.1 if i % 2 else 0.05) for i in range(n)]}
    lateness = _lateness(fracs)
    assert [f.ranks for f in _detect(lateness, min_lateness_over_noise=0.0)] == [(0,)]
    assert _detect(lateness) == []
    score = ss.straggler_scores(lateness).set_index("rank").loc[0]
    # peers pooled: 20 x 0.25, 20 x -0.3, 10 x 0.05, 10 x -0.1; median -0.025, every |deviation| 0.275 or 0.075
    assert score["noise_frac"] == pytest.approx(1.4826 * 0.275)
    assert score["lateness_over_noise"] == pytest.approx(0.15 / (1.4826 * 0.275))


def test_a_rank_late_well_above_its_quiet_peers_is_a_straggler_with_its_noise_in_evidence():
    rng = np.random.default_rng(0)
    n = 20
    fracs = {r: list(rng.uniform(-0.02, 0.01, n)) for r in range(1, 4)}
    fracs[0] = list(0.10 + rng.uniform(-0.01, 0.01, n))
    lateness = _lateness(fracs)
    [f] = _detect(lateness)
    assert f.ranks == (0,)
    ev = f.evidence
    want = _reference_noise(lateness, 0, 1, 20)
    assert ev["noise_frac"] == pytest.approx(want)
    assert ev["lateness_over_noise"] == pytest.approx(ev["median_lateness_frac"] / want)
    assert ev["lateness_over_noise"] >= ss.MIN_LATENESS_OVER_NOISE


def test_a_rank_whose_forward_stands_out_of_its_peers_phase_noise_is_found_by_the_phases_view():
    # arrivals as noisy as in the chance case above, but rank 0's data+fwd is 8% longer than its peers' in every
    # step while theirs differ by at most 3%: the phases view names it
    rng = np.random.default_rng(1)
    n = 20
    fracs = {0: [0.15] * n, 1: [0.25] * 10 + [-0.30] * 10, 2: [-0.30] * 10 + [0.25] * 10,
             3: [(-0.1 if i % 2 else 0.05) for i in range(n)]}
    pre = {r: list(rng.uniform(-0.03, 0.01, n)) for r in (1, 2, 3)}
    pre[0] = list(0.08 + rng.uniform(-0.01, 0.01, n))
    lateness = _lateness(fracs, pre=pre)
    [f] = _detect(lateness)
    ev = f.evidence
    assert (f.ranks, ev["detected_by"]) == ((0,), "arrival+phases")
    assert ev["lateness_over_noise"] < ss.MIN_LATENESS_OVER_NOISE        # the arrival view alone: no verdict
    peers = np.concatenate([pre[r] for r in (1, 2, 3)])
    want = max(1.4826 * np.median(np.abs(peers - np.median(peers))), float(np.quantile(peers, 0.9)))
    assert ev["phase_noise_frac"] == pytest.approx(want)
    assert ev["pre_excess_over_noise"] == pytest.approx(ev["median_pre_excess_frac"] / want)
    assert ev["pre_excess_over_noise"] >= ss.MIN_PRE_EXCESS_OVER_NOISE
    # the same excess inside the peers' phase noise: no verdict
    noisy = {r: list(rng.uniform(-0.1, 0.1, n)) for r in (1, 2, 3)} | {0: pre[0]}
    assert _detect(_lateness(fracs, pre=noisy)) == []


def test_in_a_group_where_every_member_is_always_a_little_late_the_later_one_is_no_straggler():
    # TP-like: many collectives per step, so each member's worst lateness is positive in every step
    n = 20
    lateness = _lateness({0: [0.03 + 0.01 * (i % 3) for i in range(n)], 1: [0.06 + 0.01 * (i % 2) for i in range(n)]},
                         pg="tp")
    assert [f.ranks for f in _detect(lateness, min_lateness_over_noise=0.0)] == [(1,)]
    assert _detect(lateness) == []


def test_a_rank_standing_on_its_peers_level_is_named_at_the_levelled_multiple():
    # TP-like: the peer's worst lateness of a step is 2% (+-0.4%), rank 1's 5.5%: the noise (the peer's 90th
    # percentile, 2.5%) holds the peer's level, and rank 1's median is about 2.2x it: under the arrival view's 2.5x,
    # over the 1.5x asked where the peers' median is at least half their noise (a levelled group)
    rng = np.random.default_rng(7)
    n = 20
    fracs = {0: list(0.02 + rng.normal(0.0, 0.004, n)), 1: list(0.055 + rng.normal(0.0, 0.004, n))}
    lateness = _lateness(fracs, pg="tp")
    [f] = _detect(lateness)
    ev = f.evidence
    assert (f.ranks, ev["detected_by"]) == ((1,), "arrival")
    assert ev["peer_level_frac"] == pytest.approx(np.median(fracs[0]))
    assert ev["noise_frac"] == pytest.approx(_reference_noise(lateness, 1, 1, 20))
    assert ev["peer_level_frac"] >= ss.LEVELLED_PEERS_SHARE * ev["noise_frac"]
    assert (ss.LEVELLED_NOISE_SHARE * ss.MIN_LATENESS_OVER_NOISE <= ev["lateness_over_noise"]
            < ss.MIN_LATENESS_OVER_NOISE)
    # a group of two with one collective per step: the peer's lateness mirrors the rank's, its median is below
    # zero, and the noise is the rank's own spread; at about 2.2x that noise the full multiple is asked: no verdict
    late = list(0.055 + rng.normal(0.0, 0.025, n))
    mirrored = _lateness({0: [-x for x in late], 1: late})
    row = ss.straggler_scores(mirrored).set_index("rank").loc[1]
    assert row["peer_level_frac"] == pytest.approx(-np.median(late))
    assert row["median_lateness_frac"] >= 0.05 and row["positive_frac"] == 1.0
    assert ss.LEVELLED_NOISE_SHARE * ss.MIN_LATENESS_OVER_NOISE <= row["lateness_over_noise"] \
        < ss.MIN_LATENESS_OVER_NOISE
    assert _detect(mirrored) == []


def test_the_arrival_view_asks_less_only_where_the_peers_level_is_half_their_noise():
    noise = np.array([0.02, 0.02, 0.02, np.nan, 0.02, 0.0])
    level = np.array([0.01, 0.0099, -0.03, 0.01, np.nan, 0.0])
    levelled = np.array([True, False, False, False, False, True])
    floor = np.where(levelled, ss.LEVELLED_LATENESS_SHARE * 0.05, 0.05)
    multiple = np.where(levelled, ss.LEVELLED_NOISE_SHARE * 2.5, 2.5)

    def view(med, over, pos=1.0):
        return ss.arrival_view(np.full(6, med), np.full(6, pos), over, noise, level, min_lateness_frac=0.05,
                               min_positive_frac=0.8, min_lateness_over_noise=2.5)
    # each bound met exactly passes, just under it fails; the other bound met with room
    assert view(floor, np.full(6, 10.0)).tolist() == [True] * 6
    assert view(floor - 1e-9, np.full(6, 10.0)).tolist() == [False] * 6
    assert view(0.1, multiple).tolist() == [True] * 6
    assert view(0.1, multiple - 1e-9).tolist() == [False] * 6
    assert view(0.1, np.full(6, np.nan)).tolist() == [True] * 6            # unknown noise does not block
    assert view(0.1, np.full(6, 10.0), pos=0.75).tolist() == [False] * 6


def test_in_a_levelled_group_a_median_under_the_levelled_floor_is_no_straggler():
    # rank 1 at 3.5% (+-0.4%) over a peer at 0.8% (+-0.2%): far out of the peer's noise, but under 4% of the step
    rng = np.random.default_rng(11)
    n = 20
    fracs = {0: list(0.008 + rng.normal(0.0, 0.002, n)), 1: list(0.035 + rng.normal(0.0, 0.004, n))}
    row = ss.straggler_scores(_lateness(fracs, pg="tp")).set_index("rank").loc[1]
    assert row["peer_level_frac"] >= ss.LEVELLED_PEERS_SHARE * row["noise_frac"]
    assert row["lateness_over_noise"] >= ss.MIN_LATENESS_OVER_NOISE
    assert row["median_lateness_frac"] < ss.LEVELLED_LATENESS_SHARE * 0.05
    assert _detect(_lateness(fracs, pg="tp")) == []
    shifted = {0: fracs[0], 1: [x + 0.01 for x in fracs[1]]}             # 4.5%: over the levelled floor
    [f] = _detect(_lateness(shifted, pg="tp"))
    assert (f.ranks, f.evidence["detected_by"]) == ((1,), "arrival")


def test_scores_without_noise_columns_are_judged_by_the_fixed_thresholds():
    lateness = _lateness({0: [0.15] * 20, 1: [0.25] * 10 + [-0.3] * 10, 2: [-0.3] * 10 + [0.25] * 10})
    scores = ss.straggler_scores(lateness)[ss.SCORE_COLUMNS]
    assert [f.ranks for f in st.detect_stragglers(scores, pd.DataFrame({c: [] for c in sc.CAUSE_COLUMNS}))] == [(0,)]


def test_clean_dp4_scenario_has_no_straggler_and_the_straggler_scenario_keeps_rank2():
    clean = RunAnalysis.open(SAMPLES / "dp4_clean")
    assert [f for f in clean.findings() if f.code == "STRAGGLER"] == []
    # the fixed thresholds alone named rank 3 here: 6% median lateness, inside its peers' noise
    row = clean.straggler_scores().set_index("rank").loc[3]
    assert row["median_lateness_frac"] >= 0.05 and row["lateness_over_noise"] < ss.MIN_LATENESS_OVER_NOISE
    slow = RunAnalysis.open(SAMPLES / "dp4_straggler_rank2")
    [f] = [f for f in slow.findings() if f.code == "STRAGGLER"]
    assert (f.ranks, f.group) == ((2,), "dp")
    assert f.evidence["lateness_over_noise"] >= ss.MIN_LATENESS_OVER_NOISE
    assert 0 < f.evidence["noise_frac"] < f.evidence["median_lateness_frac"]


def test_median_t_is_the_median_over_its_standard_error():
    x = np.array([[0.1, 0.2, 0.3, 0.4, np.nan], [0.1, 0.1, 0.1, np.nan, np.nan], [0.5, np.nan, 0.5, np.nan, np.nan],
                  [0.0, 0.0, 0.0, 0.0, 0.0]])
    med = np.nanmedian(x, axis=1)
    got = ss._median_t(x, med)
    # row 0: median 0.25, |deviations| 0.15 0.05 0.05 0.15 -> MAD 0.1; standard error 1.4826 x 0.1 / 2
    assert got[0] == pytest.approx(0.25 / (1.4826 * 0.1 / 2))
    assert got[1] == np.inf                                     # steady positive excess without spread
    assert np.isnan(got[2])                                     # two values: too few
    assert got[3] == 0.0


def test_peer_max_is_the_largest_value_of_the_other_members_over_the_same_steps():
    windows = pd.DataFrame({"pg": "dp", "pg_ranks": "0,1,2", "rank": [0, 1, 2, 0, 1, 2],
                            "first_step": [1, 1, 1, 2, 2, 9], "last_step": [20, 20, 20, 21, 21, 28]})
    values = np.array([7.0, 3.0, np.nan, 1.0, 4.0, 9.0])
    got = ss._peer_max(values, windows)
    # steps 1-20: 0 sees max(3, NaN) = 3, 1 sees 7, 2 sees 7; steps 2-21: 0 sees 4, 1 sees 1; steps 9-28 alone
    assert got[:5].tolist() == [3.0, 7.0, 7.0, 4.0, 1.0]
    assert np.isnan(got[5])


def _busy_host(seed: int, n: int = 20) -> tuple[dict[int, list[float]], dict[int, list[float]]]:
    """Arrivals as noisy as a busy 2-core host's (every rank late by +-20% of the step by chance, rank 0 6%
    later), peers' data+fwd excesses of +-4% at random and rank 0's steadily 6% (+-1.5%) longer."""
    rng = np.random.default_rng(seed)
    fracs = {r: list(rng.normal(0.0, 0.2, n)) for r in range(4)}
    fracs[0] = list(np.array(fracs[0]) + 0.06)
    pre = {r: list(rng.normal(0.0, 0.04, n)) for r in range(4)}
    pre[0] = list(rng.normal(0.06, 0.015, n))
    return fracs, pre


def test_a_steady_data_fwd_excess_inside_noisy_arrivals_is_found_by_the_persistence_view():
    # neither the arrival view (arrivals jitter by +-20%) nor the phases view (rank 0's 6% is under 1.5x its
    # peers' excess noise, and its median lateness under 5%) names rank 0; its excess is many standard errors
    # above zero while no peer's is, and above the peers' noise: the persistence view does
    fracs, pre = _busy_host(8)
    lateness = _lateness(fracs, pre=pre)
    [f] = _detect(lateness)
    ev = f.evidence
    assert (f.ranks, ev["detected_by"]) == ((0,), "persistence")
    assert ev["lateness_over_noise"] < ss.MIN_LATENESS_OVER_NOISE
    assert 0 < ev["median_lateness_frac"] < 0.05
    assert ss.MIN_PERSISTENT_PRE_OVER_NOISE <= ev["pre_excess_over_noise"] < ss.MIN_PRE_EXCESS_OVER_NOISE
    mine = np.array(pre[0])
    med = np.median(mine)
    assert ev["pre_excess_t"] == pytest.approx(med / (1.4826 * np.median(np.abs(mine - med)) / np.sqrt(20)))
    assert ev["pre_excess_t"] >= ss.MIN_PRE_EXCESS_T
    assert ev["peer_pre_excess_t"] < ev["pre_excess_t"] / ss.MIN_PRE_EXCESS_T_OVER_PEERS
    assert "data+fwd" in f.title and "standard errors" in f.title
    # without the persistence view (threshold out of reach): no verdict
    assert _detect(lateness, min_pre_excess_t=np.inf) == []


def test_a_longer_forward_spent_waiting_inside_it_for_a_later_tensor_parallel_peer_is_no_straggler():
    # A user's dp2 x tp2 script, rank 1 held by a CPU quota: rank 3 (rank 1's dp peer) starts each step late, so
    # rank 2 blocks in the first tp all-reduce of its forward. Rank 2 is a little late at its latest collective
    # (+4% of the step) but rank 3 far more (+25%), and rank 2's data+fwd is 15% longer: its wait for rank 3
    rng = np.random.default_rng(5)
    n = 20
    fracs = {2: list(rng.normal(0.04, 0.01, n)), 3: list(rng.normal(0.25, 0.05, n))}
    pre2 = rng.normal(0.15, 0.02, n)
    lateness = _lateness(fracs, pg="tp", pre={2: list(pre2), 3: list(-pre2)})
    scores = ss.straggler_scores(lateness).set_index("rank")
    assert scores.loc[2, "pre_excess_t"] >= ss.MIN_PRE_EXCESS_T and scores.loc[2, "median_lateness_frac"] > 0
    # below the group's median lateness on average and above it in fewer than half the steps: not who waits
    assert scores.loc[2, "mean_excess_frac"] < 0
    assert scores.loc[2, "excess_positive_frac"] < ss.MIN_PERSISTENT_LATER_FRAC
    assert pd.isna(scores.loc[2, "detected_at_step"])           # no view qualifies any window of rank 2
    assert [f.ranks for f in _detect(lateness)] == [(3,)]       # alone here: no other group shows whom it waited for
    # the same rank, now a little later than rank 3 on average (+1% of the step), its forward as long: named by
    # the persistence view
    fracs[3] = list(rng.normal(0.03, 0.01, n))
    [f] = _detect(_lateness(fracs, pg="tp", pre={2: list(pre2), 3: list(-pre2)}))
    assert (f.ranks, f.evidence["detected_by"]) == ((2,), "persistence")


def test_a_steady_data_fwd_excess_while_waiting_longer_than_the_peers_in_the_groups_collectives_is_no_straggler():
    # A busy host: for 20 steps rank 0's data+fwd is 6% of the step longer than its peers', and it spends 1% of the
    # step more than they do inside the group's collectives (as a tensor-parallel rank of a clean user script, 4
    # ranks on 2 cores, whose forward holds its all-reduces): that is no work its peers wait for. The same excess
    # with 2% less time in them than its peers (they wait for it) is a straggler
    fracs, pre = _busy_host(8)
    rng = np.random.default_rng(11)
    waits_longer = {r: list(rng.normal(0.01 if r == 0 else -0.01 / 3, 0.004, 20)) for r in fracs}
    scores = ss.straggler_scores(_lateness(fracs, pre=pre, comm=waits_longer)).set_index("rank")
    assert scores.loc[0, "pre_excess_t"] >= ss.MIN_PRE_EXCESS_T and scores.loc[0, "median_comm_excess_frac"] > 0
    assert _detect(_lateness(fracs, pre=pre, comm=waits_longer)) == []
    waited_for = {r: list(rng.normal(-0.02 if r == 0 else 0.02 / 3, 0.004, 20)) for r in fracs}
    [f] = _detect(_lateness(fracs, pre=pre, comm=waited_for))
    assert (f.ranks, f.evidence["detected_by"]) == ((0,), "persistence")


def test_two_ranks_with_the_same_steady_excess_are_the_host_not_a_straggler():
    # ranks 0 and 1 both lose 6% to data+fwd in every step (a busy host slowing several ranks alike): each one's
    # persistence is matched by a peer's, so neither is singled out
    fracs, pre = _busy_host(8)
    pre[1] = list(np.random.default_rng(80).normal(0.06, 0.015, 20))
    lateness = _lateness(fracs, pre=pre)
    assert _detect(lateness) == []
    scores = ss.straggler_scores(lateness).set_index("rank")
    assert scores.loc[0, "pre_excess_t"] >= ss.MIN_PRE_EXCESS_T
    assert scores.loc[0, "pre_excess_t"] < ss.MIN_PRE_EXCESS_T_OVER_PEERS * scores.loc[0, "peer_pre_excess_t"]


def test_a_real_dp2_run_slowed_20_percent_on_a_busy_host_is_found_within_20_steps_of_the_fault():
    # tests/data/dp2_straggler_busy_host: `dtprobe run --nproc 2` of the tiny model on a loaded 2-core host,
    # rank 1 slowed by 20% from step 10 (--inject straggler:rank=1,slowdown=1.2,from_step=10). Its arrivals
    # jitter as much as its lateness (lateness_over_noise < 1): the arrival view cannot tell; its data+fwd is
    # longer than rank 0's in 90% of the window's steps, ~6 standard errors above zero.
    a = RunAnalysis.open(Path(__file__).parent / "data" / "dp2_straggler_busy_host")
    [f] = [f for f in a.findings() if f.code == "STRAGGLER"]
    ev = f.evidence
    assert (f.ranks, f.group, ev["detected_by"], ev["cause"]) == ((1,), "dp", "persistence", "compute")
    assert 10 <= ev["detected_at_step"] <= 10 + 20
    assert ev["lateness_over_noise"] < 1.0
    lat = a.rank_lateness()
    first, last = ev["window"]
    mine = lat[(lat["rank"] == 1) & lat["step"].between(first, last)]["pre_excess_frac"].to_numpy(dtype="float64")
    med = np.median(mine)
    assert ev["median_pre_excess_frac"] == pytest.approx(med)
    assert ev["pre_excess_t"] == pytest.approx(med / (1.4826 * np.median(np.abs(mine - med)) / np.sqrt(len(mine))))
    assert ev["pre_excess_t"] >= ss.MIN_PRE_EXCESS_T
    assert ev["pre_excess_over_noise"] >= ss.MIN_PERSISTENT_PRE_OVER_NOISE
    # the rule of the arrival and phases views alone (persistence out of reach) misses it
    scores = ss.straggler_scores(lat, min_pre_excess_t=np.inf)
    assert st.detect_stragglers(scores, a.straggler_causes(), min_pre_excess_t=np.inf) == []


# ------------------------------------------------------------------------------------------------ steady view


def _quiet_peers(rng: np.random.Generator, n: int, ranks=(1, 2, 3), sd: float = 0.03) -> dict[int, list[float]]:
    return {r: list(rng.normal(0.0, sd, n)) for r in ranks}


def test_the_predicted_gain_is_the_wait_over_a_qualifying_window_of_the_slowdown_not_the_first_one():
    # rank 2 late by 20% of the step from step 11 of 40: the first window that names it (steps 4-23) holds 7 clean
    # steps, where its peers waited for nothing; its fix saves the 20% its peers wait once it is slow
    rng = np.random.default_rng(7)
    fracs = _quiet_peers(rng, 40, ranks=(0, 1, 3), sd=0.01)
    fracs[2] = [float(x) + (0.2 if i >= 10 else 0.0) for i, x in enumerate(rng.normal(0.0, 0.01, 40))]
    lateness = _lateness(dict(sorted(fracs.items())))
    [finding] = _detect(lateness)
    ev = finding.evidence
    first, last = ev["window"]
    assert finding.ranks == (2,) and first < 11 <= ev["detected_at_step"]
    mine = lateness[lateness["rank"] == 2].set_index("step")["victims_wait_ns"] / STEP_NS
    assert mine.loc[first:last].mean() < 0.15                     # what the first window's wait would have said
    gain_first, gain_last = ev["gain_window"]
    assert gain_first >= 11 and gain_last - gain_first == last - first
    assert finding.predicted_gain.frac == pytest.approx(mine.loc[gain_first:gain_last].mean(), rel=1e-9)
    assert finding.predicted_gain.frac == pytest.approx(0.2, abs=0.01)


def test_a_slowdown_in_bursts_is_found_by_the_steady_view_where_the_median_views_miss_it():
    # rank 0 loses 30% of two steps in five (a CPU quota throttling it for part of some periods): its median
    # lateness stays near zero and it is late in only ~70% of the steps, but the window's mean rises
    rng = np.random.default_rng(11)
    n = 80
    fracs = {0: [(0.3 if i % 5 in (1, 3) else 0.0) + rng.normal(0.0, 0.02) for i in range(n)],
             **_quiet_peers(rng, n)}
    lateness = _lateness(fracs)
    scores = ss.straggler_scores(lateness, window_steps=n)
    none = pd.DataFrame({c: [] for c in sc.CAUSE_COLUMNS})
    assert st.detect_stragglers(scores, none, min_steady_t=np.inf) == []       # the median views miss it
    [f] = st.detect_stragglers(scores, none, lateness=lateness)
    ev = f.evidence
    assert f.ranks == (0,) and ev["detected_by"] == "steady", ev
    x = np.array(fracs[0]) - np.median(np.array([fracs[r] for r in range(4)]), axis=0)
    assert ev["mean_excess_frac"] == pytest.approx(x.mean())
    assert ev["excess_t"] >= ss.MIN_STEADY_T and ev["positive_frac"] < 0.8
    assert "standard errors" in f.title and "later than its group's median" in f.title


def test_a_one_off_stall_or_a_steady_offset_below_the_floor_is_no_straggler():
    rng = np.random.default_rng(12)
    n = 20
    stall = {0: [3.0 if i == 7 else rng.normal(0.0, 0.03) for i in range(n)], **_quiet_peers(rng, n)}
    score = ss.straggler_scores(_lateness(stall)).set_index("rank").loc[0]
    assert score["mean_excess_frac"] > 0.1 and score["excess_t"] < 1.5      # the stall inflates the error too
    assert _detect(_lateness(stall)) == []
    offset = {0: list(0.04 + rng.normal(0.0, 0.005, n)), **_quiet_peers(rng, n, sd=0.005)}
    score = ss.straggler_scores(_lateness(offset)).set_index("rank").loc[0]
    assert score["excess_t"] > 20 and score["mean_excess_frac"] < ss.MIN_STEADY_EXCESS_FRAC
    assert _detect(_lateness(offset)) == []


def test_a_tp_peer_late_in_its_dp_group_only_because_it_waited_inside_their_tp_collectives_is_a_victim():
    # rank 0 is slowed; rank 1 waits for it inside their TP collectives (no arrival wait shows: rank 0 was
    # throttled after it arrived), so rank 1 is as late in its own DP group {1, 3} as rank 0 is in {0, 2}
    rng = np.random.default_rng(13)
    n = 20

    def late(x: float) -> list[float]:
        return list(x + rng.normal(0.0, 0.01, n))
    parts = [_lateness({0: late(0.15), 2: late(-0.15)}, pg="dp"), _lateness({1: late(0.15), 3: late(-0.15)}, pg="dp"),
             _lateness({0: late(0.10), 1: late(-0.10)}, pg="tp"), _lateness({2: late(0.0), 3: late(0.0)}, pg="tp")]
    lateness = pd.concat(parts, ignore_index=True)
    scores = ss.straggler_scores(lateness)
    none = pd.DataFrame({c: [] for c in sc.CAUSE_COLUMNS})
    links = {frozenset(p) for p in ((0, 2), (1, 3), (0, 1), (2, 3))}
    found = st.detect_stragglers(scores, none, links=links, axis_of_pg=lambda pg: pg, lateness=lateness)
    assert [(f.ranks, f.group, f.evidence["propagated_to"]) for f in found] == [((0,), "dp", [1])]
    # without the shared TP group nothing says which of the two is the origin: both are named
    alone = st.detect_stragglers(scores[scores["pg"] == "dp"], none, links=links, axis_of_pg=lambda pg: pg)
    assert sorted(f.ranks for f in alone) == [(0,), (1,)]


def test_a_rank_late_only_because_it_waited_on_others_is_told_as_info_not_blamed():
    # a pipeline stage that waits on a slowed upstream stage (p2p) arrives late at its DP group: its cause is
    # communication, and with no culprit named it stays a hint, not a verdict
    rng = np.random.default_rng(14)
    lateness = _lateness({0: list(0.2 + rng.normal(0, 0.01, 20)), 1: list(-0.2 + rng.normal(0, 0.01, 20))})
    scores = ss.straggler_scores(lateness)
    causes = pd.DataFrame([{"pg": "dp", "pg_ranks": "0,1", "rank": 0, "data_excess_ns": 0.0,
                            "compute_excess_ns": 2e6, "comm_excess_ns": 18e6, "throttled_frac": np.nan,
                            "cause": "communication"}])[sc.CAUSE_COLUMNS]
    [f] = st.detect_stragglers(scores, causes)
    assert (f.ranks, f.severity, f.evidence["cause"]) == ((0,), "info", "communication")
    [g] = st.detect_stragglers(scores, causes.assign(cause="compute"))
    assert g.ranks == (0,) and g.severity in ("warning", "critical")


def test_a_flagged_rank_that_waited_on_an_unflagged_tp_peer_moves_the_blame_to_that_peer():
    # rank 0 is slowed but its own DP group's arrivals swing (late in half the steps) so no view names it; its
    # TP peer rank 1 waits for it inside their TP collectives and is steadily late in its DP group {1, 3}
    rng = np.random.default_rng(15)
    n = 20
    swing = [0.5 if i % 2 else -0.2 for i in range(n)]
    parts = [_lateness({0: swing, 2: [-x for x in swing]}, pg="dp"),
             _lateness({1: list(0.15 + rng.normal(0.0, 0.01, n)), 3: list(-0.15 + rng.normal(0.0, 0.01, n))},
                       pg="dp"),
             _lateness({0: list(0.04 + rng.normal(0.0, 0.01, n)), 1: list(-0.04 + rng.normal(0.0, 0.01, n))},
                       pg="tp"),                     # later in TP, by less than any view names
             _lateness({2: list(rng.normal(0.0, 0.01, n)), 3: list(rng.normal(0.0, 0.01, n))}, pg="tp")]
    lateness = pd.concat(parts, ignore_index=True)
    scores = ss.straggler_scores(lateness)
    assert pd.isna(scores.set_index(["pg", "pg_ranks", "rank"]).loc[("tp", "0,1", 0), "detected_by"])
    assert pd.isna(scores.set_index(["pg", "pg_ranks", "rank"]).loc[("dp", "0,2", 0), "detected_by"])
    none = pd.DataFrame({c: [] for c in sc.CAUSE_COLUMNS})
    links = {frozenset(p) for p in ((0, 2), (1, 3), (0, 1), (2, 3))}
    [f] = st.detect_stragglers(scores, none, links=links, axis_of_pg=lambda pg: pg, lateness=lateness)
    ev = f.evidence
    assert (f.ranks, f.group, ev["detected_by"], ev["propagated_to"]) == ((0,), "dp", "via_victim", [1])
    assert ev["detected_at_step"] == scores.set_index(["pg", "pg_ranks", "rank"]).loc[("dp", "1,3", 1),
                                                                                        "detected_at_step"]


def test_a_rank_later_in_the_same_group_as_the_flagged_rank_takes_no_blame_from_it():
    # dp4 (one group): rank 2 is late from the start and named; rank 0 becomes late from step 17, in swings no view
    # names, though later than rank 2 on average over its own window (as a rank held back by its CPU quota and
    # its core-mate were, in a dp4 run of this host). Both arrivals are measured at the same collectives, so rank
    # 2's lateness is its own: it stays named, and rank 0 is not made its culprit (``via_victim``)
    rng = np.random.default_rng(16)
    n = 40
    fracs = {0: [(-0.2 + rng.normal(0.0, 0.02)) if i < 16 else (0.7 if i % 2 else 0.0) for i in range(n)],
             1: list(-0.2 + rng.normal(0.0, 0.02, n)), 2: list(0.2 + rng.normal(0.0, 0.02, n)),
             3: list(-0.2 + rng.normal(0.0, 0.02, n))}
    lateness = _lateness(fracs)
    scores = ss.straggler_scores(lateness)
    by_rank = scores.set_index("rank")
    assert pd.isna(by_rank.loc[0, "detected_by"]) and not pd.isna(by_rank.loc[2, "detected_by"])
    assert by_rank.loc[0, "mean_excess_frac"] > by_rank.loc[2, "mean_excess_frac"]      # rank 0 arrives later
    none = pd.DataFrame({c: [] for c in sc.CAUSE_COLUMNS})
    links = {frozenset(p) for p in ((0, 1), (0, 2), (0, 3), (1, 2), (1, 3), (2, 3))}
    [f] = st.detect_stragglers(scores, none, links=links, axis_of_pg=lambda pg: pg, lateness=lateness)
    assert (f.ranks, f.evidence["detected_by"], f.evidence["propagated_to"]) == ((2,), "arrival", [])
