"""What the dashboard reads and computes at scale: a live refresh reads only the events lines appended since the
last one (spied on the store's readers), and when a source's analysis is slow the refreshed Overview comes back at
once with the previous analysis while a background thread re-analyzes, then shows the new one (what that thread
raised is shown); the Timeline reads its window's partitions; pages of a finished run show their own findings with
evidence rows without making the analysis find every finding (which findings the run reports, and at which
severity, come from its stored Overview, the evidence from the one facade method that finds them)."""

from __future__ import annotations

import dataclasses
import os
import threading
from pathlib import Path

import pytest
import streamlit
from streamlit.testing.v1 import AppTest

from dtprobe import summary_store
from dtprobe.analysis.facade import RunAnalysis
from dtprobe.dashboard import data
from dtprobe.dashboard.paths import ROOT_ENV, resolve_choice
from dtprobe.store import jsonl, reader
from dtprobe.synthetic import SyntheticRun, write_synthetic_run

APP = Path(__file__).resolve().parents[1] / "dashboard" / "app.py"
STRAGGLER_RANK = 2


@pytest.fixture(autouse=True)
def _fresh_streamlit(monkeypatch, tmp_path):
    streamlit.config.set_option("client.showErrorDetails", "full")
    streamlit.cache_data.clear()
    data.clear()
    monkeypatch.setenv(summary_store.CACHE_ENV, str(tmp_path.parent / f"{tmp_path.name}-user-cache"))
    yield
    data.clear()


class ReadSpy:
    """Every events read of the store: (file, first byte read, thread name); and every compacted file read."""

    def __init__(self, monkeypatch) -> None:
        self.events: list[tuple[str, int, str]] = []
        self.compacted: list[str] = []
        one, batched, files = jsonl.read_new_rows, jsonl.read_new_rows_batched, reader.read_files_at_once

        def read_new_rows(path, cursor, *args, **kwargs):
            self.events.append((Path(path).as_posix(), cursor.offset_bytes, threading.current_thread().name))
            return one(path, cursor, *args, **kwargs)

        def read_new_rows_batched(items, *args, **kwargs):
            self.events += [(Path(p).as_posix(), c.offset_bytes, threading.current_thread().name)
                            for p, c, _ in items]
            return batched(items, *args, **kwargs)

        def read_files(tables_dir, parts, *args, **kwargs):
            parts = list(parts)
            self.compacted += [p.path for p in parts]
            return files(tables_dir, parts, *args, **kwargs)

        monkeypatch.setattr(reader, "read_new_rows", read_new_rows)
        monkeypatch.setattr(reader, "read_new_rows_batched", read_new_rows_batched)
        monkeypatch.setattr(reader, "read_files_at_once", read_files)   # the reader's every compacted read

    def clear(self) -> None:
        self.events.clear()
        self.compacted.clear()


def _sizes(run_dir: Path) -> dict[str, int]:
    return {p.as_posix(): p.stat().st_size for p in (run_dir / "events").rglob("*.jsonl")}


def _app(root: Path, monkeypatch) -> AppTest:
    monkeypatch.setenv(ROOT_ENV, str(root))
    return AppTest.from_file(str(APP), default_timeout=240).run()


def _steps_metric(at: AppTest) -> str:
    return {m.label: m.value for m in at.metric}["steps"]


def test_live_refresh_reads_each_file_from_where_the_last_read_ended_when_a_step_is_appended(tmp_path, monkeypatch):
    run = SyntheticRun(tmp_path / "live", num_ranks=4, straggler_rank=1)
    run.write_steps(6)
    spy = ReadSpy(monkeypatch)
    source = resolve_choice(tmp_path, "live")
    assert data.load_overview(source).num_steps == 6
    before = _sizes(run.run_dir)
    spy.clear()
    run.write_steps(1)
    after = _sizes(run.run_dir)
    grown = {path for path in after if after[path] != before.get(path, 0)}
    assert data.load_overview(source).num_steps == 7
    read = {path: start for path, start, _ in spy.events}
    assert set(read) == grown  # every grown file is read, no other file
    assert read == {path: before.get(path, 0) for path in grown}  # from where the last read ended, not from 0
    assert spy.compacted == []
    spy.clear()
    assert data.load_overview(source).num_steps == 7  # nothing appended: nothing read
    assert spy.events == [] and spy.compacted == []


