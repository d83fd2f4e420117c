"""Time-varying clock offsets: the offset model (interpolation, ends, restarts), a drifting rank read aligned,
and compacted tables equal to the JSONL reader's also when clock samples arrive after compaction."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pytest

from dtprobe.store import RunStore, TraceError
from dtprobe.store.clock_sync import ClockModel
from dtprobe.store.compaction import compact
from dtprobe.store.manifest import create_manifest, write_rank_info
from dtprobe.store.writer import RankWriter

T0 = 1_700_000_000_000_000_000
S = 1_000_000_000


def clock_rows(rows: list[tuple]) -> pa.Table:
    """(rank, restart, time_ns, offset_ns) tuples as ``clock`` rows."""
    rank, restart, t, o = zip(*rows)
    return pa.table({"rank": pa.array(rank, pa.int32()), "restart": pa.array(restart, pa.int32()),
                     "time_ns": pa.array(t, pa.int64()), "offset_ns": pa.array(o, pa.int64())})


@pytest.mark.parametrize("t,expected", [
    (T0 - 5 * S, 1000),            # before the first sample: the first (the attach offset)
    (T0, 1000),
    (T0 + 5 * S, 1500),            # halfway between 1000 and 2000
    (T0 + 10 * S, 2000),
    (T0 + 12 * S, 1800),           # 1/5 of the way from 2000 down to 1000
    (T0 + 20 * S, 1000),
    (T0 + 60 * S, 1000),           # after the last sample: the last
])
def test_clock_model_interpolates_between_samples_and_holds_the_ends(t, expected):
    model = ClockModel.build({1: 7}, clock_rows([(1, 0, T0 + 10 * S, 2000), (1, 0, T0, 1000),
                                                  (1, 0, T0 + 20 * S, 1000)]))
    assert model.offsets_at(1, np.array([t], dtype=np.int64)).tolist() == [expected]


def test_clock_model_keeps_the_rank_info_constant_for_a_rank_without_samples():
    model = ClockModel.build({0: 0, 1: 7, 2: -3}, clock_rows([(1, 0, T0, 1000)]))
    assert model.offsets_at(2, np.array([T0, T0 + S], dtype=np.int64)).tolist() == [-3, -3]
    assert model.offsets_at(0, np.array([T0], dtype=np.int64)).tolist() == [0]
    assert model.offsets_at(1, np.array([T0 - S, T0 + S], dtype=np.int64)).tolist() == [1000, 1000]


def test_clock_model_steps_instead_of_sloping_across_a_restart():
    # restart 0: 1000 -> 2000 over 10 s; restart 1 (maybe another host) attaches at +30 s with 50_000
    model = ClockModel.build({1: 50_000}, clock_rows([
        (1, 0, T0, 1000), (1, 0, T0 + 10 * S, 2000), (1, 1, T0 + 30 * S, 50_000), (1, 1, T0 + 40 * S, 51_000)]))
    times = np.array([T0 + 5 * S, T0 + 20 * S, T0 + 30 * S, T0 + 35 * S, T0 + 99 * S], dtype=np.int64)
    assert model.offsets_at(1, times).tolist() == [1500, 2000, 50_000, 50_500, 51_000]


def test_clock_model_ignores_failed_rows_without_an_offset():
    rows = pa.table({"rank": pa.array([1, 1], pa.int32()), "restart": pa.array([0, 0], pa.int32()),
                     "time_ns": pa.array([T0, T0 + S], pa.int64()), "offset_ns": pa.array([1000, None], pa.int64())})
    model = ClockModel.build({1: 0}, rows)
    assert model.offsets_at(1, np.array([T0 + 2 * S], dtype=np.int64)).tolist() == [1000]


# ---- a run whose rank 1 clock drifts -------------------------------------------------------------------------

def true_offset(raw_ns: int) -> int:
    """Rank 1's offset at its own clock time: 3 ms, drifting by 40 us per second, speeding up (quadratic)."""
    dt_s = (raw_ns - T0) / S
    return int(3_000_000 + 40_000 * dt_s + 20 * dt_s ** 2)


def write_rank(run_dir: Path, rank: int, *, offset_fn, samples_s: list[float], steps: range,
               restart: int = 0) -> None:
    """Steps rows whose true (rank 0 clock) start is T0 + step * 1.3 s, written on the rank's clock; clock
    samples at the true times ``samples_s`` (seconds after T0)."""
    writer = RankWriter(run_dir, rank)
    for sec in samples_s:
        raw = _raw_of(T0 + int(sec * S), offset_fn)
        writer.write("clock", {"restart": restart, "time_ns": raw, "offset_ns": offset_fn(raw), "rtt_ns": 50_000,
                               "event": "attach" if sec == samples_s[0] and restart == 0 else "remeasure"})
    for step in steps:
        true = T0 + step * 1_300_000_000
        raw = _raw_of(true, offset_fn)
        writer.write("steps", {"step": step, "start_ns": raw, "end_ns": raw + 500_000_000, "restart": restart})
    writer.close()


def _raw_of(true_ns: int, offset_fn) -> int:
    """The rank-clock time at which rank 0's clock reads ``true_ns`` (fixed point of raw + offset(raw))."""
    raw = true_ns
    for _ in range(20):
        raw = true_ns - offset_fn(raw)
    return raw


