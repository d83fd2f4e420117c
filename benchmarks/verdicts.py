"""Verdict quality: precision, recall and time-to-detect of dtprobe's findings over a matrix of real faults.

    python benchmarks/verdicts.py [--repeats 10] [--layouts dp2 dp4 dp2xtp2 dp2xpp2] [--kinds clean inject ...]
                                  [--seq-len 256] [--step-ms 200] [--seed 0] [--quick]

Every run is ``dtprobe run`` of the tiny GPT with micro-batches of ``--seq-len`` tokens per rank (``--cpu-bind
auto`` places each worker on its own share of the cores), its host sampler on as by default (every second: each
rank's CPU, and the time its cgroup's CPU quota withheld). Before the matrix, one short clean run per layout
measures its step time at 2 sequences per micro-batch (a pipeline's 4 micro-batches: 4), and the matrix runs that
layout with the whole multiple of that batch that brings its steps nearest ``--step-ms`` (``calibrate``): the
host's few ms of scheduling noise per step are then the same small share of a step on a fast host as on a slow
one, where a fixed batch gave 50 ms steps on one host and 200 ms on another.

Scenario classes, on every layout (dp2, dp4, dp2xtp2, dp2xpp2) unless said otherwise:
- ``clean``: ``--repeats`` undisturbed runs. Any verdict here is a false positive.
- ``inject-5/10/20``: a randomly drawn rank computes 5, 10 or 20% slower from step ``--fault-step`` on
  (``--inject straggler:rank=R,slowdown=F,from_step=S``; the injector's own ``faults`` row is not evidence).
- ``quota-5/10/20``: the same slowdown caused from outside: the rank's CPU use is measured over the 6 steps before
  ``--fault-step``, then a cgroup v1 cpu quota (``cpu.cfs_quota_us``) holds it to 1/(1+F) of that. That
  share includes the time the rank waits on its peers at collectives, so a rank faster than its peers first loses
  that slack: its lateness grows by less than F.
- ``kill``: the rank is SIGKILLed mid-run (``--max-restarts 1 --ckpt-every 5``: the run recovers).
- ``stop``: the rank is SIGSTOPped mid-run (``--collective-timeout`` ends the job).
- ``pause``: the rank is SIGSTOPped mid-run for ``PAUSE_S`` seconds, then SIGCONTed: the job goes on (RANK_STALL).
- ``mismatch`` (a user's 4-rank torchrun script, tests/chaos/mismatch_job.py, as many runs as layouts): the rank
  all_gathers where its peers all_reduce, and the job dies on the process-group timeout.

Scoring. A *verdict* is a warning or critical STRAGGLER, HANG, RANK_CRASH, COLLECTIVE_MISMATCH, SLOW_LINK or
RANK_STALL finding; each (verdict, named rank) pair is judged. It is a true positive when it is the scenario's
expected code (STRAGGLER with cause ``compute`` for a slowdown, RANK_CRASH for kill, HANG for stop,
COLLECTIVE_MISMATCH for mismatch, RANK_STALL for pause) naming the faulted rank (a run counts at most one); a false
positive is any verdict on a clean run or on another rank; any other verdict on the faulted rank (another code, or
a STRAGGLER of another cause) is counted apart as ``other``. Recall = runs with a true positive / faulted runs;
precision = true positives / (true positives + false positives). Time-to-detect = the finding's
``detected_at_step`` minus the fault's first step (blank when the finding has no ``detected_at_step``).
Realized effect. A fault's nominal slowdown is not what the job gets: a CPU quota first takes the slack a rank
had while waiting on its peers, and the host's own noise moves every rank. So each slowdown run also reports the
slowdown it realized, read from the raw events (not from dtprobe's analysis): the faulted rank's own compute (the
median per step of fwd + opt; on a pipeline layout of its pipeline actions' summed length, since its fwd also
holds the waits for the previous stage's activations) against the median of the other ranks' over the steps after
the fault (``--fault-step`` + 1 to the end), divided by the same ratio over the steps before it (from step 3: the
first steps are warm-up), minus 1. The ``real>=10%`` row scores the slowdown runs that realized 10% or more; the goal's
"slowdowns of 10% and more" is judged there as well as on the nominal ``slow>=10%`` row. On a tensor-parallel
layout fwd also holds the waits at the tp collectives, so the figure is rougher there.
Job effect. Neither figure says whether the job got slower: a rank with slack (a pipeline stage that finishes
before the others, a rank faster than its peers) can compute longer without lengthening the step, and then no
straggler verdict with a gain is due. So every slowdown and clean run also reports the job's step-time change, read
from the raw step rows (``harness.job_step_ms``: per step the median over ranks of a step row's length, then the
median over steps) over the steps after ``--fault-step`` against the steps before it (from step 3), minus 1; a clean
run's is taken at ``--fault-step`` too, which shows the host's own spread. The table prints each class's range (``job
%``) and median (``job med%``). It scores nothing: where the clean runs' spread is as wide as the slowdowns (a host
whose other guests come and go), a threshold on it would sort runs by the host's noise.
Predicted gain. Beside it the table prints the median of the true positives' ``predicted_gain`` (``gain med%``: the
share of the step dtprobe says the fix would save). Removing a fault that made the job's steps ``job`` longer saves
job / (1 + job) of them, so over a class's runs the two medians show whether the predicted gains are of the size
the faults cost (a single run's job effect is as noisy as the clean runs' spread).
A STRAGGLER false positive is also checked against the run's raw step and collective rows (the chaos harness's
``straggler_confirmed``): ``FP conf`` counts those whose rank's own work between synchronization points (from the
end of its backward to its next step's first collective; a pipeline rank's summed actions) over the finding's window
was longer than its group's by half its lateness or more, a straggler the host made (a VM's vCPUs run at different
speeds for stretches when other guests share the host), rather than one dtprobe made up; they stay false positives
by this benchmark's rule.

Goals: precision 1.00; recall 1.00 for slowdowns of 10% and more, detected within 20 steps of the fault; every
kill, stop, mismatch and pause named.

Faults are caused with the chaos suite's harness (tests/chaos/harness.py). The defaults start several hundred
jobs; ``--quick`` runs one of each class on dp2 (slowdowns of 20% only) as a smoke test.

Every job runs the dtprobe installed from this checkout (an editable install imports its files as they are when the
job starts), so an edit to the checkout during a matrix changes the code of the runs after it: the matrix stops at
the first run that ended with the sources (``SOURCE_DIRS``) changed since the start, prints the table of the runs
before it, and exits with status 3.
"""

