"""The per-step frames kept at compaction (``store.derived`` + ``analysis.derived_tables``): the facade reads them
instead of computing lateness and exposure from the whole ``collectives`` table, with the same findings, key
figures and frames; they are ignored whenever they may no longer be the run's. Hang verdicts read only the rows
of unfinished collectives."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import orjson
import pandas as pd
import pytest

from dtprobe.analysis import RunAnalysis
from dtprobe.analysis.derived_tables import EXPOSURE, KEY, LATENESS, deriver
from dtprobe.analysis.hangs import missing_arrivals
from dtprobe.analysis.render import render_json
from dtprobe.store import RunStore, compact
from dtprobe.store.compaction import add_derived
from dtprobe.store.frames import conform, empty_frame
from dtprobe.store.resolve import open_source
from dtprobe.synthetic import (MS, T0, cuda_dp_tables, cut_rank, lockstep_tables, pending_row, stall_rank,
                               write_rows_run, write_run)
from test_sample_trace_findings import BASELINES, GOLDEN, SAMPLES, SCENARIOS, by_severity
from test_store_partitions import files_read  # noqa: F401 (a fixture: the compacted files the reader opens)

RESTARTED = {"ckpt_crash_restart": "a collective numbering restarts inside step block 0 (a torchrun restart)"}
"""Scenarios whose frames are not kept, and why: per-block numbering could differ from the whole run's."""


def compacted_copy(name: str, dest: Path) -> Path:
    run = dest / name
    shutil.copytree(SAMPLES / name, run)
    compact(run, derive=deriver())
    return run


def from_rows(store: RunStore) -> RunStore:
    """The same store with the derived frames hidden: the facade computes from the rows."""
    store.derived_table = lambda *args, **kwargs: None
    return store


def analyses(run: Path, baseline: Path | None) -> tuple[RunAnalysis, RunAnalysis]:
    # kept: opened as `dtprobe analyze` opens it (lazily: compacted files read on first use)
    kept = RunAnalysis(open_source(run), baseline=open_source(baseline) if baseline else None)
    raw = RunAnalysis(from_rows(RunStore.open(run)), baseline=RunStore.open(baseline) if baseline else None)
    return kept, raw


def described(analysis: RunAnalysis) -> list[dict]:
    return [f.to_json() for f in analysis.findings()]


@pytest.mark.parametrize("name", SCENARIOS)
def test_findings_and_key_figures_are_identical_with_and_without_derived_tables(name, tmp_path):
    run = compacted_copy(name, tmp_path)
    base = BASELINES.get(name)
    baseline = compacted_copy(base, tmp_path / "base") if base else None
    derived = orjson.loads((run / "tables" / "_compacted.json").read_bytes())["derived"]
    assert derived["key"] == KEY
    store = RunStore.open(run)
    if name in RESTARTED:
        assert derived["skipped"] == RESTARTED[name]
        assert store.derived_table(LATENESS, KEY) is None
    else:
        assert "skipped" not in derived
        assert store.derived_table(LATENESS, KEY) is not None and store.derived_table(EXPOSURE, KEY) is not None
    kept, raw = analyses(run, baseline)
    pd.testing.assert_frame_equal(kept.rank_lateness(), raw.rank_lateness())
    pd.testing.assert_frame_equal(kept.comm_exposure(), raw.comm_exposure())
    pd.testing.assert_frame_equal(kept.collective_bandwidth(), raw.collective_bandwidth())
    assert described(kept) == described(raw)
    for a, b in zip(kept.findings(), raw.findings()):
        pd.testing.assert_frame_equal(kept.evidence_rows(a), raw.evidence_rows(b))
    assert kept.key_figures() == raw.key_figures()
    assert render_json(kept.report()) == render_json(raw.report())     # every metric of `analyze --format json`
    got = [(f.code, f.severity, f.ranks, f.group) for f in kept.findings()]
    assert by_severity(got) == by_severity(GOLDEN[name])


def test_lateness_rows_of_straggler_scenario_come_from_the_derived_files(tmp_path):
    run = compacted_copy("dp4_straggler_rank2", tmp_path)
    kept = RunStore.open(run).derived_table(LATENESS, KEY)
    assert len(kept) == 120 and set(kept["rank"]) == {0, 1, 2, 3}     # 4 ranks x 30 steps, warm-up included
    assert RunAnalysis(RunStore.open(run)).rank_lateness()["step"].min() == 1   # the facade drops the warm-up
    window = RunStore.open(run).derived_table(LATENESS, KEY, steps=(18, 21))     # across the block boundary
    pd.testing.assert_frame_equal(window, kept[kept["step"].between(18, 21)].reset_index(drop=True))
    late = kept[kept["step"] >= 1].groupby("rank")["lateness_ns"].median()
    assert late.idxmax() == 2 and late[2] > 150e6                     # 200 ms sleep on rank 2


