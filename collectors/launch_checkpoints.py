"""Checkpoint saves and loads of an unmodified script (``dtprobe launch``), as ``checkpoints`` rows, so that
CHECKPOINT_STALL judges a script's own checkpoints as it does ``dtprobe run``'s.

What is timed (``CheckpointTimer``):
- ``torch.distributed.checkpoint``'s ``save``, ``async_save`` and ``load`` (DCP: every rank writes or reads its
  shards), called as the package's attributes (``dcp.save``: a name bound by ``from ... import save`` before the
  probe attached keeps the untimed function);
- ``torch.save`` and ``safetensors.torch.save_file`` to a file path (the way single-file checkpoints are written,
  often by one rank, e.g. by the Hugging Face Trainer; a save into a buffer is not seen);
- Lightning's ``TorchCheckpointIO.save_checkpoint`` (its ``ModelCheckpoint``'s saves: a ``torch.save`` into a
  buffer, then written through fsspec, also to object storage).

``torch.save`` and ``safetensors.torch`` (imported then: it costs nothing) are wrapped before the script runs
(``install``), so that names bound at import (transformers' ``from safetensors.torch import save_file``) are the
timed functions; DCP and Lightning when the probe starts recording (``start``) if the script imported them by
then, else at the first optimizer step after it did (a global optimizer step hook checks ``sys.modules``: no import
hook; DCP is not imported for the script, which costs a second).

One row per call and rank: ``step`` (the step the call falls in, ``step_of()``), ``kind`` (``save``/``load``),
``start_ns``, ``blocking_ns`` (the call's time on the main thread; 0 for a save made on another thread, which
does not hold the training loop), ``async_ns`` (an ``async_save``'s time from its return to its completion, and a
save on another thread: its whole time), ``total_ns``, ``num_bytes`` (the file's size; of DCP, the ``.distcp``
files this rank's name prefix marks in the checkpoint folder; null when unknown), ``ok`` (False when it raised or its
future failed) and ``path``. A call inside another timed one (DCP writing through ``torch.save``) is not timed
again. Nothing is recorded before ``start`` (the probe attached) or after ``close``.
"""

from __future__ import annotations

import functools
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable

DCP_MODULE = "torch.distributed.checkpoint"
SAFETENSORS_MODULE = "safetensors.torch"
LIGHTNING_IO_MODULES = ("lightning.fabric.plugins.io.torch_io", "lightning_fabric.plugins.io.torch_io")
"""Where Lightning keeps ``TorchCheckpointIO`` (the ``lightning`` package, and the standalone ``lightning_fabric``
that ``pytorch_lightning`` uses)."""
_DCP_FUNCTIONS = {"save": "save", "async_save": "save", "load": "load"}
"""DCP function -> the ``kind`` of its rows."""