from __future__ import annotations

import argparse
import hashlib
import random
import shutil
import signal
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "chaos"))

from harness import (Job, analyze, cgroup_v1_cpu_available, cpu_quota_cgroup, cpu_seconds,  # noqa: E402
                     dtprobe_run_cmd, job_step_ms, own_compute_ms, steps_done, straggler_confirmed, torchrun_cmd)

LAYOUTS = {"dp2": ("--nproc", "2"), "dp4": ("--nproc", "4"), "dp2xtp2": ("--nproc", "4", "--tp", "2"),
           "dp2xpp2": ("--nproc", "4", "--pp", "2")}
"""Layout name -> ``dtprobe run`` flags."""
BASE_BATCH = {"dp2": 2, "dp4": 2, "dp2xtp2": 2, "dp2xpp2": 4}
"""Layout name -> sequences per micro-batch before ``--step-ms`` scales it (a pipeline's 4 micro-batches: 4)."""
CALIBRATION_STEPS = 12
"""Steps of a layout's calibration run (``calibrate``): its step time is the median from ``WARMUP_STEPS`` on."""
WORLD_SIZE = {"dp2": 2, "dp4": 4, "dp2xtp2": 4, "dp2xpp2": 4}
VERDICT_CODES = ("STRAGGLER", "HANG", "RANK_CRASH", "COLLECTIVE_MISMATCH", "SLOW_LINK", "RANK_STALL")
KINDS = ("clean", "inject", "quota", "kill", "stop", "mismatch", "pause")
EXPECTED_CODE = {"inject": "STRAGGLER", "quota": "STRAGGLER", "kill": "RANK_CRASH", "stop": "HANG",
                 "pause": "RANK_STALL",
                 "mismatch": "COLLECTIVE_MISMATCH"}
