"""Each exporter without its optional library: exit code 2, a message naming `pip install dtprobe[<extra>]`, no
stack trace, nothing written. The library is hidden from the child by a package of the same name first on its
``PYTHONPATH`` that fails to import, as an absent one does."""

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