class CheckpointTimer:
    """Wraps the checkpoint functions (module docstring); ``install`` before the script runs, ``start`` once its
    probe records, ``close`` at its end."""

    def __init__(self) -> None:
        self.record: Callable[[str, dict], None] | None = None
        self.step_of: Callable[[], int | None] = lambda: None
        self.rank = 0
        self._originals: list[tuple[Any, str, Any]] = []
        self._pending = {DCP_MODULE: self._patch_dcp, SAFETENSORS_MODULE: self._patch_safetensors,
                         **dict.fromkeys(LIGHTNING_IO_MODULES, self._patch_lightning)}
        """Modules not patched yet -> what patches them."""
        self._step_hook: Any = None
        self._inside = threading.local()
        self._main_thread = threading.main_thread()

    def install(self) -> None:
        import torch

        original = torch.save
        wrapper = self._file_save(original)
        self._patch(torch, "save", wrapper)
        if torch.serialization.save is original:
            self._patch(torch.serialization, "save", wrapper)
        # safetensors costs nothing to import: wrapped now, so that a library binding its name at import
        # (transformers' `from safetensors.torch import save_file`) gets the timed function
        import importlib.util

        if importlib.util.find_spec("safetensors") is not None:
            import safetensors.torch  # noqa: F401

            self.patch_imported()

    def start(self, record: Callable[[str, dict], None], step_of: Callable[[], int | None], rank: int) -> None:
        """Record from now on through ``record(table, row)``, each call in step ``step_of()``."""
        from torch.optim import optimizer

        self.record, self.step_of, self.rank = record, step_of, rank
        self.patch_imported()
        self._step_hook = optimizer.register_optimizer_step_post_hook(lambda *args: self.patch_imported())

    def patch_imported(self) -> None:
        """Patch the modules of the module docstring the script has imported since the last call."""
        for name in [n for n in self._pending if n in sys.modules]:
            self._pending.pop(name)(sys.modules[name])

    def close(self) -> None:
        self.record = None
        if self._step_hook is not None:
            self._step_hook.remove()
            self._step_hook = None
        for owner, name, original in reversed(self._originals):
            setattr(owner, name, original)
        self._originals = []

    # ------------------------------------------------------------------------------------------------- patches

    def _patch(self, owner: Any, name: str, wrapper: Any) -> None:
        self._originals.append((owner, name, getattr(owner, name)))
        setattr(owner, name, wrapper)

    def _patch_dcp(self, dcp: Any) -> None:
        # the package's names only: async_save's background thread calls its own module's save, which is then
        # not timed again
        for name, kind in _DCP_FUNCTIONS.items():
            original = getattr(dcp, name, None)
            if original is not None:
                self._patch(dcp, name, self._dcp_call(original, kind, is_async=name == "async_save"))

    def _patch_safetensors(self, module: Any) -> None:
        if getattr(module, "save_file", None) is not None:
            self._patch(module, "save_file", self._file_save(module.save_file, path_arg=1))

    def _patch_lightning(self, module: Any) -> None:
        io = getattr(module, "TorchCheckpointIO", None)
        if io is not None:           # save_checkpoint(self, checkpoint, path, storage_options=None)
            self._patch(io, "save_checkpoint", self._file_save(io.save_checkpoint, path_arg=2))

    # ------------------------------------------------------------------------------------------------ wrappers

    def _file_save(self, original: Any, *, path_arg: int = 1) -> Any:
        timer = self

        @functools.wraps(original)
        def save(*args: Any, **kwargs: Any) -> Any:
            target = args[path_arg] if len(args) > path_arg else kwargs.get("f", kwargs.get("filename",
                                                                                          kwargs.get("path")))
            if not isinstance(target, (str, os.PathLike)) or not timer._recording():
                return original(*args, **kwargs)
            with timer._timed("save", Path(target), lambda: _size(Path(target))):
                return original(*args, **kwargs)
        return save

    def _dcp_call(self, original: Any, kind: str, *, is_async: bool) -> Any:
        timer = self

        @functools.wraps(original)
        def call(*args: Any, **kwargs: Any) -> Any:
            if not timer._recording():
                return original(*args, **kwargs)
            folder = _dcp_folder(kwargs)
            with timer._timed(kind, folder, lambda: _dcp_bytes(folder, timer.rank)) as timed:
                result = original(*args, **kwargs)
                if is_async:      # the row waits for the save's future: its background time, its bytes
                    future = result if hasattr(result, "add_done_callback") else getattr(result, "upload_completion",
                                                                                         None)
                    timed.finish_with(future if hasattr(future, "add_done_callback") else None)
            return result
        return call

    # --------------------------------------------------------------------------------------------------- rows

    def _recording(self) -> bool:
        return self.record is not None and not getattr(self._inside, "depth", 0)

    def _timed(self, kind: str, path: Path | None, size: Callable[[], int | None]) -> "_Timed":
        return _Timed(self, kind, path, size)

    def _write(self, step: int | None, kind: str, start_ns: int, blocking_ns: int, async_ns: int, path: Path | None,
               num_bytes: int | None, *, ok: bool) -> None:
        record = self.record
        if record is None:
            return
        record("checkpoints", {"step": step, "kind": kind, "start_ns": start_ns, "blocking_ns": blocking_ns,
                               "async_ns": async_ns, "total_ns": blocking_ns + async_ns, "num_bytes": num_bytes,
                               "ok": ok, "path": None if path is None else str(path)})


class _Timed:
    """One timed call (a context manager): its row is written when it returns or raises, or, after
    ``finish_with(future)``, when that future completes (an async save: the call's time blocked, the rest in the
    background). A call on another thread than the main one blocks nothing: its time is background time."""

    def __init__(self, timer: CheckpointTimer, kind: str, path: Path | None, size: Callable[[], int | None]) -> None:
        self.timer, self.kind, self.path, self.size = timer, kind, path, size
        self.future: Any = None

    def finish_with(self, future: Any) -> None:
        self.future = future

    def __enter__(self) -> "_Timed":
        inside = self.timer._inside
        inside.depth = getattr(inside, "depth", 0) + 1       # a save inside this call is not timed again
        self.step, self.start_ns, self.t0 = self.timer.step_of(), time.time_ns(), time.perf_counter_ns()
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        took = time.perf_counter_ns() - self.t0
        self.timer._inside.depth -= 1
        blocking = took if threading.current_thread() is self.timer._main_thread else 0
        if exc_type is None and self.future is not None:
            self.future.add_done_callback(
                lambda f: self._write(blocking, time.perf_counter_ns() - self.t0, f.exception() is None))
        else:
            self._write(blocking, took, exc_type is None)

    def _write(self, blocking: int, total: int, ok: bool) -> None:
        self.timer._write(self.step, self.kind, self.start_ns, blocking, total - blocking, self.path,
                          self.size() if ok else None, ok=ok)


def _dcp_folder(kwargs: dict[str, Any]) -> Path | None:
    """The folder a DCP call writes or reads: ``checkpoint_id``, else its storage writer's or reader's path."""
    where = kwargs.get("checkpoint_id")
    if where is None:
        storage = kwargs.get("storage_writer") or kwargs.get("storage_reader")
        where = getattr(storage, "path", None)
    return Path(where) if isinstance(where, (str, os.PathLike)) else None


def _dcp_bytes(folder: Path | None, rank: int) -> int | None:
    """The size of the ``.distcp`` files of ``rank`` (DCP names them ``__<rank>_<n>.distcp``) in ``folder``."""
    if folder is None:
        return None
    try:
        sizes = [p.stat().st_size for p in folder.glob(f"__{rank}_*.distcp")]
    except OSError:
        return None
    return sum(sizes) if sizes else None


def _size(path: Path) -> int | None:
    try:
        return path.stat().st_size
    except OSError:
        return None
