"""Pipeline parallelism with ``torch.distributed.pipelining``: stage split, schedules, per-action timing and
sleep stages; used by ``parallelize``, its rows feed the ``pipeline`` table.

Stages: the GPT's blocks are split evenly over ``pp * virtual_stages`` stages (embedding on the first, norm
and head on the last); rank ``r`` holds stages ``r, r+pp, ...`` (looped) or ``r, 2pp-1-r`` for ``zbv``.
Each stage module is a copy of the full model with the other parts removed, so parameter names (and
checkpoints) stay those of the unsplit model.

Timing: every ``forward_one_chunk`` (F), ``backward_one_chunk`` (B, or I when the schedule splits the
backward) and ``backward_weight_one_chunk`` (W) of a stage is timed on the host; one row per action.
The ideal timeline replays the schedule's own action list with the measured mean cost per (stage, action)
(``dtprobe.schedule_sim``); torch's ``Schedule1F1B.pipeline_order`` is wrong on the last rank (it lists
F1..F8 for 8 micro-batches and no F0), so 1F1B's list comes from the simulator instead.
"""

from __future__ import annotations

import atexit
import copy
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from dtprobe.collectors import training
from dtprobe.collectors.cuda_clock import DeviceSpan
from dtprobe.runtime.parallel.stage_sleep import StageSleep, parse_stage_sleep  # noqa: F401 (re-export)

SCHEDULE_CLASSES = {
    "gpipe": "ScheduleGPipe",
    "1f1b": "Schedule1F1B",
    "interleaved-1f1b": "ScheduleInterleaved1F1B",
    "zero-bubble": "ScheduleInterleavedZeroBubble",
    "zbv": "ScheduleZBVZeroBubble",
}
"""``--pp-schedule`` name -> class in ``torch.distributed.pipelining``."""
SINGLE_STAGE_SCHEDULES = ("gpipe", "1f1b")


