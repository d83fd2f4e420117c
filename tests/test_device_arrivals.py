"""Device-clock arrivals of Kineto trace folders: collectives matched across ranks (by sequence number, else by
order within group and step, refusing mismatches), clock offsets from the collectives' ends, arrival tables and
STRAGGLER on the device clock; partial groups abstain; results do not depend on the ranks' clocks."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd
import pytest

from dtprobe.analysis import RunAnalysis
from dtprobe.analysis.device_arrivals import MIN_MATCHED_COLLECTIVES
from dtprobe.cli import main

DLRM = Path(__file__).parent / "data" / "traces" / "dlrm_8rank_v100"
STEP_US = 10_000
"""Synthetic step length; each step holds the collectives given per step."""


@dataclass
class Scenario:
    """A synthetic job: ``world`` ranks issue ``num_steps`` x ``per_step`` allreduces of one group; every
    collective's kernels end together (the transfer after the last start), ``late`` ranks reach it later on
    their device, ``clock_us`` shifts a rank's whole trace (its clock)."""

    world: int = 4
    num_steps: int = 8
    per_step: int = 4
    late: dict[int, int] = field(default_factory=dict)
    clock_us: dict[int, int] = field(default_factory=dict)
    with_seq: bool = True
    with_args: bool = True
    group: list[int] | None = None
    ranks: list[int] | None = None
    skip_first: dict[int, int] = field(default_factory=dict)
    nelems: dict[tuple[int, int], int] = field(default_factory=dict)
    ops: dict[tuple[int, int], str] = field(default_factory=dict)

    def write(self, folder: Path) -> Path:
        folder.mkdir(parents=True, exist_ok=True)
        group = self.group or list(range(self.world))
        for rank in self.ranks or group:
            (folder / f"rank{rank}.pt.trace.json").write_text(json.dumps(self._trace(rank, group), indent=1))
        return folder

    def _trace(self, rank: int, group: list[int]) -> dict:
        shift = self.clock_us.get(rank, 0)
        events: list[dict] = []
        corr = 0
        for step in range(self.num_steps):
            t_step = 1_000_000 + step * STEP_US
            events.append({"ph": "X", "cat": "user_annotation", "name": f"ProfilerStep#{step}", "pid": 1, "tid": 1,
                           "ts": t_step + shift, "dur": STEP_US - 10})
            for i in range(self.per_step):
                seq = step * self.per_step + i + 1
                if seq <= self.skip_first.get(rank, 0):
                    continue
                corr += 1
                arrive = t_step + 500 + i * 2000
                start = arrive + self.late.get(rank, 0) + (7 * rank + 3 * seq) % 5   # device arrival, jitter
                last = arrive + max(self.late.values(), default=0) + 4
                end = last + 300 + (rank + seq) % 2                                  # ends within a hop
                op = self.ops.get((rank, seq), "allreduce")
                nelems = self.nelems.get((rank, seq), 1 << 20)
                launch = t_step + 100 + i * 2000
                events.append({"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "pid": 1, "tid": 1,
                               "ts": launch + shift, "dur": 5, "args": {"correlation": corr}})
                kname = {"allreduce": "AllReduce", "allgather": "AllGather"}[op]
                args = {"stream": 20, "correlation": corr}
                if self.with_args:
                    args.update({"Collective name": op, "In msg nelems": nelems, "Out msg nelems": nelems,
                                 "dtype": "Float", "Group size": len(group), "Process Group Name": "0",
                                 "Process Group Description": "default_pg", "Process Group Ranks": str(group)})
                    if self.with_seq:
                        args["Seq"] = seq
                else:
                    events.append({"ph": "X", "cat": "user_annotation", "name": f"nccl:{op}", "pid": 1, "tid": 1,
                                   "ts": launch - 2 + shift, "dur": 20,
                                   "args": {"Input Dims": [[nelems]], "Input type": ["float"]}})
                events.append({"ph": "X", "cat": "kernel", "name": f"ncclDevKernel_{kname}_Sum_f32_RING_LL(x)",
                               "pid": 0, "tid": 20, "ts": start + shift, "dur": end - start, "args": args})
                events.append({"ph": "X", "cat": "kernel", "name": "sgemm_128x64", "pid": 0, "tid": 7,
                               "ts": end + 50 + shift, "dur": 800, "args": {"stream": 7, "correlation": 0}})
        return {"schemaVersion": 1, "distributedInfo": {"backend": "nccl", "rank": rank, "world_size": self.world},
                "deviceProperties": [{"name": "NVIDIA A100-SXM4-80GB"}], "traceEvents": events}


