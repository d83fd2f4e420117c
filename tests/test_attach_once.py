"""One probe per process: a second ``dtprobe.attach`` returns the open probe (warning when it names another run
directory), a framework callback's ``OptimizerStepMarker`` records through a probe it finds open without closing
it and stops ``dtprobe launch``'s hook-driven steps, a probe closed frees the process for a new attach, and a
script's own attach under ``dtprobe launch`` (which attaches when that attach initializes torch.distributed) gets
the worker's probe. Each case runs in child processes (attach initializes a 1-rank gloo group in the one-process
cases), so no group outlives it."""

from __future__ import annotations

import json
import textwrap

import pytest

from dtprobe.store import RunStore


def _run(run_python, tmp_path, body: str) -> dict:
    code = textwrap.dedent("""
        import json, sys, warnings
        from pathlib import Path
        import torch, torch.distributed as dist
        import dtprobe
        from dtprobe.collectors.attach import open_probe
        root = Path(sys.argv[1])
    """) + textwrap.dedent(body)
    proc = run_python(code, tmp_path, timeout_s=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_attach_returns_the_open_probe_and_warns_only_when_asked_for_another_run_dir(run_python, tmp_path):
    out = _run(run_python, tmp_path, """
        first = dtprobe.attach(root / "a", devices=False)
        with warnings.catch_warnings(record=True) as same:
            warnings.simplefilter("always")
            again = dtprobe.attach(root / "a", devices=False)
        with warnings.catch_warnings(record=True) as other:
            warnings.simplefilter("always")
            elsewhere = dtprobe.attach(root / "b", devices=False)
        with first.step(0):
            dist.all_reduce(torch.ones(4))
        first.close()
        print(json.dumps({"same": again is first, "elsewhere": elsewhere is first, "open_after_close": open_probe()
                          is not None, "same_warnings": [str(w.message) for w in same],
                          "other_warnings": [str(w.message) for w in other], "b_exists": (root / "b").exists()}))
    """)
    assert out["same"] and out["elsewhere"] and not out["open_after_close"]
    assert out["same_warnings"] == [] and not out["b_exists"]
    assert len(out["other_warnings"]) == 1 and "already records into" in out["other_warnings"][0]
    assert str(tmp_path / "a") in out["other_warnings"][0] and str(tmp_path / "b") in out["other_warnings"][0]
    store = RunStore.open(tmp_path / "a")
    assert store.table("lifecycle")["event"].tolist() == ["attach", "close"]       # one attach, one close
    coll = store.table("collectives")
    assert coll[["pg", "op", "num_bytes", "step"]].values.tolist() == [["world", "allreduce", 16, 0]]


def test_marker_reuses_an_open_probe_stops_its_step_hooks_and_leaves_it_open_at_close(run_python, tmp_path):
    out = _run(run_python, tmp_path, """
        from dtprobe.integrations.optimizer_steps import OptimizerStepMarker

        class StepHooks:                          # stands for dtprobe launch's ScriptSteps
            closed = 0
            def close(self):
                self.closed += 1

        probe = dtprobe.attach(root / "launch", devices=False)
        hooks = probe.step_hooks = StepHooks()
        marker = OptimizerStepMarker(root / "callback", {"devices": False})
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            reused = marker.attach(framework="Lightning")
        for step in range(2):
            marker.begin(step)
            marker.count_tokens(8)
            dist.all_reduce(torch.ones(2))
            marker.end(loss=1.5 + step, lr=0.1)
        marker.close("finished")
        still_open = open_probe() is probe
        dist.all_reduce(torch.ones(3))            # the owner's probe still records after the callback's end
        probe.close()
        print(json.dumps({"reused": reused is probe, "owns": marker.owns_probe, "hooks_closed": hooks.closed,
                          "step_hooks": probe.step_hooks is None, "still_open": still_open,
                          "warnings": [str(w.message) for w in caught],
                          "callback_dir": (root / "callback").exists()}))
    """)
    assert out["reused"] and not out["owns"] and out["still_open"] and not out["callback_dir"]
    assert out["hooks_closed"] == 1 and out["step_hooks"]
    assert len(out["warnings"]) == 1 and "Lightning callback records into the probe already open" in out["warnings"][0]
    store = RunStore.open(tmp_path / "launch")
    assert store.table("lifecycle")["event"].tolist() == ["attach", "close"]
    steps = store.table("steps").sort_values("step")
    assert steps[["step", "loss", "lr", "tokens"]].values.tolist() == [[0, 1.5, 0.1, 8], [1, 2.5, 0.1, 8]]
    coll = store.table("collectives").sort_values("enqueue_ns")
    assert coll[["step", "num_bytes"]].values.tolist() == [[0, 8], [1, 8], [-1, 12]]


def test_marker_that_attached_closes_its_probe_and_a_later_attach_opens_a_new_run(run_python, tmp_path):
    out = _run(run_python, tmp_path, """
        from dtprobe.integrations.optimizer_steps import OptimizerStepMarker

        marker = OptimizerStepMarker(root / "first", {"devices": False})
        probe = marker.attach(framework="Hugging Face")
        marker.begin(0)
        marker.end(loss=2.0)
        marker.close("finished")
        closed = open_probe() is None
        second = dtprobe.attach(root / "second", devices=False)
        dist.all_reduce(torch.ones(5))
        second.close()
        print(json.dumps({"owns": marker.owns_probe, "closed": closed, "new": second is not probe,
                          "backend": dist.get_backend()}))
    """)
    assert out == {"owns": True, "closed": True, "new": True, "backend": "gloo"}
    first, second = RunStore.open(tmp_path / "first"), RunStore.open(tmp_path / "second")
    assert first.manifest.status == "finished" and first.table("steps")["loss"].tolist() == [2.0]
    assert second.table("lifecycle")["event"].tolist() == ["attach", "close"]
    assert second.table("collectives")["num_bytes"].tolist() == [20]      # the group recorded for the new probe


LAUNCHED_SCRIPT = """
import sys
import torch, torch.distributed as dist
import dtprobe

probe = dtprobe.attach(sys.argv[1], devices=False, timeout_s=60)    # initializes: dtprobe launch attaches then
for step in range(3):
    with probe.step(step):
        dist.all_reduce(torch.ones(4))
probe.close()
"""


def _launched(script: str, tmp_path, run_cli, child_env) -> RunStore:
    """``script`` (which attaches to the run directory it is given) run by ``dtprobe launch`` on 2 ranks: the
    launch's run, the script's own run directory never created."""
    (tmp_path / "train.py").write_text(script)
    run = tmp_path / "launch-run"
    proc = run_cli("launch", "--nproc", "2", "--run-dir", run, "--no-devices", tmp_path / "train.py",
                   tmp_path / "own-run", timeout_s=240, env=child_env())
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert not (tmp_path / "own-run").exists()
    return RunStore.open(run)


@pytest.mark.multiproc
def test_attach_that_initializes_under_dtprobe_launch_returns_the_workers_probe_and_marks_the_steps(
        tmp_path, run_cli, child_env):
    store = _launched(LAUNCHED_SCRIPT, tmp_path, run_cli, child_env)
    lifecycle = store.table("lifecycle").sort_values(["rank", "time_ns"])
    assert lifecycle.groupby("rank")["event"].apply(list).to_dict() == {r: ["attach", "close"] for r in (0, 1)}
    # the script's steps, once each (the launch's hook-driven steps stopped), with their all-reduce
    steps = store.table("steps")
    assert steps.groupby("rank")["step"].apply(sorted).to_dict() == {r: [0, 1, 2] for r in (0, 1)}
    coll = store.table("collectives")
    assert coll.groupby(["rank", "step"])["num_bytes"].sum().to_dict() == {(r, s): 16 for r in (0, 1)
                                                                          for s in range(3)}


UNMARKED_SCRIPT = """
import sys
import torch, torch.distributed as dist
import dtprobe

probe = dtprobe.attach(sys.argv[1], devices=False, timeout_s=60)    # attaches, marks no step
model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for _ in range(3):
    model(torch.ones(2, 4)).sum().backward()
    opt.step()
    opt.zero_grad()
probe.close()
"""


@pytest.mark.multiproc
def test_attach_under_dtprobe_launch_that_marks_no_step_keeps_the_launchs_hook_driven_steps(
        tmp_path, run_cli, child_env):
    steps = _launched(UNMARKED_SCRIPT, tmp_path, run_cli, child_env).table("steps")
    # one row per optimizer step, from the hooks, with the forward/backward/optimizer phases they time
    assert steps.groupby("rank")["step"].apply(sorted).to_dict() == {r: [0, 1, 2] for r in (0, 1)}
    assert steps[["fwd_ns", "bwd_ns", "opt_ns"]].notna().all().all()
