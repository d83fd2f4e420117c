"""The train loop in-process on a 1-rank gloo group: seeding, gradient accumulation, lr schedule, stragglers."""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist

from dtprobe.collectors.training import StepContext
from dtprobe.runtime.config import JobConfig, TrainConfig
from dtprobe.runtime.faults import FaultInjector, parse_fault
from dtprobe.runtime.train import train


class RecordingProbe:
    """The probe surface the train loop uses, keeping rows in memory."""

    rank, world_size, local_rank, restart, is_leader = 0, 1, 0, 0, False

    def __init__(self) -> None:
        self.steps: list[dict] = []
        self.faults: list[dict] = []

    def step(self, step: int) -> StepContext:
        return StepContext(step, on_enter=lambda s: None, on_exit=lambda ctx: self.steps.append(ctx.row(restart=0)))

    def fault(self, kind: str, *, step=None, injected=False, **detail) -> None:
        self.faults.append({"kind": kind, "step": int(step), "injected": injected, **detail})

    def record(self, table: str, row: dict) -> None:
        pass

    def flush(self) -> None:
        pass


@pytest.fixture(scope="module", autouse=True)
def one_rank_group():
    torch.set_num_threads(1)
    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def run(steps: int = 3, faults=(), **train_kw) -> RecordingProbe:
    probe = RecordingProbe()
    args = dict(steps=steps, batch_size=2, seq_len=16, warmup=2)
    args.update(train_kw)
    job = JobConfig(train=TrainConfig(**args), faults=tuple(faults), run_dir="/unused")
    train(job, probe=probe, device=torch.device("cpu"))
    return probe


def losses(probe: RecordingProbe) -> list[float]:
    return [row["loss"] for row in probe.steps]


def test_same_seed_gives_the_same_losses_and_another_seed_does_not():
    a, b, c = run(seed=1), run(seed=1), run(seed=2)
    assert losses(a) == losses(b)
    assert losses(a) != losses(c)
    assert losses(a)[-1] < losses(a)[0]


@pytest.mark.parametrize("data", ["synthetic", "text"])
def test_grad_accum_2_of_batch_b_matches_batch_2b(data):
    whole = run(batch_size=4, grad_accum=1, data=data)
    accum = run(batch_size=2, grad_accum=2, data=data)
    assert losses(whole) == pytest.approx(losses(accum), abs=1e-5)
    assert losses(whole) != pytest.approx(losses(run(batch_size=2, grad_accum=1, data=data)), abs=1e-5)
    assert [r["tokens"] for r in whole.steps] == [r["tokens"] for r in accum.steps] == [4 * 16] * 3


def test_lr_warms_up_linearly_to_the_scaled_peak():
    probe = run(steps=3, warmup=2, lr=1e-3, batch_size=2, reference_batch=8)   # peak = 1e-3 * 2 / 8
    assert [r["lr"] for r in probe.steps] == pytest.approx([1.25e-4, 2.5e-4, 2.5e-4])


def test_every_step_row_has_all_phases():
    row = run(steps=1).steps[0]
    assert all(row[f"{p}_ns"] > 0 for p in ("data", "fwd", "bwd", "opt"))
    assert row["end_ns"] - row["start_ns"] >= row["fwd_ns"] + row["bwd_ns"] + row["opt_ns"]


def test_straggler_sleeps_in_forward_from_its_step_and_is_recorded_once():
    probe = run(steps=3, faults=[parse_fault("straggler:rank=0,delay_ms=300,from_step=1")])
    assert min(row["fwd_ns"] for row in probe.steps[1:]) >= 300e6
    assert probe.faults == [{"kind": "straggler", "step": 1, "injected": True, "from_step": 1, "delay_ms": 300.0}]


def test_straggler_injector_sleeps_only_from_its_step():
    probe = RecordingProbe()
    injector = FaultInjector((parse_fault("straggler:rank=0,delay_ms=300,from_step=2"),), rank=0, restart=0,
                             probe=probe)
    elapsed = []
    for step in range(4):
        t0 = time.perf_counter()
        injector.in_compute(step)
        elapsed.append(time.perf_counter() - t0)
    assert max(elapsed[:2]) < 0.3 <= min(elapsed[2:])
    assert [f["step"] for f in probe.faults] == [2]


def test_straggler_slowdown_sleeps_factor_minus_one_times_the_last_compute():
    probe = RecordingProbe()
    injector = FaultInjector((parse_fault("straggler:rank=0,slowdown=3"),), rank=0, restart=0, probe=probe)
    injector.in_compute(0)
    time.sleep(0.2)                        # "compute" of step 0
    injector.after_compute()
    t0 = time.perf_counter()
    injector.in_compute(1)                 # sleeps (3 - 1) x ~0.2 s
    assert time.perf_counter() - t0 >= 0.39
    assert probe.faults[0]["slowdown"] == 3.0


