"""One analysis for every clock: a dtprobe CUDA run's device arrivals (``arrive_ns``), NCCL's device start/end
(``timing="cuda_event"``) and device-timed steps and pipeline actions go through the same arrival, exposure and
bubble code as host times, and every timing-based finding says which clock it used (``evidence.clock``)."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from dtprobe.analysis import RunAnalysis
from dtprobe.analysis.arrivals import arrival_clocks, lateness_vs_peers, on_arrival_clock
from dtprobe.analysis.clocks import clock_of, clock_of_timing
from dtprobe.analysis.comm_efficiency import bandwidth_by_size, collective_bandwidth, detect_comm_inefficient
from dtprobe.analysis.links import find_slow_links
from dtprobe.store.reader import RunStore
from dtprobe.synthetic import (MS, T0, cuda_dp_tables, cut_rank, dp_tables, lockstep_tables, pending_row,
                               pipeline_tables, stall_rank, write_rows_run, write_run)

LAYOUT = {"layout": {"dp": 4, "tp": 1, "pp": 1}}


def _analysis(tmp_path, clock: str, **kw) -> RunAnalysis:
    run = write_run(tmp_path / clock, cuda_dp_tables(clock=clock, **kw), world_size=4, config=LAYOUT)
    return RunAnalysis(RunStore.open(run))


def test_straggler_is_the_late_device_on_the_device_clock_when_its_host_enqueues_on_time(tmp_path):
    a = _analysis(tmp_path, "device", straggler=2, delay_ms=15.0)
    assert a.arrival_clock() == "device"
    assert a.report()["metrics"]["run"]["arrival_clock"] == "device"
    [f] = [f for f in a.findings() if f.code == "STRAGGLER"]
    assert f.ranks == (2,) and f.evidence["clock"] == "device" and f.evidence["victims"] == [0, 1, 3]
    # 15 ms of a ~101 ms step on the device; its host enqueues are within the 1 ms jitter of its peers'
    assert f.evidence["mean_lateness_ms"] == pytest.approx(15.0, abs=1.0)
    assert f.evidence["positive_frac"] == 1.0
    host_enq = a.table("collectives").groupby("rank")["enqueue_ns"].mean()
    assert (host_enq.max() - host_enq.min()) / MS < 1.0


def test_same_run_read_on_host_times_names_no_straggler(tmp_path):
    a = _analysis(tmp_path, "host", straggler=2, delay_ms=15.0)
    assert a.arrival_clock() == "host"
    assert [f for f in a.findings() if f.code == "STRAGGLER"] == []
    # the slow device only shows as an exposed communication tail on every rank, on the host clock
    [f] = [f for f in a.findings() if f.code == "EXPOSED_COMM"]
    assert f.evidence["clock"] == "host" and f.evidence["source"] == "host collectives tail"


def test_exposure_on_device_clock_separates_straggler_wait_from_transfer(tmp_path):
    a = _analysis(tmp_path, "device", straggler=2, delay_ms=15.0, xfer_ms=3.0)
    e = a.comm_exposure()
    e = e[e["step"] >= 1].groupby("rank")[["exposed_ns", "straggler_wait_ns", "exposed_net_ns"]].mean() / MS
    # the last bucket's tail: victims wait ~15 ms (+ jitter) for rank 2, then 3 ms of transfer; rank 2 waits on nobody
    assert e.loc[2, "straggler_wait_ns"] == pytest.approx(0.0, abs=1.0)
    for r in (0, 1, 3):
        assert e.loc[r, "straggler_wait_ns"] == pytest.approx(15.0, abs=1.5)
    assert np.allclose(e["exposed_net_ns"], 3.0, atol=1.0)
    assert [f for f in a.findings() if f.code == "EXPOSED_COMM"] == []


def test_on_arrival_clock_returns_the_table_itself_when_no_row_has_a_device_arrival():
    coll = dp_tables(world=2, num_steps=3)["collectives"]
    assert on_arrival_clock(coll) is coll
    assert arrival_clocks(coll)["clock"].tolist() == ["host"]


def test_on_arrival_clock_uses_arrive_ns_per_group_and_drops_rows_without_one():
    coll = cuda_dp_tables(clock="device", world=2, num_steps=2)["collectives"]
    other = dp_tables(world=2, num_steps=2, pg="tp")["collectives"]
    both = pd.concat([coll, other], ignore_index=True)
    both.loc[0, "arrive_ns"] = pd.NA                     # one unresolved event (e.g. a hung collective)
    out = on_arrival_clock(both)
    clocks = dict(zip(arrival_clocks(both)["pg"], arrival_clocks(both)["clock"]))
    assert clocks == {"dp": "device", "tp": "host"}
    dp = both["pg"] == "dp"
    assert pd.isna(out.loc[0, "enqueue_ns"])
    assert (out.loc[dp, "enqueue_ns"].iloc[1:] == both.loc[dp, "arrive_ns"].iloc[1:]).all()
    assert (out.loc[~dp, "enqueue_ns"] == both.loc[~dp, "enqueue_ns"]).all()
    assert (both.loc[dp, "enqueue_ns"] != both.loc[dp, "arrive_ns"]).iloc[1:].all()   # input untouched


def test_hangs_read_host_enqueues_when_arrivals_are_on_the_device(tmp_path):
    a = _analysis(tmp_path, "device", straggler=None)
    assert a.hangs() == []
    assert a.host_collective_skew()["first_enqueue_ns"].tolist() != a.collective_skew()["first_enqueue_ns"].tolist()


@pytest.mark.parametrize("clock,expected", [(None, "host"), ("host", "host"), ("device", "device")])
def test_pipeline_bubble_evidence_names_the_clock_of_the_pipeline_rows(tmp_path, clock, expected):
    t = pipeline_tables(schedule="gpipe", pp=4, microbatches=4, clock=clock)
    run = write_run(tmp_path / "pp", t, world_size=4, config={"layout": {"dp": 1, "tp": 1, "pp": 4,
                                                                         "pp_schedule": "gpipe"}})
    [f] = [f for f in RunAnalysis(RunStore.open(run)).findings() if f.code == "PIPELINE_BUBBLE"]
    assert f.evidence["clock"] == expected


@pytest.mark.parametrize("labels,expected", [
    ([], "host"), ([None, None], "host"), (["host", None], "host"), (["device", "device"], "device"),
    (["device", "host"], "mixed"), (["device", None], "mixed"),
])
def test_clock_of_names_one_clock_or_mixed(labels, expected):
    assert clock_of(pd.Series(labels, dtype="string")) == expected


@pytest.mark.parametrize("timing,expected", [
    (["host", "host"], "host"), (["cuda_event"] * 3, "device"), (["cuda_event", "host"], "mixed"), ([], "host"),
])
def test_clock_of_timing_maps_cuda_event_to_device(timing, expected):
    assert clock_of_timing(pd.Series(timing, dtype="string")) == expected


def test_comm_inefficient_evidence_names_the_device_clock_for_nccl_timed_collectives():
    coll = cuda_dp_tables(clock="device", world=4, num_steps=12)["collectives"]
    # many small buckets: latency-bound and mergeable
    coll = coll.assign(num_bytes=pd.array([4096] * len(coll), dtype="Int64"))
    bw = collective_bandwidth(coll)
    assert set(bw["timing"]) == {"cuda_event"}
    by_size = bandwidth_by_size(bw)
    findings = detect_comm_inefficient(bw, by_size, fit=None, step_ns=100 * MS, num_steps=12,
                                       peak_busbw_bytes_per_s=1e12)
    assert findings and {f.evidence["clock"] for f in findings} == {"device"}


def test_lateness_vs_peers_is_the_median_of_the_other_members_exactly_on_unix_times():
    rng = np.random.default_rng(3)
    gid = np.repeat(np.arange(50), rng.integers(2, 9, size=50))
    t = 1_700_000_000_000_000_000 + rng.integers(0, 10**7, size=len(gid))
    got = lateness_vs_peers(t, gid)
    for i in range(len(t)):
        peers = t[(gid == gid[i]) & (np.arange(len(t)) != i)] - t[gid == gid[i]].min()
        assert got[i] == (t[i] - t[gid == gid[i]].min()) - np.median(peers.astype("float64"))
    assert np.isnan(lateness_vs_peers(np.array([5]), np.array([0])))[0]


def test_hang_evidence_names_the_host_clock(tmp_path):
    # rank 1 freezes at 330 ms; rank 0 waits in all-reduce #4 from 360 ms, alive, until its watchdog at 10.4 s
    rows = lockstep_tables(world=2, num_steps=6)
    cut_rank(rows, 1, T0 + 330 * MS)
    stall_rank(rows, 0, T0 + 360 * MS, until_ns=T0 + 10_400 * MS, close=("crashed", "watchdog"))
    rows["pending"] = [pending_row(0, step=3, seq=4, t_ns=T0 + 360 * MS)]
    a = RunAnalysis.open(write_rows_run(tmp_path / "run", rows, world_size=2, status="crashed"))
    [f] = [f for f in a.findings() if f.code == "HANG"]
    assert f.ranks == (1,) and f.evidence["clock"] == "host"


@pytest.mark.parametrize("timing,expected", [("host", "host"), ("cuda_event", "device")])
def test_slow_link_evidence_names_the_clock_of_the_transfer_times(timing, expected):
    from test_analysis_slow_link import two_node_tables     # the two-node run whose link slows at step 20

    t = two_node_tables(ranks_per_node=1, num_buckets=1)
    coll = t["collectives"].assign(timing=pd.array([timing] * len(t["collectives"]), dtype="string"))
    bw = collective_bandwidth(coll)
    [f] = find_slow_links(bw[bw["step"] >= 1], t["ranks"], t["steps"])
    assert f.evidence["clock"] == expected and f.evidence["changed_at_step"] == 20
