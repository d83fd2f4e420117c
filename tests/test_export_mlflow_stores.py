"""`dtprobe export mlflow RUN` with the installed MLflow and no MLflow variable of the user's: a folder store works
whether it is named by --tracking-uri, MLFLOW_TRACKING_URI or MLflow's own default (./mlruns when it exists); a
store mlflow-skinny cannot open fails with exit 2 and a message that says what to pass or set."""

from __future__ import annotations

import importlib.util

import pytest
from mlflow.tracking import MlflowClient

SCENARIO = "fp16_overflow"
MLFLOW_VARIABLES = ("MLFLOW_TRACKING_URI", "MLFLOW_ALLOW_FILE_STORE", "MLFLOW_EXPERIMENT_NAME",
                    "MLFLOW_EXPERIMENT_ID", "MLFLOW_REGISTRY_URI")


@pytest.fixture
def clean_env(child_env):
    """``clean_env(**extra)``: a child's environment with none of MLflow's variables but ``extra``."""
    def make(**extra: str) -> dict[str, str]:
        return {k: v for k, v in child_env(**extra).items() if k not in MLFLOW_VARIABLES or k in extra}
    return make


def _logged_runs(uri: str, monkeypatch) -> list[str]:
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")       # reading the file store back needs the opt-in
    client = MlflowClient(tracking_uri=uri)
    experiment = client.get_experiment_by_name("dtprobe")
    return [r.info.run_name for r in client.search_runs([experiment.experiment_id])]


@pytest.mark.parametrize("how", ["flag file: URI", "flag plain path", "MLFLOW_TRACKING_URI", "default ./mlruns"])
def test_mlflow_export_to_a_folder_works_without_any_mlflow_variable_when_named_any_way(
        how, tmp_path, sample_traces_dir, run_cli, clean_env, monkeypatch):
    store = tmp_path / "mlruns"
    args, env = [], clean_env()
    if how == "flag file: URI":
        args = ["--tracking-uri", f"file:{store}"]
    elif how == "flag plain path":
        args = ["--tracking-uri", "mlruns"]                          # relative to the working directory
    elif how == "MLFLOW_TRACKING_URI":
        env = clean_env(MLFLOW_TRACKING_URI=f"file:{store}")
    else:   # MLflow defaults to ./mlruns when it holds an experiment: one export named it, the next one does not
        first = run_cli("export", "mlflow", sample_traces_dir / SCENARIO, "--tracking-uri", "mlruns",
                        "--run-name", "first", env=env, cwd=tmp_path)
        assert first.returncode == 0, first.stderr
    res = run_cli("export", "mlflow", sample_traces_dir / SCENARIO, *args, "--run-name", how, env=env, cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    assert "Logged MLflow run" in res.stdout and "mlruns" in res.stdout
    expected = [how, "first"] if how == "default ./mlruns" else [how]
    assert sorted(_logged_runs(f"file:{store}", monkeypatch)) == sorted(expected)
    assert not (tmp_path / "mlflow.db").exists()


def test_mlflow_export_keeps_a_users_own_refusal_of_the_file_store_and_says_what_to_set(
        tmp_path, sample_traces_dir, run_cli, clean_env):
    res = run_cli("export", "mlflow", sample_traces_dir / SCENARIO, "--tracking-uri", f"file:{tmp_path / 'mlruns'}",
                  env=clean_env(MLFLOW_ALLOW_FILE_STORE="false"), cwd=tmp_path)
    assert res.returncode == 2
    assert f"cannot open --tracking-uri file:{tmp_path / 'mlruns'}" in res.stderr
    assert "set MLFLOW_ALLOW_FILE_STORE=true" in res.stderr and "Traceback" not in res.stderr


@pytest.mark.parametrize("env_uri", [None, "sqlite:///runs.db"], ids=["mlflow default", "MLFLOW_TRACKING_URI"])
def test_mlflow_export_to_a_database_store_names_where_the_uri_came_from_and_what_to_set(
        env_uri, tmp_path, sample_traces_dir, run_cli, clean_env):
    env = clean_env(**({"MLFLOW_TRACKING_URI": env_uri} if env_uri else {}))
    res = run_cli("export", "mlflow", sample_traces_dir / SCENARIO, env=env, cwd=tmp_path)
    if importlib.util.find_spec("sqlalchemy") is not None:           # a full MLflow install opens sqlite: itself
        assert res.returncode == 0, res.stderr
        return
    assert res.returncode == 2
    where = (f"MLFLOW_TRACKING_URI={env_uri}" if env_uri
             else f"MLflow's default tracking store sqlite:///{tmp_path / 'mlflow.db'}")
    assert f"cannot open {where}:" in res.stderr.replace("\n", "")
    for fix in ("pass --tracking-uri file:./mlruns", "set MLFLOW_TRACKING_URI to one of them",
                "pip install sqlalchemy alembic"):
        assert fix in res.stderr.replace("\n", ""), fix
    assert "Traceback" not in res.stderr
    assert not (tmp_path / "mlflow.db").exists() and not (tmp_path / "runs.db").exists()
