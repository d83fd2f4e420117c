"""Every crash and restart heads the report: `dtprobe analyze` (text, md, json ``metrics.run``) and the dashboard's
Overview show the same line for each, on the sample run whose rank 1 crashed and was restarted."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
from rich.console import Console
from streamlit.testing.v1 import AppTest

from dtprobe.dashboard.paths import ROOT_ENV
from dtprobe.analysis import RunAnalysis
from dtprobe.cli import main as cli_main
from dtprobe.commands.analyze import render_text
from dtprobe.summary_store import CACHE_ENV


@pytest.fixture
def crash_run(sample_traces_dir) -> Path:
    """The sample run whose rank 1 died at step 15 and whose job restarted once."""
    return sample_traces_dir / "ckpt_crash_restart"


def _crash_title(run_dir: Path) -> str:
    [f] = [f for f in RunAnalysis.open(run_dir).findings() if f.code == "RANK_CRASH"]
    return f.title


def test_analyze_names_the_crash_and_its_restart_first_in_every_format(capsys, crash_run):
    title = _crash_title(crash_run)
    assert title.startswith("rank 1 died at step 15") and "the job restarted (attempt 1) from step 15" in title
    cli_main(["analyze", str(crash_run), "--format", "json"])
    run = json.loads(capsys.readouterr().out)["metrics"]["run"]
    assert [(c["rank"], c["step"], c["recovered"], c["title"]) for c in run["crashes"]] == [(1, 15, True, title)]
    assert [(r["restart"], r["from_step"], r["checkpoint_step"], r["steps_lost"]) for r in run["restarts"]] == [
        (1, 15, 14, 0)]
    cli_main(["analyze", str(crash_run), "--format", "md"])
    md = capsys.readouterr().out.splitlines()
    assert md[3] == f"- **crash: {title}**"          # right under the source line, before the facts
    out = io.StringIO()
    render_text(RunAnalysis.open(crash_run).report(), Console(file=out, width=400))
    text = out.getvalue()
    assert f"crash: {title}" in text and text.index("crash:") < text.index("finding(s), worst first")


def test_overview_heads_the_page_with_the_crash_line(monkeypatch, tmp_path, crash_run, repo_root):
    monkeypatch.setenv(ROOT_ENV, str(crash_run))
    monkeypatch.setenv(CACHE_ENV, str(tmp_path))  # no summary stored by another test: the Overview is made here
    at = AppTest.from_file(str(repo_root / "dashboard" / "app.py"), default_timeout=240).run()
    assert not at.exception, [e.message for e in at.exception]
    crash_lines = [m.value for m in at.markdown if "[crash]**" in m.value]
    assert crash_lines == [f"**:orange[crash]** {_crash_title(crash_run)}"]


def _without_crash_findings(monkeypatch) -> None:
    """The sample's restart with no RANK_CRASH behind it (as after a hang the watchdog ended)."""
    hangs = RunAnalysis.hangs
    monkeypatch.setattr(RunAnalysis, "hangs", lambda self: [f for f in hangs(self) if f.code != "RANK_CRASH"])


def test_a_restart_no_crash_tells_heads_the_report_and_the_overview(monkeypatch, tmp_path, crash_run,
                                                                   repo_root):
    from dtprobe.overview import Overview, summarize

    line = "restart 1: the job restarted from step 15, 0 step(s) lost"
    assert summarize(RunAnalysis.open(crash_run), path=str(crash_run)).restarts == ()       # the crash title tells it
    _without_crash_findings(monkeypatch)
    overview = summarize(RunAnalysis.open(crash_run), path=str(crash_run))
    assert overview.restarts == (line,)
    assert Overview.from_json(overview.to_json()).restarts == (line,)
    out = io.StringIO()
    render_text(RunAnalysis.open(crash_run).report(), Console(file=out, width=400))
    assert line in out.getvalue()
    monkeypatch.setenv(ROOT_ENV, str(crash_run))
    monkeypatch.setenv(CACHE_ENV, str(tmp_path))  # no summary stored by another test: the Overview is made here
    at = AppTest.from_file(str(repo_root / "dashboard" / "app.py"), default_timeout=240).run()
    assert not at.exception, [e.message for e in at.exception]
    assert [m.value for m in at.markdown if "[restart]**" in m.value] == [f"**:orange[restart]** {line}"]


def test_a_run_stopped_by_an_interrupt_says_so_unless_a_node_failed_in_its_last_attempt():
    from dtprobe.analysis.render import event_lines
    from dtprobe.analysis.report import interrupted_attempt

    ended = [{"attempt": 0, "node_rank": 0, "result": "failed"},
             {"attempt": 1, "node_rank": 0, "result": "interrupted"},
             {"attempt": 1, "node_rank": 1, "result": "interrupted"}]
    assert interrupted_attempt(ended, status="crashed")
    assert not interrupted_attempt(ended[:2] + [{"attempt": 1, "node_rank": 1, "result": "failed"}], status="crashed")
    assert not interrupted_attempt(ended[:1], status="crashed") and not interrupted_attempt([], status="crashed")
    assert not interrupted_attempt(ended, status="running")            # a restart caused by another node
    run = {"crashes": [], "restarts": [], "interrupted": True}
    assert event_lines({"metrics": {"run": run}}) == [
        "interrupted: the launcher was stopped (Ctrl-C or SIGTERM) and ended the workers of its last attempt, in "
        "which no rank had failed"]
    assert event_lines({"metrics": {"run": {**run, "interrupted": False}}}) == []


def test_an_interrupted_launcher_heads_the_overview(monkeypatch, tmp_path, crash_run, repo_root):
    from dtprobe.analysis.render import INTERRUPTED
    from dtprobe.overview import Overview, summarize

    assert not summarize(RunAnalysis.open(crash_run), path=str(crash_run)).interrupted   # its last attempt succeeded
    monkeypatch.setattr(RunAnalysis, "attempts", lambda self: [{"attempt": 0, "node_rank": 0, "result": "failed"},
                                                               {"attempt": 1, "node_rank": 0, "result": "interrupted"}])
    overview = summarize(RunAnalysis.open(crash_run), path=str(crash_run))
    assert overview.interrupted and Overview.from_json(overview.to_json()).interrupted
    monkeypatch.setenv(ROOT_ENV, str(crash_run))
    monkeypatch.setenv(CACHE_ENV, str(tmp_path))  # no summary stored by another test: the Overview is made here
    at = AppTest.from_file(str(repo_root / "dashboard" / "app.py"), default_timeout=240).run()
    assert not at.exception, [e.message for e in at.exception]
    assert [m.value for m in at.markdown if "[interrupted]**" in m.value] == [f"**:blue[interrupted]** {INTERRUPTED}"]
