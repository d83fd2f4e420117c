"""``open_source(path)``: the ``Source`` reader for a path (a dtprobe run or a Kineto trace folder); read by
``RunAnalysis.open``, ``dtprobe analyze`` and the dashboard. A later kind of source is recognised here."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

from dtprobe.store.errors import TraceError
from dtprobe.store.schema import MANIFEST_FILE
from dtprobe.store.source import Source

if TYPE_CHECKING:
    from dtprobe.store.kineto import ProgressFn


def open_source(path: str | os.PathLike, *, progress: ProgressFn | None = None,
                live_tail_steps: int | None = None, workers: int | None = None,
                dask_address: str | None = None) -> Source:
    """A dtprobe run (``RunStore``) or a Kineto trace folder (``KinetoRun``) at ``path``; TraceError otherwise.

    ``live_tail_steps``: if the run is running, read only its newest that many steps of the per-step tables
    (``RunStore.open(tail_steps=...)``; ``load_head()`` reads the rest): for recent-steps views of live runs.
    ``workers`` / ``dask_address``: where a trace folder's files are reduced (``kineto.load_trace_dir``).
    """
    from dtprobe.store.kineto import is_trace_dir, load_trace_dir

    path = Path(path)
    if (path / MANIFEST_FILE).is_file():
        from dtprobe.store.manifest import read_manifest
        from dtprobe.store.reader import RunStore

        live = live_tail_steps is not None and read_manifest(path).status == "running"
        # lazy: a compacted table's files are read on first use (what a derived table replaces is never read)
        store = RunStore.open(path, tables=(), tail_steps=live_tail_steps if live else None)
        store.list_tables()
        return store
    if is_trace_dir(path):
        return load_trace_dir(path, progress=progress, workers=workers, dask_address=dask_address)
    if not path.exists():
        raise TraceError(f"'{path}': no such file or directory. Pass a run directory (with run.json) made by "
                         f"`dtprobe run`/`dtprobe.attach`, or a folder of Kineto traces (*.pt.trace.json[.gz]).")
    raise TraceError(f"'{path}' is neither a dtprobe run (no run.json) nor a folder of Kineto traces (no *.json or "
                     f"*.json.gz file). Pass a run directory made by `dtprobe run`/`dtprobe.attach`, or the folder "
                     f"torch.profiler's tensorboard_trace_handler wrote.")
