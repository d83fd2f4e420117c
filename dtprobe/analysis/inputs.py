"""The tables analyzers read, from any ``dtprobe.store.source.Source``; read by the facade for the run and its
baseline alike.

``collectives`` is completed by the ``pending`` rows no completed row matches (collectives a rank was still in
when it stopped writing: ``end_ns`` null, ``hangs.merge_pending``) and has its ``seq`` made unique across
torchrun restarts (``arrivals.unique_seq``); every other table is as the source gives it.
"""

from __future__ import annotations

import pandas as pd

from dtprobe.analysis.arrivals import unique_seq
from dtprobe.analysis.hangs import merge_pending
from dtprobe.store.source import Source


def analysed_table(source: Source, name: str) -> pd.DataFrame:
    """Table ``name`` of ``source`` as the analyzers read it (see the module docstring)."""
    if name == "collectives":
        return unique_seq(merge_pending(source.table("collectives"), source.table("pending")))
    return source.table(name)