SLOWDOWN_CAUSE = "compute"
JOB_TIMEOUT_S = 600
PAUSE_S = 2.0
"""How long a ``pause`` scenario keeps its rank stopped."""
WARMUP_STEPS = 3
"""Steps left out of the realized slowdown's before-the-fault window (``realized_slowdown``)."""
REALIZED_MIN = 0.10
"""Realized slowdown from which a slowdown run counts in the ``real>=10%`` row."""
SOURCE_DIRS = ("dtprobe", "dashboard", "collectors", "tests/chaos")
"""The checkout's folders whose Python files the jobs and their analysis run (``source_fingerprint``)."""


@dataclass(kw_only=True)
class Scenario:
    """One run of the matrix."""

    kind: str
    """``clean``, ``inject``, ``quota``, ``kill``, ``stop``, ``mismatch`` or ``pause``."""
    layout: str
    rank: int | None = None
    """The faulted rank (None on a clean run)."""
    slowdown: float = 0.0
    """For inject/quota: 0.1 = 10% slower compute."""
    fault_step: int | None = None
    """The fault's first step (set when the fault is caused)."""

    @property
    def label(self) -> str:
        return f"{self.kind}-{round(self.slowdown * 100)}" if self.kind in ("inject", "quota") else self.kind


@dataclass(kw_only=True)
class Outcome:
    scenario: Scenario
    true_positive: bool = False
    false_positives: list[str] = field(default_factory=list)
    confirmed_fps: int = 0
    """STRAGGLER false positives whose rank's own compute the raw step rows show slower (``straggler_confirmed``)."""
    other: list[str] = field(default_factory=list)
    """Verdicts on the faulted rank that are not the expected one (another code or cause)."""
    detect_steps: int | None = None
    realized: float | None = None
    """For inject/quota: the slowdown the fault realized (``realized_slowdown``); None when not measurable."""
    job: float | None = None
    """For clean, inject and quota runs: the job's step-time change after the fault step (``job_effect``)."""
    gain: float | None = None
    """The true positive's predicted gain (``predicted_gain.frac``: the share of the step its fix would save);
    None without a true positive or without a predicted gain."""
    error: str | None = None
    wall_s: float = 0.0


# ---------------------------------------------------------------------------------------------- the runs


def _run_dtprobe(sc: Scenario, run_dir: Path, args: argparse.Namespace, *flags: str, steps: int | None = None) -> Job:
    cmd = dtprobe_run_cmd(run_dir, *LAYOUTS[sc.layout], "--steps", str(steps or args.steps),
                          "--seq-len", str(args.seq_len), "--batch-size", str(args.batch[sc.layout]), *flags,
                          devices=True)
    return Job(cmd=cmd, run_dir=run_dir, timeout_s=JOB_TIMEOUT_S).start()


def scaled_batch(base: int, step_ms: float, target_ms: float) -> int:
    """The batch that brings a layout whose steps take ``step_ms`` at batch ``base`` nearest to ``target_ms`` were
    the step in proportion to the batch: a whole multiple of ``base``, never below it. A step grows less than its
    batch (its fixed costs stay), so the steps come out somewhat shorter than ``target_ms``."""
    return base * max(1, round(target_ms / step_ms)) if step_ms > 0 else base


