"""One MLflow run per exported dtprobe run: key figures and finding counts as metrics, the layout as params, the
findings document and the Perfetto timeline as artifacts; written by ``dtprobe export mlflow``.

Written through ``mlflow.tracking.MlflowClient`` (no active-run state), so it works with mlflow-skinny against
any tracking URI it supports: an MLflow server (``http(s)://``), a file store (``file:``), or a database store
when SQLAlchemy is installed. Every export creates a new MLflow run, tagged with the dtprobe run's id and path.
"""

from __future__ import annotations

import os
import tempfile
import time
from dataclasses import dataclass, fields
from pathlib import Path

from dtprobe.analysis.facade import RunAnalysis
from dtprobe.analysis.findings import SEVERITIES
from dtprobe.analysis.perfetto import export_perfetto
from dtprobe.analysis.render import render_json
from dtprobe.export.extras import require
from dtprobe.store.errors import ConfigError

DEFAULT_EXPERIMENT = "dtprobe"
"""Experiment of the exported runs unless ``--experiment`` names another."""
FINDINGS_ARTIFACT = "findings.json"
"""The ``dtprobe.findings/1`` document, as ``dtprobe analyze --format json`` prints it."""
TIMELINE_ARTIFACT = "timeline.perfetto.json"
"""The Perfetto timeline, as ``dtprobe export perfetto`` writes it (open it at ui.perfetto.dev)."""


@dataclass(frozen=True, kw_only=True)
class MlflowExport:
    """What ``export_mlflow`` logged."""

    tracking_uri: str
    """Where it was logged."""
    experiment_id: str
    """The experiment's id."""
    run_id: str
    """The new MLflow run's id."""
    metrics: dict[str, float]
    """Metric name -> value."""
    params: dict[str, str]
    """Param name -> value."""
    artifacts: tuple[str, ...]
    """Artifact paths in the run."""


def run_metrics(analysis: RunAnalysis) -> dict[str, float]:
    """Every known key figure (``RunAnalysis.key_figures``, same names; unknown ones left out), and the number
    of findings (``num_findings``) and of each severity (``num_findings_<severity>``)."""
    figures = analysis.key_figures()
    out = {f.name: float(getattr(figures, f.name)) for f in fields(figures)
           if isinstance(getattr(figures, f.name), (int, float)) and not isinstance(getattr(figures, f.name), bool)}
    findings = analysis.findings()
    out["num_findings"] = float(len(findings))
    for severity in SEVERITIES:
        out[f"num_findings_{severity}"] = float(sum(f.severity == severity for f in findings))
    return out


def run_params(analysis: RunAnalysis) -> dict[str, str]:
    """The layout (``layout.<key>`` for each key of the config's ``layout`` section), the world size, the source's
    kind and the dtprobe run id, as strings (MLflow params are strings)."""
    params = {f"layout.{k}": str(v) for k, v in analysis.layout().items()}
    params["world_size"] = str(analysis.world_size)
    params["source_kind"] = analysis.info.kind
    if analysis.info.run_id:
        params["dtprobe_run_id"] = str(analysis.info.run_id)
    return params


def tracking_uri_of(tracking_uri: str | None) -> str:
    """The tracking URI an export to ``tracking_uri`` logs to: itself, else ``MLFLOW_TRACKING_URI``, else MLflow's
    default (``./mlruns`` when the working directory has one holding experiments, else ``sqlite:///mlflow.db``)."""
    mlflow = require("mlflow", extra="mlflow", what="dtprobe export mlflow")
    return tracking_uri or mlflow.get_tracking_uri()


