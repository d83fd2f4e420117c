"""CPU time a rank lost: withheld by its cgroup quota (``CpuThrottle``, on fake cgroup files and on a real cgroup v1
quota) and waited for in the run queue (``RunQueueWait``, on a fake schedstat and on a real shared core), their
per-step shares (``cpu_throttle``), and what the straggler detector makes of them on hand-made lateness with known
answers: the CPU-throttle view, and a shared core named as the reason."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from dtprobe.analysis import straggler_causes as sc
from dtprobe.analysis import straggler_scores as ss
from dtprobe.analysis import cpu_throttle as ct
from dtprobe.analysis import stragglers as st
from dtprobe.collectors.devices import CpuThrottle, RunQueueWait

STEP_NS = 100_000_000


# ------------------------------------------------------------------------------------------- the counter


def _cgroup_files(tmp_path: Path, *, v2: bool = False) -> tuple[Path, Path]:
    root, proc = tmp_path / "cgroup", tmp_path / "proc_cgroup"
    (root / ("" if v2 else "cpu")).mkdir(parents=True)
    return root, proc


def _place(root: Path, proc: Path, path: str, throttled: int, *, v2: bool = False) -> None:
    """The process in cgroup ``path``, whose cpu.stat says ``throttled`` (ns in v1, us in v2)."""
    folder = root / ("" if v2 else "cpu") / path.lstrip("/")
    folder.mkdir(parents=True, exist_ok=True)
    key = "throttled_usec" if v2 else "throttled_time"
    (folder / "cpu.stat").write_text(f"nr_periods 10\nnr_throttled 3\n{key} {throttled}\n")
    proc.write_text("4:memory:/x\n1:cpu:" + path + "\n0::/\n" if not v2 else "0::" + path + "\n")


def test_counter_accumulates_the_cgroups_throttled_time_and_a_move_adds_nothing(tmp_path):
    root, proc = _cgroup_files(tmp_path)
    _place(root, proc, "/", 5_000)
    reader = CpuThrottle(proc_cgroup=str(proc), root=str(root))
    assert reader.read() == 0                                  # what the cgroup had before is not ours
    _place(root, proc, "/", 7_000)
    assert reader.read() == 2_000
    _place(root, proc, "/quota", 900_000)                      # moved: that cgroup's past is another's
    assert reader.read() == 2_000
    _place(root, proc, "/quota", 950_000)
    assert reader.read() == 52_000
    (root / "cpu" / "quota" / "cpu.stat").unlink()             # cgroup gone: the count stays where it was
    proc.write_text("1:cpu:/quota\n")
    assert reader.read() == 52_000


def test_counter_reads_cgroup_v2_microseconds(tmp_path):
    root, proc = _cgroup_files(tmp_path, v2=True)
    _place(root, proc, "/job.slice", 10, v2=True)
    reader = CpuThrottle(proc_cgroup=str(proc), root=str(root))
    assert reader.read() == 0
    _place(root, proc, "/job.slice", 35, v2=True)
    assert reader.read() == 25_000


def test_counter_is_none_where_no_cgroup_reports_throttling(tmp_path):
    root, proc = _cgroup_files(tmp_path, v2=True)
    proc.write_text("0::/\n")
    (root / "cpu.stat").write_text("usage_usec 100\n")         # a v2 root: no throttle fields
    assert CpuThrottle(proc_cgroup=str(proc), root=str(root)).read() is None
    assert CpuThrottle(proc_cgroup=str(tmp_path / "missing"), root=str(root)).read() is None
    proc.write_text("garbage\n\n0::/\n")                        # a line that is not id:controllers:path
    assert CpuThrottle(proc_cgroup=str(proc), root=str(root)).read() is None


CGROUP_CPU = Path("/sys/fs/cgroup/cpu")


def test_counter_on_a_real_quota_counts_the_time_the_kernel_held_this_process_back():
    assert (CGROUP_CPU / "cpu.cfs_quota_us").is_file() and os.access(CGROUP_CPU, os.W_OK), (
        "needs a writable cgroup v1 cpu controller at /sys/fs/cgroup/cpu: run the tests as root on a host that "
        "mounts it (as the chaos suite's CPU-quota test does)")
    folder = CGROUP_CPU / f"dtprobe_test_{uuid.uuid4().hex[:8]}"
    origin = next(line.split(":", 2)[2] for line in Path("/proc/self/cgroup").read_text().splitlines()
                  if "cpu" in line.split(":")[1].split(","))
    folder.mkdir()
    try:
        (folder / "cpu.cfs_quota_us").write_text("20000")         # 20 ms of every 100 ms period
        reader = CpuThrottle()
        reader.read()
        (folder / "cgroup.procs").write_text(str(os.getpid()))
        assert reader.read() == reader.read()                     # the move itself adds nothing
        before, t0 = reader.read(), time.monotonic()
        while time.monotonic() - t0 < 0.6:                        # busy: wants the whole core, gets a fifth
            pass
        wall = time.monotonic() - t0
        withheld = (reader.read() - before) / 1e9
        assert 0.5 * wall <= withheld <= 1.1 * wall
    finally:
        (CGROUP_CPU / origin.lstrip("/") / "cgroup.procs").write_text(str(os.getpid()))
        folder.rmdir()


def test_run_queue_wait_reads_the_threads_schedstat_run_delay(tmp_path):
    task = tmp_path / "self" / "task" / "123"
    task.mkdir(parents=True)
    (task / "schedstat").write_text("5000 7000 3\n")          # on-CPU ns, run-queue ns, timeslices
    assert RunQueueWait(123, proc=str(tmp_path)).read() == 7000
    (task / "schedstat").write_text("5000\n")
    assert RunQueueWait(123, proc=str(tmp_path)).read() is None
    assert RunQueueWait(456, proc=str(tmp_path)).read() is None


def test_run_queue_wait_of_the_main_thread_grows_while_another_process_holds_its_core():
    core = min(os.sched_getaffinity(0))
    affinity = os.sched_getaffinity(0)
    hog = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        os.sched_setaffinity(hog.pid, {core})
        os.sched_setaffinity(0, {core})                          # this (the main) thread shares the hog's core
        reader = RunQueueWait()
        before, t0 = reader.read(), time.monotonic()
        while time.monotonic() - t0 < 0.6:                        # busy: wants the whole core, shares it
            pass
        waited = (reader.read() - before) / 1e9
        assert 0.2 * 0.6 <= waited <= 0.6, waited                 # CFS gives each about half
    finally:
        os.sched_setaffinity(0, affinity)
        hog.kill()
        hog.wait(timeout=10)


# ------------------------------------------------------------------------------------------- per step


def _steps(rank: int, n: int, *, t0: int = 0) -> list[dict]:
    return [{"rank": rank, "step": i, "start_ns": t0 + i * STEP_NS, "end_ns": t0 + (i + 1) * STEP_NS}
            for i in range(n)]


def test_per_step_share_interpolates_the_counter_between_samples():
    # samples every 0.5 s; 40 ms of every 100 ms withheld between 1.0 s and 2.0 s, nothing else
    devices = pd.DataFrame({"rank": 1, "time_ns": [0, 500_000_000, 1_000_000_000, 1_500_000_000, 2_000_000_000,
                                                   2_500_000_000],
                            "cpu_throttled_ns": [0, 0, 0, 200_000_000, 400_000_000, 400_000_000]})
    steps = pd.DataFrame(_steps(1, 30))
    got = ct.cpu_throttled_per_step(devices, steps).set_index("step")["cpu_throttled_frac"]
    assert list(got.index) == list(range(25))                    # steps past the last sample are not known
    assert got.loc[0:9].tolist() == pytest.approx([0.0] * 10)
    assert got.loc[10:19].tolist() == pytest.approx([0.4] * 10)
    assert got.loc[20:24].tolist() == pytest.approx([0.0] * 5)


def test_per_step_share_counts_a_restarted_process_from_zero():
    devices = pd.DataFrame({"rank": 0, "time_ns": [0, 1_000_000_000, 2_000_000_000, 3_000_000_000],
                            "cpu_throttled_ns": [0, 500_000_000, 0, 100_000_000]})    # restarted before 2 s
    got = ct.cpu_throttled_per_step(devices, pd.DataFrame(_steps(0, 30))).set_index("step")["cpu_throttled_frac"]
    assert got.loc[0:9].tolist() == pytest.approx([0.5] * 10)
    assert got.loc[10:19].tolist() == pytest.approx([0.0] * 10)   # the new process's first read: 0
    assert got.loc[20:29].tolist() == pytest.approx([0.1] * 10)


def test_per_step_wait_share_reads_the_run_queue_counter():
    devices = pd.DataFrame({"rank": 0, "time_ns": [0, 1_000_000_000, 2_000_000_000],
                            "cpu_wait_ns": [10**9, 10**9 + 50_000_000, 10**9 + 650_000_000]})
    got = ct.cpu_wait_per_step(devices, pd.DataFrame(_steps(0, 25))).set_index("step")["cpu_wait_frac"]
    assert list(got.index) == list(range(20))
    assert got.loc[0:9].tolist() == pytest.approx([0.05] * 10)
    assert got.loc[10:19].tolist() == pytest.approx([0.6] * 10)
    assert ct.cpu_wait_per_step(devices.drop(columns="cpu_wait_ns"), pd.DataFrame(_steps(0, 5))).empty


def test_per_step_share_is_empty_without_the_counter():
    devices = pd.DataFrame({"rank": [0, 0], "time_ns": [0, 10**9], "cpu_frac": [0.5, 0.5]})
    assert ct.cpu_throttled_per_step(devices, pd.DataFrame(_steps(0, 5))).empty
    assert ct.cpu_throttled_per_step(pd.DataFrame(), pd.DataFrame(_steps(0, 5))).empty


# ------------------------------------------------------------------------------------------- the view


def _lateness(fracs: dict[int, list[float]]) -> pd.DataFrame:
    members = ",".join(map(str, sorted(fracs)))
    rows = [{"pg": "dp", "pg_ranks": members, "step": i + 1, "rank": r, "lateness_ns": f * STEP_NS,
             "victims_wait_ns": max(f, 0.0) * STEP_NS, "is_last": False, "step_ns": STEP_NS, "lateness_frac": f,
             "pre_excess_frac": np.nan, "comm_excess_frac": np.nan}
            for r, series in fracs.items() for i, f in enumerate(series)]
    return pd.DataFrame(rows)[st.LATENESS_COLUMNS]


def _throttled(shares: dict[int, list[float]]) -> pd.DataFrame:
    return pd.DataFrame([{"rank": r, "step": i + 1, "cpu_throttled_frac": x}
                         for r, series in shares.items() for i, x in enumerate(series)])


def _bursty(n: int, first: int, *, seed: int) -> dict[int, list[float]]:
    """Two ranks; from step ``first`` rank 1 is ~30% of the step late in every other step and on time in the
    rest (a quota's bursts), with a few % of noise on both: its median lateness barely moves."""
    rng = np.random.default_rng(seed)
    late = [(0.3 if (i >= first and i % 2) else 0.0) + rng.normal(0, 0.02) for i in range(n)]
    return {0: [-x for x in late], 1: late}


def _findings(lateness: pd.DataFrame, throttled: pd.DataFrame | None, waited: pd.DataFrame | None = None,
              busy: pd.DataFrame | None = None) -> list:
    scores = ss.straggler_scores(lateness, cpu_throttled=throttled, cpu_wait=waited, cpu_busy=busy)
    causes = sc.straggler_causes(scores, lateness, _phase_steps(lateness), pd.DataFrame(),
                                 blocked=pd.DataFrame({c: [] for c in sc.BLOCKED_COLUMNS}))
    return st.detect_stragglers(scores, causes, lateness=lateness)


def _phase_steps(lateness: pd.DataFrame) -> pd.DataFrame:
    keys = lateness[["rank", "step"]].drop_duplicates()
    return keys.assign(start_ns=keys["step"] * STEP_NS, end_ns=(keys["step"] + 1) * STEP_NS, data_ns=0.0,
                       fwd_ns=0.0, bwd_ns=0.0, opt_ns=0.0)


def test_a_rank_late_in_bursts_while_its_quota_throttles_it_is_a_compute_straggler():
    n, first = 40, 10
    lateness = _lateness(_bursty(n, first, seed=1))
    assert _findings(lateness, None) == []                      # the other views alone do not name it
    held = _throttled({0: [0.0] * n, 1: [0.0] * first + [0.35] * (n - first)})
    (f,) = _findings(lateness, held)
    assert f.code == "STRAGGLER" and f.ranks == (1,) and f.severity in ("warning", "critical")
    ev = f.evidence
    assert ev["detected_by"] == "cpu_throttle" and ev["cause"] == "compute"
    a, b = ev["window"]                                         # the first window that qualifies
    assert b == ev["detected_at_step"] and first < b <= first + 20
    held_steps = len(range(max(a, first + 1), b + 1))           # throttled from step first + 1 (1-based steps)
    assert ev["cpu_throttled_frac"] == pytest.approx(0.35 * held_steps / (b - a + 1))
    assert ev["peer_cpu_throttled_frac"] == 0.0
    assert f"throttled by its quota for {ev['cpu_throttled_frac']:.0%}" in f.title
    assert "CPU limit" in f.recommendation


def test_throttling_without_lateness_or_shared_by_every_peer_names_nobody():
    n, first = 40, 10
    quiet = _lateness({r: list(np.random.default_rng(r).normal(0, 0.02, n)) for r in (0, 1)})
    held = _throttled({0: [0.0] * n, 1: [0.0] * first + [0.35] * (n - first)})
    assert _findings(quiet, held) == []                         # it had slack: the job never waited for it
    both = _throttled({0: [0.0] * first + [0.3] * (n - first), 1: [0.0] * first + [0.35] * (n - first)})
    assert _findings(_lateness(_bursty(n, first, seed=2)), both) == []     # one limit for the whole pod


def _last_among_scattered_peers(n: int, first: int, *, late_every: int | None = None) -> dict[int, list[float]]:
    """Four ranks whose peers scatter widely (lateness -0.25, 0 and +0.25 of the step, taking turns); from step
    ``first`` rank 1 is later than the group's median in every step (``late_every`` None: by 6% of the step), or
    in all but every ``late_every``-th step (by 12%, and 5% early in the others). Its excess is steady, but so small
    against the peers' spread that its t stays near 1."""
    out: dict[int, list[float]] = {r: [] for r in range(4)}
    for i in range(n):
        turn = np.roll([-0.25, 0.0, 0.25], i)
        for r, x in zip((0, 2, 3), turn):
            out[r].append(float(x))
        if i < first:
            out[1].append(0.0)
        elif late_every is None:
            out[1].append(0.12)                   # median of (-0.25, 0, 0.12, 0.25) is 0.06: its excess 0.06
        else:
            out[1].append(-0.1 if i % late_every == 0 else 0.24)   # excess -0.05 or 0.12
    return out


def test_a_throttled_rank_later_than_its_group_in_nearly_every_step_is_named_though_its_t_is_low():
    n, first = 40, 10
    held = _throttled({0: [0.0] * n, 1: [0.0] * first + [0.3] * (n - first), 2: [0.0] * n, 3: [0.0] * n})
    lateness = _lateness(_last_among_scattered_peers(n, first))
    assert _findings(lateness, None) == []                      # the other views do not name it
    (f,) = _findings(lateness, held)
    ev = f.evidence
    assert f.ranks == (1,) and ev["detected_by"] == "cpu_throttle" and ev["cause"] == "compute"
    assert ev["excess_t"] < ss.MIN_THROTTLED_T                  # the t alone would not name it
    assert ev["excess_positive_frac"] >= ss.MIN_THROTTLED_POSITIVE_FRAC and ev["mean_excess_frac"] >= 0.05
    assert first < ev["detected_at_step"] <= first + 20
    # later than its group in only 2 of 3 steps, at the same mean excess and t: a quota'd rank with slack
    sometimes = _lateness(_last_among_scattered_peers(n, first, late_every=3))
    scores = ss.straggler_scores(sometimes, cpu_throttled=held).set_index("rank").loc[1]
    assert scores["mean_excess_frac"] >= 0.05 and scores["excess_t"] < ss.MIN_THROTTLED_T
    assert scores["excess_positive_frac"] < ss.MIN_THROTTLED_POSITIVE_FRAC
    assert _findings(sometimes, held) == []


def test_a_throttled_rank_a_few_percent_late_at_each_steps_latest_collective_is_named():
    # A user's tp4 script, rank 2 under a CPU quota from step 10: the job's step grew 10%, but every tp collective
    # re-synchronises the ranks, so at its latest collective of a step it is late by only 3.5% of the step more
    # than its group's median (peers +-1.5%). The kernel counted it throttled 10% of the time, its peers never.
    n, first = 40, 10
    rng = np.random.default_rng(4)
    fracs = {r: list(rng.normal(0.0, 0.015, n)) for r in range(4)}
    fracs[2] = [x + (0.035 if i >= first else 0.0) for i, x in enumerate(fracs[2])]
    lateness = _lateness(fracs)
    assert _findings(lateness, None) == []                      # without the kernel's count: under every bar
    held = _throttled({r: [0.0] * n if r != 2 else [0.0] * first + [0.1] * (n - first) for r in range(4)})
    (f,) = _findings(lateness, held)
    ev = f.evidence
    assert (f.ranks, ev["detected_by"], ev["cause"]) == ((2,), "cpu_throttle", "compute")
    assert ss.MIN_THROTTLED_EXCESS_SHARE * 0.05 <= ev["mean_excess_frac"] < 0.05
    assert first < ev["detected_at_step"] <= first + 20


def _frozen_inside_collectives(n: int, first: int, *, stall_every: int | None = 3) -> pd.DataFrame:
    """Two ranks of an FSDP-like job; from step ``first`` rank 1's quota freezes it for whole steps, inside
    collectives it had reached: every ``stall_every``-th step lasts 3 steps (None: none does), while its arrivals
    stay within a few tenths of a percent of its peer's (later by 0.4% of the step in every fourth step)."""
    late = [0.004 if (i >= first and i % 4 == 0) else 0.0 for i in range(n)]
    lateness = _lateness({0: [-x for x in late], 1: late})
    stalled = (lateness["step"] - 1 >= first) & (stall_every is not None
                                                  and (lateness["step"] % (stall_every or 1) == 0))
    step_ns = np.where(stalled, 3 * STEP_NS, STEP_NS).astype("float64")
    return lateness.assign(step_ns=step_ns, lateness_ns=lateness["lateness_frac"] * step_ns,
                           victims_wait_ns=lateness["lateness_frac"].clip(lower=0) * step_ns)


def test_a_rank_its_quota_froze_inside_collectives_is_named_by_the_steps_its_group_stalled():
    # The steps it froze in took 3 steps' time: a third of the steps 3x long is a mean of 5/3 steps, 40% of the
    # time beyond the median step, as long as the kernel held it back
    n, first = 60, 10
    lateness = _frozen_inside_collectives(n, first)
    held = _throttled({0: [0.0] * n, 1: [0.0] * first + [0.4] * (n - first)})
    assert _findings(lateness, None) == []                      # its arrivals alone name nobody
    (f,) = _findings(lateness, held)
    ev = f.evidence
    assert (f.ranks, ev["detected_by"], ev["cause"]) == ((1,), "cpu_throttle", "compute")
    assert ev["mean_excess_frac"] < ss.MIN_THROTTLED_EXCESS_SHARE * 0.05 and ev["victims_wait_frac"] < 0.01
    # its first window holds some steps before the quota: both shares below their 40%, within a factor 2
    assert 0.05 <= ev["step_stall_frac"] <= 0.45 and 0.05 <= ev["cpu_throttled_frac"] <= 0.4
    assert ev["cpu_throttled_frac"] * ss.STALL_THROTTLE_RATIO >= ev["step_stall_frac"]
    assert first < ev["detected_at_step"] <= first + 25
    # the job's loss is the stall, not the wait at its arrivals: critical
    assert f.predicted_gain.frac == pytest.approx(ev["step_stall_frac"]) and f.severity == "critical"
    assert "steps stalled" in f.title and "CPU limit" in f.recommendation


def test_a_stall_the_quota_does_not_explain_or_a_quota_without_a_stall_names_nobody():
    n, first = 60, 10
    # throttled 40% while the steps kept their length: its quota took its slack
    steady = _frozen_inside_collectives(n, first, stall_every=None)
    assert _findings(steady, _throttled({0: [0.0] * n, 1: [0.0] * first + [0.4] * (n - first)})) == []
    # the steps stalled 40% (a checkpoint save, another process) while rank 1 was throttled 5% of the time: the
    # stall is 8x what its quota held it back, not its quota's; throttled 25%, the stall is its quota's
    stalled = _frozen_inside_collectives(n, first)
    assert _findings(stalled, _throttled({0: [0.0] * n, 1: [0.0] * first + [0.05] * (n - first)})) == []
    (f,) = _findings(stalled, _throttled({0: [0.0] * n, 1: [0.0] * first + [0.25] * (n - first)}))
    assert f.ranks == (1,) and f.evidence["detected_by"] == "cpu_throttle"
    # the same stall with no rank throttled: nobody (the stall is not computed there)
    assert np.isnan(ss.straggler_scores(stalled, cpu_throttled=_throttled({0: [0.0] * n, 1: [0.0] * n}))
                    ["step_stall_frac"]).all()


def test_scores_carry_the_throttle_columns_only_when_given():
    lateness = _lateness(_bursty(30, 5, seed=3))
    assert "cpu_throttled_frac" not in ss.straggler_scores(lateness)
    held = ss.straggler_scores(lateness, cpu_throttled=_throttled({0: [0.0] * 30, 1: [0.25] * 30}))
    assert list(held.columns) == ss.SCORE_COLUMNS + ss.NOISE_COLUMNS + ss.THROTTLE_SCORE_COLUMNS
    assert held.set_index("rank").loc[1, "cpu_throttled_frac"] == pytest.approx(0.25)



def _waited(shares: dict[int, float], n: int) -> pd.DataFrame:
    return pd.DataFrame([{"rank": r, "step": i + 1, "cpu_wait_frac": x} for r, x in shares.items()
                         for i in range(n)])


def test_a_straggler_whose_main_thread_waits_for_its_core_is_told_its_core_is_shared():
    n = 30
    rng = np.random.default_rng(4)
    late = [0.3 + rng.normal(0, 0.02) for _ in range(n)]
    lateness = _lateness({0: [-x for x in late], 1: late})
    (plain,) = _findings(lateness, None)                        # named without the count: no reason given
    assert plain.ranks == (1,) and "waited for a CPU" not in plain.title and "Another process" not in \
        plain.recommendation
    (f,) = _findings(lateness, None, _waited({0: 0.03, 1: 0.45}, n))
    assert f.ranks == (1,) and f.evidence["cause"] == "compute"
    assert (f.evidence["cpu_wait_frac"], f.evidence["peer_cpu_wait_frac"]) == pytest.approx((0.45, 0.03))
    assert "its main thread waited for a CPU 45% of the time (its peers at most 3%)" in f.title
    assert "Another process or thread runs on rank 1's core" in f.recommendation
    # a few points more than its peer (as between clean cores) explains nothing
    (g,) = _findings(lateness, None, _waited({0: 0.03, 1: 0.07}, n))
    assert "waited for a CPU" not in g.title and g.evidence["cpu_wait_frac"] == pytest.approx(0.07)
    # both counts known and neither explains it: the core or device itself is slower
    (k,) = _findings(lateness, _throttled({0: [0.0] * n, 1: [0.0] * n}), _waited({0: 0.03, 1: 0.07}, n))
    assert "the kernel's counts do not explain it" in k.recommendation
    assert "kernel's counts" not in g.recommendation            # one count unknown: the general advice
    # the kernel counts a quota's throttling as run-queue wait too: the quota is the reason then
    held = _throttled({0: [0.0] * n, 1: [0.4] * n})
    (h,) = _findings(lateness, held, _waited({0: 0.03, 1: 0.45}, n))
    assert "waited for a CPU" not in h.title and "CPU limit" in h.recommendation


# ------------------------------------------------------------------------------------- the run-queue view


def _per_step(column: str, series: dict[int, list[float]]) -> pd.DataFrame:
    return pd.DataFrame([{"rank": r, "step": i + 1, column: x} for r, values in series.items()
                         for i, x in enumerate(values)])


def _core_taken_from(first: int, n: int, *, wait: float = 0.37, peer_busy: float = 0.55,
                     throttled: float = 0.0) -> tuple[pd.DataFrame, pd.DataFrame, pd.DataFrame]:
    """Two ranks' host counters per step (throttled, waited, busy); from step ``first`` another process shares
    rank 1's core: its main thread waits for a CPU ``wait`` of the time (its peer 14%, as before), and rank 0's
    process uses ``peer_busy`` of a core (87% before): it sits idle the rest, blocked in collectives."""
    before, after = [0.0] * first, [1.0] * (n - first)
    waited = _per_step("cpu_wait_frac", {0: [0.14] * n, 1: [0.14] * first + [wait] * (n - first)})
    busy = _per_step("cpu_busy_frac", {0: [0.86] * first + [peer_busy] * (n - first),
                                       1: [0.86] * first + [0.45] * (n - first)})
    held = _throttled({0: [0.0] * n, 1: [x * throttled for x in before + after]})
    return held, waited, busy


def test_a_rank_whose_core_another_process_takes_while_its_peers_sit_idle_is_named_by_the_run_queue_view():
    # FSDP2 on gloo with a busy process on rank 1's core: the kernel takes its core inside collectives as often as
    # between them, so its arrivals hardly differ from its peer's (here: earlier in odd steps, later in even ones)
    n, first = 60, 10
    lateness = _lateness({0: [0.01 * (-1) ** i for i in range(n)], 1: [-0.01 * (-1) ** i for i in range(n)]})
    held, waited, busy = _core_taken_from(first, n)
    assert _findings(lateness, held, waited) == []              # without the CPU use: nothing to say the job waited
    (f,) = _findings(lateness, held, waited, busy)
    ev = f.evidence
    assert (f.ranks, ev["detected_by"], ev["cause"]) == ((1,), "cpu_wait", "compute")
    assert first < ev["detected_at_step"] <= first + 20
    # its extra wait (23 points) and its peer's idle time (1 - 0.55 - 0.14 = 31%) in the first window that shows
    # them, which holds some steps before the other process came
    extra, idle = ev["cpu_wait_frac"] - ev["peer_cpu_wait_frac"], ev["peer_idle_frac"]
    assert ss.MIN_WAIT_VIEW_EXCESS_FRAC <= extra <= 0.23 + 1e-9 and ss.PEER_IDLE_SHARE_OF_WAIT * extra <= idle <= 0.31
    gain = f.predicted_gain.frac
    assert gain == pytest.approx(min(extra, idle)) and gain > ev["victims_wait_frac"]
    assert f.severity == ("critical" if gain >= 0.2 else "warning")
    assert f"peers sat idle {idle:.0%}" in f.title and "waited for a CPU" in f.title
    assert "Another process" in f.recommendation


def test_the_run_queue_view_names_nobody_for_a_clean_host_a_rank_with_slack_or_a_quota():
    n, first = 60, 10
    lateness = _lateness({0: [0.01 * (-1) ** i for i in range(n)], 1: [-0.01 * (-1) ** i for i in range(n)]})
    # a clean host: one core's rank waits 6 points more than the other's (the most seen in clean runs)
    held, waited, busy = _core_taken_from(first, n, wait=0.20)
    assert _findings(lateness, held, waited, busy) == []
    # the core shared, but its peer computes all along (idle 1 - 0.84 - 0.14 = 2%): it had slack
    held, waited, busy = _core_taken_from(first, n, peer_busy=0.84)
    assert _findings(lateness, held, waited, busy) == []
    # a quota: the kernel counts its throttled time as run-queue wait too; the throttle view judges it
    held, waited, busy = _core_taken_from(first, n, throttled=0.3)
    assert _findings(lateness, held, waited, busy) == []
    # a quota whose throttle count shows 20 steps after the wait it causes (a process moved into a quota'd cgroup:
    # the sampler's first sample there only sets the counter's base): not called another process's
    late_count = _throttled({0: [0.0] * n, 1: [0.0] * (first + 20) + [0.4] * (n - first - 20)})
    assert all(f.evidence["detected_by"] != "cpu_wait" and "Another process" not in f.recommendation
               for f in _findings(lateness, late_count, waited, busy))
    scores = ss.straggler_scores(lateness, cpu_throttled=held, cpu_wait=waited, cpu_busy=busy)
    assert list(scores.columns) == (ss.SCORE_COLUMNS + ss.NOISE_COLUMNS + ss.THROTTLE_SCORE_COLUMNS
                                    + ss.WAIT_SCORE_COLUMNS + ss.IDLE_SCORE_COLUMNS)
