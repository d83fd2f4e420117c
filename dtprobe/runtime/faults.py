"""Fault injection: the ``--inject kind:key=value,...`` parser, the table of fault kinds (``FAULT_KINDS``), and
the faults injected at fixed points of the step (``FaultInjector``: ``crash``, ``hang``, ``straggler``). Read by
the launcher (parsing, validation) and the train loop (injection).

Every injected fault writes one ``faults`` row through ``probe.fault(kind, step=..., injected=True, **detail)``.
The other kinds are injected by their owners, which read their specs with ``job_faults_of``: ``overflow`` by
the layouts' steps (``runtime.precision``), ``slow-ckpt`` and ``corrupt-ckpt`` by ``runtime.recovery``.
Torch-free, so the CLI parses fast.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

from dtprobe.store.errors import ConfigError


@dataclass(kw_only=True, frozen=True)
class FaultKind:
    """What one fault kind accepts; one row of ``FAULT_KINDS``, used to parse and validate ``--inject`` specs."""

    name: str
    """The kind as typed after ``--inject`` (also the ``faults.kind`` column)."""
    keys: Mapping[str, type]
    """Accepted keys and their types (int, float or str)."""
    required: tuple[str, ...] = ()
    """Keys that must be given."""
    example: str = ""
    """A complete valid spec, shown in error messages."""
    help: str = ""
    """One line for ``dtprobe run --help``."""
    check: Callable[[dict[str, Any]], str | None] | None = None
    """Extra validation of the parsed values: returns an error message (without the spec) or None."""
    check_job: Callable[[Any], str | None] | None = None
    """Validation against the whole ``JobConfig`` (e.g. the precision it needs), run by the launcher before any
    process starts: returns an error message naming the flag to add (without the spec) or None."""


@dataclass(kw_only=True, frozen=True)
class FaultSpec:
    """One parsed ``--inject`` value."""

    kind: str
    """A fault kind of ``FAULT_KINDS``."""
    params: Mapping[str, Any] = field(default_factory=dict)
    """Typed key/values (``rank``, ``step``, ``delay_ms`` ...)."""

    def get(self, key: str, default: Any = None) -> Any:
        return self.params.get(key, default)

    @property
    def rank(self) -> int | None:
        """The target global rank, or None for kinds without one."""
        return self.params.get("rank")

    def to_string(self) -> str:
        """The canonical ``kind:key=value,...`` form (parses back to an equal spec)."""
        return self.kind + ":" + ",".join(f"{k}={v}" for k, v in self.params.items())

    def check_against(self, *, world_size: int, steps: int, job: Any = None) -> None:
        """ConfigError if the fault targets a rank or a step the job does not have (it would silently do nothing),
        or, given the ``job``, if its kind's ``check_job`` refuses it (e.g. overflow without fp16)."""
        kind = FAULT_KINDS.get(self.kind)
        problem = kind.check_job(job) if job is not None and kind is not None and kind.check_job else None
        if problem:
            raise ConfigError(f"--inject {self.to_string()}: {problem}")
        if self.rank is not None and not 0 <= self.rank < world_size:
            raise ConfigError(f"--inject {self.to_string()}: rank {self.rank} does not exist; WORLD_SIZE = "
                              f"{world_size}, so use rank=0..{world_size - 1}.")
        for key in ("step", "from_step"):
            value = self.params.get(key)
            if value is not None and not 0 <= value < steps:
                raise ConfigError(f"--inject {self.to_string()}: {key}={value} is outside the run's steps "
                                  f"0..{steps - 1}; lower it or raise --steps.")


def parse_fault(text: str | Mapping[str, Any], *, source: str = "--inject") -> FaultSpec:
    """``"straggler:rank=2,delay_ms=40"`` (or a TOML table ``{kind = "straggler", rank = 2, ...}``) -> FaultSpec."""
    if isinstance(text, Mapping):
        raw = dict(text)
        kind_name = str(raw.pop("kind", ""))
        pairs = {k: str(v) for k, v in raw.items()}
        shown = f"{kind_name}:" + ",".join(f"{k}={v}" for k, v in pairs.items())
    else:
        shown = text
        kind_name, _, rest = text.partition(":")
        pairs = {}
        for item in filter(None, (p.strip() for p in rest.split(","))):
            key, eq, value = item.partition("=")
            if not eq or not key.strip() or not value.strip():
                raise ConfigError(f"{source} {shown!r}: '{item}' is not key=value. Write it as kind:key=value,... "
                                  f"e.g. straggler:rank=2,delay_ms=40.")
            if key.strip() in pairs:
                raise ConfigError(f"{source} {shown!r}: key '{key.strip()}' is given twice.")
            pairs[key.strip()] = value.strip()
    kind = FAULT_KINDS.get(kind_name.strip())
    if kind is None:
        raise ConfigError(f"{source} {shown!r}: unknown fault kind '{kind_name.strip()}'; known kinds: "
                          f"{sorted(FAULT_KINDS)} (e.g. straggler:rank=2,delay_ms=40 or crash:rank=1,step=10).")
    params: dict[str, Any] = {}
    for key, value in pairs.items():
        if key not in kind.keys:
            raise ConfigError(f"{source} {shown!r}: '{kind.name}' has no key '{key}'; it accepts "
                              f"{sorted(kind.keys)}. Example: {kind.example}.")
        typ = kind.keys[key]
        try:
            params[key] = typ(value)
        except ValueError:
            raise ConfigError(f"{source} {shown!r}: {key}={value} should be a {typ.__name__}. "
                              f"Example: {kind.example}.") from None
    missing = [k for k in kind.required if k not in params]
    if missing:
        raise ConfigError(f"{source} {shown!r}: '{kind.name}' needs {missing}. Example: {kind.example}.")
    problem = kind.check(params) if kind.check else None
    if problem:
        raise ConfigError(f"{source} {shown!r}: {problem} Example: {kind.example}.")
    return FaultSpec(kind=kind.name, params=params)