def test_slow_live_analysis_refreshes_at_once_with_the_steps_of_now_and_the_previous_findings(tmp_path,
                                                                                              monkeypatch):
    monkeypatch.setattr(data, "LIVE_BLOCK_S", 0.0)  # every analysis counts as slow
    run = SyntheticRun(tmp_path / "live", num_ranks=4, straggler_rank=1)
    run.write_steps(5)
    at = _app(tmp_path, monkeypatch)
    assert not at.exception and _steps_metric(at) == "5"
    monkeypatch.setattr(data, "LARGE_EVENTS_BYTES", 0)  # the run grew large: its slow re-analyses run behind
    source = resolve_choice(tmp_path, "live")
    gate = threading.Event()
    analyze = data.summary.analyze

    def held_analyze(*args, **kwargs):  # the background re-analysis waits until the refresh has been drawn
        if threading.current_thread().name.startswith("dtprobe-refresh-"):
            assert gate.wait(60)
        return analyze(*args, **kwargs)

    monkeypatch.setattr(data.summary, "analyze", held_analyze)
    spy = ReadSpy(monkeypatch)
    run.write_steps(2)
    at.run()
    # the steps' figures of now beside the previous analysis' findings, said so
    assert not at.exception and _steps_metric(at) == "7"
    assert any("Analyzing the newest rows in the background" in c.value and "analysis of 5 steps" in c.value
               for c in at.caption)
    assert any("STRAGGLER" in m.value and "ranks 1 " in m.value for m in at.markdown)
    gate.set()
    data.wait_for_refresh(source, 60)
    page_reads = {Path(path).parent.name for path, _, thread in spy.events if not thread.startswith("dtprobe-refresh-")}
    # the page tailed the steps and the ranks' per-step summaries (their group keys resolved by the groups rows)
    # alone; the raw rows were read behind it
    assert page_reads == {"steps", "comm_steps", "groups"}
    assert any(thread.startswith("dtprobe-refresh-") for _, _, thread in spy.events)
    spy.clear()
    run.write_steps(1)
    at.run()  # the 8 steps of now, the findings of the re-analysis of 7 steps; starts that of the newest one
    assert not at.exception and _steps_metric(at) == "8"
    assert any("analysis of 7 steps" in c.value for c in at.caption)
    data.wait_for_refresh(source, 60)
    at.run()
    assert _steps_metric(at) == "8"
    assert not any("analysis of 7 steps" in c.value for c in at.caption)
    page_reads = {Path(path).parent.name for path, _, thread in spy.events if not thread.startswith("dtprobe-refresh-")}
    assert page_reads == {"steps", "comm_steps"} and any(thread.startswith("dtprobe-refresh-")
                                                          for _, _, thread in spy.events)


@pytest.mark.parametrize("status", ["running", "finished"])
def test_a_slow_first_analysis_draws_the_steps_key_figures_at_once_then_the_findings(tmp_path, monkeypatch,
                                                                                    status):
    # a large run (live, or finished without a stored summary): its first analysis runs behind the first draw
    monkeypatch.setattr(data, "LARGE_EVENTS_BYTES", 0)
    write_synthetic_run(tmp_path / "run", num_ranks=4, num_steps=5, straggler_rank=STRAGGLER_RANK, status=status)
    source = resolve_choice(tmp_path, "run")
    gate = threading.Event()
    analyze = data.summary.analyze

    def held_analyze(*args, **kwargs):  # the background analysis waits until the page has been drawn
        if threading.current_thread().name.startswith("dtprobe-refresh-"):
            assert gate.wait(60)
        return analyze(*args, **kwargs)

    monkeypatch.setattr(data.summary, "analyze", held_analyze)
    spy = ReadSpy(monkeypatch)
    at = _app(tmp_path, monkeypatch)
    assert not at.exception, [e.message for e in at.exception]
    metrics = {m.label: m.value for m in at.metric}
    assert metrics["steps"] == "5" and metrics["step time"] != "-" and metrics["exposed comm"] == "-"
    assert any("key figures of its steps" in c.value for c in at.caption)
    assert not at.success and not at.warning and not at.error               # no health verdict yet
    drawn = {Path(path).parent.name for path, _, thread in spy.events if not thread.startswith("dtprobe-refresh-")}
    # the page read the steps and the ranks' per-step summaries alone: the communication share is known at once
    assert drawn == {"steps", "comm_steps", "groups"} and metrics["comm"] != "-"
    if status == "finished":
        assert data.overview_pending(source) and summary_store.load(source.path) is None
    gate.set()
    data.wait_for_refresh(source, 60)
    if status == "finished":
        assert summary_store.load(source.path) is not None                  # stored for the next start
    at.run()
    assert not at.exception
    assert not any("key figures of its steps" in c.value for c in at.caption)
    assert any("STRAGGLER" in m.value and f"ranks {STRAGGLER_RANK} " in m.value for m in at.markdown)
    analyzed = {m.label: m.value for m in at.metric}
    assert analyzed["exposed comm"] != "-" and analyzed["comm"] == metrics["comm"]   # the same steps' figure


