"""Exporters that cannot run exit with code 2, a message saying what to do, no stack trace and nothing written:
without their optional library (the message names `pip install dtprobe[<extra>]`; the library is hidden from the
child by a package of the same name first on its ``PYTHONPATH`` that fails to import, as an absent one does), or
on a run without events."""

from __future__ import annotations

import os
import shutil

import pytest


@pytest.mark.parametrize("command,hidden,extra", [
    ("tensorboard", "tensorboard", "tensorboard"),
    ("mlflow", "mlflow", "mlflow"),
    ("serve-metrics", "prometheus_client", "prometheus"),
])
def test_exporter_without_its_library_exits_2_naming_the_pip_extra(tmp_path, command, hidden, extra, run_cli,
                                                                   child_env, repo_root, sample_traces_dir,
                                                                   free_port):
    blocker = tmp_path / "blocker" / hidden
    blocker.mkdir(parents=True)
    (blocker / "__init__.py").write_text(f'raise ModuleNotFoundError("No module named {hidden!r}")\n')
    env = child_env(PYTHONPATH=os.pathsep.join([str(blocker.parent), str(repo_root)]))
    run = sample_traces_dir / "fp16_overflow"
    out = tmp_path / "out"
    args = {"tensorboard": ("export", "tensorboard", run, "-o", out),
            "mlflow": ("export", "mlflow", run, "--tracking-uri", f"file:{out}"),
            "serve-metrics": ("serve-metrics", tmp_path / "runs", "--port", str(free_port()), "--all")}[command]
    if command == "serve-metrics":
        shutil.copytree(run, tmp_path / "runs" / "fp16_overflow")
    res = run_cli(*args, env=env)
    assert res.returncode == 2, res.stderr
    assert f"pip install dtprobe[{extra}]" in res.stderr
    assert "Traceback" not in res.stderr
    assert not out.exists()


@pytest.mark.parametrize("command", ["tensorboard", "mlflow"])
def test_export_of_a_run_without_events_exits_2_and_writes_nothing(tmp_path, command, capsys, monkeypatch):
    from analysis_synth import write_run

    from dtprobe.cli import main

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")   # what the command sets for a file: URI, undone after
    run = write_run(tmp_path / "empty", {}, world_size=2)
    out = tmp_path / "out"
    args = ["-o", str(out)] if command == "tensorboard" else ["--tracking-uri", f"file:{out}"]
    assert main(["export", command, str(run), *args]) == 2
    assert "holds no events" in capsys.readouterr().err
    assert not out.exists()
