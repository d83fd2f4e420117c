"""``DtprobeCallback``: a ``lightning.pytorch.Callback`` that records a Lightning ``Trainer.fit`` with dtprobe; the
run directory it writes is read by ``dtprobe analyze`` and the dashboard like any other run.

Install and use (``pip install 'dtprobe[lightning]'``)::

    from dtprobe.integrations.lightning import DtprobeCallback
    trainer = lightning.pytorch.Trainer(strategy="ddp", callbacks=[DtprobeCallback("runs/pl-run")])
    trainer.fit(module, datamodule)

    torchrun --nproc-per-node 2 train.py                  # or Lightning's own launcher

``DtprobeCallback(run_dir, *, count_tokens=input_ids_count, **attach_options)``: ``attach_options`` go to
``dtprobe.attach`` (``collectives``, ``devices``, ``profile_steps``, ``timeout_s``, ...).

- **Attach** at ``setup(stage="fit")``: the strategy has initialized torch.distributed by then, so
  ``dtprobe.attach`` finds the default group already there (see its docstring for what it records of it), and
  has not yet wrapped the model (DDP, FSDP), so the wrapper's collectives go through the group attach records.
  A probe already open in the process (``dtprobe launch``, the script's own ``dtprobe.attach``) is reused, not
  attached again (``optimizer_steps``).
- **Steps**: one ``steps`` row per optimizer step, numbered by ``trainer.global_step`` from 0. A step opens where
  the previous one ended (the first: at the ``on_train_batch_start`` of its first micro-batch, which Lightning calls
  after fetching the batch: its ``data_ns`` phase times the DataLoader's batches, ``OptimizerStepMarker``) and
  closes at the ``on_train_batch_end`` of the batch in
  which ``trainer.global_step`` advanced: with ``accumulate_grad_batches=k`` it spans k batches (fewer for the
  last group of an epoch, which Lightning steps anyway); in manual optimization, a batch that stepped.
- **Loss**: this rank's mean over the step's micro-batches of ``training_step``'s loss. Lightning hands
  ``on_train_batch_end`` the loss divided by ``accumulate_grad_batches`` (automatic optimization), so the
  callback multiplies it back; absent when a micro-batch returned no loss.
- **Learning rate**: the first parameter group's ``lr`` at ``on_before_optimizer_step`` (the rate this step
  uses, before a step-interval scheduler moves it).
- **Tokens**: ``count_tokens(batch)`` summed over the step's micro-batches; by default the elements of
  ``batch["input_ids"]`` when the batch is a mapping holding that tensor. Absent when a micro-batch gives None.
- **Close** at ``on_train_end`` (status "finished"), or at ``on_exception`` (status "crashed", reason
  "exception"; the step it broke is written with its timing and no values), when the callback attached the probe.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from typing import Any

import torch

try:
    from lightning.pytorch import Callback
except ImportError as exc:
    raise ImportError("dtprobe.integrations.lightning needs lightning: pip install 'dtprobe[lightning]'") from exc

from dtprobe.integrations.optimizer_steps import OptimizerStepMarker


def input_ids_count(batch: Any) -> int | None:
    """Elements of ``batch["input_ids"]`` (padding included) when ``batch`` is a mapping holding that tensor."""
    if isinstance(batch, Mapping) and isinstance(batch.get("input_ids"), torch.Tensor):
        return batch["input_ids"].numel()
    return None


def _loss_of(outputs: Any) -> torch.Tensor | None:
    loss = outputs.get("loss") if isinstance(outputs, Mapping) else outputs
    return loss.detach() if isinstance(loss, torch.Tensor) else None


class DtprobeCallback(Callback):
    """Records ``Trainer.fit``'s training into ``run_dir``; see the module docstring for what each hook records."""

    def __init__(self, run_dir: str | os.PathLike, *,
                 count_tokens: Callable[[Any], int | None] = input_ids_count, **attach_options: Any) -> None:
        self.marker = OptimizerStepMarker(run_dir, attach_options)
        self.count_tokens = count_tokens
        self._step_global_step = -1
        self._losses: list[torch.Tensor] = []
        self._loss_known = True
        self._lr: float | None = None

    @property
    def probe(self) -> Any:
        """The ``Probe`` once attached (at ``setup`` of ``fit``), else None."""
        return self.marker.probe

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if stage == "fit":
            self.marker.attach(framework="Lightning")

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        self.marker.attach(framework="Lightning")          # the probe of setup; attaches if setup did not run

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if not self.marker.step_is_open:
            self._step_global_step = trainer.global_step
            self._losses, self._loss_known, self._lr = [], True, None
            self.marker.begin(trainer.global_step)
        self.marker.count_tokens(self.count_tokens(batch))

    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        self._lr = float(optimizer.param_groups[0]["lr"])

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        loss = _loss_of(outputs)
        if loss is None:
            self._loss_known = False
        else:
            # automatic optimization divides the loss by accumulate_grad_batches (Callback.on_train_batch_end)
            self._losses.append(loss * trainer.accumulate_grad_batches if pl_module.automatic_optimization else loss)
        if trainer.global_step > self._step_global_step:       # an optimizer step ran in this batch
            self._end_step()

    def _end_step(self) -> None:
        loss = None
        if self._loss_known and self._losses:
            loss = torch.stack([x.float().reshape(()) for x in self._losses]).mean().item()
        self.marker.end(loss=loss, lr=self._lr)
        self._losses = []

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        if self.marker.step_is_open:
            self._end_step()
        self.marker.close("finished")

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        self.marker.close("crashed", reason="exception")     # the open step's row, without values: it broke