def _analysis(path: Path) -> RunAnalysis:
    return RunAnalysis.open(path)


def _offsets(a: RunAnalysis) -> dict[int, float]:
    return dict(zip(a.clock_offsets()["rank"], a.clock_offsets()["offset_us"].astype(float)))


def test_offsets_recover_each_rank_clock_shift_and_stragglers_use_the_device_clock(tmp_path):
    clocks = {1: -2_500_000, 2: 40_000, 3: 7_777_777}
    a = _analysis(Scenario(num_steps=8, late={2: 600}, clock_us=clocks).write(tmp_path / "t"))
    assert a.matching_method() == "seq" and a.clock_alignment() == "device_collectives"
    for rank, off in _offsets(a).items():
        assert off == pytest.approx(-clocks.get(rank, 0), abs=2.0)
    residual = a.clock_offsets().set_index("rank")["residual_us"]
    assert (residual < 2.0).all()
    [f] = a.stragglers()
    assert f.ranks == (2,) and f.evidence["clock"] == "device" and f.evidence["last_frac"] == 1.0
    assert f.evidence["num_collectives"] == 32 and f.evidence["min_collectives"] == MIN_MATCHED_COLLECTIVES
    summary = a.arrival_summary().set_index("rank")
    assert summary.loc[2, "median_lateness_us"] == pytest.approx(600, abs=5)
    transfer = a.device_collective_transfer()
    assert (transfer["last_rank"] == 2).all() and transfer["latency_us"].between(299, 306).all()
    assert transfer["busbw_gb_per_s"].iloc[0] == pytest.approx(
        transfer["algbw_gb_per_s"].iloc[0] * 2 * 3 / 4)   # allreduce: 2(n-1)/n


def test_shifting_a_non_reference_rank_changes_its_offset_by_exactly_the_shift_and_nothing_else(tmp_path):
    base = Scenario(num_steps=8, late={3: 400}, clock_us={1: 123, 2: -9_000})
    a = _analysis(base.write(tmp_path / "a"))
    shifted = Scenario(num_steps=8, late={3: 400}, clock_us={1: 123, 2: -9_000 + 3_141_593})
    b = _analysis(shifted.write(tmp_path / "b"))
    off_a, off_b = _offsets(a), _offsets(b)
    assert off_b[2] == off_a[2] - 3_141_593                     # exactly, to the nanosecond
    assert {r: o for r, o in off_b.items() if r != 2} == {r: o for r, o in off_a.items() if r != 2}
    assert a.clock_offsets()["residual_us"].tolist() == b.clock_offsets()["residual_us"].tolist()
    assert a.arrival_summary().equals(b.arrival_summary())
    cols = ["coll_id", "rank", "lateness_us", "wait_us", "transfer_us", "is_last"]
    assert a.device_arrivals()[cols].equals(b.device_arrivals()[cols])
    assert [f.to_json() for f in a.stragglers()] == [f.to_json() for f in b.stragglers()]
    assert [f.ranks for f in a.stragglers()] == [(3,)]


def test_too_few_matched_collectives_give_no_straggler_verdict(tmp_path):
    a = _analysis(Scenario(num_steps=4, per_step=4, late={1: 900}).write(tmp_path / "t"))   # 16 < 20
    assert a.arrival_summary().set_index("rank").loc[1, "last_frac"] == 1.0
    assert a.stragglers() == []