def test_a_small_finished_run_without_a_summary_is_summarized_before_its_overview_is_drawn(tmp_path, monkeypatch):
    write_synthetic_run(tmp_path / "done", num_ranks=4, num_steps=5, straggler_rank=STRAGGLER_RANK)
    at = _app(tmp_path, monkeypatch)
    assert not at.exception and not any("key figures of its steps" in c.value for c in at.caption)
    assert any("STRAGGLER" in m.value for m in at.markdown)
    assert not data.overview_pending(resolve_choice(tmp_path, "done"))


def test_a_live_views_steps_only_store_goes_when_its_source_is_dropped_from_the_open_ones(tmp_path, monkeypatch):
    monkeypatch.setattr(data, "LARGE_EVENTS_BYTES", 0)
    monkeypatch.setattr(data, "MAX_SOURCES", 1)
    for name in ("live", "other"):
        write_synthetic_run(tmp_path / name, num_ranks=2, num_steps=3, status="running")
    live, other = resolve_choice(tmp_path, "live"), resolve_choice(tmp_path, "other")
    assert data.live_overview(live).pending                 # the first draw: the steps table alone, kept open
    data.wait_for_refresh(live, 60)
    assert str(live.path) in data._STEPS_ONLY
    data.load_overview(other)                                # the one source kept open now
    assert str(live.path) not in data._STEPS_ONLY and str(live.path) not in data._ENTRIES


def test_what_the_background_re_analysis_raised_is_shown_by_the_next_refresh(tmp_path, monkeypatch):
    monkeypatch.setattr(data, "LIVE_BLOCK_S", 0.0)
    run = SyntheticRun(tmp_path / "live", num_ranks=2)
    run.write_steps(3)
    at = _app(tmp_path, monkeypatch)
    assert _steps_metric(at) == "3"
    monkeypatch.setattr(data, "LARGE_EVENTS_BYTES", 0)
    stray = run.run_dir / "events" / "steps" / "rank00007.jsonl"  # a rank with events but no rank info
    stray.write_text('{"rank": 7, "step": 0, "start_ns": 1, "end_ns": 2}\n')
    at.run()  # starts the re-analysis, which fails
    data.wait_for_refresh(resolve_choice(tmp_path, "live"), 60)
    at.run()
    assert not at.exception
    errors = [e.value for e in at.error]
    assert len(errors) == 1 and "Cannot read live" in errors[0] and "rank 7" in errors[0], errors


def test_timeline_window_reads_only_the_partitions_of_its_steps_and_equals_the_analysis_rows(tmp_path,
                                                                                            monkeypatch):
    from dtprobe.analysis.derived_tables import deriver
    from dtprobe.store import compact

    run = write_synthetic_run(tmp_path / "r", num_ranks=4, num_steps=60, straggler_rank=2)
    compact(run, derive=deriver())
    source = resolve_choice(tmp_path, "r")
    analysis = data.load_analysis(source)
    spy = ReadSpy(monkeypatch)
    window, ranks = (41, 43), [1, 2]
    rows = data.load_window(source, analysis, ("steps", "collectives"), steps=window, ranks=ranks)
    # tables the analysis holds are cut in memory; any other is read from the partitions of steps 40-59 only
    assert all("step_block=2/" in path for path in spy.compacted)
    assert spy.events == []
    for name, keys in (("steps", ["rank", "step"]), ("collectives", ["rank", "pg", "seq"])):
        whole = analysis.table(name)
        expected = whole[whole["step"].between(*window) & whole["rank"].isin(ranks)]
        got = rows[name]
        assert len(got) == len(expected) > 0
        cols = [*keys, "start_ns" if name == "steps" else "enqueue_ns", "end_ns"]
        assert (got[cols].sort_values(keys).reset_index(drop=True)
                .equals(expected[cols].sort_values(keys).reset_index(drop=True)))
    spy.clear()
    again = data.load_window(source, analysis, ("steps", "collectives"), steps=window, ranks=ranks)
    assert spy.compacted == [] and again["collectives"].equals(rows["collectives"])  # cached per version