def calibrate(args: argparse.Namespace) -> dict[str, int]:
    """Per layout of the matrix, the batch whose steps take about ``--step-ms`` (``scaled_batch``), from the
    median step time of one clean run of ``CALIBRATION_STEPS`` steps at ``BASE_BATCH``; every layout at its base
    batch when ``--step-ms`` is 0."""
    batch = dict(BASE_BATCH)
    if not args.step_ms:
        return batch
    args.batch = dict(BASE_BATCH)             # the calibration runs' batch
    for layout in args.layouts:
        run_dir = args.work_dir / f"calibrate-{layout}"
        shutil.rmtree(run_dir, ignore_errors=True)
        job = _run_dtprobe(Scenario(kind="clean", layout=layout), run_dir, args, steps=CALIBRATION_STEPS)
        try:
            job.wait()
        finally:
            job.stop()
        step_ms = job_step_ms(run_dir, WARMUP_STEPS, CALIBRATION_STEPS)
        if step_ms is None:
            raise RuntimeError(f"the calibration run of {layout} in {run_dir} recorded no steps: see its logs")
        batch[layout] = scaled_batch(BASE_BATCH[layout], step_ms, args.step_ms)
        print(f"[calibrate] {layout}: steps of {step_ms:.0f} ms at batch {BASE_BATCH[layout]} -> batch "
              f"{batch[layout]}", flush=True)
        shutil.rmtree(run_dir, ignore_errors=True)
    return batch


def run_scenario(sc: Scenario, run_dir: Path, args: argparse.Namespace) -> None:
    """Run ``sc`` into ``run_dir``, causing its fault; sets ``sc.fault_step``. Every process is stopped after."""
    job, quota = None, None
    try:
        if sc.kind == "clean":
            job = _run_dtprobe(sc, run_dir, args)
        elif sc.kind == "inject":
            sc.fault_step = args.fault_step
            job = _run_dtprobe(sc, run_dir, args, "--inject",
                               f"straggler:rank={sc.rank},slowdown={1 + sc.slowdown:g},from_step={sc.fault_step}")
        elif sc.kind == "quota":
            job = _run_dtprobe(sc, run_dir, args)
            pid = job.worker_pid(sc.rank)
            job.wait_steps(sc.rank, max(3, args.fault_step - 6))               # past the warm-up steps
            cpu0, t0 = cpu_seconds(pid), time.monotonic()
            job.wait_steps(sc.rank, args.fault_step)
            share = (cpu_seconds(pid) - cpu0) / (time.monotonic() - t0)        # cores it gets now
            quota = cpu_quota_cgroup(share / (1 + sc.slowdown)).create()
            quota.add(pid)
            sc.fault_step = steps_done(run_dir, sc.rank)
        elif sc.kind == "kill":
            job = _run_dtprobe(sc, run_dir, args, "--ckpt-every", "5", "--max-restarts", "1")
            job.wait_steps(sc.rank, args.fault_step)
            sc.fault_step = steps_done(run_dir, sc.rank)
            job.signal(sc.rank, signal.SIGKILL)
        elif sc.kind == "stop":
            job = _run_dtprobe(sc, run_dir, args, "--collective-timeout", "6", "--device-interval", "0.2")
            # (sampled every 0.2 s: the liveness verdict reads the host sampler's rows after the stall)
            job.wait_steps(sc.rank, args.fault_step)
            sc.fault_step = steps_done(run_dir, sc.rank)
            job.signal(sc.rank, signal.SIGSTOP)
            job.end_stopped(sc.rank)                    # once the others' watchdogs ended the job
        elif sc.kind == "pause":
            job = _run_dtprobe(sc, run_dir, args, "--device-interval", "0.25")
            job.wait_steps(sc.rank, args.fault_step)
            sc.fault_step = steps_done(run_dir, sc.rank)
            job.signal(sc.rank, signal.SIGSTOP)
            time.sleep(PAUSE_S)
            job.signal(sc.rank, signal.SIGCONT)
        elif sc.kind == "mismatch":
            sc.fault_step = args.fault_step
            cmd = torchrun_cmd(ROOT / "tests" / "chaos" / "mismatch_job.py", str(run_dir), "--odd-rank",
                               str(sc.rank), "--odd-step", str(sc.fault_step), "--steps", str(sc.fault_step + 4),
                               "--pg-timeout-s", "8", nproc=WORLD_SIZE[sc.layout])
            job = Job(cmd=cmd, run_dir=run_dir, timeout_s=JOB_TIMEOUT_S).start()
        else:
            raise ValueError(f"unknown scenario kind {sc.kind!r}")
        job.wait()
    finally:
        if job is not None:
            job.stop()
        if quota is not None:
            quota.remove()