def job_faults_of(faults: tuple[FaultSpec, ...], kind: str, *, rank: int | None = None) -> list[FaultSpec]:
    """The specs of ``kind`` (targeting ``rank`` when given, or with no rank at all)."""
    return [f for f in faults if f.kind == kind and (rank is None or f.rank in (None, rank))]


def _check_straggler(p: dict[str, Any]) -> str | None:
    if ("delay_ms" in p) == ("slowdown" in p):
        return "give exactly one of delay_ms=<ms to sleep per step> or slowdown=<factor > 1>."
    if "delay_ms" in p and not p["delay_ms"] > 0:
        return f"delay_ms={p['delay_ms']} must be > 0."
    if "slowdown" in p and not p["slowdown"] > 1:
        return f"slowdown={p['slowdown']} must be > 1 (2 = twice as slow)."
    return None


def _check_overflow_job(job: Any) -> str | None:
    dtype = job.precision.dtype
    if dtype != "fp16":
        return (f"an overflow needs fp16 loss scaling, but the run uses --precision {dtype}: only fp16 has a "
                f"loss scaler that detects the inf gradients and skips the step (without one the weights would "
                f"become inf). Add --precision fp16, or drop this --inject.")
    return None


FAULT_KINDS: Mapping[str, FaultKind] = {kind.name: kind for kind in (
    FaultKind(
        name="straggler", keys={"rank": int, "delay_ms": float, "slowdown": float, "from_step": int},
        required=("rank",), example="straggler:rank=2,delay_ms=40",
        help="rank R sleeps delay_ms in every step's compute from from_step on, or computes slowdown times longer "
             "(on CPU it burns (slowdown-1) x its compute's CPU time, so a rank sharing a core stays slowed; on "
             "CUDA the host sleeps that long; a pipeline rank sleeps (slowdown-1) x each action's length)",
        check=_check_straggler),
    FaultKind(
        name="crash", keys={"rank": int, "step": int}, required=("rank", "step"), example="crash:rank=1,step=10",
        help="rank R exits with code 1 at the start of step S (first attempt only; telemetry flushed first)"),
    FaultKind(
        name="hang", keys={"rank": int, "step": int}, required=("rank", "step"), example="hang:rank=1,step=5",
        help="at the start of step S rank R stops issuing collectives (sleeps; first attempt only); pair it with "
             "--collective-timeout T"),
    FaultKind(
        name="overflow", keys={"rank": int, "step": int}, required=("step",), example="overflow:step=3,rank=0",
        help="fp16 only: rank R (default every rank) multiplies its loss by 1e38 at step S (a pipeline rank "
             "without the loss sets a gradient to inf instead); every rank skips the step (runtime.precision)",
        check_job=_check_overflow_job),
    FaultKind(
        name="slow-ckpt", keys={"rank": int, "delay_ms": float}, required=("rank", "delay_ms"),
        example="slow-ckpt:rank=1,delay_ms=2000",
        help="rank R's checkpoint writes sleep delay_ms first (in the background with --ckpt-async)",
        check=lambda p: None if p["delay_ms"] > 0 else f"delay_ms={p['delay_ms']} must be > 0."),
    FaultKind(
        name="corrupt-ckpt", keys={"step": int}, required=("step",), example="corrupt-ckpt:step=9",
        help="the checkpoint saved after step S is damaged right after its commit, first attempt only (a resume "
             "must skip it)"),
)}
"""Every fault kind ``--inject`` accepts, by name."""