def stage_layers(num_layers: int, num_stages: int) -> list[range]:
    """Block indices of each stage: an even split, the remainder going to the middle-to-last stages."""
    return [range(s * num_layers // num_stages, (s + 1) * num_layers // num_stages) for s in range(num_stages)]


def local_stages(schedule: str, *, pp: int, pp_rank: int, virtual_stages: int) -> list[int]:
    """Global stage indices held by pipeline rank ``pp_rank``, in local-chunk order."""
    from dtprobe.schedule_sim import stage_ranks

    return stage_ranks(schedule, num_ranks=pp, virtual_stages=virtual_stages)[pp_rank]


def stage_module(model: nn.Module, stage: int, num_stages: int) -> nn.Module:
    """A copy of the GPT holding only ``stage``'s blocks (plus embedding first, norm and head last)."""
    layers = stage_layers(len(model.blocks), num_stages)[stage]
    part = copy.deepcopy(model)
    for key in list(part.blocks.keys()):
        if int(key) not in layers:
            del part.blocks[key]
    if stage != 0:
        part.embed = None
    if stage != num_stages - 1:
        part.norm = None
        part.head = None
    return part


class _Sleep(torch.autograd.Function):
    """Identity whose forward sleeps ``fwd_s`` and whose backward sleeps ``bwd_s``."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, fwd_s: float, bwd_s: float) -> torch.Tensor:
        time.sleep(fwd_s)
        ctx.bwd_s = bwd_s
        return x.clone()   # not a view: the zero-bubble backward detaches stage outputs in place

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        time.sleep(ctx.bwd_s)
        return grad, None, None


class SleepStage(nn.Module):
    """A stage whose compute is a fixed sleep: ``x * w`` (one scalar weight) wrapped in ``_Sleep``.
    The first stage turns tokens into floats; activations are ``(batch, seq)``."""

    def __init__(self, sleep: StageSleep, *, is_first: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(()))
        self.fwd_s = sleep.fwd_ms / 1000.0
        self.bwd_s = sleep.bwd_ms / 1000.0
        self.is_first = is_first

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.is_first:
            x = x.float()
        return _Sleep.apply(x * self.weight, self.fwd_s, self.bwd_s)


def sleep_loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Loss of sleep stages: the mean output (it only has to be differentiable)."""
    return output.float().mean()


def build_schedule(stages: Sequence[Any], schedule: str, *, microbatches: int,
                   loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> Any:
    """The torch pipelining schedule over this rank's ``PipelineStage`` objects (gradients scaled by
    1/microbatches, so a mean loss per micro-batch gives the gradient of the global mean)."""
    import torch.distributed.pipelining as pipelining

    cls = getattr(pipelining, SCHEDULE_CLASSES[schedule])
    if schedule in SINGLE_STAGE_SCHEDULES:
        return cls(stages[0], n_microbatches=microbatches, loss_fn=loss_fn)
    return cls(list(stages), n_microbatches=microbatches, loss_fn=loss_fn)


class PipelineTimer:
    """Times every pipeline action of this rank's stages; rows go to ``record("pipeline", row)``.

    On the host each action is timed around its call (``clock="host"``). With a device clock (``device``: the
    ``(DeviceClock, torch.cuda)`` pair of ``collectors.training.device_clock()``, the default) each action is also
    bracketed by CUDA events on the compute stream and an NVTX range (``F3.1``: action, stage, micro-batch); its
    row is held until the device has finished it (checked, never waited for, at each later action and at the
    next ``start_step``, and at exit) and then written with device times and ``clock="device"``; an action still
    running at the next step's start is written with its host times.
    """

    def __init__(self, stages: Sequence[Any], record: Callable[[str, dict[str, Any]], None] | None, *,
                 device: tuple[Any, Any] | None | str = "auto") -> None:
        self.step = -1
        """Training step the next actions belong to (set by the train step)."""
        self.rows: list[dict[str, Any]] = []
        """Rows of the current step, host times (kept for ``fwd_ns``/``bwd_ns`` and tests; cleared by
        ``start_step``)."""
        self._record = record
        self._device = training.device_clock() if device == "auto" else device
        self._held: list[tuple[dict[str, Any], DeviceSpan]] = []
        self.faults: Any = None
        """The runtime's ``FaultInjector`` of the current step (set by the train step; None: no faults): an
        injected slowdown stretches each action inside its timing (``FaultInjector.stretch``)."""
        for stage in stages:
            self._wrap(stage)
        if self._device is not None:
            # The last step's held rows: atexit runs this before the probe's own close (registered earlier).
            atexit.register(self.flush)

    def flush(self) -> None:
        """Write every held row now (device times where finished, else host times)."""
        self._write_finished(final=True)

    def start_step(self, step: int) -> None:
        self.flush()
        self.step = step
        self.rows = []

    def _wrap(self, stage: Any) -> None:
        forward, backward, weight = stage.forward_one_chunk, stage.backward_one_chunk, stage.backward_weight_one_chunk

        def forward_one_chunk(chunk: int, *args: Any, **kwargs: Any) -> Any:
            return self._timed(stage.stage_index, chunk, "F", forward, chunk, *args, **kwargs)

        def backward_one_chunk(chunk: int, *args: Any, **kwargs: Any) -> Any:
            full = kwargs.get("full_backward", args[1] if len(args) > 1 else True)
            return self._timed(stage.stage_index, chunk, "B" if full else "I", backward, chunk, *args, **kwargs)

        def backward_weight_one_chunk(chunk: int, *args: Any, **kwargs: Any) -> Any:
            return self._timed(stage.stage_index, chunk, "W", weight, chunk, *args, **kwargs)

        stage.forward_one_chunk = forward_one_chunk
        stage.backward_one_chunk = backward_one_chunk
        stage.backward_weight_one_chunk = backward_weight_one_chunk

    def _timed(self, stage: int, chunk: int, action: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        span = None
        if self._device is not None:
            span = DeviceSpan(self._device[0], self._device[1], f"{action}{stage}.{int(chunk)}")
            span.begin()
        faults = self.faults
        started = faults.clock() if faults is not None else 0.0
        t0 = time.time_ns()
        out = fn(*args, **kwargs)
        if faults is not None:
            faults.stretch(self.step, started)
        t1 = time.time_ns()
        if span is not None:
            span.end()
        self._add(stage, chunk, action, t0, t1, span)
        return out

    def _add(self, stage: int, chunk: int, action: str, t0: int, t1: int, span: DeviceSpan | None) -> None:
        row = {"stage": stage, "step": self.step, "microbatch": int(chunk), "action": action,
               "start_ns": t0, "end_ns": t1, "clock": "host"}
        self.rows.append(row)
        if span is None:
            if self._record is not None:
                self._record("pipeline", row)
            return
        self._held.append((dict(row), span))
        self._write_finished(final=False)

    def _write_finished(self, *, final: bool) -> None:
        """Write held rows in order while the device has finished them (all of them if ``final``)."""
        held = self._held
        while held:
            row, span = held[0]
            times = span.resolve()
            if times is None and not final:
                break
            held.pop(0)
            if times is not None:
                row["start_ns"], row["end_ns"], row["clock"] = times[0], times[1], "device"
            if self._record is not None:
                self._record("pipeline", row)

    def phase_ns(self) -> tuple[int, int]:
        """(forward ns, backward ns) of the current step: summed F, and summed B/I/W actions (host times)."""
        fwd = sum(r["end_ns"] - r["start_ns"] for r in self.rows if r["action"] == "F")
        bwd = sum(r["end_ns"] - r["start_ns"] for r in self.rows if r["action"] != "F")
        return fwd, bwd


class ScriptPipelineTimers:
    """``dtprobe launch``: a ``PipelineTimer`` for every ``torch.distributed.pipelining`` stage the script builds, its
    rows in the step ``steps`` (``collectors.launch_steps.ScriptSteps``) is in, so the pipeline findings read a
    user's schedule as they read ``dtprobe run``'s. ``install()`` wraps the stages' base ``__init__``; ``close()``
    restores it."""

    def __init__(self, steps: Any, record: Callable[[str, dict[str, Any]], None]) -> None:
        self._steps, self._record = steps, record
        self._original: Any = None
        self.timers: list[PipelineTimer] = []

    def install(self) -> bool:
        """Wrap the stages' ``__init__`` when the script has imported ``torch.distributed.pipelining`` (as a script
        does before it initializes its process group, where ``dtprobe launch`` installs this); else do nothing:
        that import is costly (the schedules and what they import), and every other script is spared it. True when
        installed."""
        stage_module = sys.modules.get("torch.distributed.pipelining.stage")
        if stage_module is None:
            return False
        base = stage_module._PipelineStageBase
        original = self._original = base.__init__
        timers = self

        def __init__(stage: Any, *args: Any, **kwargs: Any) -> None:
            original(stage, *args, **kwargs)
            timers.timers.append(_StepTimer([stage], timers._record, timers._steps))

        base.__init__ = __init__
        return True

    def close(self) -> None:
        if self._original is not None:
            sys.modules["torch.distributed.pipelining.stage"]._PipelineStageBase.__init__ = self._original
            self._original = None
        for timer in self.timers:
            timer.flush()


class _StepTimer(PipelineTimer):
    """A ``PipelineTimer`` whose step is the script's current one (``ScriptSteps.num_steps``)."""

    def __init__(self, stages: Sequence[Any], record: Callable[[str, dict[str, Any]], None], steps: Any) -> None:
        self._steps = steps
        super().__init__(stages, record)

    def _add(self, stage: int, chunk: int, action: str, t0: int, t1: int, span: DeviceSpan | None) -> None:
        if self.step != self._steps.num_steps:
            self.start_step(self._steps.num_steps)
        super()._add(stage, chunk, action, t0, t1, span)


def torch_action_order(schedule_obj: Any, schedule: str) -> list[list[Any]] | None:
    """The schedule's own per-rank action lists (``pipeline_order``) as ``schedule_sim.Action`` lists, or None
    where torch's list is known wrong (1F1B's last rank) or absent."""
    from dtprobe.schedule_sim import Action

    order = getattr(schedule_obj, "pipeline_order", None)
    if order is None or schedule == "1f1b":
        return None
    out = []
    for rank in sorted(order):
        acts = []
        for a in order[rank]:
            if a is None:
                continue
            kind = str(getattr(a.computation_type, "value", a.computation_type))
            kind = {"FULL_BACKWARD": "B", "BACKWARD_INPUT": "I", "BACKWARD_WEIGHT": "W", "FORWARD": "F"}.get(kind, kind)
            if kind not in ("F", "B", "I", "W"):
                continue
            acts.append(Action(int(a.stage_index), kind, int(a.microbatch_index)))
        out.append(acts)
    return out