def test_a_folder_with_some_members_of_a_large_group_abstains_and_says_why(tmp_path, capsys):
    path = Scenario(world=128, num_steps=8, late={1: 900}, ranks=[0, 1]).write(tmp_path / "two_of_128")
    a = _analysis(path)
    assert a.arrival_summary().empty and a.stragglers() == []
    assert "only 2 of the group's 128 members" in a.clock_alignment()
    assert main(["analyze", str(path), "--format", "json"]) in (0, 1)
    doc = json.loads(capsys.readouterr().out)
    m = doc["metrics"]
    assert m["arrivals"] == [] and m["clock_alignment"] == []
    assert m["run"]["clock_aligned"].startswith("not aligned: only 2 of the group's 128 members")
    [group] = m["collective_matching"]["groups_not_judged"]
    assert group["pg_ranks"] == list(range(128)) and "add the others' traces" in group["reason"]
    assert not [f for f in doc["findings"] if f["code"] == "STRAGGLER"]


def test_sequence_numbers_pair_collectives_across_windows_cut_at_different_points(tmp_path):
    # rank 1's window starts two collectives later: by Seq the rest still pair; the two it lacks are refused
    a = _analysis(Scenario(num_steps=6, late={3: 500}, skip_first={1: 2}).write(tmp_path / "t"))
    assert a.matching_method() == "seq"
    m = a.matched_collectives().drop_duplicates("coll_id")
    assert (m["status"] == "missing_member").sum() == 2 and (m["status"] == "matched").sum() == 22
    assert (a.device_collective_transfer()["last_rank"] == 3).all()


def test_a_sequence_number_a_rank_uses_twice_is_refused_not_paired(tmp_path):
    from dtprobe.analysis.collective_matching import match_collectives
    a = _analysis(Scenario(num_steps=6).write(tmp_path / "t"))
    device = a.device_collectives()
    twice = device[(device["rank"] == 1) & (device["seq"] == 7)].assign(start_ns=lambda x: x["start_ns"] + 10)
    matched = match_collectives(pd.concat([device, twice], ignore_index=True), a.group_coverage(), by="seq")
    per_coll = matched.drop_duplicates("coll_id").set_index("key")["status"]
    assert per_coll[7] == "duplicate" and (per_coll.drop(7) == "matched").all()


def test_order_matching_refuses_a_step_whose_members_differ_in_size_and_says_so(tmp_path):
    # no Seq, no collective args (an older trace): matched by order within (group, step); rank 1's third
    # collective of step 2 is a different size: that whole step is refused, the other steps pair
    sc = Scenario(num_steps=6, late={2: 500}, with_seq=False, with_args=False, nelems={(1, 2 * 4 + 3): 4096})
    a = _analysis(sc.write(tmp_path / "t"))
    assert a.matching_method() == "order"
    per_coll = a.matched_collectives().drop_duplicates("coll_id")
    refused = per_coll.loc[per_coll["status"] != "matched"]
    assert set(refused["status"]) == {"size_mismatch"} and set(refused["step"]) == {2} and len(refused) == 4
    assert (per_coll["status"] == "matched").sum() == 20
    doc = a.metrics()["collective_matching"]
    assert doc["method"] == "order" and doc["refused_by_reason"] == {"size_mismatch": 4}
    assert set(a.device_arrivals()["step"]) == {0, 1, 3, 4, 5}


def test_order_matching_refuses_an_op_mismatch_and_uneven_counts(tmp_path):
    # rank 3's window starts at step 1's second collective; rank 0 runs an allgather where the others allreduce
    sc = Scenario(num_steps=4, with_seq=False, ops={(0, 2 * 4 + 1): "allgather"}, skip_first={3: 5})
    a = _analysis(sc.write(tmp_path / "t"))
    per_coll = a.matched_collectives().drop_duplicates("coll_id")
    by_step = per_coll.groupby("step")["status"].agg(set).to_dict()
    assert by_step == {0: {"missing_member"}, 1: {"count_mismatch"}, 2: {"op_mismatch"}, 3: {"matched"}}


