"""Profiler windows: torch.profiler over steps first..last -> ``traces/steps<a>-<b>/rankNNNNN.pt.trace.json.gz``.

The trace is exported with the profiler's own ``export_chrome_trace`` and gzipped by streaming the file's bytes
unchanged: HTA finds the rank with the regex ``"rank":\\s+(\\d+)``, which a compact re-dump would break. Read by
HTA, Perfetto and ``dtprobe.store.kineto``.
"""

from __future__ import annotations

import gzip
import os
import shutil
from pathlib import Path
from typing import Any

import torch

from dtprobe.store.schema import TRACES_DIR

TRACE_FILE = "rank{rank:05d}.pt.trace.json.gz"
"""File name of one rank's trace inside a window folder."""


def window_dir(run_dir: str | os.PathLike, first: int, last: int) -> Path:
    """``<run>/traces/steps<first>-<last>``."""
    return Path(run_dir) / TRACES_DIR / f"steps{first}-{last}"


class ProfilerWindow:
    """Starts torch.profiler when step ``first`` begins and exports when step ``last`` ends.

    CPU activity always; CUDA activity when CUDA is available. Each step inside the window is marked with a
    ``ProfilerStep#<step>`` annotation numbered like the training step (HTA uses these as iterations).
    A run that starts (or resumes) after ``first`` has no window; one that stops inside it exports at close.
    """

    def __init__(self, run_dir: str | os.PathLike, rank: int, *, first: int, last: int,
                 record_shapes: bool = True, cuda: bool | None = None) -> None:
        self.run_dir = Path(run_dir)
        self.rank = rank
        self.first = first
        self.last = last
        self.record_shapes = record_shapes
        self.cuda = torch.cuda.is_available() if cuda is None else cuda
        self._prof: Any = None
        self._step_mark: Any = None
        self.path: Path | None = None
        """The exported trace, once written."""
        self._done = False

    @property
    def active(self) -> bool:
        return self._prof is not None

    def on_step_begin(self, step: int) -> None:
        if self._done:
            return
        if self._prof is None and step == self.first:
            self._start(step)
        if self._prof is not None:
            from torch.profiler import record_function

            self._end_step_mark()
            self._step_mark = record_function(f"ProfilerStep#{step}")
            self._step_mark.__enter__()

    def on_step_end(self, step: int) -> None:
        if self._prof is None:
            return
        self._end_step_mark()
        if step >= self.last:
            self.stop()

    def _end_step_mark(self) -> None:
        mark, self._step_mark = self._step_mark, None
        if mark is not None:
            mark.__exit__(None, None, None)

    def _start(self, step: int) -> None:
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU]
        if self.cuda:
            activities.append(ProfilerActivity.CUDA)
        prof = profile(activities=activities, record_shapes=self.record_shapes)
        prof.start()
        self._prof = prof

    def stop(self) -> Path | None:
        """Stop profiling and write the trace (no-op when not profiling)."""
        self._end_step_mark()
        prof, self._prof = self._prof, None
        if prof is None:
            return self.path
        self._done = True
        prof.stop()
        out_dir = window_dir(self.run_dir, self.first, self.last)
        out_dir.mkdir(parents=True, exist_ok=True)
        final = out_dir / TRACE_FILE.format(rank=self.rank)
        raw = final.with_suffix("")            # rankNNNNN.pt.trace.json
        prof.export_chrome_trace(str(raw))
        tmp = final.with_name(final.name + ".tmp")
        with open(raw, "rb") as src, gzip.open(tmp, "wb", compresslevel=6) as dst:
            shutil.copyfileobj(src, dst, length=1 << 20)
        os.replace(tmp, final)
        raw.unlink()
        self.path = final
        return final
