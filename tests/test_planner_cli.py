"""Tests for `dtprobe plan` (dtprobe/commands/plan.py): JSON and text output, calibration, errors."""

from __future__ import annotations

import json

import pytest

from dtprobe.cli import main

from test_planner_calibrate import write_dp2_tp2_run


def test_plan_json_is_the_documented_document(capsys):
    assert main(["plan", "--model", "llama3-8b", "--gpus", "16", "--gpu", "h100-80", "--gpus-per-node", "8",
                 "--seq-len", "4096", "--global-batch", "64", "--top", "3", "--format", "json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["schema"] == "dtprobe.plan/1"
    assert len(doc["layouts"]) == 3 and doc["world_size"] == 16 and doc["seq_len"] == 4096
    assert [x["step_time_s"] for x in doc["layouts"]] == sorted(x["step_time_s"] for x in doc["layouts"])
    assert all(set(x["memory_gib"]) >= {"weights", "grads", "optimizer", "activations", "total"}
               for x in doc["layouts"])


def test_plan_text_names_the_best_layout_and_the_rejected(capsys):
    assert main(["plan", "--model", "llama3-70b", "--gpus", "64", "--gpu", "a100-80", "--seq-len", "4096",
                 "--global-batch", "128", "--top", "2"]) == 0
    out = capsys.readouterr().out
    assert "#1" in out and "#2" in out and "why:" in out
    assert "do not fit" in out and "plain data parallel" in out


def test_plan_calibrate_prints_predicted_against_measured(tmp_path, capsys):
    run = write_dp2_tp2_run(tmp_path / "run")
    assert main(["plan", "--calibrate", str(run), "--warmup-steps", "2"]) == 0
    out = capsys.readouterr().out
    assert "CPU figures" in out and "step_time_s" in out and "predicted ms" in out
    assert main(["plan", "--calibrate", str(run), "--warmup-steps", "2", "--format", "json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["schema"] == "dtprobe.calibration/1" and doc["device_is_cpu"] is True
    assert doc["comparison"][0]["term"] == "step_time_s"
    assert abs(doc["comparison"][0]["error_frac"]) < 0.25


def test_plan_calibrate_then_plan_with_the_refit_efficiency(tmp_path, capsys):
    run = write_dp2_tp2_run(tmp_path / "run")
    assert main(["plan", "--calibrate", str(run), "--warmup-steps", "2", "--model", "small", "--gpu", "cpu",
                 "--gpus", "4", "--gpus-per-node", "4", "--format", "json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["device_is_cpu"] and doc["calibration"]["efficiency"]["compute"] > 0 and doc["layouts"]


@pytest.mark.parametrize("argv,match", [
    (["plan", "--model", "gpt5"], "not a preset"),
    (["plan", "--model", "tiny", "--gpus", "12", "--gpus-per-node", "8"], "multiple of --gpus-per-node"),
    (["plan"], "--model is required"),
    (["plan", "--model", "llama3-8b", "--gpu", "a100-80", "--precision", "fp8"], "no fp8 peak"),
])
def test_plan_bad_input_exits_2_with_a_message(argv, match, capsys):
    assert main(argv) == 2
    assert match in capsys.readouterr().err
