"""HANG then RANK_CRASH findings of a run, a crash that a hang or mismatch already explains left out; read by the
facade (``RunAnalysis.hangs``)."""

from __future__ import annotations

from collections.abc import Callable

import pandas as pd

from dtprobe.analysis import crashes, hangs
from dtprobe.analysis.findings import Finding
from dtprobe.analysis.liveness import Activity


def detect_failures(*, mismatches: pd.DataFrame, stalls: pd.DataFrame, faults: pd.DataFrame,
                    collectives: pd.DataFrame, last_seen: pd.DataFrame, activity: Activity, exits: pd.DataFrame,
                    nodes: dict[int, int], starts: list[int], crash_events: pd.DataFrame, num_restarts: int,
                    injected_crash_ranks: frozenset[int], axis_of_pg: Callable[[str], str | None],
                    hang_ns: int = 0) -> list[Finding]:
    """HANG (``hangs.detect_hangs`` over ``stalls``) then RANK_CRASH (``crashes.detect_crashes`` over
    ``crash_events``). No HANG for a group a COLLECTIVE_MISMATCH (``mismatches``) names, nor for a stall whose
    missing ranks failed on their own within ``hang_ns`` of it (the hang timeout: they were on their way to their
    crash); a crash whose first failure is a rank the hangs or mismatches already hold (a survivor's timeout error)
    is their consequence, not a crash."""
    skip = frozenset(zip(mismatches["pg"], mismatches["pg_ranks"])) if not mismatches.empty else frozenset()
    found = hangs.detect_hangs(stalls, faults, last_seen=last_seen, axis_of_pg=axis_of_pg, activity=activity,
                               exits=exits, nodes=nodes, skip_groups=skip, starts=starts,
                               open_since=hangs.unfinished_since(collectives), own_failure_within_ns=hang_ns)
    held = {r for f in found for r in (*f.ranks, *f.evidence["arrived_ranks"])}
    for pg_ranks in (m for _, m in skip):
        held.update(int(x) for x in str(pg_ranks).split(",") if x.strip().lstrip("-").isdigit())
    return found + crashes.detect_crashes(
        crash_events, num_restarts=num_restarts, missing=stalls, injected_ranks=injected_crash_ranks,
        explained_ranks=frozenset(held), waited=lambda stall: hangs.waited_until_given_up(stall, activity, starts))