def _spin(seconds: float) -> None:
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


def test_straggler_slowdown_on_cpu_burns_factor_minus_one_times_the_last_computes_cpu_time():
    probe = RecordingProbe()
    injector = FaultInjector((parse_fault("straggler:rank=0,slowdown=1.5"),), rank=0, restart=0, probe=probe,
                             burn=True)
    injector.in_compute(0)
    _spin(0.2)                             # 0.2 s of CPU work, then 0.3 s waiting (not work: not counted)
    time.sleep(0.3)
    injector.after_compute()
    t0, cpu0 = time.perf_counter(), time.thread_time()    # the wall interval encloses the CPU one
    injector.in_compute(1)                 # burns (1.5 - 1) x ~0.2 s of this thread's CPU, sleeps nothing
    burnt, wall = time.thread_time() - cpu0, time.perf_counter() - t0
    assert 0.099 <= burnt < 0.16 and wall >= burnt
    assert probe.faults[0]["slowdown"] == 1.5


_SLEEP = time.sleep   # not the tests' patched one


class _SpinStage:
    """A pipeline stage whose every action is ``cpu_s`` of this thread's CPU work (twice that for a backward), then
    ``off_s`` off the CPU (as when a rank sharing its core runs meanwhile)."""

    stage_index = 0

    def __init__(self, cpu_s: float, off_s: float = 0.0) -> None:
        self.cpu_s, self.off_s = cpu_s, off_s

    def forward_one_chunk(self, chunk, *args, **kwargs):
        _spin(self.cpu_s)
        _SLEEP(self.off_s)

    def backward_one_chunk(self, chunk, *args, **kwargs):
        _spin(2 * self.cpu_s)
        _SLEEP(self.off_s)

    def backward_weight_one_chunk(self, chunk, *args, **kwargs):
        _spin(self.cpu_s)
        _SLEEP(self.off_s)


def test_straggler_slowdown_on_a_pipeline_rank_stretches_each_action_not_the_steps_start(monkeypatch):
    from dtprobe.runtime import faults
    from dtprobe.runtime.parallel.pp import PipelineTimer

    slept: list[tuple[int, float]] = []
    step = 0
    real_sleep = time.sleep

    def sleep(seconds: float) -> None:
        slept.append((step, seconds))
        real_sleep(seconds)

    monkeypatch.setattr(faults.time, "sleep", sleep)
    probe = RecordingProbe()
    injector = FaultInjector((parse_fault("straggler:rank=0,slowdown=2,from_step=1"),), rank=0, restart=0,
                             probe=probe, burn=True)
    stage = _SpinStage(0.03, off_s=0.03)   # an action's wall time is its CPU time and as long again off the CPU
    timer = PipelineTimer([stage], None, device=None)
    lengths = {}
    for step in range(3):
        cpu0 = time.thread_time()
        injector.in_compute(step, per_action=True)       # the step's start: nothing burnt or slept there
        assert time.thread_time() - cpu0 < 0.01 and [s for s in slept if s[0] == step] == []
        timer.start_step(step)
        timer.faults = injector
        stage.forward_one_chunk(0)
        stage.backward_one_chunk(0, None, True)
        injector.after_compute()
        lengths[step] = [(r["action"], (r["end_ns"] - r["start_ns"]) / 1e9) for r in timer.rows]
    assert [a for a, _ in lengths[0]] == ["F", "B"]
    # before from_step nothing; then each action sleeps (2 - 1) x its own wall time (CPU time and time off the
    # CPU, where a sleep of its CPU time would add only half that), inside its row
    assert [s for s in slept if s[0] == 0] == []
    for step in (1, 2):
        f, b = [seconds for s, seconds in slept if s == step]
        assert f >= 0.055 and b >= 0.085
        (_, f_row), (_, b_row) = lengths[step]
        assert f <= f_row - f + 0.002 and b <= b_row - b + 0.002   # no longer than the action itself
        assert f_row >= 0.06 + f and b_row >= 0.09 + b
    assert [f["step"] for f in probe.faults] == [1]


def test_faults_for_another_rank_or_a_restarted_attempt_are_inactive():
    specs = (parse_fault("straggler:rank=3,delay_ms=500"), parse_fault("crash:rank=0,step=1"))
    assert not FaultInjector(specs[:1], rank=0, restart=0, probe=None).active
    assert FaultInjector(specs, rank=0, restart=0, probe=None).active
    assert not FaultInjector(specs, rank=0, restart=1, probe=None).active     # a crash fires on attempt 0 only
