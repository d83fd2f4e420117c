"""The failure verdicts (HANG, RANK_CRASH, COLLECTIVE_MISMATCH, liveness, last seen) read only the collective rows
they need (``RunStore.arrow`` with filters pushed down, ``analysis.failure_reads``) and give what the whole table
gives: on compacted runs of several step blocks with a hang, a crash, a point-to-point stall, a mismatch and none,
the frames and findings equal those of the same source read whole, and the whole ``collectives`` table is never
asked for."""

from __future__ import annotations

import pandas as pd
import pyarrow.compute as pc
import pytest
from analysis_synth import MS, T0, cut_rank, lockstep_tables, pending_row, stall_rank, write_rows_run

from dtprobe.analysis import RunAnalysis
from dtprobe.store import RunStore, compact

S = 1000 * MS
NUM_STEPS = 50       # three step blocks of the compacted layout


class Recorded:
    """A run read through its ``RunStore``, recording the tables asked for whole."""

    def __init__(self, store: RunStore) -> None:
        self.store = store
        self.whole: list[str] = []

    path = property(lambda self: self.store.path)
    info = property(lambda self: self.store.info)

    def table(self, name: str, **kwargs) -> pd.DataFrame:
        if not kwargs:
            self.whole.append(name)
        return self.store.table(name, **kwargs)

    def arrow(self, name: str, **kwargs):
        return self.store.arrow(name, **kwargs)


class WholeTables:
    """The same run as a source that can only give whole tables (the facade then reads ``collectives`` whole)."""

    def __init__(self, store: RunStore) -> None:
        self.store = store

    path = property(lambda self: self.store.path)
    info = property(lambda self: self.store.info)

    def table(self, name: str, **kwargs) -> pd.DataFrame:
        return self.store.table(name, **kwargs)


def _wait_in(rows: dict, waiters: list[int], *, step: int, since_ns: int, until_ns: int, close: tuple,
             world: int) -> dict:
    """``waiters`` enter all-reduce #``step + 1`` at ``since_ns`` (a pending row each) and stay in it, alive,
    until ``until_ns``, when their probes close with ``close``."""
    rows["pending"] = []
    for r in waiters:
        stall_rank(rows, r, since_ns, until_ns=until_ns, close=close)
        rows["pending"].append(pending_row(r, step=step, seq=step + 1, t_ns=since_ns + r * MS, world=world))
    return rows


def _hang(world: int) -> tuple[dict, str]:
    """Rank 3 freezes at step 45 (no row after, its sampler stops too); the others wait in all-reduce #46."""
    rows = lockstep_tables(world=world, num_steps=NUM_STEPS)
    at = T0 + 45 * 100 * MS + 30 * MS
    stall_rank(rows, 3, at, until_ns=at, close=None)
    rows["devices"] = [d for d in rows["devices"] if not (d["rank"] == 3 and d["time_ns"] > at)]
    return _wait_in(rows, [0, 1, 2], step=45, since_ns=at + 30 * MS, until_ns=at + 12 * S,
                    close=("crashed", "watchdog"), world=world), "crashed"


def _crash(world: int) -> tuple[dict, str]:
    """Rank 1 is killed at step 30 (its telemetry stops, no close); the others wait in all-reduce #31 until
    torchrun SIGTERMs them."""
    rows = lockstep_tables(world=world, num_steps=NUM_STEPS)
    at = T0 + 30 * 100 * MS + 30 * MS
    cut_rank(rows, 1, at)
    return _wait_in(rows, [0, 2, 3], step=30, since_ns=at + 30 * MS, until_ns=at + 200 * MS,
                    close=("crashed", "SIGTERM"), world=world), "crashed"


def _p2p(world: int) -> tuple[dict, str]:
    """Every step rank 0 sends to rank 1, which receives, until step 40: rank 1 waits in a recv there, and rank 0
    never sends again."""
    rows = lockstep_tables(world=world, num_steps=NUM_STEPS)
    for i in range(NUM_STEPS):
        start = T0 + i * 100 * MS
        for rank, op, peer in ((0, "send", 1), (1, "recv", 0)):
            if (i >= 40 and rank == 0) or i > 40:
                continue
            end = None if i == 40 else start + 85 * MS
            rows["collectives"].append({"rank": rank, "pg": "pp", "pg_ranks": "0,1", "pg_size": 2, "seq": i + 1,
                                        "op": op, "peer": peer, "num_bytes": 1 << 20, "dtype": "float32",
                                        "enqueue_ns": start + 80 * MS, "start_ns": start + 80 * MS, "end_ns": end,
                                        "step": i, "timing": "host", "restart": 0})
    return rows, "finished"


