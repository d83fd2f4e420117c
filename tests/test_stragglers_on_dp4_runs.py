"""Stragglers on real runs made by `dtprobe run` (4 CPU/gloo workers under torchrun, tiny GPT, DDP).

The injected delay (a sleep at the start of every step's forward on one rank) is made large enough to dominate
the timing noise of CPU ranks sharing cores, and is checked to be at least 10% of the step time. Four ranks on two
cores share them two by two: while the slowed rank sleeps, its core-mate runs alone, so the pair on the other core
is the slow one unless the sleep outweighs their sharing, and the two cores of a VM also run at different speeds
for stretches. The sleep is therefore longer than the pair's whole forward and backward on a shared core.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from dtprobe.analysis import RunAnalysis

pytestmark = [pytest.mark.multiproc, pytest.mark.exclusive]

NUM_STEPS = 21            # step 0 is warm-up: 20 analysed steps, so "named within 20 steps"
DELAY_MS = 400.0


@pytest.fixture(scope="module")
def runs(tmp_path_factory, run_cli, clean_dp4_run) -> dict:
    def run(run_dir: Path, *extra: str) -> Path:
        proc = run_cli("run", *clean_dp4_run.flags, "--run-dir", run_dir, *extra, timeout_s=600)
        assert proc.returncode == 0, f"dtprobe run failed ({proc.returncode}):\n{proc.stderr[-3000:]}"
        return run_dir

    # the clean run is shared (conftest): the straggler runs are its job with one rank slowed
    assert clean_dp4_run.steps == NUM_STEPS
    assert clean_dp4_run.proc.returncode == 0, clean_dp4_run.proc.stderr[-3000:]
    root = tmp_path_factory.mktemp("real_runs")
    return {
        "clean": clean_dp4_run.run_dir,
        1: run(root / "straggler_rank1", "--inject", f"straggler:rank=1,delay_ms={DELAY_MS:g}"),
        3: run(root / "straggler_rank3", "--inject", f"straggler:rank=3,delay_ms={DELAY_MS:g}"),
    }


def test_clean_dp4_run_has_no_straggler(runs):
    a = RunAnalysis.open(runs["clean"])
    assert len(a.steps_analyzed()) == NUM_STEPS - 1
    assert [f for f in a.findings() if f.code == "STRAGGLER"] == []


@pytest.mark.parametrize("rank", [1, 3])
def test_dp4_straggler_is_named_alone_within_20_steps(runs, rank):
    a = RunAnalysis.open(runs[rank])
    stragglers = [f for f in a.findings() if f.code == "STRAGGLER"]
    assert [(f.ranks, f.group) for f in stragglers] == [((rank,), "dp")]
    ev = stragglers[0].evidence
    assert ev["detected_at_step"] is not None and ev["detected_at_step"] <= NUM_STEPS - 1
    assert ev["injected"] == {"from_step": 0, "delay_ms": DELAY_MS}
    assert DELAY_MS / ev["step_time_ms"] >= 0.10
    assert ev["cause"] == "compute"                 # the sleep sits in the forward
    assert ev["victims"] == [r for r in range(4) if r != rank]
