"""SLOW_LINK (links.py) on hand-made two-node tables with known answers, and its interplay with STRAGGLER."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pandas as pd
import pytest
from analysis_synth import MS, T0

from dtprobe.analysis import straggler_causes as sc
from dtprobe.analysis import straggler_scores as ss
from dtprobe.analysis import links
from dtprobe.analysis import stragglers as st
from dtprobe.analysis.comm_efficiency import collective_bandwidth
from dtprobe.store.frames import frame_from_rows

NUM_BYTES = 4 << 20


def two_node_tables(*, ranks_per_node: int = 2, num_steps: int = 40, slow_from_step: int | None = 20,
                    factor: float = 5.0, xfer_ms: float = 4.0, num_buckets: int = 3, seed: int = 0,
                    far_lag: bool = True, single_node: bool = False, straggler: int | None = None,
                    delay_ms: float = 0.0, xfer_noise: float = 0.0) -> dict:
    """DDP over every rank of two nodes (rank = node * ranks_per_node + local): per step data 5 ms, fwd 30 ms, bwd
    50 ms (+ up to 1 ms jitter each), one all-reduce per bucket taking ``xfer_ms`` after the last arrival, ``factor``
    times longer from ``slow_from_step`` on (the link rate-limited mid-run). With ``far_lag``, the ranks of node 1
    see each slow all-reduce end later (its last chunk crosses the slow link), so they start the next step later:
    every rank of one node late the same way. Compute never changes, except that the ``straggler`` rank's forward
    takes ``delay_ms`` longer from step 1 on. ``xfer_noise``: each step's transfers are scaled by a log-normal
    factor of that sigma (a busy host's step-to-step spread)."""
    rng = random.Random(seed)
    world = 2 * ranks_per_node
    node_of = {r: (0 if single_node else r // ranks_per_node) for r in range(world)}
    members = ",".join(map(str, range(world)))
    steps, coll = [], []
    start = {r: T0 for r in range(world)}
    seq = 0
    for step in range(num_steps):
        slow = slow_from_step is not None and step >= slow_from_step
        xfer = xfer_ms * (factor if slow else 1.0) * rng.lognormvariate(0.0, xfer_noise)
        phases = {r: (5 + rng.uniform(0, 1), 30 + rng.uniform(0, 1) + (delay_ms if r == straggler and step else 0),
                      50 + rng.uniform(0, 1)) for r in range(world)}
        enq = {r: [start[r] + int((d + f + (k + 1) / num_buckets * b) * MS) for k in range(num_buckets)]
               for r, (d, f, b) in phases.items()}
        prev = 0
        for k in range(num_buckets):
            done = max(max(enq[r][k] for r in range(world)), prev) + int(xfer * MS)
            prev = done
            seq += 1
            for r in range(world):
                lag = int(0.5 * xfer * MS) if far_lag and slow and node_of[r] == 1 else 0
                coll.append({"rank": r, "pg": "dp", "pg_ranks": members, "pg_size": world, "seq": seq,
                             "op": "allreduce", "num_bytes": NUM_BYTES, "dtype": "float32", "enqueue_ns": enq[r][k],
                             "end_ns": done + lag, "step": step, "timing": "host"})
        for r, (d, f, b) in phases.items():
            lag = int(0.5 * xfer * MS) if far_lag and slow and node_of[r] == 1 else 0
            bwd_end = max(start[r] + int((d + f + b) * MS), prev + lag)
            end = bwd_end + 10 * MS
            steps.append({"rank": r, "step": step, "start_ns": start[r], "end_ns": end, "data_ns": int(d * MS),
                          "fwd_ns": int(f * MS), "bwd_ns": bwd_end - start[r] - int((d + f) * MS),
                          "opt_ns": 10 * MS, "loss": 4.0, "tokens": 256, "restart": 0})
            start[r] = end + MS
    ranks = [SimpleNamespace(rank=r, node_rank=node_of[r], host=f"node-{'ab'[node_of[r]]}") for r in range(world)]
    return {"steps": frame_from_rows("steps", steps), "collectives": frame_from_rows("collectives", coll),
            "ranks": ranks}


def _slow_links(t: dict) -> list:
    bw = collective_bandwidth(t["collectives"])
    return links.find_slow_links(bw[bw["step"] >= 1], t["ranks"], t["steps"])


@pytest.mark.parametrize("ranks_per_node", [1, 2])
def test_slow_link_names_the_two_nodes_and_the_step_when_transfers_grow_fivefold(ranks_per_node):
    t = two_node_tables(ranks_per_node=ranks_per_node, num_buckets=1)     # one all-reduce per step: no queueing
    found = _slow_links(t)
    assert [(f.code, f.severity) for f in found] == [("SLOW_LINK", "warning")]
    ev = found[0].evidence
    assert ev["nodes"] == ["node-a", "node-b"]
    assert ev["changed_at_step"] == 20
    # busbw of a 4 MiB all-reduce over n ranks: bytes / time x 2(n-1)/n
    n = 2 * ranks_per_node
    want_before = NUM_BYTES / 4e-3 * 2 * (n - 1) / n * 8 / 1e9
    assert ev["busbw_before_gbps"] == pytest.approx(want_before, rel=1e-3)
    # after: 5x the transfer, and node-b's ranks see the end half a transfer later (latest completion counts)
    assert ev["busbw_after_gbps"] == pytest.approx(want_before / 7.5, rel=1e-3)
    assert ev["num_collectives_before"] == 19 and ev["num_collectives_after"] == 20
    assert ev["ranks"] == {"node-a": list(range(ranks_per_node)),
                           "node-b": list(range(ranks_per_node, 2 * ranks_per_node))}
    assert found[0].ranks == tuple(range(n))
    assert ev["transfer_ms_per_step_after"] - ev["transfer_ms_per_step_before"] == pytest.approx(26, abs=0.01)
    # the step grows from ~100 to ~130 ms: the gain of a healthy link is 26 of ~130 ms
    assert 0.17 < found[0].predicted_gain.frac < 0.23


@pytest.mark.parametrize("case", [dict(slow_from_step=None), dict(single_node=True), dict(factor=1.5, far_lag=False)])
def test_slow_link_finds_nothing_without_a_large_lasting_drop_across_nodes(case):
    assert _slow_links(two_node_tables(**case)) == []


def test_slow_link_is_found_through_step_to_step_noise_when_the_drop_stands_out_of_it():
    t = two_node_tables(num_buckets=1, xfer_noise=0.3, seed=4)
    [f] = _slow_links(t)
    assert f.evidence["nodes"] == ["node-a", "node-b"] and f.evidence["changed_at_step"] == 20
    assert f.evidence["change_over_noise"] >= 3 and f.evidence["busbw_ratio"] < 0.2


def test_slow_link_stays_silent_when_a_halving_is_within_the_links_own_noise():
    # transfers 2.5x longer from step 20 but spread ~1.8x (sigma 0.6) from step to step: a drop that size cannot
    # be told from what CPU contention alone does to host-timed transfers on a busy host
    t = two_node_tables(num_buckets=1, factor=2.5, far_lag=False, xfer_noise=0.6, seed=6)
    bw = collective_bandwidth(t["collectives"])
    bw = bw[bw["step"] >= 1]
    node_of = {r.rank: r.host for r in t["ranks"]}
    [change] = links.link_changes(links.link_bandwidth(bw, node_of)).itertuples(index=False)
    assert change.rel_busbw_ratio < 0.5 and change.after_below_frac >= 0.8     # ratio and consistency pass ...
    assert change.change_over_noise < 3                                          # ... the noise rule does not
    assert _slow_links(t) == []
    assert len(links.detect_slow_links(links.link_changes(links.link_bandwidth(bw, node_of)), node_of, t["steps"],
                                       min_change_over_noise=0.0)) == 1


def test_slow_link_ignores_a_few_slow_collectives():
    t = two_node_tables(slow_from_step=None)
    coll = t["collectives"]
    burst = coll["step"].isin([10, 25])                     # two steps with 5x transfers, the rest normal
    coll.loc[burst, "end_ns"] = coll.loc[burst, "end_ns"] + 16 * MS
    assert _slow_links(t) == []


def test_node_names_fall_back_to_node_rank_when_hosts_repeat():
    frame = pd.DataFrame({"rank": [0, 1, 2, 3], "node_rank": [0, 0, 1, 1], "host": ["h", "h", "h", "h"]})
    assert links.node_names(frame) == {0: "node0", 1: "node0", 2: "node1", 3: "node1"}
    frame["host"] = ["a", "a", "b", "b"]
    assert links.node_names(frame) == {0: "a", 1: "a", 2: "b", 3: "b"}


def _stragglers(t: dict, slow_link_ranks: dict[int, int] | None) -> list:
    lateness = st.rank_lateness(t["collectives"], t["steps"])
    lateness = lateness[lateness["step"] >= 1]
    scores = ss.straggler_scores(lateness)
    waits = st.collective_waits(t["collectives"], st.collective_skew(t["collectives"]))
    causes = sc.straggler_causes(scores, lateness, t["steps"], pd.DataFrame(),
                                 blocked=sc.blocked_outside_groups(t["collectives"], waits))
    return st.detect_stragglers(scores, causes, links=st.linked_ranks(t["collectives"]), lateness=lateness,
                                slow_link_ranks=slow_link_ranks)


def test_a_node_late_behind_a_slow_link_is_not_a_compute_straggler():
    t = two_node_tables(ranks_per_node=2, num_steps=50)
    found = _slow_links(t)
    assert [f.code for f in found] == ["SLOW_LINK"]
    # the metric does see node-b's ranks arrive late (their all-reduces end later) ...
    scores = ss.straggler_scores(st.rank_lateness(t["collectives"], t["steps"]))
    assert (scores.set_index("rank").loc[[2, 3], "median_lateness_frac"] > 0.05).all()
    # ... but with the slow link known, no rank's compute is blamed
    assert _stragglers(t, links.slow_link_ranks(found)) == []


def test_a_compute_straggler_on_a_healthy_link_is_still_found():
    t = two_node_tables(ranks_per_node=2, slow_from_step=None, straggler=3, delay_ms=12.0)
    assert _slow_links(t) == []
    found = _stragglers(t, {})
    assert [(f.code, f.ranks, f.evidence["cause"]) for f in found] == [("STRAGGLER", (3,), "compute")]


def _two_node_run(tmp_path, t: dict):
    from analysis_synth import write_run

    from dtprobe.store.manifest import write_rank_info

    run = write_run(tmp_path / "two_nodes", {"steps": t["steps"], "collectives": t["collectives"]},
                    world_size=len(t["ranks"]), config={"layout": {"dp": len(t["ranks"]), "tp": 1, "pp": 1}})
    for r in t["ranks"]:                                    # the ranks as a two-node launch describes them
        write_rank_info(run, r.rank, host=r.host, node_rank=r.node_rank, local_rank=r.rank % 2, device="cpu",
                        pid=1000 + r.rank, clock_offset_ns=0)
    return run


def test_analysis_of_a_two_node_run_reports_the_slow_link_and_no_straggler(tmp_path):
    from dtprobe.analysis import RunAnalysis

    a = RunAnalysis.open(_two_node_run(tmp_path, two_node_tables(ranks_per_node=2, num_steps=50)))
    found = [f for f in a.findings() if f.code in ("SLOW_LINK", "STRAGGLER")]
    assert [(f.code, f.severity, f.group) for f in found] == [("SLOW_LINK", "warning", "dp")]
    doc = [f for f in a.report()["findings"] if f["code"] == "SLOW_LINK"][0]
    assert doc["evidence"]["nodes"] == ["node-a", "node-b"] and doc["evidence"]["changed_at_step"] == 20
    assert doc["evidence"]["ranks"] == {"node-a": [0, 1], "node-b": [2, 3]}


def test_analysis_of_a_one_node_run_has_no_slow_link_for_the_same_drop(tmp_path):
    from dtprobe.analysis import RunAnalysis

    a = RunAnalysis.open(_two_node_run(tmp_path, two_node_tables(ranks_per_node=2, num_steps=50, single_node=True)))
    assert a.slow_links() == []
