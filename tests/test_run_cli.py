"""``dtprobe run`` end to end: torchrun workers on CPU/gloo, the run store they leave, multi-node, crashes.

Each run starts torchrun and 2-4 workers, so the runs are kept small (tiny model, short sequences, few steps)
and every process has an outer timeout.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from dtprobe.store import RunStore

pytestmark = pytest.mark.multiproc

# The CLI router with only `run` registered, so this file checks `dtprobe run` alone.
DRIVER = "import sys, dtprobe.cli as c; c.COMMANDS = ('run',); sys.exit(c.main(sys.argv[1:]))"


@pytest.fixture(scope="session")
def dtprobe_run(run_python):
    """``dtprobe_run(*args, timeout=900)``: ``dtprobe run *args`` to its end, output captured."""
    def run(*args: str, timeout: float = 900) -> subprocess.CompletedProcess:
        return run_python(DRIVER, "run", *args, timeout_s=timeout)
    return run


@pytest.fixture
def dtprobe_popen(start_python):
    """``dtprobe_popen(*args, log=path)``: ``dtprobe run *args`` started, its output in ``log``."""
    def start(*args: str, log: Path) -> subprocess.Popen:
        return start_python(DRIVER, "run", *args, stdout=open(log, "w"), stderr=subprocess.STDOUT)
    return start


def tiny_grad_bytes() -> int:
    from dtprobe.runtime.model import build_model

    return sum(p.numel() * p.element_size() for p in build_model("tiny", seed=0).parameters())


def test_run_rejects_a_layout_that_does_not_fit_before_launching_anything(tmp_path, dtprobe_run):
    run_dir = tmp_path / "never"
    proc = dtprobe_run("--dp", "3", "--nproc", "4", "--run-dir", str(run_dir), timeout=120)
    assert proc.returncode == 2
    assert "dtprobe run: error: layout.dp(3) * layout.tp(1) * layout.pp(1) = 3, but WORLD_SIZE = 4" in proc.stderr
    assert "--dp -1 (or --dp 4)" in proc.stderr and "--nproc 3" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not run_dir.exists()


def test_run_rejects_an_unknown_fault_kind_with_exit_2(tmp_path, dtprobe_run):
    proc = dtprobe_run("--nproc", "2", "--inject", "meteor:rank=1", "--run-dir", str(tmp_path / "r"), timeout=120)
    assert proc.returncode == 2 and "unknown fault kind 'meteor'" in proc.stderr


STRAGGLER_RUN_STEPS = 12
"""Steps of ``straggler_run``: its profile window, steps 10-11, is the run's last two steps."""


@pytest.fixture(scope="module")
def straggler_run(tmp_path_factory, dtprobe_run) -> tuple[subprocess.CompletedProcess, RunStore]:
    run_dir = tmp_path_factory.mktemp("straggler") / "run"
    proc = dtprobe_run("--nproc", "4", "--steps", str(STRAGGLER_RUN_STEPS), "--run-dir", str(run_dir), "--inject",
                       "straggler:rank=2,delay_ms=40", "--profile-steps", "10-11", "--seq-len", "32",
                       "--batch-size", "4")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc, RunStore.open(run_dir)


def test_straggler_run_finishes_and_prints_its_run_directory(straggler_run):
    proc, store = straggler_run
    assert proc.stdout.strip().splitlines()[-1] == str(store.path.resolve())
    assert store.manifest.status == "finished" and store.manifest.world_size == 4
    assert (store.path / "tables" / "steps" / "step_block=0").is_dir()          # compacted by the launcher
    assert json.loads((store.path / "job.json").read_text())["train"]["steps"] == STRAGGLER_RUN_STEPS


def test_straggler_run_has_a_step_row_per_step_on_each_of_4_ranks(straggler_run):
    steps = straggler_run[1].table("steps")
    assert steps.groupby("rank")["step"].apply(sorted).to_dict() == {r: list(range(STRAGGLER_RUN_STEPS))
                                                                     for r in range(4)}
    assert steps["loss"].notna().all() and (steps["tokens"] == 4 * 32).all()