def export_mlflow(analysis: RunAnalysis, *, tracking_uri: str | None = None, experiment: str = DEFAULT_EXPERIMENT,
                  run_name: str | None = None) -> MlflowExport:
    """Log ``analysis`` as a new finished MLflow run in ``experiment`` (created if missing) at ``tracking_uri``
    (MLflow's own default, ``MLFLOW_TRACKING_URI`` or its local store, when None). ConfigError when MLflow is not
    installed or the tracking store cannot be opened, naming the URI and the fix."""
    require("mlflow", extra="mlflow", what="dtprobe export mlflow")
    from mlflow.exceptions import MlflowException
    from mlflow.tracking import MlflowClient

    metrics, params = run_metrics(analysis), run_params(analysis)
    report = analysis.report()
    uri = tracking_uri_of(tracking_uri)
    try:
        client = MlflowClient(tracking_uri=uri)
        found = client.get_experiment_by_name(experiment)
        if found is not None and found.lifecycle_stage == "deleted":
            raise ConfigError(f"experiment {experiment!r} is deleted in {uri}. Restore it (mlflow experiments "
                              f"restore --experiment-id {found.experiment_id}) or pass another --experiment.")
        experiment_id = found.experiment_id if found is not None else client.create_experiment(experiment)
        run = client.create_run(experiment_id, run_name=run_name or analysis.path.name,
                                tags={"dtprobe.source": str(analysis.path), "dtprobe.status": analysis.status})
    except (MlflowException, ImportError) as exc:
        raise ConfigError(_store_error(uri, explicit=tracking_uri is not None, exc=exc,
                                       from_env=bool(os.environ.get(TRACKING_URI_ENV)))) from None
    run_id = run.info.run_id
    status = "FAILED"
    try:
        from mlflow.entities import Metric, Param

        now_ms = int(time.time() * 1000)
        client.log_batch(run_id, metrics=[Metric(k, v, now_ms, 0) for k, v in metrics.items()],
                         params=[Param(k, v) for k, v in params.items()])
        with tempfile.TemporaryDirectory(prefix="dtprobe-mlflow-") as tmp:
            (Path(tmp) / FINDINGS_ARTIFACT).write_text(render_json(report))
            export_perfetto(analysis.source, Path(tmp) / TIMELINE_ARTIFACT)
            client.log_artifacts(run_id, tmp)
        status = "FINISHED"
    except (MlflowException, OSError) as exc:
        raise ConfigError(f"logging to MLflow run {run_id} at {uri} failed (the run is marked FAILED): {exc}. "
                          f"Check that the tracking store and its artifact location are writable.") from None
    finally:
        client.set_terminated(run_id, status=status)
    return MlflowExport(tracking_uri=uri, experiment_id=experiment_id, run_id=run_id, metrics=metrics,
                        params=params, artifacts=(FINDINGS_ARTIFACT, TIMELINE_ARTIFACT))


TRACKING_URI_ENV = "MLFLOW_TRACKING_URI"
"""MLflow's own variable for the tracking URI, read when no ``tracking_uri`` is given."""
DATABASE_SCHEMES = ("sqlite", "postgresql", "mysql", "mssql")
"""Tracking URI schemes of MLflow's database stores (they need SQLAlchemy, which mlflow-skinny leaves out)."""


def _store_error(uri: str, *, explicit: bool, exc: Exception, from_env: bool = False) -> str:
    """The message of a tracking store MLflow could not open, with the fix for the common cases. ``explicit``: the
    URI came from --tracking-uri; else from ``MLFLOW_TRACKING_URI`` when ``from_env``, else it is MLflow's default,
    and the fix also says which variable to set."""
    where = (f"--tracking-uri {uri}" if explicit else f"{TRACKING_URI_ENV}={uri}" if from_env
             else f"MLflow's default tracking store {uri}")
    text = (str(exc).strip().splitlines() or [type(exc).__name__])[0].rstrip(".")
    if "MLFLOW_ALLOW_FILE_STORE" in str(exc):
        fix = ("MLflow keeps its file store in maintenance mode: set MLFLOW_ALLOW_FILE_STORE=true to use it, or pass "
               "a server's --tracking-uri http://HOST:5000")
    elif isinstance(exc, ImportError) or uri.split(":", 1)[0].split("+", 1)[0] in DATABASE_SCHEMES:
        also = "" if explicit else f" (or set {TRACKING_URI_ENV} to one of them)"
        fix = ("mlflow-skinny has no database driver: pass --tracking-uri file:./mlruns (a folder) or a server's "
               f"http://HOST:5000{also}, or pip install sqlalchemy alembic for sqlite: stores")
    else:
        fix = "check the URI, or pass --tracking-uri file:./mlruns for a local folder"
    return f"cannot open {where}: {text}. {fix}."
