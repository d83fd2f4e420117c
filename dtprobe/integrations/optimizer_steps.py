"""``OptimizerStepMarker``: one probe step per optimizer step of a framework's loop, written to the ``steps`` table;
the Hugging Face and Lightning callbacks (``dtprobe.integrations.hf``, ``.lightning``) drive it from their hooks.

A framework calls back at the start and end of a step instead of running a ``with probe.step(n)`` block, so the
marker enters and exits the step context itself. A step starts where the previous one ended, as in ``dtprobe
launch``: the frameworks call their step's start after its batches were fetched (and, in the Hugging Face
Trainer, after the ranks exchanged their token counts), so the data loading and whatever else runs between two
optimizer steps belongs to the next step, and so do the collectives issued there. The batches a ``DataLoader``
hands the main thread are timed as the step's ``data`` phase (``launch_steps.DataLoaderTimer``). The marker opens
the next step when one ends (numbered one more); a framework's start of a step with another number replaces it,
from the same start, and one still open at ``close`` (evaluation after the last step) is dropped. Tokens are summed
over the step's micro-batches and kept only when every micro-batch gave its count: a partial sum would be a guess,
so the step then has none.

One probe per process: when a probe is already open (``dtprobe launch`` attached in the worker, or the script
called ``dtprobe.attach``), the marker records through it instead of attaching again, marks the framework's steps
in it (stopping ``dtprobe launch``'s hook-driven steps, so each step is written once, with the loss, learning rate
and tokens only the framework knows), and leaves closing it to whoever opened it.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Any

import dtprobe
from dtprobe.collectors.attach import open_probe
from dtprobe.store.errors import ConfigError


class OptimizerStepMarker:
    """Attaches once, opens a step, counts its tokens, times its optimizer phase, closes it with loss and lr.

    ``attach_options`` go to ``dtprobe.attach`` (the ``CollectConfig`` fields, ``timeout_s``, ...).
    """

    def __init__(self, run_dir: str | os.PathLike, attach_options: dict[str, Any]) -> None:
        self.run_dir = Path(run_dir)
        self.attach_options = dict(attach_options)
        self.probe: Any = None
        """The ``Probe`` (or ``NullProbe`` with ``enabled=False``) once ``attach`` ran."""
        self.owns_probe = False
        """True when ``attach`` opened the probe (then ``close`` closes it); False when it found one open."""
        self._step: Any = None
        self._next: Any = None
        """The step opened when the previous one ended, until the framework starts it (``begin``)."""
        self._opt_phase: Any = None
        self._num_batches = 0
        self._num_counted_batches = 0
        self._tokens = 0
        self._closed = False
        self._batches: Any = None

    def attach(self, *, framework: str) -> Any:
        """On the first call, the probe already open in this process (see the module docstring), else
        ``dtprobe.attach(run_dir, **attach_options)``; the same probe afterwards."""
        if self._closed:
            raise ConfigError(
                f"the dtprobe {framework} callback for {self.run_dir} already closed its probe at the end of a "
                f"training run; a callback records one run. Pass a new callback with another run_dir to the next "
                f"training run.")
        if self.probe is not None:
            return self.probe
        existing = open_probe()
        if existing is None:
            self.probe = dtprobe.attach(self.run_dir, **self.attach_options)
            self.owns_probe = True
            self._time_batches()
            return self.probe
        if existing.run_dir.resolve() != self.run_dir.resolve():
            warnings.warn(
                f"dtprobe: the {framework} callback records into the probe already open in this process "
                f"({existing.run_dir}, attached by `dtprobe launch` or the script), not into {self.run_dir}; its "
                f"attach options are not used. Drop the callback's run_dir or the other attach to choose one.",
                stacklevel=3)
        existing.stop_step_hooks()                 # dtprobe launch's steps: the framework's replace them
        self.probe = existing
        self._time_batches()
        return self.probe

    def _time_batches(self) -> None:
        from dtprobe.collectors.launch_steps import DataLoaderTimer

        self._batches = DataLoaderTimer(lambda: self._step if self._step is not None else self._next)
        self._batches.install()

    @property
    def step_is_open(self) -> bool:
        """True between ``begin`` and ``end``."""
        return self._step is not None

    def begin(self, step: int) -> None:
        """Open step ``step`` (ending an open one first, without values: its framework never closed it), from the
        end of the previous step when one ended."""
        if self._step is not None:
            self.end()
        self._num_batches = self._num_counted_batches = self._tokens = 0
        pending, self._next = self._next, None
        if pending is not None and pending.step == step:
            self._step = pending
            return
        start_ns = None
        if pending is not None:                  # another number than the one expected: from the same start
            self.probe.discard_step(pending)
            start_ns = getattr(pending, "start_ns", None)
        self._step = self.probe.step(step)
        self._step.__enter__()
        if start_ns is not None:
            self._step.start_ns = start_ns

    def count_tokens(self, num_tokens: int | None) -> None:
        """Add one micro-batch of the open step: its token count, or None when the batch does not say."""
        if self._step is None:
            return
        self._num_batches += 1
        if num_tokens is not None:
            self._num_counted_batches += 1
            self._tokens += int(num_tokens)

    def begin_optimizer(self) -> None:
        """Start the open step's ``opt`` phase (the optimizer's ``step()``)."""
        if self._step is not None and self._opt_phase is None:
            self._opt_phase = self._step.phase("opt")
            self._opt_phase.__enter__()

    def end_optimizer(self) -> None:
        """End the ``opt`` phase."""
        if self._opt_phase is not None:
            self._opt_phase.__exit__(None, None, None)
            self._opt_phase = None

    def end(self, *, loss: float | None = None, lr: float | None = None) -> None:
        """Close the open step, recording ``loss``, ``lr`` and the tokens (each only when known)."""
        if self._step is None:
            return
        self.end_optimizer()
        step, self._step = self._step, None
        known = self._num_batches > 0 and self._num_counted_batches == self._num_batches
        step.record(loss=loss, lr=lr, tokens=self._tokens if known else None)
        step.__exit__(None, None, None)
        if not self._closed:
            self._next = self.probe.step(step.step + 1)
            self._next.__enter__()
            if getattr(step, "end_ns", None) is not None:     # (a disabled probe's steps have no times)
                self._next.start_ns = step.end_ns

    def close(self, status: str = "finished", *, reason: str | None = None) -> None:
        """End an open step and close the probe (``Probe.close``: the run's last rows, its status) when this marker
        opened it; a probe found open is left to whoever opened it."""
        if self._closed:
            return
        self._closed = True
        self.end()
        if self._batches is not None:
            self._batches.close()
        if self._next is not None:
            self.probe.discard_step(self._next)
            self._next = None
        if self.probe is not None and self.owns_probe:
            self.probe.close(status, reason=reason)