def test_derived_tables_are_ignored_after_an_events_line_is_appended(tmp_path):
    run = compacted_copy("dp4_clean", tmp_path)
    assert RunStore.open(run).derived_table(LATENESS, KEY) is not None
    events = run / "events" / "faults" / "rank00000.jsonl"
    events.parent.mkdir(parents=True, exist_ok=True)
    events.write_text('{"rank": 0, "time_ns": 1, "kind": "note"}\n')
    assert RunStore.open(run).derived_table(LATENESS, KEY) is None


def test_derived_tables_are_ignored_under_another_key_or_a_tail_open(tmp_path):
    run = compacted_copy("dp4_clean", tmp_path)
    assert RunStore.open(run).derived_table(LATENESS, {**KEY, "version": KEY["version"] + 1}) is None
    assert RunStore.open(run, tail_steps=5).derived_table(LATENESS, KEY) is None


def test_derived_tables_are_absent_when_compacted_without_a_deriver(tmp_path):
    run = tmp_path / "dp4_clean"
    shutil.copytree(SAMPLES / "dp4_clean", run)
    compact(run)
    assert "derived" not in orjson.loads((run / "tables" / "_compacted.json").read_bytes())
    assert RunStore.open(run).derived_table(LATENESS, KEY) is None
    assert not (run / "tables" / "derived").exists()


def _collective(rank: int, seq: int, step: int) -> dict:
    return {"rank": rank, "pg": "world", "pg_ranks": "0,1", "pg_size": 2, "seq": seq, "op": "allreduce",
            "num_bytes": 4, "enqueue_ns": 1000 * seq + rank, "end_ns": 1000 * seq + 500, "step": step, "restart": 0}


def _frames(rows: list[dict]) -> dict[str, pd.DataFrame]:
    return {"collectives": conform(pd.DataFrame(rows), "collectives"),
            "pending": empty_frame("pending"), "steps": empty_frame("steps")}


def test_a_collective_split_between_step_blocks_makes_the_derived_tables_invalid():
    d = deriver()
    d.derive(0, _frames([_collective(0, 1, 18), _collective(1, 1, 18), _collective(0, 2, 19)]))
    d.derive(1, _frames([_collective(1, 2, 20), _collective(0, 3, 20), _collective(1, 3, 20)]))
    assert d.invalid_reason() == ("collective seq 2 of group 'world' has rows in step blocks [0, 1] (ranks were "
                                  "at different steps in it)")
    whole = deriver()
    whole.derive(0, _frames([_collective(0, 1, 18), _collective(1, 1, 18)]))
    whole.derive(1, _frames([_collective(0, 3, 20), _collective(1, 3, 20)]))
    assert whole.invalid_reason() is None


def test_scale_run_straggler_is_named_with_the_same_figures_from_derived_tables(tmp_path, repo_root):
    run = tmp_path / "s64"
    subprocess.run([sys.executable, str(repo_root / "benchmarks" / "scale_data.py"), "run", str(run), "--ranks", "64",
                    "--steps", "40"], check=True, timeout=120, capture_output=True)
    compact(run, derive=deriver())
    kept, raw = analyses(run, None)
    [late] = [f for f in kept.findings() if f.code == "STRAGGLER"]
    assert late.ranks == (35,) and late.group == "dp"                 # scale_data's default: ranks // 2 + 3
    assert described(kept) == described(raw)
    pd.testing.assert_frame_equal(kept.collective_bandwidth(), raw.collective_bandwidth())
    # per step: 60 collectives on each of the 8 tp groups, 40 on each of the 8 dp groups
    assert kept.collective_bandwidth().groupby("pg").size().to_dict() == {"tp": 40 * 60 * 8, "dp": 40 * 40 * 8}
    assert render_json(kept.report()) == render_json(raw.report())     # every metric of `analyze --format json`
    assert late.evidence["mean_lateness_ms"] == pytest.approx(80, rel=0.05)


