"""`dtprobe analyze`: output formats, the JSON document shape, exit codes 0/1/2, on runs written to disk."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from analysis_synth import MS, T0, dp_tables, pipeline_tables, write_run

from dtprobe.analysis import RunAnalysis
from dtprobe.cli import main
from dtprobe.store.frames import frame_from_rows

TRACES = Path(__file__).parent / "data" / "traces"
CONFIG = {"model": {"name": "tiny"}, "train": {"seq_len": 64}, "layout": {"dp": 4, "tp": 1, "pp": 1}}


@pytest.fixture(scope="module")
def straggler_run(tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("runs") / "dp4_straggler_rank2"
    return write_run(run, dp_tables(straggler=2, delay_ms=15, num_steps=21), world_size=4, config=CONFIG)


@pytest.fixture(scope="module")
def hang_run(tmp_path_factory) -> Path:
    t = dp_tables(num_steps=6)
    coll = t["collectives"]
    last = coll["seq"].max()
    coll = coll[~((coll["seq"] == last) & (coll["rank"] == 1))].copy()
    coll.loc[coll["seq"] == last, "end_ns"] = None  # the others wait in it: written at close, unfinished
    t["collectives"] = coll
    run = tmp_path_factory.mktemp("runs") / "dp4_hang_rank1"
    return write_run(run, t, world_size=4, config=CONFIG, status="crashed")


def _json(capsys, *argv) -> tuple[int, dict]:
    code = main(["analyze", *map(str, argv), "--format", "json"])
    return code, json.loads(capsys.readouterr().out)


def test_analyze_json_has_the_documented_shape_and_names_the_straggler(straggler_run, capsys):
    code, doc = _json(capsys, straggler_run)
    assert code == 0                                           # a 15 ms straggler is a warning, not critical
    assert list(doc)[:4] == ["schema", "source", "metrics", "findings"]
    assert doc["schema"] == "dtprobe.findings/1" and doc["source"] == str(straggler_run)
    [f] = doc["findings"]
    assert (f["code"], f["severity"], f["ranks"], f["group"]) == ("STRAGGLER", "warning", [2], "dp")
    assert set(f) == {"code", "severity", "ranks", "group", "title", "evidence", "recommendation", "predicted_gain"}
    assert f["predicted_gain"]["metric"] == "step_time" and 0 < f["predicted_gain"]["frac"] < 1
    m = doc["metrics"]
    assert m["steps_analyzed"] == {"first": 1, "last": 20, "count": 20, "skipped_warmup_steps": 1}
    assert m["throughput"]["mfu"] is None and "CPU" in m["throughput"]["mfu_reason"]
    assert {r["rank"] for r in m["comm_exposure"]} == {0, 1, 2, 3}


def test_analyze_exits_1_on_a_critical_hang_and_names_the_missing_rank(hang_run, capsys):
    code, doc = _json(capsys, hang_run)
    assert code == 1
    hangs = [f for f in doc["findings"] if f["code"] == "HANG"]
    assert [(f["ranks"], f["severity"]) for f in hangs] == [([1], "critical")]


@pytest.mark.parametrize("fmt,marker", [("text", "STRAGGLER"), ("md", "| warning | STRAGGLER | 2 | dp |")])
def test_analyze_text_and_markdown_show_the_findings_and_steps(straggler_run, capsys, fmt, marker):
    assert main(["analyze", str(straggler_run), "--format", fmt]) == 0
    out = capsys.readouterr().out
    assert marker in out and "1..20" in out


def test_analyze_writes_the_report_to_a_file(straggler_run, tmp_path, capsys):
    out = tmp_path / "f.json"
    assert main(["analyze", str(straggler_run), "--format", "json", "-o", str(out)]) == 0
    assert json.loads(out.read_text())["schema"] == "dtprobe.findings/1"


def test_analyze_exits_2_naming_a_path_that_is_neither_run_nor_traces(tmp_path, capsys):
    (tmp_path / "notes.txt").write_text("hi")
    assert main(["analyze", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert str(tmp_path) in err and "neither a dtprobe run" in err


def test_analyze_exits_2_on_a_run_without_events(tmp_path, capsys):
    run = write_run(tmp_path / "empty", {}, world_size=2)
    assert main(["analyze", str(run)]) == 2
    assert "holds no events" in capsys.readouterr().err


def test_analyze_reports_the_crash_of_workers_that_died_before_they_wrote_a_row(tmp_path, capsys):
    # a script given an argument it does not take exits 2 in argparse, before it attaches: the launcher's record
    # of the attempt is all the run holds, and it is what analyze reports (as `dtprobe launch` printed it)
    from dtprobe.store.manifest import record_attempt, set_status

    run = write_run(tmp_path / "argv", {}, world_size=2)
    ranks = [{"rank": r, "local_rank": r, "pid": 700 + r, "exit_code": 2, "signal": None, "first_failure": r == 1,
              "time_ns": T0 + r, "error": None,
              "stderr_tail": "usage: train.py [-h]\ntrain.py: error: unrecognized arguments: --steps 30"}
             for r in range(2)]
    record_attempt(run, {"attempt": 0, "node_rank": 0, "started_ns": T0 - 1, "ended_ns": T0 + 5, "result": "failed",
                         "ranks": ranks})
    set_status(run, "crashed")
    assert main(["analyze", str(run), "--format", "json"]) == 1       # a critical finding
    [f] = json.loads(capsys.readouterr().out)["findings"]
    assert (f["code"], f["severity"], f["ranks"], f["evidence"]["exit_code"]) == ("RANK_CRASH", "critical", [1], 2)
    assert f["evidence"]["stderr_tail"].endswith("--steps 30")
    assert 'exit code 2, its stderr ending "train.py: error: unrecognized arguments: --steps 30"' in f["title"]


def test_analyze_exits_2_naming_a_malformed_trace_file(capsys):
    assert main(["analyze", str(TRACES / "malformed")]) == 2
    assert "distributed_info_not_found.json.gz" in capsys.readouterr().err


def test_analyze_a_kineto_trace_folder_reports_temporal_breakdown_and_overlap(capsys):
    code, doc = _json(capsys, TRACES / "dlrm_8rank_v100")
    assert code == 0
    tb = {r["rank"]: r for r in doc["metrics"]["temporal_breakdown"]}
    assert sorted(tb) == list(range(8))
    assert set(tb[0]) == {"rank", "idle_frac", "compute_frac", "non_compute_frac", "kernel_time_us"}
    assert tb[0]["kernel_time_us"] == 13009 and tb[0]["idle_frac"] == pytest.approx(0.4934, abs=1e-3)  # HTA
    assert {r["rank"] for r in doc["metrics"]["comm_comp_overlap"]} == set(range(8))
    assert doc["metrics"]["run"]["clock_aligned"] == "device_collectives"   # Kineto records no offsets
    # 8 matched collectives, under the 20 a device-clock STRAGGLER verdict needs
    assert doc["metrics"]["collective_matching"]["num_matched"] == 8
    assert not [f for f in doc["findings"] if f["code"] == "STRAGGLER"]


def test_analyze_pipeline_run_reports_the_bubble_with_config_schedule(tmp_path, capsys):
    t = pipeline_tables(schedule="gpipe", pp=4, microbatches=4)
    run = write_run(tmp_path / "pp4", t, world_size=4,
                    config={"layout": {"dp": 1, "tp": 1, "pp": 4, "pp_schedule": "gpipe", "microbatches": 4}})
    code, doc = _json(capsys, run)
    [f] = [f for f in doc["findings"] if f["code"] == "PIPELINE_BUBBLE"]
    assert f["evidence"]["schedule_source"] == "config" and f["predicted_gain"]["frac"] > 0.15
    assert doc["metrics"]["pipeline"]["ideal_bubble_frac"] == pytest.approx(3 / 7, abs=1e-4)


def test_analyze_baseline_gives_the_compression_loss_gap(tmp_path, capsys):
    t = dp_tables(num_steps=8)
    base = write_run(tmp_path / "base", t, world_size=4, config=CONFIG)
    t2 = dict(t, steps=t["steps"].assign(loss=t["steps"]["loss"] * 1.1),
              compression=frame_from_rows("compression", [
                  {"rank": r, "step": s, "bucket": 0, "method": "fp16", "raw_bytes": 4 << 20, "sent_bytes": 2 << 20,
                   "encode_ns": MS // 10, "decode_ns": MS // 10} for r in range(4) for s in range(8)]))
    run = write_run(tmp_path / "fp16", t2, world_size=4, config=CONFIG)
    code, doc = _json(capsys, run, "--baseline", base)
    [f] = [f for f in doc["findings"] if f["code"] == "COMPRESSION"]
    assert f["evidence"]["ratio"] == 2.0 and f["evidence"]["loss_gap_frac"] == pytest.approx(0.1, abs=1e-6)
    assert f["severity"] == "warning"


def test_facade_exposes_metrics_and_evidence_rows(straggler_run):
    a = RunAnalysis.open(straggler_run)
    assert set(a.straggler_scores()["rank"]) == {0, 1, 2, 3}
    assert not a.collective_skew().empty and not a.rank_lateness().empty
    [f] = a.stragglers()
    rows = a.evidence_rows(f)
    assert set(rows["rank"]) == {0, 1, 2, 3} and "lateness_frac" in rows
    assert a.group_axis("world") == "dp"
    assert a.now_ns() >= T0


def test_facade_key_figures_and_findings_table(straggler_run):
    a = RunAnalysis.open(straggler_run)
    k = a.key_figures()
    assert k.num_steps == 21 and k.step_time_ms > 100 and k.tokens_per_s > 0          # steps recorded so far
    assert k.mfu is None and "CPU" in k.mfu_reason
    assert k.bubble_frac is None and k.num_overflows is None and k.checkpoint_share_frac is None
    table = a.findings_table()
    assert table[["code", "ranks", "group"]].values.tolist() == [["STRAGGLER", "2", "dp"]]