def score(sc: Scenario, doc: dict, run_dir: Path, *, nominal_fault_step: int) -> Outcome:
    """Judge every (verdict, rank) pair of the findings document of ``run_dir`` against the scenario. A clean run's
    job effect is taken at ``nominal_fault_step``."""
    out = Outcome(scenario=sc)
    if sc.kind in ("inject", "quota") and sc.fault_step is not None:
        out.realized = realized_slowdown(run_dir, sc.rank, sc.fault_step)
    if sc.kind in ("clean", "inject", "quota"):
        out.job = job_effect(run_dir, sc.fault_step if sc.fault_step is not None else nominal_fault_step)
    expected = EXPECTED_CODE.get(sc.kind)
    for f in doc["findings"]:
        if f["code"] not in VERDICT_CODES or f["severity"] not in ("warning", "critical"):
            continue
        ev = f.get("evidence") or {}
        for rank in f["ranks"]:
            right = (f["code"] == expected and rank == sc.rank
                     and (expected != "STRAGGLER" or ev.get("cause") == SLOWDOWN_CAUSE))
            if right and not out.true_positive:
                out.true_positive = True
                out.gain = (f.get("predicted_gain") or {}).get("frac")
                if ev.get("detected_at_step") is not None and sc.fault_step is not None:
                    out.detect_steps = int(ev["detected_at_step"]) - sc.fault_step
            elif not right:
                cause = f" cause={ev.get('cause')}" if f["code"] == "STRAGGLER" else ""
                label = f"{f['code']}({f['severity']}) rank {rank}{cause}"
                if rank == sc.rank:
                    out.other.append(label)
                    continue
                confirmed = f["code"] == "STRAGGLER" and _confirmed(run_dir, f)
                out.false_positives.append(label + (" [own compute slower]" if confirmed else ""))
                out.confirmed_fps += confirmed
    return out


def realized_slowdown(run_dir: Path, rank: int, fault_step: int) -> float | None:
    """How much slower ``rank``'s own compute became against the other ranks' once the fault began (module
    docstring, "Realized effect"): 0.1 = 10%; None without step rows on both sides of the fault."""
    before = own_compute_ms(run_dir, WARMUP_STEPS, fault_step - 1)
    after = own_compute_ms(run_dir, fault_step + 1, 1 << 62)

    def ratio(medians: dict[int, float]) -> float | None:
        others = [v for r, v in medians.items() if r != rank]
        if rank not in medians or not others or statistics.median(others) <= 0:
            return None
        return medians[rank] / statistics.median(others)

    r0, r1 = ratio(before), ratio(after)
    return None if r0 is None or r1 is None else r1 / r0 - 1


def job_effect(run_dir: Path, fault_step: int) -> float | None:
    """How much longer the job's steps became once the fault began (module docstring, "Job effect"): 0.1 = 10%;
    None without step rows on both sides of the fault."""
    before = job_step_ms(run_dir, WARMUP_STEPS, fault_step - 1)
    after = job_step_ms(run_dir, fault_step + 1, 1 << 62)
    return None if not before or after is None else after / before - 1


def _confirmed(run_dir: Path, finding: dict) -> bool:
    try:
        return straggler_confirmed(run_dir, finding)
    except Exception:                   # rows without fwd/opt (a user's script): not confirmed
        return False


# ------------------------------------------------------------------------------------------------ matrix