def test_hang_verdict_reads_only_the_rows_of_unfinished_collectives():
    analysis = RunAnalysis.open(SAMPLES / "hang_rank1")
    rows = analysis.unfinished_collectives()
    assert set(rows["seq"]) == {11} and rows["end_ns"].isna().any()      # the all-reduce rank 1 never reached
    assert len(rows) < len(analysis.table("collectives")) / 10
    whole = missing_arrivals(analysis.host_collective_skew(), analysis.table("collectives"),
                             now_ns=analysis.now_ns(), min_wait_ns=0)
    pd.testing.assert_frame_equal(analysis.missing_arrivals(), whole)
    assert whole["missing_ranks"].tolist() == ["1"]


def test_no_rows_are_unfinished_in_a_clean_run():
    analysis = RunAnalysis.open(SAMPLES / "dp4_clean")
    assert analysis.unfinished_collectives().empty and analysis.missing_arrivals().empty


def test_derived_tables_are_added_to_a_run_compacted_without_them(tmp_path):
    run = tmp_path / "dp4_straggler_rank2"
    shutil.copytree(SAMPLES / "dp4_straggler_rank2", run)
    compact(run)                                                       # as the launcher of `dtprobe run` does
    assert add_derived(run, deriver()) is True
    assert add_derived(run, deriver()) is False                        # already there under the same key
    assert RunStore.open(run).derived_table(LATENESS, KEY) is not None
    kept, raw = analyses(run, None)
    assert described(kept) == described(raw) and [f.code for f in kept.findings()] == ["STRAGGLER"]


def test_derived_tables_are_not_added_to_a_run_that_changed_since_its_compaction(tmp_path):
    run = tmp_path / "dp4_clean"
    shutil.copytree(SAMPLES / "dp4_clean", run)
    compact(run)
    (run / "events" / "faults").mkdir(parents=True)
    (run / "events" / "faults" / "rank00000.jsonl").write_text('{"rank": 0, "time_ns": 1, "kind": "note"}\n')
    assert add_derived(run, deriver()) is False
    assert not (run / "tables" / "derived").exists()


def test_dtprobe_compact_writes_the_derived_tables(tmp_path, run_cli):
    run = tmp_path / "dp4_clean"
    shutil.copytree(SAMPLES / "dp4_clean", run)
    shutil.rmtree(run / "tables" / "derived", ignore_errors=True)
    result = run_cli("compact", run)
    assert result.returncode == 0, result.stderr
    derived = orjson.loads((run / "tables" / "_compacted.json").read_bytes())["derived"]
    assert derived["key"] == KEY and derived["tables"][LATENESS]["rows"] == 120


def test_analyze_says_when_a_large_compacted_run_lacks_this_dtprobes_derived_tables(tmp_path, monkeypatch, capsys):
    from dtprobe.cli import main as cli_main
    from dtprobe.commands import compact as compact_command

    run = tmp_path / "dp4_straggler_rank2"
    shutil.copytree(SAMPLES / "dp4_straggler_rank2", run)
    compact(run)                                                       # compacted by the API alone: none written
    rows = RunStore.open(run).num_rows()["collectives"]

    def hint_of_analyze() -> str:
        cli_main(["analyze", str(run), "--format", "json"])
        return capsys.readouterr().err

    assert "hold no derived tables" not in hint_of_analyze()           # below DERIVED_HINT_ROWS: said nowhere
    monkeypatch.setattr(compact_command, "DERIVED_HINT_ROWS", rows)    # the run counts as large
    err = hint_of_analyze()
    assert (f"{run}: its compacted tables hold no derived tables of this dtprobe, so every analysis derives them "
            f"from all {rows:,} collective rows; `dtprobe compact {run}` adds them once, and later analyses read "
            f"them.\n") in err
    assert add_derived(run, deriver()) is True
    assert "hold no derived tables" not in hint_of_analyze()
    marker = run / "tables" / "_compacted.json"                        # written by a dtprobe whose deriver differs
    doc = orjson.loads(marker.read_bytes())
    doc["derived"]["key"] = {**KEY, "version": KEY["version"] - 1}
    marker.write_bytes(orjson.dumps(doc))
    assert "hold no derived tables" in hint_of_analyze()


def _compacted(run: Path) -> Path:
    compact(run, derive=deriver())
    assert "skipped" not in orjson.loads((run / "tables" / "_compacted.json").read_bytes())["derived"]
    return run


