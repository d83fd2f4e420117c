"""Steps of an unmodified script, found from torch's hooks (``dtprobe launch``): ``steps`` rows (and ``amp`` rows
for ``GradScaler`` steps) written through a probe; installed by ``dtprobe.runtime.launch_worker``.

A **step is an optimizer step attempt**: ``torch.optim.optimizer.register_optimizer_step_post_hook`` ends one each
time an optimizer's ``step()`` returns (an optimizer stepping inside another's step, e.g. ZeRO's wrapped optimizer,
is the same step; several optimizers stepping in one iteration are several steps). Gradient accumulation
therefore counts optimizer steps, not micro-batches. A ``GradScaler.step`` that skips the optimizer (inf/NaN
gradients) is still a step attempt: it ends the step and writes an ``amp`` row with ``skipped=True``.

Step boundaries: step 0 starts at the first batch fetched from a DataLoader, forward, backward or optimizer step
seen; each later step starts where the previous one ended, so data loading and anything else between two optimizer
steps belongs to the next step. A step still open when the script ends (evaluation, saving) had no optimizer step
and is not written.

Phases (``data_ns``, ``fwd_ns``, ``bwd_ns``, ``opt_ns``), summed over a step's micro-batches:
- ``data``: a ``torch.utils.data.DataLoader`` iterator's ``__next__`` on the main thread, outside the other phases
  (the batch read and collated in the process, or waited for from its worker processes). Batches from other
  iterables (a generator, a streaming client) are not seen: their time is in the step and in no phase.
- ``fwd``: an outermost module call (``register_module_forward_pre_hook``/``_hook`` with ``always_call``; a module
  called inside another is not timed again, nor one called during backward: activation checkpointing's recompute
  is backward time). During step 0 every module call goes through these global hooks to
  find the outermost modules; from step 1 on only those modules carry hooks, so the others keep torch's fast path.
- ``bwd``: from the moment the gradient reaches an outermost module's output (a tensor hook) to the end of that
  backward pass (an autograd engine callback, ``torch_internals.queue_backward_callback``).
- ``opt``: the optimizer's ``step()`` (``register_optimizer_step_pre_hook`` to the post hook).

``loss`` and ``tokens`` come only from ``dtprobe.record(loss=..., tokens=...)`` (the mean of the losses and the sum
of the tokens given during the step); ``lr`` is the first parameter group's ``lr`` after the step. Nothing is
guessed: a step without ``dtprobe.record`` has no loss and no tokens.
"""

from __future__ import annotations

import threading
from typing import Any

import torch
from torch.utils.hooks import RemovableHandle

from dtprobe.collectors import torch_internals