def test_straggler_run_allreduce_bytes_per_step_equal_the_gradient_bytes(straggler_run):
    coll = straggler_run[1].table("collectives")
    allreduce = coll[(coll["op"] == "allreduce") & (coll["step"] >= 0)]
    per_step = allreduce.groupby(["rank", "step"])["num_bytes"].sum()
    assert sorted(per_step.index.get_level_values("rank").unique()) == [0, 1, 2, 3]
    assert len(per_step) == 4 * STRAGGLER_RUN_STEPS
    assert (per_step == tiny_grad_bytes()).all()


def test_straggler_run_has_device_or_host_samples_from_every_rank(straggler_run):
    devices = straggler_run[1].table("devices")
    assert sorted(devices["rank"].unique()) == [0, 1, 2, 3]
    assert devices.groupby("rank").size().min() >= 2


def test_straggler_run_records_the_straggler_as_an_injected_fault(straggler_run):
    faults = straggler_run[1].table("faults")
    assert len(faults) == 1
    row = faults.iloc[0]
    assert (row["kind"], row["rank"], row["injected"], row["step"]) == ("straggler", 2, True, 0)
    assert json.loads(row["detail"]) == {"from_step": 0, "delay_ms": 40.0}


def test_straggler_run_traces_the_profile_window_on_every_rank(straggler_run):
    traces = sorted(p.name for p in (straggler_run[1].path / "traces" / "steps10-11").iterdir())
    assert traces == [f"rank{r:05d}.pt.trace.json.gz" for r in range(4)]


def test_straggler_run_binds_each_cpu_worker_to_its_share_of_the_cores(straggler_run):
    cores = sorted(os.sched_getaffinity(0))          # the workers inherit the test's cores
    if len(cores) >= 4:
        k = len(cores) // 4
        want = {r: cores[r * k:(r + 1) * k] for r in range(4)}
    else:
        want = {r: [cores[r % len(cores)]] for r in range(4)}
    workers = [json.loads(p.read_text()) for p in (straggler_run[1].path / "logs").rglob("worker.json")]
    assert {w["rank"]: w["cpus"] for w in workers} == want


def test_two_torchrun_agents_make_one_4_rank_run_with_both_nodes(tmp_path, dtprobe_popen, free_port):
    run_dir, port = tmp_path / "run", free_port()
    common = ("--nnodes", "2", "--nproc", "2", "--rdzv-endpoint", f"127.0.0.1:{port}", "--run-dir", str(run_dir),
              "--steps", "3", "--seq-len", "32", "--batch-size", "4")
    agents = [dtprobe_popen(*common, "--node-rank", str(k), log=tmp_path / f"node{k}.log") for k in (0, 1)]
    try:
        codes = [agent.wait(timeout=900) for agent in agents]
    finally:
        for agent in agents:
            if agent.poll() is None:
                agent.kill()
    logs = "\n".join((tmp_path / f"node{k}.log").read_text() for k in (0, 1))
    assert codes == [0, 0], logs
    store = RunStore.open(run_dir)
    assert store.manifest.status == "finished" and store.manifest.world_size == 4 and store.manifest.nnodes == 2
    assert [node_rank for node_rank, _host in store.manifest.nodes] == [0, 1]
    assert sorted(store.table("steps")["rank"].unique()) == [0, 1, 2, 3]


def test_crashed_run_leaves_a_store_that_loads_marked_crashed(tmp_path, dtprobe_run):
    run_dir = tmp_path / "run"
    toml = tmp_path / "job.toml"
    toml.write_text('nproc = 2\n[train]\nsteps = 40\nseq_len = 32\nbatch_size = 4\n')
    proc = dtprobe_run("--config", str(toml), "--steps", "12", "--inject", "crash:rank=1,step=5",
                       "--run-dir", str(run_dir))
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "first failure on rank 1" in proc.stderr and "injected: crash on rank 1 at step 5" in proc.stderr
    store = RunStore.open(run_dir)
    assert store.manifest.status == "crashed" and store.manifest.config["train"]["steps"] == 12   # flag won
    faults = store.table("faults")
    crash = faults[faults["kind"] == "crash"]
    assert (crash["rank"].tolist(), crash["step"].tolist(), crash["injected"].tolist()) == ([1], [5], [True])
    steps = store.table("steps")
    assert sorted(steps.loc[steps["rank"] == 1, "step"]) == [0, 1, 2, 3, 4]


