"""Checks shared by the commands that analyse a source (``dtprobe analyze``, ``dtprobe export``); light to import
(``dtprobe --help`` imports every command module)."""

from __future__ import annotations

from dtprobe.store.errors import TraceError

EVENT_TABLES = ("steps", "collectives", "kernels", "faults", "pipeline", "checkpoints", "amp", "devices",
                "lifecycle")
"""Tables of which at least one must have rows for a source to be worth analysing."""


def check_not_empty(analysis) -> None:
    """TraceError when the source of ``analysis`` (a ``RunAnalysis``) holds nothing to analyse: a run whose ranks
    never wrote a row and whose launcher recorded no rank that failed (a worker that died before it attached, e.g.
    on a wrong script argument, still gets its RANK_CRASH)."""
    for name in EVENT_TABLES:
        if not analysis.table(name).empty:
            return
    from dtprobe.analysis.liveness import attempts_of   # here: dtprobe --help imports this module, not pandas

    for attempt in attempts_of(getattr(analysis.source, "manifest", None)):
        if any(r.get("exit_code") not in (0, None) or r.get("signal") for r in attempt.get("ranks") or ()):
            return
    where = analysis.path / "events" if not analysis.is_trace_folder else analysis.path
    raise TraceError(f"'{where}' holds no events: no rank wrote steps, collectives or any other table. Check that "
                     f"the ranks called dtprobe.attach(...) and ran at least one step (status: {analysis.status}).")
