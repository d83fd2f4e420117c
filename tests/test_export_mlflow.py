"""`dtprobe export mlflow RUN`: a new MLflow run in a local file store (no server, no network), read back with
``MlflowClient`` and checked against `dtprobe analyze --format json`, the facade and `dtprobe export perfetto`."""

from __future__ import annotations

import json
from collections import Counter

import pytest
from mlflow.exceptions import MlflowException
from mlflow.tracking import MlflowClient

from dtprobe.analysis.facade import RunAnalysis
from dtprobe.export.mlflow import _store_error
from dtprobe.store import RunStore

SCENARIO = "fp16_overflow"


@pytest.fixture(scope="module")
def logged(tmp_path_factory, sample_traces_dir, run_cli, sample_trace_analyze):
    """(client, the MLflow run, the analyze JSON document, the run directory, a scratch folder)."""
    tmp = tmp_path_factory.mktemp("mlflow")
    uri = f"file:{tmp / 'mlruns'}"
    run_dir = sample_traces_dir / SCENARIO
    res = run_cli("export", "mlflow", run_dir, "--tracking-uri", uri, "--experiment", "exporters")
    assert res.returncode == 0, res.stderr
    assert "Logged MLflow run" in res.stdout and "findings.json, timeline.perfetto.json" in res.stdout
    doc = json.loads(sample_trace_analyze(SCENARIO).stdout)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MLFLOW_ALLOW_FILE_STORE", "true")      # reading MLflow's file store back needs the same opt-in
        client = MlflowClient(tracking_uri=uri)
        experiment = client.get_experiment_by_name("exporters")
        (run,) = client.search_runs([experiment.experiment_id])
        yield client, run, doc, run_dir, tmp


def test_mlflow_run_is_finished_named_after_the_run_and_tagged_with_its_path(logged):
    _, run, _, run_dir, _ = logged
    assert run.info.status == "FINISHED"
    assert run.info.run_name == SCENARIO
    assert run.data.tags["dtprobe.source"] == str(run_dir)
    assert run.data.tags["dtprobe.status"] == "finished"


def test_mlflow_metrics_are_the_key_figures_analyze_json_prints(logged):
    _, run, doc, run_dir, _ = logged
    m = run.data.metrics
    metrics = doc["metrics"]
    assert m["tokens_per_s"] == pytest.approx(metrics["throughput"]["tokens_per_s"], abs=1e-6)
    assert m["step_time_ms"] == pytest.approx(metrics["throughput"]["step_time_ms"], abs=1e-6)
    assert m["num_overflows"] == metrics["amp"]["num_overflows"] == 1
    figures = RunAnalysis(RunStore.open(run_dir)).key_figures()
    assert m["num_steps"] == figures.num_steps == 14
    assert m["exposed_comm_frac"] == pytest.approx(figures.exposed_comm_frac, rel=1e-12)
    assert "mfu" not in m and "bubble_frac" not in m       # unknown on CPU / without pipeline: left out, not 0
    by_severity = Counter(f["severity"] for f in doc["findings"])
    assert m["num_findings"] == len(doc["findings"]) == 1
    assert {s: m[f"num_findings_{s}"] for s in ("critical", "warning", "info")} == {
        s: by_severity.get(s, 0) for s in ("critical", "warning", "info")}


def test_mlflow_params_hold_the_layout_and_world_size(logged):
    _, run, doc, _, _ = logged
    p = run.data.params
    layout = doc["metrics"]["run"]["layout"]
    assert {k[len("layout."):]: v for k, v in p.items() if k.startswith("layout.")} == {
        k: str(v) for k, v in layout.items()}
    assert p["world_size"] == "2" and p["dtprobe_run_id"] == SCENARIO and p["source_kind"] == "dtprobe_run"


def test_mlflow_artifacts_are_the_analyze_document_and_the_perfetto_timeline(logged, run_cli):
    client, run, doc, run_dir, tmp = logged
    assert sorted(a.path for a in client.list_artifacts(run.info.run_id)) == [
        "findings.json", "timeline.perfetto.json"]
    local = tmp / "artifacts"
    local.mkdir()
    findings = json.loads(open(client.download_artifacts(run.info.run_id, "findings.json", str(local))).read())
    assert findings == doc
    timeline = json.loads(open(client.download_artifacts(run.info.run_id, "timeline.perfetto.json",
                                                         str(local))).read())
    assert run_cli("export", "perfetto", run_dir, "-o", tmp / "direct.json").returncode == 0
    direct = json.loads((tmp / "direct.json").read_text())
    assert timeline == direct
    assert sum(e["ph"] == "X" and e["name"].startswith("step ") for e in timeline["traceEvents"]) == 2 * 14


def test_mlflow_export_twice_adds_a_second_run_to_the_same_experiment(tmp_path, sample_traces_dir, run_cli,
                                                                      monkeypatch):
    uri = f"file:{tmp_path / 'mlruns'}"
    for name in ("first", "second"):
        res = run_cli("export", "mlflow", sample_traces_dir / SCENARIO, "--tracking-uri", uri, "--run-name", name)
        assert res.returncode == 0, res.stderr
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    client = MlflowClient(tracking_uri=uri)
    experiment = client.get_experiment_by_name("dtprobe")               # the default experiment
    assert sorted(r.info.run_name for r in client.search_runs([experiment.experiment_id])) == ["first", "second"]


def test_mlflow_export_to_an_unusable_tracking_uri_fails_with_the_uri_and_no_traceback(sample_traces_dir, run_cli):
    res = run_cli("export", "mlflow", sample_traces_dir / SCENARIO, "--tracking-uri", "nosuchscheme://somewhere")
    assert res.returncode == 2
    assert "cannot open --tracking-uri nosuchscheme://somewhere" in res.stderr and "Traceback" not in res.stderr


@pytest.mark.parametrize("uri,explicit,fix", [
    ("sqlite:///mlflow.db", False, "pip install sqlalchemy alembic"),
    ("postgresql+psycopg2://db/mlflow", True, "pass --tracking-uri file:./mlruns"),
    ("file:./mlruns", True, "set MLFLOW_ALLOW_FILE_STORE=true"),
])
def test_mlflow_store_error_names_the_uri_and_the_fix(uri, explicit, fix):
    exc = MlflowException("The filesystem tracking backend ... set `MLFLOW_ALLOW_FILE_STORE=true` to opt out."
                          if uri.startswith("file:") else "unsupported URI")
    message = _store_error(uri, explicit=explicit, exc=exc)
    assert fix in message and uri in message
    assert message.startswith("cannot open --tracking-uri" if explicit else "cannot open MLflow's default")


def test_mlflow_export_into_a_deleted_experiment_says_how_to_restore_it(tmp_path, sample_traces_dir, run_cli,
                                                                         monkeypatch):
    uri = f"file:{tmp_path / 'mlruns'}"
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    client = MlflowClient(tracking_uri=uri)
    client.delete_experiment(client.create_experiment("gone"))
    res = run_cli("export", "mlflow", sample_traces_dir / SCENARIO, "--tracking-uri", uri, "--experiment", "gone")
    assert res.returncode == 2
    assert "experiment 'gone' is deleted" in res.stderr and "--experiment" in res.stderr
    assert "Traceback" not in res.stderr