def build_matrix(args: argparse.Namespace) -> list[Scenario]:
    rng = random.Random(args.seed)
    matrix: list[Scenario] = []
    for layout in args.layouts:
        world = WORLD_SIZE[layout]
        matrix += [Scenario(kind="clean", layout=layout) for _ in range(args.repeats)]
        for kind in ("inject", "quota"):
            if kind == "quota" and not cgroup_v1_cpu_available():
                print("no writable cgroup v1 cpu controller at /sys/fs/cgroup/cpu: quota scenarios skipped")
                continue
            matrix += [Scenario(kind=kind, layout=layout, rank=rng.randrange(world), slowdown=s)
                       for s in args.slowdowns]
        matrix += [Scenario(kind=k, layout=layout, rank=rng.randrange(world)) for k in ("kill", "stop")]
    # the mismatch job is its own 4-rank data-parallel script, run once per layout of the matrix
    matrix += [Scenario(kind="mismatch", layout="dp4", rank=rng.randrange(4)) for _ in args.layouts]
    # drawn after the others, so that adding them left the earlier scenarios' ranks as they were
    matrix += [Scenario(kind="pause", layout=layout, rank=rng.randrange(WORLD_SIZE[layout]))
               for layout in args.layouts]
    return [sc for sc in matrix if sc.kind in args.kinds]      # drawn in full first: the same seed, the same ranks


def _fmt(x: float | None, spec: str = ".2f") -> str:
    return "-" if x is None else format(x, spec)


def report(outcomes: list[Outcome]) -> str:
    """The table: per scenario class and overall, runs, TP, FN, FP, precision, recall, time-to-detect, the median
    realized slowdown of the class's slowdown runs, the range and median of its runs' job effects, and the median
    predicted gain of its true positives."""
    def row(name: str, group: list[Outcome]) -> str:
        faulted = [o for o in group if o.scenario.kind != "clean" and o.error is None]
        tp = sum(o.true_positive for o in faulted)
        fp = sum(len(o.false_positives) for o in group if o.error is None)
        fp_conf = sum(o.confirmed_fps for o in group if o.error is None)
        other = sum(len(o.other) for o in group if o.error is None)
        errors = sum(o.error is not None for o in group)
        precision = tp / (tp + fp) if tp + fp else None
        recall = tp / len(faulted) if faulted else None
        ttd = [o.detect_steps for o in faulted if o.detect_steps is not None]
        ttd_med = _fmt(statistics.median(ttd) if ttd else None, '.0f')
        realized = [o.realized for o in faulted if o.realized is not None]
        real_med = _fmt(100 * statistics.median(realized) if realized else None, '+.0f')
        job = [o.job for o in group if o.job is not None and o.error is None]
        job_range = "-" if not job else f"{100 * min(job):+.0f}..{100 * max(job):+.0f}"
        job_med = _fmt(100 * statistics.median(job) if job else None, '+.1f')
        gains = [o.gain for o in faulted if o.gain is not None]
        gain_med = _fmt(100 * statistics.median(gains) if gains else None, '.1f')
        return (f"{name:<14} {len(group):>4} {tp:>4} {len(faulted) - tp:>4} {fp:>4} {fp_conf:>7} {other:>5} "
                f"{errors:>4} {_fmt(precision):>9} {_fmt(recall):>6} {ttd_med:>8} "
                f"{_fmt(max(ttd) if ttd else None, '.0f'):>8} {real_med:>9} {job_range:>10} {job_med:>9} "
                f"{gain_med:>9}")

    lines = [f"{'class':<14} {'runs':>4} {'TP':>4} {'FN':>4} {'FP':>4} {'FP conf':>7} {'other':>5} {'err':>4} "
             f"{'precision':>9} {'recall':>6} {'ttd med':>8} {'ttd max':>8} {'real med%':>9} {'job %':>10} "
             f"{'job med%':>9} {'gain med%':>9}"]
    labels = sorted({o.scenario.label for o in outcomes},
                    key=lambda s: (list(EXPECTED_CODE).index(s.split("-")[0]) + 1 if s != "clean" else 0, s))
    for label in labels:
        lines.append(row(label, [o for o in outcomes if o.scenario.label == label]))
    big = [o for o in outcomes if o.scenario.kind in ("inject", "quota") and o.scenario.slowdown >= 0.1]
    if big:
        lines.append(row("slow>=10%", big))
    real = [o for o in outcomes if o.scenario.kind in ("inject", "quota") and o.realized is not None
            and o.realized >= REALIZED_MIN]
    if real:
        lines.append(row("real>=10%", real))
    lines.append(row("overall", outcomes))
    return "\n".join(lines)


