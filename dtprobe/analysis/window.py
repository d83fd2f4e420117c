"""``StepWindow``: the last N steps of a run as an analysis source (a ``dtprobe.store.source.Source``), so a live view
costs the window, not the run.

``RunAnalysis(StepWindow(store, 100))`` computes every metric and finding over the newest 100 steps of the
per-step tables (``schema.STEP_TABLES``: the ones a tail-opened store reads from its newest steps); the event
tables (faults, checkpoints) stay whole, so a crash, a hang report or a checkpoint stall earlier in the run is never
dropped. Rows outside any step (``step`` null or -1, e.g. set-up collectives) are outside every window. ``pending``
(collectives a rank was in when it last spilled) holds the window's steps' rows and the older ones of ranks with no
step in the window: a rank stuck before the window still shows its hang, while a rank that went on past an older
spilled collective completed it (its completed row lies before the window), so it is not unfinished here. The step
range is pushed down to the store (``RunStore.table(name, steps=...)``): of a compacted run, only the partition
files of the window's steps are read. Of a run read from its events, the window also gives the derived per-step
frames of its steps (``derived_table``: ``window_derived``, kept per store as the window slides) and its rows
through the store's pushed-down Arrow reads (``arrow``), so a live refresh derives the steps it added and the
failure verdicts read their few rows, not the window's whole ``collectives`` frame.
"""

from __future__ import annotations

import weakref
from pathlib import Path
from typing import Callable, Iterable, Sequence

import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc

from dtprobe.analysis.derived_tables import KEY
from dtprobe.analysis.window_derived import WindowFrames
from dtprobe.store.schema import STEP_TABLES
from dtprobe.store.source import SourceInfo

_FRAMES: "weakref.WeakKeyDictionary[object, WindowFrames]" = weakref.WeakKeyDictionary()
"""store -> the derived frames of its windows (a window is built anew for every analysis; its frames outlive it)."""


class StepWindow:
    """Steps ``first_step .. last_step`` of ``store`` (a ``RunStore``): the newest ``num_steps`` recorded.

    The window is fixed when it is built (``store.last_step()`` then); build a new one after ``store.refresh()``.
    """

    def __init__(self, store, num_steps: int) -> None:
        if num_steps < 1:
            raise ValueError(f"a step window needs at least 1 step, got {num_steps}")
        self.store = store
        self.num_steps = num_steps
        last = store.last_step()
        self.last_step: int | None = last
        """Newest step recorded (None before the first step row)."""
        self.first_step: int = 0 if last is None else max(0, last - num_steps + 1)
        """Oldest step in the window."""
        self.total_steps: int = store.num_steps()
        """Distinct steps the whole run has recorded so far."""

    @property
    def info(self) -> SourceInfo:
        """The run's facts (the ``Source`` protocol): those of the store."""
        return self.store.info

    @property
    def manifest(self):
        return self.store.manifest

    @property
    def path(self) -> Path:
        return Path(self.store.path)

    @property
    def is_whole_run(self) -> bool:
        """True when the run has no step before the window (the window is the whole run so far)."""
        return self.first_step == 0

    def table(self, name: str) -> pd.DataFrame:
        """Rows of ``name`` in the window (steps from ``first_step`` on); tables outside ``STEP_TABLES`` (rare
        events) are read whole."""
        if name == "pending":
            return self._pending()
        if name not in STEP_TABLES:
            return self.store.table(name)
        return self.store.table(name, steps=(self.first_step, None))

    def _pending(self) -> pd.DataFrame:
        """``pending`` rows of the window (module docstring): of its steps, and older ones (or outside any step) of
        ranks with no step row in the window."""
        pending = self.store.table("pending")
        old = (pending["step"].fillna(-1) < self.first_step).to_numpy(dtype=bool)
        if not old.any():
            return pending
        went_on = pending["rank"].isin(self.table("steps")["rank"].unique()).to_numpy(dtype=bool)
        return pending[~(old & went_on)].reset_index(drop=True)

    def derived_table(self, name: str, key: dict, *, steps: tuple[int | None, int | None] | None = None,
                      deriver: Callable[[], object] | None = None,
                      order: Sequence[str] | None = None) -> pd.DataFrame | None:
        """The derived per-step table ``name`` (``derived_tables``, under its ``key``) of the window's rows, only
        of ``steps`` when given; None when the window cannot give it (the facade then computes it from the rows):
        a compacted run (its kept frames are whole step blocks'), a tail-opened store that does not hold the
        window's first step, ``pending`` rows of earlier steps (``table`` keeps some of them, so the window's
        collectives hold rows of no step of it), or frames of its units that may differ from the rows'
        (``window_derived``). ``deriver`` is not used: the window derives ``derived_tables``' frames itself.
        ``order``: sorted by those columns (``derived.blocks_frame``)."""
        store = self.store
        if key != KEY or getattr(store, "is_compacted", True) or not hasattr(store, "step_rows"):
            return None
        tail = store.tail_from_step
        if tail is not None and self.first_step < tail:
            return None
        # the store's rows per step and per block, under its lock: the counts and the rows read must be of the same
        # moment
        with store.step_rows() as rows:
            # a pending row before the window (or of no step: key -1), from the counts the store keeps (the frames
            # read them too), not from the pending rows
            if min(rows.counts("pending"), default=self.first_step) < self.first_step:
                return None
            frames = _FRAMES.setdefault(store, WindowFrames())
            return frames.table(name, first_step=self.first_step, clock=store.clock_model().key,
                                counts=rows.counts, rows=rows.block, steps=steps, order=order)

    def arrow(self, name: str, *, columns: Iterable[str] | None = None, filter: pc.Expression | None = None,
              steps: tuple[int | None, int | None] | None = None, ranks: Iterable[int] | None = None) -> pa.Table:
        """``RunStore.arrow`` of the window: a per-step table's rows of its steps only (as ``table`` gives them)."""
        if name in STEP_TABLES:
            first, last = steps if steps is not None else (None, None)
            steps = (self.first_step if first is None else max(first, self.first_step), last)
            if not getattr(self.store, "is_compacted", True):
                # rows held in memory: the steps are part of the filter, so only the rows that pass it are copied
                # (a steps cut copies every row of the window before the filter)
                cut = pc.field("step") >= steps[0]
                cut = cut if last is None else cut & (pc.field("step") <= last)
                filter, steps = (cut if filter is None else cut & filter), None
        return self.store.arrow(name, columns=columns, filter=filter, ranks=ranks, steps=steps)

    def describe(self) -> str:
        """``steps 900-999 (the last 100)`` for captions."""
        if self.last_step is None:
            return "no step yet"
        return f"steps {self.first_step}-{self.last_step} (the last {self.last_step - self.first_step + 1})"
