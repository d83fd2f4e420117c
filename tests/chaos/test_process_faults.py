"""Faults caused from outside the training processes (no ``--inject``): the verdict must come from telemetry.

Each test starts a tiny real job, hurts one worker with a signal, a CPU hog or quota, a memory limit, a slow data
pipeline of the user's script, or damaged checkpoint bytes, and asserts the finding ``dtprobe analyze RUN --format
json`` gives: its code, its severity and the rank.
Set ``DTPROBE_CHAOS_RUNS=/some/dir`` to keep each scenario's run directory there for inspection.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

import psutil
import pytest

from harness import (analyze, assert_only_confirmed_stragglers, cgroup_v1_cpu_available, cgroup_v1_memory_available,
                     committed_checkpoints, dtprobe_run_cmd, findings_of, flip_bit, largest_data_file, pin,
                     steps_done, summary, torchrun_cmd, truncate, verdicts_on)

pytestmark = [pytest.mark.multiproc, pytest.mark.chaos]

HERE = Path(__file__).resolve().parent
JOB_TIMEOUT_S = 300
"""Outer bound of every job: launcher, workers and their restarts."""
PAUSE_S = 2.0
"""How long the pause test keeps its worker stopped each time."""


def _per_rank(value) -> dict[int, object]:
    """A per-rank evidence value as {rank: value}: a JSON object keyed by rank, or a list of {"rank", ...}."""
    if isinstance(value, dict):
        return {int(k): v for k, v in value.items()}
    return {int(item["rank"]): item for item in value or ()}


def _crash_causes(finding: dict) -> dict[int, str]:
    """{rank: cause class} of a RANK_CRASH finding: from its per-crash ``details`` (rank, cause), or its
    top-level ``cause`` when it names one rank."""
    ev = finding["evidence"]
    causes = {int(d["rank"]): d.get("cause") for d in ev.get("details") or () if isinstance(d, dict) and "rank" in d}
    if isinstance(ev.get("cause"), str) and len(finding["ranks"]) == 1:
        causes.setdefault(finding["ranks"][0], ev["cause"])
    return causes


def _liveness(finding: dict) -> dict[int, str]:
    """{rank: liveness verdict} of a HANG finding (evidence ``liveness``)."""
    per_rank = _per_rank(finding["evidence"]["liveness"])
    return {r: v if isinstance(v, str) else v["liveness"] for r, v in per_rank.items()}


# --------------------------------------------------------------------------------------- SIGKILL of a worker


# Exclusive: the verdicts besides RANK_CRASH must stand on the rows (``assert_only_confirmed_stragglers``), and a
# neighbouring test's load makes real stragglers of these 2-rank jobs, which the harness's rows need not confirm.
@pytest.mark.exclusive
def test_sigkill_of_a_worker_with_restart_is_a_recovered_rank_crash_naming_it(run_dir, launch):
    run = run_dir("sigkill_restart")
    job = launch(dtprobe_run_cmd(run, "--nproc", "2", "--steps", "14", "--ckpt-every", "4", "--max-restarts", "1"),
                 run, timeout_s=JOB_TIMEOUT_S)
    job.wait_steps(1, 6)                      # the checkpoint after step 3 is committed
    job.signal(1, signal.SIGKILL)
    assert job.wait() == 0, job.output()[-3000:]           # restarted from the checkpoint and finished

    doc = analyze(run)
    crashes = findings_of(doc, "RANK_CRASH")
    assert [(f["severity"], f["ranks"]) for f in crashes] == [("warning", [1])], summary(doc)
    assert _crash_causes(crashes[0]).get(1) == "killed_by_signal", crashes[0]["evidence"]
    assert crashes[0]["evidence"]["recovered"] is True, crashes[0]["evidence"]
    assert_only_confirmed_stragglers(run, doc, ("HANG", "STRAGGLER", "COLLECTIVE_MISMATCH"))


@pytest.mark.exclusive
def test_sigkill_of_a_worker_without_restart_is_a_critical_rank_crash_naming_it(run_dir, launch):
    run = run_dir("sigkill_no_restart")
    job = launch(dtprobe_run_cmd(run, "--nproc", "2", "--steps", "20"), run, timeout_s=JOB_TIMEOUT_S)
    job.wait_steps(0, 6)
    job.signal(0, signal.SIGKILL)
    assert job.wait() != 0

    doc = analyze(run)
    crashes = findings_of(doc, "RANK_CRASH")
    assert [(f["severity"], f["ranks"]) for f in crashes] == [("critical", [0])], summary(doc)
    assert _crash_causes(crashes[0]).get(0) == "killed_by_signal", crashes[0]["evidence"]
    assert crashes[0]["evidence"]["recovered"] is False, crashes[0]["evidence"]
    # rank 1 died of the lost connection (or torchrun's SIGTERM): a consequence, not a second culprit
    assert_only_confirmed_stragglers(run, doc, ("HANG", "STRAGGLER", "COLLECTIVE_MISMATCH"))


def test_a_worker_the_kernels_oom_killer_ends_is_a_rank_crash_out_of_memory(run_dir, launch, memory_limit):
    assert cgroup_v1_memory_available(), ("needs a writable cgroup v1 memory controller at /sys/fs/cgroup/memory: "
                                          "run the tests as root on a host that mounts it")
    run = run_dir("oom_kill")
    # a user's DDP script under dtprobe launch; its rank 1 is moved into a 256 MiB memory cgroup (only what it
    # allocates after the move is charged), then allocates 1 GiB at step 40, as a batch far larger than the
    # others' would: the kernel's OOM killer ends it with SIGKILL, which is all torchrun reports
    script = Path(__file__).resolve().parents[2] / "examples" / "launch" / "train_ddp.py"
    cmd = [sys.executable, "-m", "dtprobe.cli", "launch", "--nproc", "2", "--run-dir", str(run), "--no-devices",
           str(script), "--epochs", "20", "--alloc-rank", "1", "--alloc-step", "40", "--alloc-mb", "1024"]
    job = launch(cmd, run, timeout_s=JOB_TIMEOUT_S)
    pid = job.worker_pid(1)
    memory_limit(256 << 20).add(pid)
    moved_at = steps_done(run, 1)
    assert job.wait() != 0, job.output()[-3000:]

    doc = analyze(run)
    crashes = findings_of(doc, "RANK_CRASH")
    assert [(f["severity"], f["ranks"]) for f in crashes] == [("critical", [1])], summary(doc)
    ev = crashes[0]["evidence"]
    assert (ev["signal"], ev["cause"]) == ("SIGKILL", "out_of_memory"), ev
    assert moved_at < 40 and ev["step"] == 40, (moved_at, ev)
    # the kernel log names its pid (the launcher runs as root here, in the kernel's pid namespace)
    assert f"Killed process {pid} (" in ev["oom_kill"], ev
    assert "SIGKILL from the kernel's OOM killer" in crashes[0]["title"], crashes[0]["title"]
    assert "OOM killer" in crashes[0]["recommendation"], crashes[0]["recommendation"]


def test_a_dataloader_worker_the_oom_killer_ends_is_its_ranks_crash_out_of_memory_not_a_hang(run_dir, launch,
                                                                                             memory_limit):
    assert cgroup_v1_memory_available(), ("needs a writable cgroup v1 memory controller at /sys/fs/cgroup/memory: "
                                          "run the tests as root on a host that mounts it")
    run = run_dir("oom_kill_data_worker")
    # the same script with 2 DataLoader worker processes per rank; rank 1 and its workers in a 768 MiB memory
    # cgroup, and one of its workers allocates 2 GiB at its 20th batch: the OOM killer ends that worker (by then
    # the largest process of the cgroup), rank 1 raises "DataLoader worker (pid(s) N) exited unexpectedly" seconds
    # later, while rank 0 waits for it
    script = Path(__file__).resolve().parents[2] / "examples" / "launch" / "train_ddp.py"
    cmd = [sys.executable, "-m", "dtprobe.cli", "launch", "--nproc", "2", "--run-dir", str(run), "--no-devices",
           str(script), "--epochs", "20", "--num-workers", "2", "--alloc-rank", "1", "--alloc-step", "20",
           "--alloc-mb", "2048", "--alloc-in-data-worker"]
    job = launch(cmd, run, timeout_s=JOB_TIMEOUT_S)
    pid = job.worker_pid(1)
    limit = memory_limit(768 << 20)
    limit.add(pid)
    job.wait_steps(1, 2)                       # its DataLoader workers run: moved too if forked before the rank
    for child in psutil.Process(pid).children():
        limit.add(child.pid)
    assert job.wait() != 0, job.output()[-3000:]

    doc = analyze(run)
    assert not verdicts_on(doc, ("HANG",)), summary(doc)     # rank 1 was on its way to its crash, not stuck
    crashes = findings_of(doc, "RANK_CRASH")
    assert [(f["severity"], f["ranks"]) for f in crashes] == [("critical", [1])], summary(doc)
    ev = crashes[0]["evidence"]
    assert (ev["error_type"], ev["cause"]) == ("RuntimeError", "out_of_memory"), ev
    assert "DataLoader worker" in ev["error_message"] and ev["oom_kill"].startswith("its DataLoader worker "), ev
    assert "OOM killer ended a DataLoader worker of rank 1" in crashes[0]["recommendation"], crashes[0]
    assert [w["arrived_ranks"] for w in ev["waited_at"]] == [[0]], ev


def _launched_ddp_straggler(run: Path, launch, rank: int, cause: str, *fault: str) -> dict:
    """The STRAGGLER verdict on ``rank`` (of ``cause``) of examples/launch/train_ddp.py under ``dtprobe launch`` on
    2 ranks, 25 epochs of a 3-layer MLP, with the script's ``fault`` options. Its steps take about 10 ms before the
    fault: another test's ranks on the same cores delay its arrivals by as much as the fault does, so the tests that
    call it are ``exclusive``."""
    script = Path(__file__).resolve().parents[2] / "examples" / "launch" / "train_ddp.py"
    cmd = [sys.executable, "-m", "dtprobe.cli", "launch", "--nproc", "2", "--run-dir", str(run), "--no-devices",
           str(script), "--epochs", "25", "--hidden", "256", "--layers", "3", *fault]
    job = launch(cmd, run, timeout_s=JOB_TIMEOUT_S)
    assert job.wait() == 0, job.output()[-3000:]
    return _straggler_verdict(analyze(run), rank, cause=cause)


@pytest.mark.exclusive
def test_a_slow_data_pipeline_on_one_rank_of_a_launched_script_is_a_straggler_whose_cause_is_data(run_dir, launch):
    # a user's DDP script under dtprobe launch: from its batch 60 on, rank 1's collate function takes 20 ms more (a
    # slow disk or decode on its node), 2 to 4 times its steps; the launch's hooks time the DataLoader's batches
    finding = _launched_ddp_straggler(run_dir("slow_data_launch"), launch, 1, "data", "--slow-data-rank", "1",
                                      "--slow-data-ms", "20", "--slow-data-from", "60")
    ev = finding["evidence"]
    # the data excess is a mean over the window's steps where rank 1 was late; a window detected early still holds
    # steps before the fault, where it was late by chance with no extra data time: 75% of the 20 ms on the faulty
    # share of those steps (each faulty step is late: the 20 ms exceed a whole step)
    first, last = ev["window"]
    late_steps = round(ev["positive_frac"] * ev["window_steps"])
    faulty = min(last - max(first, 60) + 1, late_steps)
    assert ev["cause_excess_ms"]["data"] >= 0.75 * 20 * faulty / late_steps, ev
    assert 60 < ev["detected_at_step"] <= 60 + 25, ev      # within a window (and the steps of its minimum time)
    assert "loading data" in finding["recommendation"], finding["recommendation"]


@pytest.mark.exclusive
def test_rank_0_only_work_after_the_optimizer_step_is_a_straggler_sent_to_look_outside_its_phases(run_dir, launch):
    # the same script: from optimizer step 60 on, rank 0 alone computes 20 ms after each optimizer step (a metric it
    # logs); its forward and backward stay as rank 1's, so the advice is to look for work only rank 0 runs
    finding = _launched_ddp_straggler(run_dir("rank0_work_launch"), launch, 0, "compute", "--rank0-work-ms", "20",
                                      "--rank0-work-from", "60")
    ev = finding["evidence"]
    assert ev["outside_phases"] is True, ev
    assert ev["cause_excess_ms"]["compute"] >= 10 and ev["forward_excess_ms"] < 5, ev
    assert "if rank == 0:" in finding["recommendation"], finding["recommendation"]
    assert 60 < ev["detected_at_step"] <= 60 + 25, ev


@pytest.mark.exclusive
def test_a_rank_with_a_larger_batch_is_a_straggler_not_sent_outside_its_phases(run_dir, launch):
    # the counter-case: rank 0's extra time is in its forward and backward (batches of 128 where rank 1 has 16)
    finding = _launched_ddp_straggler(run_dir("rank0_bigger_batch"), launch, 0, "compute", "--rank0-batch-factor",
                                      "8", "--rank0-work-from", "60")
    ev = finding["evidence"]
    assert ev["outside_phases"] is False, ev
    assert "if rank == 0:" not in finding["recommendation"], finding["recommendation"]


# --------------------------------------------------------------------------------------- SIGSTOP of a worker


@pytest.mark.exclusive
def test_sigstop_of_a_worker_is_a_hang_naming_it_stopped(run_dir, launch):
    run = run_dir("sigstop")
    # devices on: the liveness verdict reads the host sampler's rows after the stall
    job = launch(dtprobe_run_cmd(run, "--nproc", "2", "--steps", "60", "--collective-timeout", "6",
                                 "--device-interval", "0.2", devices=True), run, timeout_s=JOB_TIMEOUT_S)
    job.wait_steps(1, 22)                     # a full straggler window first: the verdict judges 20 steps
    job.signal(1, signal.SIGSTOP)
    job.end_stopped(1)                        # after rank 0's watchdog ended it and torchrun stopped the job
    assert job.wait() != 0

    doc = analyze(run)
    hangs = findings_of(doc, "HANG")
    assert [(f["severity"], f["ranks"]) for f in hangs] == [("critical", [1])], summary(doc)
    assert _liveness(hangs[0]).get(1) == "stopped", hangs[0]["evidence"]
    assert_only_confirmed_stragglers(run, doc, ("RANK_CRASH", "STRAGGLER", "COLLECTIVE_MISMATCH"))


def test_sigstop_then_sigcont_of_a_worker_is_a_rank_stall_naming_it_frozen(run_dir, launch):
    # a process paused and resumed (a scheduler's or debugger's SIGSTOP, a VM pause): the job goes on, the
    # others wait; no HANG (every collective completed), no crash, but the lost time is reported
    run = run_dir("sigstop_sigcont")
    job = launch(dtprobe_run_cmd(run, "--nproc", "4", "--steps", "40", "--device-interval", "0.25", devices=True),
                 run, timeout_s=JOB_TIMEOUT_S)
    paused_at = []
    for step in (12, 26):
        job.wait_steps(2, step)
        paused_at.append(step)
        job.signal(2, signal.SIGSTOP)
        time.sleep(PAUSE_S)
        job.signal(2, signal.SIGCONT)
    assert job.wait() == 0, job.output()[-3000:]

    doc = analyze(run)
    stalls = verdicts_on(doc, ("RANK_STALL",))
    assert [f["ranks"] for f in stalls] == [[2]], summary(doc)
    ev = stalls[0]["evidence"]
    pauses = sorted(ev["stalls"], key=lambda s: -s["stall_ms"])[:2]
    # each pause is one stall, at or after the step it came in, whether rank 2 was stopped before the collective
    # (late_arrival) or inside it (in_collective), and its sampler wrote nothing meanwhile
    assert sorted(s["step"] for s in pauses)[0] >= paused_at[0] and len({s["step"] for s in pauses}) == 2, ev
    assert all(0.8 * PAUSE_S * 1e3 <= s["stall_ms"] <= 1.3 * PAUSE_S * 1e3 for s in pauses), ev
    assert all(s["liveness"] == "frozen" for s in pauses) and ev["liveness"] == "frozen", ev
    assert ev["lost_ms"] >= 2 * 0.8 * PAUSE_S * 1e3
    assert not verdicts_on(doc, ("HANG", "RANK_CRASH", "COLLECTIVE_MISMATCH")), summary(doc)
    assert_only_confirmed_stragglers(run, doc, ("STRAGGLER",))


# ------------------------------------------------------------------------------------ CPU slowdown of one rank


def _straggler_verdict(doc: dict, rank: int, *, cause: str = "compute") -> dict:
    stragglers = verdicts_on(doc, ("STRAGGLER",))
    assert [f["ranks"] for f in stragglers] == [[rank]], summary(doc)
    assert stragglers[0]["evidence"]["cause"] == cause, stragglers[0]["evidence"]
    assert not verdicts_on(doc, ("HANG", "RANK_CRASH", "COLLECTIVE_MISMATCH")), summary(doc)
    return stragglers[0]


@pytest.mark.exclusive
def test_busy_process_on_one_ranks_core_makes_it_a_compute_straggler(run_dir, launch, busy_loop):
    run = run_dir("cpu_hog_2ranks")
    # the host sampler on (every 0.5 s), as in a user's run: it reads each rank's main-thread run-queue wait
    job = launch(dtprobe_run_cmd(run, "--nproc", "2", "--steps", "40", "--device-interval", "0.5", devices=True),
                 run, timeout_s=JOB_TIMEOUT_S)
    for rank in (0, 1):                       # each rank alone on its core; the hog shares rank 1's
        pin(job.worker_pid(rank), rank)
    job.wait_steps(1, 3)
    busy_loop(1, duty=0.8)                    # real-time, 80% of every 10 ms: rank 1 keeps 20% of its core
    assert job.wait() == 0, job.output()[-3000:]
    finding = _straggler_verdict(analyze(run), 1)
    # the kernel's run-queue count: the hog holds rank 1's core 80% of the time, rank 0 has its core to itself
    # (its own gloo and sampler threads, and whatever else the test host runs there, cost it a fraction of that)
    ev = finding["evidence"]
    assert ev["cpu_wait_frac"] >= 0.4 and ev["peer_cpu_wait_frac"] < 0.25 * ev["cpu_wait_frac"], ev
    assert "waited for a CPU" in finding["title"] and "Another process" in finding["recommendation"], finding
    assert ev["off_cpu"] is None, ev          # its lost time is the hog's: not called off the CPU


@pytest.mark.exclusive
def test_busy_process_on_one_ranks_core_of_a_launched_fsdp2_script_is_named_by_its_idle_peer(run_dir, launch,
                                                                                           busy_loop):
    run = run_dir("cpu_hog_fsdp2_launch")
    # a user's FSDP2 script under dtprobe launch (host sampler every 0.5 s), each rank on its own core; after 50
    # steps an ordinary process spins on rank 1's core and the kernel shares it between the two
    script = Path(__file__).resolve().parents[2] / "examples" / "launch" / "train_fsdp2.py"
    cmd = [sys.executable, "-m", "dtprobe.cli", "launch", "--nproc", "2", "--run-dir", str(run),
           "--device-interval", "0.5", str(script), "--steps", "300"]
    job = launch(cmd, run, timeout_s=JOB_TIMEOUT_S)
    for rank in (0, 1):
        pin(job.worker_pid(rank), rank)
    job.wait_steps(1, 50)
    busy_loop(1, duty=1.0, realtime=False)
    shared_from = steps_done(run, 1)
    assert job.wait() == 0, job.output()[-3000:]
    finding = _straggler_verdict(analyze(run), 1)
    ev = finding["evidence"]
    # its steps are mostly collectives, where the kernel takes its core as often as between them: its arrivals do
    # not single it out, the kernel's counts do (its run-queue wait, its peer's idle time)
    assert ev["detected_by"] == "cpu_wait" and ev["detected_at_step"] > shared_from - 20, (shared_from, ev)
    assert ev["cpu_wait_frac"] - ev["peer_cpu_wait_frac"] >= 0.15 and ev["peer_idle_frac"] >= 0.1, ev
    assert "waited for a CPU" in finding["title"] and "Another process" in finding["recommendation"], finding


@pytest.mark.exclusive
def test_cpu_quota_of_one_rank_among_more_ranks_than_cores_makes_it_a_compute_straggler(run_dir, launch, cpu_quota):
    assert cgroup_v1_cpu_available(), ("needs a writable cgroup v1 cpu controller at /sys/fs/cgroup/cpu: run the "
                                       "tests as root on a host that mounts it")
    run = run_dir("cpu_quota_4ranks")
    # 40 steps, the quota in place from rank 2's start (its ranks/ file appears before its first step): every
    # step of the straggler verdict's 20-step window is slowed, however fast the steps are (a quota set after a
    # measured step count lands late: the steps' rows reach the disk a flush interval after them). The host
    # sampler on (every 0.5 s), as in a user's run, reads the kernel's throttle counter of each rank's cgroup.
    job = launch(dtprobe_run_cmd(run, "--nproc", "4", "--steps", "40", "--device-interval", "0.5", devices=True),
                 run, timeout_s=JOB_TIMEOUT_S)
    pid = job.worker_pid(2)
    # a third of its fair share of the cores (4 ranks share them; this test runs alone): 3x slower than its peers
    cpu_quota(min(1.0, len(os.sched_getaffinity(0)) / 4) / 3).add(pid)
    assert job.wait() == 0, job.output()[-3000:]
    finding = _straggler_verdict(analyze(run), 2)
    ev = finding["evidence"]
    # the kernel held rank 2 back for a clear share of its window (a third of its CPU: most of each period),
    # its peers never; the kernel counts the throttled time as run-queue wait too (read here, beside peers that
    # share cores two by two), and the finding does not call that a shared core
    assert ev["cpu_throttled_frac"] >= 0.2 and ev["peer_cpu_throttled_frac"] == 0.0, ev
    assert ev["cpu_wait_frac"] is not None and ev["peer_cpu_wait_frac"] is not None, ev
    assert "CPU quota" in finding["recommendation"] and "waited for a CPU" not in finding["title"], finding
    assert ev["off_cpu"] is None, ev          # the quota holds it back: not called off the CPU


@pytest.mark.exclusive
def test_cpu_quota_on_a_pipeline_stage_of_a_launched_script_names_it_against_its_own_first_steps(
        run_dir, launch, cpu_quota):
    assert cgroup_v1_cpu_available(), ("needs a writable cgroup v1 cpu controller at /sys/fs/cgroup/cpu: run the "
                                       "tests as root on a host that mounts it")
    run = run_dir("cpu_quota_pipeline_launch")
    # a user's 2-stage pipeline script (torch.distributed.pipelining, no data parallelism: no other pipeline runs
    # either stage) under dtprobe launch; stage 1 held to 40% of a core after 40 of its 120 steps
    script = Path(__file__).resolve().parents[2] / "examples" / "launch" / "train_pipeline.py"
    cmd = [sys.executable, "-m", "dtprobe.cli", "launch", "--nproc", "2", "--run-dir", str(run), "--no-devices",
           str(script), "--steps", "120", "--dim", "512", "--batch-size", "256"]
    job = launch(cmd, run, timeout_s=JOB_TIMEOUT_S)
    pid = job.worker_pid(1)
    job.wait_steps(1, 40)
    cpu_quota(0.4).add(pid)
    held_from = steps_done(run, 1)          # the steps on disk then: its rows reach the disk a flush later
    assert job.wait() == 0, job.output()[-3000:]
    finding = _straggler_verdict(analyze(run), 1)
    ev = finding["evidence"]
    assert (finding["group"], ev["detected_by"], ev["stage"]) == ("pp", "stage_trend", 1), ev
    assert ev["baseline_window"][0] <= 1 and ev["window"][0] > ev["baseline_window"][1], ev
    # it grew against its peer (stage 0 kept its pace) and the step with it; named after the quota, within two and
    # a half windows of it (the first window whose median is slowed, and its spread small enough: the other
    # tests of the suite share the cores)
    assert ev["rise"] >= 0.3 and ev["step_ms_after"] > 1.1 * ev["step_ms_before"], ev
    assert held_from < ev["detected_at_step"] <= held_from + 50, (held_from, ev)


@pytest.mark.exclusive
def test_cpu_quota_on_a_rank_of_a_launched_fsdp2_script_is_named_by_the_steps_it_stalled(run_dir, launch, cpu_quota):
    assert cgroup_v1_cpu_available(), ("needs a writable cgroup v1 cpu controller at /sys/fs/cgroup/cpu: run the "
                                       "tests as root on a host that mounts it")
    run = run_dir("cpu_quota_fsdp2_launch")
    # a user's FSDP2 script (examples/launch/train_fsdp2.py) under dtprobe launch, rank 1 held to 40% of a core
    # after 30 of its 200 steps: a steps' worth of its CPU every quota period, then frozen for the rest of it,
    # mostly inside a collective it had reached
    script = Path(__file__).resolve().parents[2] / "examples" / "launch" / "train_fsdp2.py"
    cmd = [sys.executable, "-m", "dtprobe.cli", "launch", "--nproc", "2", "--run-dir", str(run),
           "--device-interval", "0.5", str(script), "--steps", "200"]
    job = launch(cmd, run, timeout_s=JOB_TIMEOUT_S)
    pid = job.worker_pid(1)
    job.wait_steps(1, 30)
    cpu_quota(0.4).add(pid)
    held_from = steps_done(run, 1)
    assert job.wait() == 0, job.output()[-3000:]
    finding = _straggler_verdict(analyze(run), 1)
    ev = finding["evidence"]
    # the kernel held it back, its peer never; the group's steps stalled about as long, which is what named it
    assert ev["detected_by"] == "cpu_throttle" and ev["peer_cpu_throttled_frac"] == 0.0, ev
    assert ev["step_stall_frac"] is not None and ev["step_stall_frac"] >= 0.05, ev
    assert held_from < ev["detected_at_step"], (held_from, ev)
    assert "CPU quota" in finding["recommendation"], finding


# ------------------------------------------------------------------------- checkpoint damaged before a restart


@pytest.mark.parametrize("damage", [truncate, flip_bit], ids=["truncated", "bit_flipped"])
def test_damaged_newest_checkpoint_is_checkpoint_corrupt_and_recovery_falls_back(run_dir, launch, damage):
    run = run_dir(f"ckpt_{damage.__name__}")
    job = launch(dtprobe_run_cmd(run, "--nproc", "2", "--steps", "12", "--ckpt-every", "3", "--max-restarts", "1"),
                 run, timeout_s=JOB_TIMEOUT_S)
    job.wait_for(lambda: len(committed_checkpoints(run)) >= 2, what="two committed checkpoints")
    for rank in (0, 1):                       # freeze the job so no newer checkpoint appears meanwhile
        job.signal(rank, signal.SIGSTOP)
    *_, previous, newest = committed_checkpoints(run)
    damaged = largest_data_file(newest)
    damage(damaged)
    job.signal(1, signal.SIGKILL)             # the crash; the restart must find the damage on load
    job.signal(0, signal.SIGCONT)
    assert job.wait() == 0, job.output()[-3000:]

    prev_step, newest_step = (int(p.name.removeprefix("step")) for p in (previous, newest))
    doc = analyze(run)
    corrupt = findings_of(doc, "CHECKPOINT_CORRUPT")
    assert [f["severity"] for f in corrupt] == ["warning"], summary(doc)   # fell back: recovered
    ev = corrupt[0]["evidence"]
    assert (Path(ev["path"]).resolve(), ev["file"]) == (newest.resolve(), damaged.name), ev    # names the file
    assert (ev["ckpt_step"], ev["fallback_step"]) == (newest_step, prev_step), ev
    assert corrupt[0]["ranks"] and set(corrupt[0]["ranks"]) <= {0, 1}, corrupt[0]  # the rank(s) that found it
    crashes = findings_of(doc, "RANK_CRASH")
    assert [(f["severity"], f["ranks"]) for f in crashes] == [("warning", [1])], summary(doc)


# --------------------------------------------------------------------------------- a collective issued wrong


def test_rank_issuing_a_different_collective_is_a_collective_mismatch_not_a_hang(run_dir, launch):
    run = run_dir("collective_mismatch")
    # 3 ranks, so the odd one is the minority; rank 2 all_gathers at step 4 where its peers all_reduce, and
    # every rank dies on the 8 s process-group timeout
    job = launch(torchrun_cmd(HERE / "mismatch_job.py", str(run), "--odd-rank", "2", "--odd-step", "4",
                              "--pg-timeout-s", "8", nproc=3), run, timeout_s=JOB_TIMEOUT_S)
    assert job.wait() != 0

    doc = analyze(run)
    mismatches = findings_of(doc, "COLLECTIVE_MISMATCH")
    assert [(f["severity"], f["ranks"]) for f in mismatches] == [("critical", [2])], summary(doc)
    ev = json.dumps(mismatches[0]["evidence"])
    assert "allgather" in ev and "allreduce" in ev, ev                     # what each issued
    assert mismatches[0]["evidence"]["step"] == 4, ev
    assert not findings_of(doc, "HANG"), summary(doc)
    assert_only_confirmed_stragglers(run, doc, ("STRAGGLER",))
    # the peers' deaths on the timeout it caused are not crashes of theirs (a false positive on another rank)
    assert not [f for f in verdicts_on(doc, ("RANK_CRASH",)) if set(f["ranks"]) - {2}], summary(doc)


def test_a_rank_reducing_a_longer_buffer_is_a_size_mismatch_and_the_receiver_s_abort_its_consequence(run_dir, launch):
    run = run_dir("size_mismatch")
    # rank 2 all_reduces 16 more floats than its peers at step 4; gloo's size check aborts the member receiving its
    # larger message (SIGABRT, before that member's row reaches disk). The verdict is on rank 2, not on the aborted
    # rank, whose death the header tells as the mismatch's consequence
    job = launch(torchrun_cmd(HERE / "mismatch_job.py", str(run), "--odd-rank", "2", "--odd-step", "4",
                              "--odd-extra", "16", "--pg-timeout-s", "8", nproc=3), run, timeout_s=JOB_TIMEOUT_S)
    assert job.wait() != 0

    doc = analyze(run)
    [m] = findings_of(doc, "COLLECTIVE_MISMATCH")
    assert (m["severity"], m["ranks"], m["evidence"]["kind"], m["evidence"]["step"]) == (
        "critical", [2], "different", 4), summary(doc)
    grads = 4 * (32 * 64 + 64 + 64 * 32 + 32)
    assert f"issued allreduce (float32, {grads + 64:,} B) where" in m["title"], m["title"]
    assert "64 bytes more" in m["recommendation"] and "Received data size" in m["recommendation"]
    assert not verdicts_on(doc, ("HANG", "RANK_CRASH")), summary(doc)
    crashes = doc["metrics"]["run"]["crashes"]
    assert crashes and all(c["explained_by"] == "COLLECTIVE_MISMATCH" and c["rank"] != 2 for c in crashes), crashes


def test_a_collective_only_rank_0_issues_after_the_loop_is_a_collective_mismatch_naming_the_others(run_dir, launch):
    run = run_dir("rank0_metric")
    # every rank runs all 8 steps; then rank 0 alone all-reduces a metric, while ranks 1 and 2 return: rank 0
    # fails when their connections close. Not a HANG of frozen ranks
    job = launch(torchrun_cmd(HERE / "mismatch_job.py", str(run), "--rank0-metric", "--pg-timeout-s", "8", nproc=3),
                 run, timeout_s=JOB_TIMEOUT_S)
    assert job.wait() != 0

    doc = analyze(run)
    mismatches = findings_of(doc, "COLLECTIVE_MISMATCH")
    assert [(f["severity"], f["ranks"]) for f in mismatches] == [("critical", [1, 2])], summary(doc)
    ev = mismatches[0]["evidence"]
    assert (ev["kind"], ev["expected"]["op"]) == ("ended", "allreduce"), ev
    assert {r: (e["last_step"], e["steps_behind"]) for r, e in ev["ended"].items()} == {"1": (7, 0), "2": (7, 0)}
    assert "outside any step" in mismatches[0]["title"] and "if rank == 0:" in mismatches[0]["recommendation"]
    assert not verdicts_on(doc, ("HANG", "RANK_CRASH")), summary(doc)


def test_rank_whose_script_ended_while_its_peers_trained_is_a_collective_mismatch(run_dir, launch):
    run = run_dir("ended_early")
    # rank 1's data ends before step 4: its script returns and closes its probe while ranks 0 and 2 enter step 4's
    # all-reduce; they fail when its connection closes (or on the 8 s timeout)
    job = launch(torchrun_cmd(HERE / "mismatch_job.py", str(run), "--odd-rank", "1", "--odd-step", "4", "--odd-end",
                              "--pg-timeout-s", "8", nproc=3), run, timeout_s=JOB_TIMEOUT_S)
    assert job.wait() != 0

    doc = analyze(run)
    mismatches = findings_of(doc, "COLLECTIVE_MISMATCH")
    assert [(f["severity"], f["ranks"]) for f in mismatches] == [("critical", [1])], summary(doc)
    ev = mismatches[0]["evidence"]
    assert (ev["kind"], ev["step"], ev["ended"]["1"]["last_step"]) == ("ended", 4, 3), ev
    assert ev["expected"]["op"] == "allreduce", ev
    assert not verdicts_on(doc, ("HANG", "RANK_CRASH")), summary(doc)
    assert_only_confirmed_stragglers(run, doc, ("STRAGGLER",))