def test_order_matching_without_seq_gives_the_same_arrivals_as_seq(tmp_path):
    with_seq = _analysis(Scenario(num_steps=6, late={1: 700}).write(tmp_path / "seq"))
    by_order = _analysis(Scenario(num_steps=6, late={1: 700}, with_seq=False).write(tmp_path / "order"))
    assert by_order.matching_method() == "order"
    assert with_seq.arrival_summary().equals(by_order.arrival_summary())
    assert _offsets(with_seq) == _offsets(by_order)


def test_dlrm_offsets_are_near_zero_and_its_arrival_table_is_stable():
    a = _analysis(DLRM)
    assert a.matching_method() == "order" and a.clock_alignment() == "device_collectives"
    offsets = a.clock_offsets().set_index("rank")
    # one host clock for all 8 ranks: the collectives' ends agree to within a couple of microseconds
    assert offsets["offset_us"].abs().max() <= 2.0 and offsets["residual_us"].max() <= 2.0
    assert offsets["num_collectives"].tolist() == [8] * 8
    summary = a.arrival_summary().set_index("rank")
    assert summary["last_frac"].round(3).to_dict() == {0: 0.0, 1: 0.0, 2: 0.0, 3: 0.0, 4: 0.125, 5: 0.25, 6: 0.0,
                                                       7: 0.625}
    assert summary["median_lateness_us"].to_dict() == {0: -19.5, 1: -35.5, 2: 13.5, 3: -15.0, 4: 60.75, 5: 57.25,
                                                       6: -6.5, 7: 129.0}
    assert a.stragglers() == []      # 8 matched collectives: fewer than the minimum for a verdict


def test_analyze_json_reports_clock_alignment_and_arrivals_of_a_trace_folder(capsys):
    assert main(["analyze", str(DLRM), "--format", "json"]) in (0, 1)
    m = json.loads(capsys.readouterr().out)["metrics"]
    assert m["run"]["clock_aligned"] == "device_collectives" and "clock_alignment" not in m["run"]
    assert [set(r) for r in m["clock_alignment"]] == [{"rank", "offset_us", "residual_us", "num_collectives"}] * 8
    assert [set(r) for r in m["arrivals"]] == [
        {"rank", "pg", "pg_ranks", "num_collectives", "last_frac", "median_lateness_us"}] * 8
    assert m["arrivals"][7] == {"rank": 7, "pg": "world", "pg_ranks": list(range(8)), "num_collectives": 8,
                                "last_frac": 0.625, "median_lateness_us": 129.0}
    assert m["collective_matching"]["method"] == "order" and m["collective_matching"]["num_matched"] == 8


def test_markdown_report_of_a_trace_folder_says_how_its_clocks_were_aligned(tmp_path):
    from dtprobe.analysis.render import render_markdown
    dlrm = render_markdown(_analysis(DLRM).report())
    assert "clocks: aligned from 8 collectives matched by order (0 refused)" in dlrm
    assert ("rank 7 starts last in 62% of its world collectives (median +129 us, device clock), too few to judge: "
            "STRAGGLER needs 20 matched collectives of a group, it has 8") in dlrm
    judged = render_markdown(_analysis(Scenario(num_steps=6, late={1: 700}).write(tmp_path / "judged")).report())
    assert "starts last in" in judged and "too few to judge" not in judged
    partial = _analysis(Scenario(world=16, num_steps=2, ranks=[0, 1]).write(tmp_path / "partial"))
    assert "clocks: not aligned: only 2 of the group's 16 members" in render_markdown(partial.report())


def test_straggler_of_a_dtprobe_run_says_it_used_the_host_clock():
    a = RunAnalysis.open(Path(__file__).parents[1] / "sample_traces" / "dp4_straggler_rank2")
    assert a.clock_alignment() == "host" and a.metrics()["run"]["clock_aligned"] == "host"
    [f] = a.stragglers()
    assert f.ranks == (2,) and f.evidence["clock"] == "host"
    assert "clock_alignment" not in a.metrics() and "arrivals" not in a.metrics()
