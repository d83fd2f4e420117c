"""The analysis results kept beside a stored summary (``dtprobe.analysis.kept``, ``summary_store.load_kept``): a
finished source's analysis reads them back equal to what it computes, only while the source and the options are
those they were made under, and computes again whatever cannot be read."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pandas as pd
import pytest

from dtprobe import summary_store
from dtprobe.analysis import RunAnalysis
from dtprobe.analysis import comm_efficiency as comm_module
from dtprobe.analysis import exposed_comm as exposed_module
from dtprobe.analysis import kept
from dtprobe.analysis import links as links_module
from dtprobe.analysis import straggler_causes as causes_module
from dtprobe.analysis import straggler_scores as scores_module
from dtprobe.analysis import stragglers as stragglers_module
from dtprobe.analysis.options import AnalysisOptions
from dtprobe.store.resolve import open_source
from test_analysis_slow_link import _two_node_run, two_node_tables
from test_sample_trace_findings import SAMPLES


@pytest.fixture
def straggler_run(tmp_path, monkeypatch):
    monkeypatch.setenv(summary_store.CACHE_ENV, str(tmp_path / "cache"))
    run = tmp_path / "dp4_straggler_rank2"
    shutil.copytree(SAMPLES / "dp4_straggler_rank2", run)
    summary_store.make(run)
    return run.resolve()


def _no_compute(monkeypatch) -> None:
    """Computing the kept results fails from here on: what follows can only have read them."""
    def refuse(*args, **kwargs):
        raise AssertionError("computed, not read from the kept results")
    monkeypatch.setattr(scores_module, "straggler_scores", refuse)
    monkeypatch.setattr(causes_module, "straggler_causes", refuse)
    monkeypatch.setattr(stragglers_module, "detect_stragglers", refuse)
    monkeypatch.setattr(links_module, "find_slow_links", refuse)
    monkeypatch.setattr(comm_module, "bandwidth_by_size", refuse)
    monkeypatch.setattr(comm_module, "latency_bandwidth_fit", refuse)
    monkeypatch.setattr(exposed_module, "exposure_by_rank", refuse)


def _reading(run: Path) -> RunAnalysis:
    analysis = RunAnalysis(open_source(run))
    analysis.use_kept(summary_store.load_kept(run))
    return analysis


def _assert_same_findings(read: list, computed: list) -> None:
    assert [f.to_json() for f in read] == [f.to_json() for f in computed]
    for r, c in zip(read, computed):
        assert (r.rows is None) == (c.rows is None)
        if c.rows is not None:
            pd.testing.assert_frame_equal(r.rows, c.rows)


def test_a_finished_runs_straggler_scores_and_findings_are_read_back_equal_to_computed(straggler_run, monkeypatch):
    folder = straggler_run / "summary.kept"
    assert json.loads((folder / kept.INDEX).read_text())["path"] == str(straggler_run)
    computed = RunAnalysis(open_source(straggler_run))
    scores, causes, found = computed.straggler_scores(), computed.straggler_causes(), computed.stragglers()
    assert [(f.code, f.ranks) for f in found] == [("STRAGGLER", (2,))] and found[0].rows is not None
    by_size, fit, exposure = computed.bandwidth_by_size(), computed.bandwidth_fit(), computed.exposure_by_rank()
    assert fit is None and not by_size.empty and not exposure.empty   # one message size: no fit, read back as none
    _no_compute(monkeypatch)
    read = _reading(straggler_run)
    pd.testing.assert_frame_equal(read.straggler_scores(), scores)
    pd.testing.assert_frame_equal(read.straggler_causes(), causes)
    _assert_same_findings(read.stragglers(), found)
    assert read.slow_links() == []
    pd.testing.assert_frame_equal(read.bandwidth_by_size(), by_size)
    pd.testing.assert_frame_equal(read.exposure_by_rank(), exposure)
    assert read.bandwidth_fit() == fit


def test_slow_link_findings_and_their_rows_are_kept_too(tmp_path, monkeypatch):
    monkeypatch.setenv(summary_store.CACHE_ENV, str(tmp_path / "cache"))
    run = _two_node_run(tmp_path, two_node_tables(ranks_per_node=2, num_steps=50)).resolve()
    summary_store.make(run)
    computed = RunAnalysis(open_source(run))
    links, found = computed.slow_links(), computed.stragglers()
    assert [(f.code, f.evidence["changed_at_step"]) for f in links] == [("SLOW_LINK", 20)] and found == []
    _no_compute(monkeypatch)
    read = _reading(run)
    _assert_same_findings(read.slow_links(), links)
    assert read.stragglers() == []


def test_kept_results_of_another_state_or_other_options_are_never_read(straggler_run, monkeypatch):
    assert summary_store.load_kept(straggler_run) is not None
    assert summary_store.load_kept(straggler_run, options=AnalysisOptions(window_steps=10)) is None
    moved = straggler_run.parent / "moved"
    shutil.copytree(straggler_run, moved)       # same files, another folder: its own summary, not this one's
    assert summary_store.load_kept(moved) is None
    steps = straggler_run / "tables" / "steps.parquet"
    os.utime(steps, ns=(steps.stat().st_atime_ns, steps.stat().st_mtime_ns + 1_000_000))
    assert summary_store.load_kept(straggler_run) is None
    monkeypatch.setattr(scores_module, "straggler_scores", lambda *a, **k: pd.DataFrame({"computed": [1]}))
    assert list(_reading(straggler_run).straggler_scores().columns) == ["computed"]


def test_a_damaged_kept_file_is_computed_again_and_the_others_still_read(straggler_run, monkeypatch):
    folder = straggler_run / "summary.kept"
    entries = json.loads((folder / kept.INDEX).read_text())["entries"]
    scores_file = folder / entries["scores"]["frame"]
    scores_file.write_bytes(scores_file.read_bytes()[:100])
    computed = RunAnalysis(open_source(straggler_run)).straggler_scores()
    monkeypatch.setattr(causes_module, "straggler_causes", lambda *a, **k: pytest.fail("causes not read"))
    read = _reading(straggler_run)
    pd.testing.assert_frame_equal(read.straggler_scores(), computed)
    assert not read.straggler_causes().empty
    (folder / kept.INDEX).write_text("{not json")
    assert summary_store.load_kept(straggler_run) is None


def test_an_entry_naming_a_file_outside_its_folder_is_not_read(straggler_run):
    folder = straggler_run / "summary.kept"
    index = json.loads((folder / kept.INDEX).read_text())
    shutil.copy(folder / index["entries"]["scores"]["frame"], straggler_run / "elsewhere.parquet")
    index["entries"]["scores"]["frame"] = "../elsewhere.parquet"
    (folder / kept.INDEX).write_text(json.dumps(index))
    assert summary_store.load_kept(straggler_run).get("scores") is kept.NOT_KEPT


def test_writing_replaces_the_old_folder_and_a_read_only_place_keeps_nothing(tmp_path):
    folder = tmp_path / "x.kept"
    frame = pd.DataFrame({"rank": [0, 1], "median_lateness_frac": [0.1, 0.02]})
    assert kept.write(folder, {"scores": frame, "unknown": frame}, source="/r", key={"k": 1})
    assert kept.write(folder, {"causes": frame}, source="/r", key={"k": 2})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["x.kept"]   # no temporary or old folder left
    assert kept.read(folder, source="/r", key={"k": 1}) is None
    now = kept.read(folder, source="/r", key={"k": 2})
    assert now.names() == ["causes"] and now.get("scores") is kept.NOT_KEPT
    pd.testing.assert_frame_equal(now.get("causes"), frame)
    assert kept.write(folder, {"bw_fit": None}, source="/r", key={"k": 3})   # no fit is a result too
    assert kept.read(folder, source="/r", key={"k": 3}).get("bw_fit") is None
    assert kept.write(folder, {"bw_fit": (12_000.5, 2.5e9)}, source="/r", key={"k": 4})
    assert kept.read(folder, source="/r", key={"k": 4}).get("bw_fit") == (12_000.5, 2.5e9)
    blocked = tmp_path / "file"
    blocked.write_text("a file where the folder's parent should be")
    assert kept.write(blocked / "y.kept", {"scores": frame}, source="/r", key={}) is False


def test_the_dashboard_reads_the_kept_results_of_a_finished_run(straggler_run, monkeypatch):
    from dtprobe.dashboard import data
    from dtprobe.dashboard.paths import Source

    computed = RunAnalysis(open_source(straggler_run)).stragglers()
    _no_compute(monkeypatch)
    source = Source(name=straggler_run.name, path=straggler_run, kind="run")
    found = data.findings_with_evidence(source, data.load_analysis(source), {"STRAGGLER": "stragglers"})
    _assert_same_findings(found, computed)


def test_a_trace_folders_results_are_kept_in_the_user_cache(tmp_path, monkeypatch):
    from dtprobe.dashboard import data
    from dtprobe.dashboard.paths import Source

    monkeypatch.setenv(summary_store.CACHE_ENV, str(tmp_path / "cache"))
    traces = tmp_path / "dlrm"
    shutil.copytree(Path(__file__).resolve().parent / "data" / "traces" / "dlrm_8rank_v100", traces)
    source = Source(name="dlrm", path=traces.resolve(), kind="traces")
    data.load_overview(source)
    folders = list((tmp_path / "cache" / "dtprobe" / "summaries").glob("*.kept"))
    assert len(folders) == 1 and not any(traces.rglob("*.kept"))
    computed = RunAnalysis(open_source(traces)).stragglers()
    _no_compute(monkeypatch)
    monkeypatch.setattr(RunAnalysis, "device_stragglers", lambda self: pytest.fail("computed, not read"))
    _assert_same_findings(_reading(traces.resolve()).stragglers(), computed)


def test_a_running_run_reads_no_kept_results_even_under_its_current_key(straggler_run):
    from dtprobe.store.manifest import set_status

    set_status(straggler_run, "running")
    key = summary_store.key_of(straggler_run)
    frame = pd.DataFrame({"rank": [0], "median_lateness_frac": [0.5]})
    assert kept.write(straggler_run / "summary.kept", {"scores": frame}, source=str(straggler_run), key=key)
    assert kept.read(straggler_run / "summary.kept", source=str(straggler_run), key=key) is not None
    assert summary_store.load_kept(straggler_run, key=key) is None      # its rows still grow: nothing is kept