def _mismatch(world: int) -> tuple[dict, str]:
    """Rank 2 issues a broadcast where the others issue all-reduce #21 (step 20); every call finishes."""
    return lockstep_tables(world=world, num_steps=NUM_STEPS, ops={(2, 20): "broadcast"}), "finished"


def _clean(world: int) -> tuple[dict, str]:
    return lockstep_tables(world=world, num_steps=NUM_STEPS), "finished"


SCENARIOS = {"hang": _hang, "crash": _crash, "p2p": _p2p, "mismatch": _mismatch, "clean": _clean}


@pytest.fixture(params=sorted(SCENARIOS))
def compacted_run(request, tmp_path):
    rows, status = SCENARIOS[request.param](4)
    run = write_rows_run(tmp_path / request.param, rows, world_size=4, status=status)
    compact(run)
    return request.param, run


def _verdicts(a: RunAnalysis) -> list[tuple]:
    return [(f.code, f.severity, f.ranks, f.title, f.evidence) for f in a.hangs()]


def _mismatch_verdicts(a: RunAnalysis) -> list[tuple]:
    return [(f.code, f.severity, f.ranks, f.title, f.evidence) for f in a.mismatch_findings()]


def _frames(a: RunAnalysis) -> dict[str, pd.DataFrame]:
    return {"unfinished": a.unfinished_collectives().reset_index(drop=True), "last_seen": a.last_seen(),
            "p2p_stalls": a.p2p_stalls(), "stalls": a.stalls(), "crash_events": a.crash_events(),
            "mismatches": a.collective_mismatches()}


def test_failure_verdicts_read_few_rows_and_equal_those_of_the_whole_table(compacted_run):
    scenario, run = compacted_run
    recorded = Recorded(RunStore.open(run, tables=()))
    fast, whole = RunAnalysis(recorded), RunAnalysis(WholeTables(RunStore.open(run)))
    fast_frames, whole_frames = _frames(fast), _frames(whole)
    assert fast.now_ns() == whole.now_ns()
    assert "collectives" not in recorded.whole           # the frames above never read the whole table
    for name, frame in whole_frames.items():
        pd.testing.assert_frame_equal(fast_frames[name], frame, check_dtype=False, check_categorical=False,
                                      obj=name)
    activity, reference = fast.activity(), whole.activity()
    for rank in range(4):
        for before in (None, T0 + 5 * 100 * MS, T0 + 31 * 100 * MS, T0 + 46 * 100 * MS, T0 + 60 * S):
            assert activity.last_ns(rank, before_ns=before) == reference.last_ns(rank, before_ns=before)
    assert _verdicts(fast) == _verdicts(whole)
    assert _mismatch_verdicts(fast) == _mismatch_verdicts(whole)
    codes = {"hang": ["HANG"], "crash": ["RANK_CRASH"], "p2p": ["HANG"], "mismatch": ["COLLECTIVE_MISMATCH"],
             "clean": []}[scenario]
    assert [v[0] for v in _verdicts(fast) + _mismatch_verdicts(fast)] == codes
    assert "collectives" not in recorded.whole


def test_arrow_gives_the_filtered_columns_table_gives(compacted_run, tmp_path):
    _, run = compacted_run
    for store in (RunStore.open(run, tables=()), RunStore.open(run)):      # files pushed down; rows held
        whole = store.table("collectives")
        for expr, keep in ((pc.field("end_ns").is_null(), whole["end_ns"].isna()),
                           (pc.field("enqueue_ns") >= T0 + 44 * 100 * MS,
                            (whole["enqueue_ns"] >= T0 + 44 * 100 * MS).fillna(False)),
                           (None, pd.Series(True, index=whole.index))):
            got = store.arrow("collectives", columns=["seq", "rank", "end_ns"], filter=expr, ranks=[0, 2, 3])
            want = whole.loc[keep.to_numpy(dtype=bool) & whole["rank"].isin([0, 2, 3]).to_numpy(),
                             ["seq", "rank", "end_ns"]].reset_index(drop=True)
            pd.testing.assert_frame_equal(got.to_pandas(), want, check_dtype=False)
