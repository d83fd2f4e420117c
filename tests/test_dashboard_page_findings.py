"""Pages of a finished run show their own findings with evidence rows without making the analysis find every
finding: which findings the run reports (and at which severity) comes from its stored Overview, the evidence from
the one facade method that finds them."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import streamlit
from streamlit.testing.v1 import AppTest

from dtprobe import summary_store
from dtprobe.analysis.facade import RunAnalysis
from dtprobe.dashboard import data
from dtprobe.dashboard.paths import ROOT_ENV, resolve_choice
from dtprobe.synthetic import write_synthetic_run

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
    data._STORED[str(source.path)] = (data._files_token(source),
                                      dataclasses.replace(stored, findings=(lowered, other)))
    shown = data.findings_with_evidence(source, data.load_analysis(source), {"STRAGGLER": "stragglers"})
    assert [(f.severity, hasattr(f, "rows")) for f in shown] == [("info", True), (line.severity, False)]
    assert shown[1] is other
