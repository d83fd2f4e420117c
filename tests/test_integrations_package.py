"""``dtprobe.integrations`` itself: ``OptimizerStepMarker`` (the part the framework callbacks share) on a real 1-rank
probe in a child process (the steps rows it writes, the tokens rule: a step's tokens only when every micro-batch
gave its count, its refusal to re-attach after it closed), and that importing dtprobe imports no framework."""

from __future__ import annotations

import pytest

from dtprobe.store import RunStore

CHILD = """
import sys
from dtprobe.integrations.optimizer_steps import OptimizerStepMarker
from dtprobe.store.errors import ConfigError

marker = OptimizerStepMarker(sys.argv[1], {"devices": False, "timeout_s": 60})
marker.end(loss=9.0)                        # no open step: nothing written
marker.attach(framework="test")
for step, counts, loss, lr in [(0, [32, 32], 2.5, 1e-3), (1, [32, None], 2.25, 2e-3), (2, [None], None, None),
                               (3, [], 2.0, 3e-3)]:
    marker.begin(step)
    for n in counts:
        marker.count_tokens(n)
    marker.begin_optimizer()
    marker.end_optimizer()
    marker.end(loss=loss, lr=lr)
marker.count_tokens(64)                     # between steps: ignored
marker.begin(4)
marker.count_tokens(16)
marker.close()                              # ends step 4 without values, then closes the probe
try:
    marker.attach(framework="test")
except ConfigError as exc:
    print("refused:", exc)
"""


def test_marker_writes_loss_lr_and_tokens_only_when_every_micro_batch_counted(tmp_path, run_python):
    proc = run_python(CHILD, tmp_path / "run", timeout_s=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "refused:" in proc.stdout and "another run_dir" in proc.stdout

    store = RunStore.open(tmp_path / "run")
    assert store.manifest.status == "finished"
    steps = store.table("steps").sort_values("step").set_index("step")
    assert steps.index.tolist() == [0, 1, 2, 3, 4]
    assert steps["tokens"].isna().tolist() == [False, True, True, True, False]
    assert steps.loc[0, "tokens"] == 64 and steps.loc[4, "tokens"] == 16
    assert steps["loss"].tolist()[:2] == [2.5, 2.25] and steps["loss"].isna().tolist()[2:] == [True, False, True]
    assert steps["lr"].isna().tolist() == [False, False, True, False, True]
    assert steps.loc[3, "lr"] == pytest.approx(3e-3)
    assert (steps.loc[[0, 1, 2, 3], "opt_ns"] > 0).all() and steps["opt_ns"].isna().tolist()[4] is True
    assert (steps["end_ns"] >= steps["start_ns"]).all()


@pytest.mark.parametrize("framework", ["transformers", "accelerate", "lightning", "pytorch_lightning"])
def test_importing_dtprobe_and_the_integrations_package_does_not_import_a_framework(framework, run_python):
    code = ("import sys, dtprobe, dtprobe.cli, dtprobe.integrations, dtprobe.integrations.optimizer_steps\n"
            f"print(sorted(m for m in sys.modules if m.split('.')[0] == {framework!r}))")
    proc = run_python(code)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip() == "[]"