class ScriptSteps:
    """Turns the hooks of one process into probe steps; ``install()`` once, ``close()`` at the script's end."""

    def __init__(self, probe: Any) -> None:
        self.probe = probe
        self.num_steps = 0
        """Optimizer step attempts ended so far (the next step's number)."""
        self._step: Any = None              # the open StepContext
        self._next_start_ns: int | None = None
        self._fwd_depth = 0
        self._recompute_depth = 0           # module calls inside backward (recomputation), not timed as fwd
        self._fwd_phase: Any = None
        self._bwd_phase: Any = None
        self._opt_depth = 0
        self._opt_phase: Any = None
        self._opt_stepped = 0               # optimizer steps that ran (a skipped GradScaler step runs none)
        self._losses: list[Any] = []
        self._tokens: int | None = None
        self._roots: dict[int, torch.nn.Module] = {}
        self._handles: list[RemovableHandle] = []
        self._global_fwd: list[RemovableHandle] = []
        self._scaler_originals: dict[str, Any] = {}
        self._batches = DataLoaderTimer(self._data_step)
        self._main_thread = threading.main_thread()

    # ---- install / close ----
    def install(self) -> None:
        """Register the optimizer and global forward hooks and wrap ``GradScaler.step``."""
        from torch.nn.modules import module as nn_module
        from torch.optim import optimizer as optim

        self._handles += [optim.register_optimizer_step_pre_hook(self._on_opt_pre),
                          optim.register_optimizer_step_post_hook(self._on_opt_post)]
        self._global_fwd = [nn_module.register_module_forward_pre_hook(self._on_fwd_pre),
                            nn_module.register_module_forward_hook(self._on_fwd_post, always_call=True)]
        self._wrap_grad_scaler()
        self._batches.install()

    def close(self) -> None:
        """Remove every hook; an open step (no optimizer step in it) is dropped."""
        for handle in self._handles + self._global_fwd:
            handle.remove()
        self._handles, self._global_fwd = [], []
        from torch.amp import grad_scaler

        for name, original in self._scaler_originals.items():
            setattr(grad_scaler.GradScaler, name, original)
        self._scaler_originals = {}
        self._batches.close()
        if self._step is not None:
            self.probe.discard_step(self._step)
            self._step = None

    # ---- values from dtprobe.record ----
    def record(self, *, loss: Any = None, tokens: Any = None) -> None:
        """``dtprobe.record``: add a loss (averaged over the step) and/or tokens (summed) to the current step."""
        if loss is not None:
            self._losses.append(loss)
        if tokens is not None:
            self._tokens = (self._tokens or 0) + int(tokens)

    # ---- steps ----
    def _open(self) -> Any:
        if self._step is None:
            self._step = self.probe.hook_step(self.num_steps)
            self._step.__enter__()
            if self._next_start_ns is not None:
                self._step.start_ns = self._next_start_ns
        return self._step

    def _end(self, *, lr: Any = None) -> None:
        step = self._open()
        if self._losses:
            losses = [float(v.detach().float().mean().item()) if isinstance(v, torch.Tensor) else float(v)
                      for v in self._losses]
            step.record(loss=sum(losses) / len(losses))
        step.record(tokens=self._tokens, lr=lr)
        self._losses, self._tokens = [], None
        self._step = None
        step.__exit__(None, None, None)
        self._next_start_ns = step.end_ns
        self.num_steps += 1
        if self.num_steps == 1:
            self._hook_roots_only()

    # ---- forward ----
    def _on_fwd_pre(self, module: torch.nn.Module, args: Any) -> None:
        if threading.current_thread() is not self._main_thread:
            return
        if self._fwd_depth == 0 and (self._bwd_phase is not None or self._recompute_depth):
            self._recompute_depth += 1      # activation checkpointing recomputes inside backward: bwd time
            return
        if self._fwd_depth == 0:
            if self._global_fwd:
                self._roots.setdefault(id(module), module)
            self._fwd_phase = self._open().phase("fwd")
            self._fwd_phase.__enter__()
        self._fwd_depth += 1

    def _on_fwd_post(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        if threading.current_thread() is not self._main_thread:
            return
        if self._recompute_depth:
            self._recompute_depth -= 1
            return
        if self._fwd_depth == 0:
            return
        self._fwd_depth -= 1
        if self._fwd_depth == 0 and self._fwd_phase is not None:
            self._fwd_phase.__exit__(None, None, None)
            self._fwd_phase = None
            tensor = _first_grad_tensor(output)
            if tensor is not None:
                tensor.register_hook(self._on_bwd_start)

    def _hook_roots_only(self) -> None:
        """After step 0: hook the outermost modules seen, drop the global hooks (every module's slow path)."""
        for handle in self._global_fwd:
            handle.remove()
        self._global_fwd = []
        for module in self._roots.values():
            self._handles += [module.register_forward_pre_hook(self._on_fwd_pre),
                              module.register_forward_hook(self._on_fwd_post, always_call=True)]
        self._roots = {}

    # ---- backward ----
    def _on_bwd_start(self, grad: Any) -> None:
        if self._bwd_phase is None:
            self._bwd_phase = self._open().phase("bwd")
            self._bwd_phase.__enter__()
            torch_internals.queue_backward_callback(self._on_bwd_end)

    def _on_bwd_end(self) -> None:
        if self._bwd_phase is not None:
            self._bwd_phase.__exit__(None, None, None)
            self._bwd_phase = None

    # ---- optimizer ----
    def _on_opt_pre(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        self._opt_depth += 1
        if self._opt_depth == 1:
            self._opt_phase = self._open().phase("opt")
            self._opt_phase.__enter__()

    def _on_opt_post(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        self._opt_depth -= 1
        if self._opt_depth > 0:
            return
        if self._opt_phase is not None:
            self._opt_phase.__exit__(None, None, None)
            self._opt_phase = None
        self._opt_stepped += 1
        groups = getattr(optimizer, "param_groups", None) or [{}]
        lr = groups[0].get("lr")
        self._end(lr=float(lr) if isinstance(lr, (int, float, torch.Tensor)) else None)

    def _wrap_grad_scaler(self) -> None:
        """``GradScaler.step`` that skips the optimizer still ends a step; every scaler step writes an ``amp`` row."""
        from torch.amp import grad_scaler

        original = grad_scaler.GradScaler.step
        steps = self

        def step(scaler: Any, optimizer: Any, *args: Any, **kwargs: Any) -> Any:
            if not scaler.is_enabled():
                return original(scaler, optimizer, *args, **kwargs)
            scale_before = scaler.get_scale()
            stepped = steps._opt_stepped
            result = original(scaler, optimizer, *args, **kwargs)
            skipped = steps._opt_stepped == stepped
            number = steps.num_steps if skipped else steps.num_steps - 1
            steps.probe.record("amp", {"step": number, "scale_before": float(scale_before), "found_inf": skipped,
                                       "skipped": skipped})
            if skipped:
                steps._end()
            return result

        self._scaler_originals["step"] = original
        grad_scaler.GradScaler.step = step


    def _data_step(self) -> Any:
        """The step a batch fetched now belongs to (opened by it), or None inside fwd/bwd/opt."""
        if self._fwd_depth or self._opt_depth or self._bwd_phase is not None:
            return None
        return self._open()


class DataLoaderTimer:
    """Times every batch a ``torch.utils.data.DataLoader`` iterator hands the main thread (its ``__next__``: the
    batch read and collated in the process, or waited for from its worker processes) as the ``data`` phase of the
    step ``step_of()`` returns (None: not timed). ``install`` wraps the iterators' ``__next__`` (one class for
    every DataLoader), ``close`` puts it back. Used by ``dtprobe launch``'s steps and the framework callbacks'."""

    def __init__(self, step_of: Any) -> None:
        self.step_of = step_of
        self._original: Any = None
        self._main_thread = threading.main_thread()

    def install(self) -> None:
        from torch.utils.data import dataloader

        if self._original is not None:
            return
        original = self._original = dataloader._BaseDataLoaderIter.__next__
        timer = self

        def __next__(iterator: Any) -> Any:
            step = timer.step_of() if threading.current_thread() is timer._main_thread else None
            if step is None:
                return original(iterator)
            with step.phase("data"):
                return original(iterator)

        dataloader._BaseDataLoaderIter.__next__ = __next__

    def close(self) -> None:
        if self._original is not None:
            from torch.utils.data import dataloader

            dataloader._BaseDataLoaderIter.__next__ = self._original
            self._original = None


def _first_grad_tensor(output: Any) -> torch.Tensor | None:
    """The first tensor in a module's output (a tensor, a sequence or mapping of them, a dataclass-like object
    with tensor attributes) through which a gradient will flow."""
    if isinstance(output, torch.Tensor):
        return output if output.requires_grad else None
    if isinstance(output, dict):
        items = output.values()
    elif isinstance(output, (list, tuple)):
        items = output
    else:
        items = vars(output).values() if hasattr(output, "__dict__") else ()
    for item in items:
        if isinstance(item, torch.Tensor) and item.requires_grad:
            return item
    return None