def _realized_text(out: Outcome) -> str:
    parts = ([] if out.realized is None else [f"realized {out.realized:+.0%}"]) + \
        ([] if out.job is None else [f"job {out.job:+.0%}"]) + \
        ([] if out.gain is None else [f"predicted gain {out.gain:.1%}"])
    return f" ({', '.join(parts)})" if parts else ""


def reanalyze(log: Path, work_dir: Path, *, nominal_fault_step: int) -> list[Outcome]:
    """The outcomes of the runs an earlier invocation printed in ``log``, re-scored from their directories."""
    import re

    outcomes = []
    for line in log.read_text().splitlines():
        m = re.match(r"\[(\d+)/\d+\] (\S+)\s+(\S+)\s+(?:rank (\d+) from step (\d+))?", line)
        if not m:
            continue
        i, layout, label, rank, step = m.groups()
        kind, _, pct = label.partition("-")
        sc = Scenario(kind=kind, layout=layout, rank=None if rank is None else int(rank),
                      slowdown=int(pct) / 100 if pct else 0.0, fault_step=None if step is None else int(step))
        run_dir = work_dir / f"{int(i):03d}-{layout}-{label}"
        try:
            outcomes.append(score(sc, analyze(run_dir), run_dir, nominal_fault_step=nominal_fault_step))
        except Exception as exc:          # a run directory that is gone or broken: counted as an error
            outcomes.append(Outcome(scenario=sc, error=f"{type(exc).__name__}: {exc}"))
        print(f"{run_dir.name}: " + ("error" if outcomes[-1].error else "TP" if outcomes[-1].true_positive else
                                     "-") + _realized_text(outcomes[-1])
              + "".join(f"; FP {x}" for x in outcomes[-1].false_positives), flush=True)
    return outcomes


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=10, help="clean runs per layout (default 10)")
    parser.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    parser.add_argument("--slowdowns", nargs="+", type=float, default=[0.05, 0.1, 0.2],
                        help="compute slowdowns of the inject and quota classes (default 0.05 0.1 0.2)")
    parser.add_argument("--steps", type=int, default=40, help="steps per dtprobe run (default 40)")
    parser.add_argument("--fault-step", type=int, default=10, help="step at which faults start (default 10)")
    parser.add_argument("--seq-len", type=int, default=256, help="tokens per sequence (default 256, the tiny "
                        "model's longest)")
    parser.add_argument("--step-ms", type=float, default=200.0,
                        help="step time each layout is brought near by a larger batch, measured in a short clean "
                             "run per layout first (default 200: the host's few ms of noise per step stay small "
                             "against a 10%% slowdown whatever the host's speed; 0: batch 2, a pipeline's 4)")
    parser.add_argument("--kinds", nargs="+", default=list(KINDS), choices=list(KINDS),
                        help="scenario classes to run (default all)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the faulted-rank draws (default 0)")
    parser.add_argument("--work-dir", type=Path, default=Path("/tmp/dtprobe_verdicts"), help="run directories")
    parser.add_argument("--keep", action="store_true", help="keep every run directory (default: only missed and "
                        "falsely flagged ones)")
    parser.add_argument("--reanalyze", type=Path, metavar="LOG",
                        help="run nothing: score the run directories under --work-dir that an earlier invocation "
                             "(its printed output saved in LOG, run with --keep) left, with today's analysis")
    parser.add_argument("--quick", action="store_true",
                        help="smoke run: dp2 only, 1 clean run, slowdowns of 20%% only")
    args = parser.parse_args(argv)
    if args.quick:
        args.layouts, args.repeats, args.slowdowns = ["dp2"], 1, [0.2]
    if args.steps < args.fault_step + 10:
        parser.error(f"--steps {args.steps} leaves fewer than 10 steps after --fault-step {args.fault_step}")

    if args.reanalyze is not None:
        print(report(reanalyze(args.reanalyze, args.work_dir, nominal_fault_step=args.fault_step)))
        return 0
    if args.step_ms < 0:
        parser.error(f"--step-ms {args.step_ms:g} must be >= 0 (0: no calibration)")
    matrix = build_matrix(args)
    sources = source_fingerprint()
    try:
        args.batch = calibrate(args)
    except RuntimeError as exc:     # (the harness's ChaosError too) a layout that does not run here
        print(f"calibration failed: {exc}", file=sys.stderr)
        return 2
    print(f"{len(matrix)} runs: layouts {' '.join(args.layouts)}, {args.repeats} clean each, slowdowns "
          f"{' '.join(f'{s:.0%}' for s in args.slowdowns)}, faults from step {args.fault_step}, seed {args.seed}, "
          f"batch {' '.join(f'{k} {args.batch[k]}' for k in args.layouts)} x {args.seq_len} tokens", flush=True)
    outcomes: list[Outcome] = []
    for i, sc in enumerate(matrix, 1):
        run_dir = args.work_dir / f"{i:03d}-{sc.layout}-{sc.label}"
        if run_dir.exists():
            shutil.rmtree(run_dir)
        t0 = time.monotonic()
        try:
            run_scenario(sc, run_dir, args)
            out = score(sc, analyze(run_dir), run_dir, nominal_fault_step=args.fault_step)
        except Exception as exc:          # one broken run must not lose the hour's other results
            out = Outcome(scenario=sc, error=f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}")
        out.wall_s = time.monotonic() - t0
        if source_fingerprint() != sources:
            print(f"[{i}/{len(matrix)}] stopped: dtprobe's sources under {ROOT} changed while the matrix ran: "
                  f"this run may have run other code than the runs before it. The {i - 1} runs before it are "
                  "scored below; run the matrix again on an unchanged checkout.", flush=True)
            print()
            print(report(outcomes))
            return 3
        outcomes.append(out)
        verdict = ("error: " + out.error if out.error else
                   ("TP" if out.true_positive else ("FN" if sc.kind != "clean" else "ok"))
                   + (f" (detected +{out.detect_steps} steps)" if out.detect_steps is not None else "")
                   + _realized_text(out)
                   + (f"; FP {', '.join(out.false_positives)}" if out.false_positives else "")
                   + (f"; other {', '.join(out.other)}" if out.other else ""))
        target = "" if sc.rank is None else f" rank {sc.rank} from step {sc.fault_step}"
        print(f"[{i}/{len(matrix)}] {sc.layout:<8} {sc.label:<10}{target}: {verdict} ({out.wall_s:.0f} s)",
              flush=True)
        if not args.keep and out.error is None and not out.false_positives and not out.other and \
                (out.true_positive or sc.kind == "clean"):
            shutil.rmtree(run_dir, ignore_errors=True)
    print()
    print(report(outcomes))
    return 0


def source_fingerprint(root: Path | None = None) -> str:
    """A digest of the path, size and modification time of every Python file under the ``SOURCE_DIRS`` of
    ``root`` (default: this checkout): it changes when a file of the code the jobs run is edited, added or
    removed."""
    root = ROOT if root is None else root
    digest = hashlib.sha256()
    for folder in SOURCE_DIRS:
        for path in sorted((root / folder).rglob("*.py")):
            try:
                stat = path.stat()
            except FileNotFoundError:     # removed since the listing (an editor's temporary file): not a source
                continue
            digest.update(f"{path.relative_to(root)}\0{stat.st_size}\0{stat.st_mtime_ns}\n".encode())
    return digest.hexdigest()


if __name__ == "__main__":
    sys.exit(main())