class FaultInjector:
    """The runtime's own faults for one rank, called by the train loop at fixed points of every step.

    ``at_step_start`` (before the step row opens: hang, crash), ``in_compute`` (start of the first forward of the step:
    straggler delay), ``after_compute`` (end of the last backward: measures compute for ``slowdown``). A pipeline
    rank's step interleaves its computing with waits for its stage peers, so there ``slowdown`` stretches each
    action instead (``stretch``, called by ``parallel.pp.PipelineTimer`` at the end of every action): put in front
    of the step, extra work would fill the rank's idle start (the bubble) and slow nothing. The stretch is a sleep
    of (slowdown - 1) x the action's wall time, even on CPU: burnt work would slow the ranks that share its core
    alike (under ``--cpu-bind auto`` with more ranks than cores, the same stage of the other pipelines:
    ``worker.cores_for``), every pipeline slower and no rank singled out; a sleep leaves them their speed, as a
    slow device leaves its neighbours theirs. It is measured in wall time like the sleep it is: on a core shared
    with another rank an action's CPU time can be half its wall time, and a sleep of the CPU share would then
    make the action only half the slowdown longer.
    ``burn`` (CPU devices): ``slowdown`` is extra work, CPU time burnt on this thread, (slowdown - 1) x the CPU
    time of the last compute, so the rank computes that much longer whatever shares its core (a sleep would hand
    its core to a rank bound beside it, which then catches up). Otherwise it is a sleep of (slowdown - 1) x the
    last compute's wall time; on CUDA that is the launch time unless the step synchronizes, so prefer
    ``delay_ms`` there. ``delay_ms`` is always a sleep (a stall).
    """

    def __init__(self, faults: tuple[FaultSpec, ...], *, rank: int, restart: int, probe: Any,
                 burn: bool = False) -> None:
        self.probe = probe
        first_attempt = restart == 0   # a crash or a hang fires on the first attempt only
        self._crashes = {f.get("step") for f in job_faults_of(faults, "crash", rank=rank)} if first_attempt else set()
        self._hangs = {f.get("step") for f in job_faults_of(faults, "hang", rank=rank)} if first_attempt else set()
        self._stragglers = job_faults_of(faults, "straggler", rank=rank)
        self._announced: set[int] = set()
        self.burn = burn
        self._clock = time.thread_time if burn else time.perf_counter   # what a compute's length is measured in
        self._compute_start = 0.0
        self._last_compute_s = 0.0

    @property
    def active(self) -> bool:
        return bool(self._crashes or self._hangs or self._stragglers)

    def at_step_start(self, step: int) -> None:
        if step in self._hangs:
            inject_hang(self.probe, step=step)
        if step in self._crashes:
            self.probe.fault("crash", step=step, injected=True)
            _flush(self.probe)
            os._exit(1)

    def in_compute(self, step: int, *, per_action: bool = False) -> None:
        """The step's compute starts: record each straggler fault once from its step, sleep its ``delay_ms`` and,
        unless ``per_action`` (a pipeline rank: ``stretch``), do its ``slowdown`` for the last compute."""
        delay_s, work_s = 0.0, 0.0
        for i, spec in enumerate(self._stragglers):
            from_step = spec.get("from_step", 0)
            if step < from_step:
                continue
            if i not in self._announced:
                self._announced.add(i)
                detail = {k: v for k, v in spec.params.items() if k != "rank"}
                self.probe.fault("straggler", step=step, injected=True, **{"from_step": from_step, **detail})
            if "delay_ms" in spec.params:
                delay_s += spec.get("delay_ms") / 1000.0
        if not per_action:
            work_s = self._extra_work(step) * self._last_compute_s
        if work_s > 0 and self.burn:
            _burn_cpu(work_s)
        else:
            delay_s += work_s
        if delay_s > 0:
            time.sleep(delay_s)
        self._compute_start = self._clock()

    def after_compute(self) -> None:
        """The last compute's length: this thread's CPU time when burning, else wall time."""
        self._last_compute_s = self._clock() - self._compute_start

    @staticmethod
    def clock() -> float:
        """When a pipeline action starts, for ``stretch``: wall time (the stretch is a sleep)."""
        return time.perf_counter()

    def stretch(self, step: int, started: float) -> None:
        """End of a pipeline action that began at ``started`` (``clock()``) in ``step``: make it slowdown times
        longer, a sleep of (slowdown - 1) x its wall time, for each ``slowdown`` fault active at ``step``."""
        extra = self._extra_work(step)
        if extra > 0:
            time.sleep(extra * (time.perf_counter() - started))

    def _extra_work(self, step: int) -> float:
        """The summed (slowdown - 1) of the ``slowdown`` faults active at ``step``: the share of a compute's own
        length to add to it."""
        return sum(spec.get("slowdown") - 1.0 for spec in self._stragglers
                   if "slowdown" in spec.params and step >= spec.get("from_step", 0))


def inject_hang(probe: Any, *, step: int) -> None:
    """Stop issuing collectives forever (the ``hang`` fault): record it, flush, sleep until killed (the watchdog
    of ``runtime.hang`` on the peers, or torchrun, ends the process)."""
    probe.fault("hang", step=step, injected=True)
    _flush(probe)
    while True:
        time.sleep(3600)


def _burn_cpu(seconds: float) -> None:
    """Spin until this thread has used ``seconds`` more CPU time."""
    end = time.thread_time() + seconds
    x = 0
    while time.thread_time() < end:
        for _ in range(1000):
            x += 1


def _flush(probe: Any) -> None:
    """Push every buffered telemetry row to disk before the process dies."""
    flush = getattr(probe, "flush", None)
    if flush is not None:
        flush()
    else:
        probe.writer.flush()
