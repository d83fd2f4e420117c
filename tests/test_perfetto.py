"""`dtprobe export perfetto`: one Chrome-trace JSON timeline of every rank (steps, phases, collectives, pipeline,
checkpoints, faults, device counters, the launcher's record of each rank's exit) on the store's aligned clock."""

from __future__ import annotations

import json
from collections import Counter

from analysis_synth import MS, T0, dp_tables, pipeline_tables, write_run

from dtprobe.analysis.perfetto import build_trace, export_perfetto
from dtprobe.cli import main
from dtprobe.store import RunStore
from dtprobe.store.frames import frame_from_rows


def test_export_perfetto_writes_valid_json_with_expected_event_counts(tmp_path, capsys):
    t = dp_tables(num_steps=5, num_buckets=3)
    t["faults"] = frame_from_rows("faults", [{"rank": 2, "time_ns": T0 + MS, "step": 0, "kind": "straggler",
                                              "injected": True, "detail": '{"delay_ms": 40}'}])
    run = write_run(tmp_path / "run", t, world_size=4)
    out = tmp_path / "merged.json"
    assert main(["export", "perfetto", str(run), "-o", str(out)]) == 0
    trace = json.loads(out.read_text())
    events = trace["traceEvents"]
    ph = Counter(e["ph"] for e in events)
    assert ph["b"] == ph["e"] == 4 * 5 * 3                    # every collective of every rank, begin + end
    assert ph["X"] == 4 * 5 * (1 + 4)                         # steps + 4 phases each
    assert ph["C"] == 4 * 5                                   # one util sample per rank and step
    assert ph["i"] == 1
    names = {e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "process_name"}
    assert names == {"rank 0 (h)", "rank 1 (h)", "rank 2 (h)", "rank 3 (h)"}
    assert min(e["ts"] for e in events if "ts" in e) == 0.0   # microseconds from the run's first event
    assert trace["metadata"]["t0_unix_ns"] == T0


def test_perfetto_phases_follow_each_other_from_the_step_start():
    t = dp_tables(num_steps=1, jitter_ms=0.0)
    trace, counts = build_trace({"steps": t["steps"]})
    r0 = [e for e in trace["traceEvents"] if e.get("pid") == 0 and e.get("tid") == 2 and e["ph"] == "X"]
    assert [e["name"] for e in r0] == ["data", "fwd", "bwd", "opt"]
    assert r0[1]["ts"] == r0[0]["ts"] + r0[0]["dur"]
    assert counts["phases"] == 16


def test_perfetto_has_pipeline_actions_per_stage(tmp_path):
    t = pipeline_tables(pp=2, microbatches=2, num_steps=2)
    run = write_run(tmp_path / "pp", t, world_size=2)
    summary = export_perfetto(RunStore.open(run), tmp_path / "pp.json")
    assert summary.counts["pipeline"] == 2 * 2 * 2 * 2       # steps x ranks x microbatches x {F, B}
    pipe = [e for e in json.loads((tmp_path / "pp.json").read_text())["traceEvents"]
            if e.get("tid") == 3 and e["ph"] == "X"]
    assert {e["name"] for e in pipe} == {"F0", "F1", "B0", "B1"}


def test_the_launchers_record_of_each_ranks_exit_is_an_instant_event_also_when_no_rank_wrote_a_row(tmp_path):
    # rank 1 exited 2 in argparse before its probe attached; the agent then SIGTERMed rank 0: no table has a row,
    # and the timeline still shows both ends, the first failure named, its stderr's last lines in the args
    from dtprobe.synthetic import write_rows_run

    attempts = [{"attempt": 0, "node_rank": 0, "started_ns": T0, "ended_ns": T0 + 900 * MS, "result": "failed",
                 "ranks": [
                     {"rank": 0, "local_rank": 0, "pid": 100, "exit_code": None, "signal": "SIGTERM",
                      "first_failure": False, "time_ns": T0 + 800 * MS, "error": None},
                     {"rank": 1, "local_rank": 1, "pid": 101, "exit_code": 2, "signal": None,
                      "first_failure": True, "time_ns": T0 + 500 * MS, "error": None,
                      "stderr_tail": "train.py: error: unrecognized arguments: --steps 30"}]}]
    run = write_rows_run(tmp_path / "run", {}, world_size=2, status="crashed", attempts=attempts)
    summary = export_perfetto(RunStore.open(run), tmp_path / "t.json")
    events = json.loads((tmp_path / "t.json").read_text())["traceEvents"]
    exits = sorted((e for e in events if e["ph"] == "i"), key=lambda e: e["pid"])
    assert [(e["pid"], e["name"], e["ts"]) for e in exits] == [
        (0, "exit: SIGTERM", 300_000.0), (1, "exit: exit code 2 (first failure)", 0.0)]
    assert exits[1]["args"]["stderr_tail"].endswith("--steps 30") and exits[1]["args"]["attempt"] == 0
    assert summary.counts["exits"] == 2
    assert {e["args"]["name"] for e in events if e["name"] == "thread_name" and e["pid"] == 1} >= {"exits"}