def test_a_finished_runs_rerun_reads_nothing_until_its_files_change(tmp_path, monkeypatch):
    run = write_synthetic_run(tmp_path / "done", num_ranks=4, num_steps=10, straggler_rank=STRAGGLER_RANK)
    source = resolve_choice(tmp_path, "done")
    first = data.load_analysis(source)
    store = data.open_store(source)
    refreshes = []
    original = store.refresh
    monkeypatch.setattr(store, "refresh", lambda: refreshes.append(1) or original())
    assert data.load_analysis(source) is first and refreshes == []        # a widget change: no events file read
    events = sorted((run / "events").rglob("*.jsonl"))[0]
    stat = events.stat()
    os.utime(events, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))   # a file of the run changed
    data.load_analysis(source)
    assert refreshes == [1]
    data.load_analysis(source)
    assert refreshes == [1]


@pytest.fixture
def finished_run(tmp_path) -> Path:
    run = write_synthetic_run(tmp_path / "dp4_straggler", num_ranks=4, num_steps=40, straggler_rank=STRAGGLER_RANK)
    summary_store.make(run)  # what `dtprobe run` leaves: the stored Overview
    return run


def _key(finding) -> tuple:
    return finding.code, tuple(int(r) for r in finding.ranks), finding.group, finding.severity


def test_a_finished_runs_pages_never_ask_the_analysis_for_every_finding(finished_run, tmp_path, monkeypatch):
    def every_finding(self):
        raise AssertionError("a page asked for every finding of a finished run with a stored Overview")

    monkeypatch.setattr(RunAnalysis, "findings", every_finding)
    monkeypatch.setenv(ROOT_ENV, str(tmp_path))
    at = AppTest.from_file(str(APP), default_timeout=240).run()
    assert not at.exception
    at.switch_page("views/stragglers.py").run()
    assert not at.exception, at.exception[0].message
    assert [e.label for e in at.expander if e.label.startswith("Evidence rows")]  # the evidence is there
    text = "\n".join(m.value for m in at.markdown)
    assert "STRAGGLER" in text and f"ranks {STRAGGLER_RANK} " in text
    for page in ("views/timeline.py", "views/communication.py"):
        at.switch_page(page).run()
        assert not at.exception, (page, at.exception[0].message)


def test_findings_with_evidence_are_the_analysis_findings_of_those_codes(finished_run, tmp_path):
    source = resolve_choice(tmp_path, "dp4_straggler")
    analysis = data.load_analysis(source)
    detectors = {"STRAGGLER": "stragglers", "EXPOSED_COMM": "exposed_comm", "COMM_INEFFICIENT": "comm_findings",
                 "COMPRESSION": "compression_findings", "HANG": "hangs", "RANK_CRASH": "hangs"}
    shown = data.findings_with_evidence(source, analysis, detectors)
    expected = [f for f in RunAnalysis.open(finished_run).findings() if f.code in detectors]
    assert [_key(f) for f in shown] == [_key(f) for f in expected] and shown
    straggler = next(f for f in shown if f.code == "STRAGGLER")
    assert straggler.rows is not None and not straggler.rows.empty


def test_a_line_its_detector_does_not_give_back_is_shown_alone_and_severity_follows_the_overview(finished_run,
                                                                                                 tmp_path):
    source = resolve_choice(tmp_path, "dp4_straggler")
    stored = data.load_overview(source)
    line = next(f for f in stored.findings if f.code == "STRAGGLER")
    other = dataclasses.replace(line, ranks=(3,), title="a straggler of other options")
    lowered = dataclasses.replace(line, severity="info")
    data._STORED[str(source.path)] = (data._stored_token(source),
                                      dataclasses.replace(stored, findings=(lowered, other)))
    shown = data.findings_with_evidence(source, data.load_analysis(source), {"STRAGGLER": "stragglers"})
    assert [(f.severity, hasattr(f, "rows")) for f in shown] == [("info", True), (line.severity, False)]
    assert shown[1] is other