def drifting_run(run_dir: Path, *, steps: range = range(40), samples_s: tuple = (0, 10, 20, 30, 40, 50, 60)) -> Path:
    create_manifest(run_dir, run_id=run_dir.name, command=["train.py"], config={}, world_size=3)
    for rank in range(3):
        write_rank_info(run_dir, rank, host=f"h{rank}", node_rank=rank, local_rank=0, device="cpu", pid=10 + rank,
                        clock_offset_ns=true_offset(T0) if rank == 1 else (-2_000 if rank == 2 else 0))
    write_rank(run_dir, 0, offset_fn=lambda raw: 0, samples_s=[], steps=steps)
    write_rank(run_dir, 1, offset_fn=true_offset, samples_s=list(samples_s), steps=steps)
    write_rank(run_dir, 2, offset_fn=lambda raw: -2_000, samples_s=[], steps=steps)  # no samples: the constant
    return run_dir


def test_store_aligns_a_drifting_rank_within_1us_from_its_clock_samples(tmp_path):
    steps = RunStore.open(drifting_run(tmp_path / "r")).table("steps")
    expected = T0 + steps["step"].astype("int64") * 1_300_000_000
    for rank in (0, 1, 2):
        mine = steps["rank"] == rank
        err = (steps.loc[mine, "start_ns"].astype("int64") - expected[mine]).abs()
        assert err.max() <= 1_000, (rank, err.max())
    # the attach constant alone (today's alignment) would put rank 1's last step more than 2 ms off
    last_true = T0 + 39 * 1_300_000_000
    assert abs(_raw_of(last_true, true_offset) + true_offset(T0) - last_true) > 2_000_000


def test_store_clock_table_keeps_rank_clock_times(tmp_path):
    clock = RunStore.open(drifting_run(tmp_path / "r")).table("clock")
    assert clock["rank"].unique().tolist() == [1]
    assert clock["time_ns"].tolist() == [_raw_of(T0 + s * S, true_offset) for s in (0, 10, 20, 30, 40, 50, 60)]
    assert clock["event"].tolist() == ["attach"] + ["remeasure"] * 6


def jsonl_only(run_dir: Path, tmp_path: Path) -> RunStore:
    """The same run read from its events files alone (the compaction removed)."""
    copy = tmp_path / f"jsonl-{run_dir.name}-{len(list(tmp_path.iterdir()))}"
    shutil.copytree(run_dir, copy, ignore=shutil.ignore_patterns("tables"))
    return RunStore.open(copy)


def assert_same_tables(a: RunStore, b: RunStore) -> None:
    for name in ("steps", "clock"):
        pd.testing.assert_frame_equal(a.table(name), b.table(name))


def test_compacted_tables_equal_the_jsonl_reader_with_drifting_offsets(tmp_path):
    run = drifting_run(tmp_path / "r")
    compact(run)
    assert_same_tables(RunStore.open(run), jsonl_only(run, tmp_path))


def test_compacted_tables_equal_the_jsonl_reader_when_clock_samples_arrive_after_compaction(tmp_path):
    # compacted with rank 1's samples up to 20 s and steps up to 25 (32.5 s): steps 16-25 were aligned with the
    # 20 s sample held constant; the samples at 30-60 s arrive later and must re-align exactly those rows
    run = drifting_run(tmp_path / "r", steps=range(26), samples_s=(0, 10, 20))
    compact(run)
    live = RunStore.open(run)
    before = live.table("steps")
    writer = RankWriter(run, 1)
    for sec in (30, 40, 50, 60):
        raw = _raw_of(T0 + sec * S, true_offset)
        writer.write("clock", {"restart": 0, "time_ns": raw, "offset_ns": true_offset(raw), "rtt_ns": 1,
                               "event": "remeasure"})
    for step in range(26, 40):
        raw = _raw_of(T0 + step * 1_300_000_000, true_offset)
        writer.write("steps", {"step": step, "start_ns": raw, "end_ns": raw + 500_000_000, "restart": 0})
    writer.close()
    # a rank aligned by its constant at compaction gets samples afterwards too
    w2 = RankWriter(run, 2)
    w2.write("clock", {"restart": 0, "time_ns": _raw_of(T0 + 40 * S, lambda r: -2_000), "offset_ns": -1_000,
                       "rtt_ns": 1, "event": "remeasure"})
    w2.close()
    live.refresh()
    after = live.table("steps")
    assert_same_tables(live, jsonl_only(run, tmp_path))
    assert_same_tables(RunStore.open(run), jsonl_only(run, tmp_path))
    moved = after.merge(before, on=["rank", "step"], suffixes=("", "_before"))
    changed = moved.loc[moved["start_ns"] != moved["start_ns_before"], ["rank", "step"]]
    # rank 1: only the steps after its last compacted sample (20 s); rank 2: every step (its one sample, -1000,
    # replaces the constant -2000)
    assert changed[changed["rank"] == 1]["step"].tolist() == list(range(16, 26))
    assert changed[changed["rank"] == 2]["step"].tolist() == list(range(26))
    expected = T0 + after["step"].astype("int64") * 1_300_000_000
    r1 = after["rank"] == 1
    assert (after.loc[r1, "start_ns"].astype("int64") - expected[r1]).abs().max() <= 1_000


def test_compacted_run_aligned_with_other_clock_samples_asks_to_compact_again(tmp_path):
    run = drifting_run(tmp_path / "r")
    compact(run)
    marker_path = run / "tables" / "_compacted.json"
    marker = json.loads(marker_path.read_text())
    assert marker["clock_samples"] == {"1": [7, *marker["clock_samples"]["1"][1:]]}
    marker["clock_samples"]["1"][2] += 1          # the samples it records are not the run's first ones
    marker_path.write_text(json.dumps(marker))
    with pytest.raises(TraceError, match=r"clock samples of rank 1.*dtprobe compact"):
        RunStore.open(run).table("steps")