@pytest.mark.parametrize("clock", ["device", "host"])
def test_a_cuda_run_over_three_step_blocks_gives_the_same_frames_and_findings(tmp_path, clock):
    tables = cuda_dp_tables(clock=clock, num_steps=50, straggler=2, delay_ms=15.0)
    run = _compacted(write_run(tmp_path / clock, tables, world_size=4, config={"layout": {"dp": 4, "tp": 1, "pp": 1}}))
    kept, raw = analyses(run, None)
    assert sorted(kept.rank_lateness()["step"].unique()) == list(range(1, 50))
    pd.testing.assert_frame_equal(kept.rank_lateness(), raw.rank_lateness())
    pd.testing.assert_frame_equal(kept.comm_exposure(), raw.comm_exposure())
    pd.testing.assert_frame_equal(kept.collective_bandwidth(), raw.collective_bandwidth())
    assert described(kept) == described(raw)
    stragglers = [f.ranks for f in kept.findings() if f.code == "STRAGGLER"]
    assert stragglers == ([(2,)] if clock == "device" else [])      # the slow GPU shows on the device clock only


def test_a_hung_run_with_pending_rows_gives_the_same_frames_and_findings(tmp_path):
    rows = lockstep_tables(world=2, num_steps=30)
    cut_rank(rows, 1, T0 + 2_530 * MS)
    stall_rank(rows, 0, T0 + 2_560 * MS, until_ns=T0 + 12_600 * MS, close=("crashed", "watchdog"))
    rows["pending"] = [pending_row(0, step=25, seq=26, t_ns=T0 + 2_560 * MS)]
    run = _compacted(write_rows_run(tmp_path / "run", rows, world_size=2, status="crashed"))
    kept, raw = analyses(run, None)
    pd.testing.assert_frame_equal(kept.rank_lateness(), raw.rank_lateness())
    pd.testing.assert_frame_equal(kept.comm_exposure(), raw.comm_exposure())
    pd.testing.assert_frame_equal(kept.collective_bandwidth(), raw.collective_bandwidth())
    assert described(kept) == described(raw)
    [hang] = [f for f in kept.findings() if f.code == "HANG"]
    assert hang.ranks == (1,) and hang.evidence["step"] == 25


def test_a_run_interrupted_inside_its_second_step_block_gives_the_same_frames_and_findings(tmp_path):
    # the last step has collectives but no steps row (SIGTERM mid-step): its block's exposure types step_ns float,
    # the first block's int; read together they are the whole run's frame
    rows = lockstep_tables(world=2, num_steps=30)
    rows["steps"] = [r for r in rows["steps"] if r["step"] != 29]
    run = _compacted(write_rows_run(tmp_path / "run", rows, world_size=2, status="crashed"))
    kept, raw = analyses(run, None)
    exposure = kept.comm_exposure()
    assert sorted(exposure["step"].unique()) == list(range(30)) and exposure["step_ns"].isna().sum() == 2
    pd.testing.assert_frame_equal(exposure, raw.comm_exposure())
    pd.testing.assert_frame_equal(kept.rank_lateness(), raw.rank_lateness())
    assert described(kept) == described(raw) and kept.key_figures() == raw.key_figures()


def test_lazy_open_reads_no_compacted_file_and_lateness_exposure_bandwidth_read_no_collectives(tmp_path, files_read):
    # what the derived tables save: a run opened as `dtprobe analyze` opens it reads a compacted file only when a
    # table is asked for, and lateness, exposure and bandwidth (the inputs of STRAGGLER, EXPOSED_COMM,
    # COMM_INEFFICIENT and SLOW_LINK) never ask for `collectives`
    run = compacted_copy("dp4_straggler_rank2", tmp_path)
    read = files_read
    read.clear()                                        # what the compaction itself read back
    store = open_source(run)
    assert [r for r in read if not r.startswith("groups")] == []
    assert store.num_rows()["collectives"] > 0          # counted from the marker, not read
    analysis = RunAnalysis(store)
    lateness, exposure, bandwidth = analysis.rank_lateness(), analysis.comm_exposure(), analysis.collective_bandwidth()
    assert not lateness.empty and not exposure.empty
    assert len(bandwidth) == 32                         # an all-reduce per step (30), 2 broadcasts
    assert read and not [r for r in read if "collectives" in r]
    store.table("collectives")
    assert [r for r in read if "collectives" in r]      # the spy sees the collectives' files when they are read
    raw = RunAnalysis(from_rows(RunStore.open(run)))
    pd.testing.assert_frame_equal(lateness, raw.rank_lateness())
    pd.testing.assert_frame_equal(exposure, raw.comm_exposure())
    pd.testing.assert_frame_equal(bandwidth, raw.collective_bandwidth())