def test_same_seed_gives_the_same_losses_on_2_ranks(tmp_path, dtprobe_run):
    args = ("--nproc", "2", "--steps", "3", "--seq-len", "32", "--batch-size", "4", "--no-collectives",
            "--no-devices", "--data", "text", "--seed", "7")
    losses = []
    for name in ("a", "b"):
        proc = dtprobe_run(*args, "--run-dir", str(tmp_path / name))
        assert proc.returncode == 0, proc.stdout + proc.stderr
        steps = RunStore.open(tmp_path / name).table("steps").sort_values(["rank", "step"])
        losses.append(steps[["rank", "step", "loss"]].to_numpy().tolist())
    assert len(losses[0]) == 6 and losses[0] == losses[1]


def test_run_with_telemetry_off_writes_no_events_but_reports_its_loop_time(tmp_path, dtprobe_run):
    run_dir = tmp_path / "off"
    proc = dtprobe_run("--nproc", "1", "--steps", "3", "--seq-len", "16", "--batch-size", "2", "--no-collect",
                       "--run-dir", str(run_dir))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert not (run_dir / "events").exists()
    timing = json.loads((run_dir / "loop_timing.json").read_text())
    assert timing["steps"] == 3 and timing["loop_s"] >= timing["first_step_s"] > 0
    assert "steps 3 (telemetry off)" in proc.stderr
    assert RunStore.open(run_dir).manifest.status == "finished"


def test_a_compaction_that_fails_keeps_the_jobs_exit_code_and_says_how_to_retry(tmp_path, run_python):
    run_dir = tmp_path / "run"
    failing = ("import sys, dtprobe.cli as c, dtprobe.store as s\n"
               "from dtprobe.store.errors import TraceError\n"
               "def fail(run_dir, **kw): raise TraceError(f'{run_dir}/events: damaged (test)')\n"
               "s.compact = fail\n" + DRIVER)
    proc = run_python(failing, "run", "--nproc", "1", "--steps", "2", "--seq-len", "16", "--batch-size", "2",
                      "--no-devices", "--run-dir", str(run_dir), timeout_s=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr
    said = "".join(proc.stderr.split())     # the console wraps long paths anywhere: compare without whitespace
    for expected in (f"{run_dir} was not compacted ({run_dir}/events: damaged (test))",
                     f"`dtprobe compact {run_dir}` tries again"):
        assert "".join(expected.split()) in said, proc.stderr
    assert not (run_dir / "tables").exists() and RunStore.open(run_dir).manifest.status == "finished"


@pytest.mark.parametrize("sig", ["SIGINT", "SIGTERM"])
def test_ctrl_c_or_sigterm_stops_every_worker_and_marks_the_run_crashed(tmp_path, sig, dtprobe_popen):
    import signal
    import time

    run_dir = tmp_path / "run"
    launcher = dtprobe_popen("--nproc", "2", "--steps", "100000", "--seq-len", "16", "--batch-size", "2",
                             "--no-devices", "--run-dir", str(run_dir), log=tmp_path / "log")
    try:
        steps_file = run_dir / "events" / "steps" / "rank00000.jsonl"
        deadline = time.monotonic() + 600
        while not (steps_file.exists() and steps_file.stat().st_size) and time.monotonic() < deadline:
            assert launcher.poll() is None, (tmp_path / "log").read_text()
            time.sleep(0.1)
        launcher.send_signal(getattr(signal, sig))
        rc = launcher.wait(timeout=120)
        assert rc == 130, f"exit {rc}; dtprobe run's output:\n{(tmp_path / 'log').read_text()[-4000:]}"
    finally:
        if launcher.poll() is None:
            launcher.kill()
    store = RunStore.open(run_dir)
    assert store.manifest.status == "crashed" and store.manifest.extra["exit_code"] == 130
    for info in store.manifest.ranks:
        assert not Path(f"/proc/{info.pid}").exists() or "zombie" in Path(f"/proc/{info.pid}/status").read_text()
