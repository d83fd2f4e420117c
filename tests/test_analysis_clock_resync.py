"""How a dtprobe run's host clock offsets were re-measured (``clock_alignment.clock_resync``,
``metrics.run.clock_resync``): samples and largest drift per rank, failures, and ``clock_aligned`` unchanged."""

from __future__ import annotations

from pathlib import Path

import pytest

from dtprobe.analysis import RunAnalysis
from dtprobe.analysis.clock_alignment import RESYNC_COLUMNS, clock_resync
from dtprobe.store.frames import frame_from_rows
from dtprobe.store.manifest import create_manifest, write_rank_info
from dtprobe.store.writer import RankWriter

T0 = 1_700_000_000_000_000_000
S = 1_000_000_000

ROWS = [
    # rank 0: attach only (rank 0's own clock): left out
    {"rank": 0, "restart": 0, "time_ns": T0, "offset_ns": 0, "rtt_ns": 0, "event": "attach"},
    # rank 1: drifts by +30 us, then -10 us from attach
    {"rank": 1, "restart": 0, "time_ns": T0, "offset_ns": 5_000, "rtt_ns": 800, "event": "attach"},
    {"rank": 1, "restart": 0, "time_ns": T0 + 60 * S, "offset_ns": 35_000, "rtt_ns": 900, "event": "remeasure"},
    {"rank": 1, "restart": 0, "time_ns": T0 + 120 * S, "offset_ns": -5_000, "rtt_ns": 700, "event": "remeasure"},
    # rank 2: restarted; its drift is measured from each restart's attach offset, not across the restart
    {"rank": 2, "restart": 0, "time_ns": T0, "offset_ns": 1_000, "rtt_ns": 500, "event": "attach"},
    {"rank": 2, "restart": 0, "time_ns": T0 + 60 * S, "offset_ns": 3_000, "rtt_ns": 500, "event": "remeasure"},
    {"rank": 2, "restart": 1, "time_ns": T0 + 200 * S, "offset_ns": 900_000, "rtt_ns": 500, "event": "attach"},
    {"rank": 2, "restart": 1, "time_ns": T0 + 260 * S, "offset_ns": 904_000, "rtt_ns": 500, "event": "remeasure"},
    # rank 3: its thread stopped at the first round (a dead peer)
    {"rank": 3, "restart": 0, "time_ns": T0, "offset_ns": 7_000, "rtt_ns": 600, "event": "attach"},
    {"rank": 3, "restart": 0, "time_ns": T0 + 70 * S, "event": "failed", "detail": "clock re-measurement stopped"},
]


def test_clock_resync_gives_samples_and_largest_drift_per_rank_resampled():
    out = clock_resync(frame_from_rows("clock", ROWS))
    assert list(out.columns) == RESYNC_COLUMNS
    assert out.to_dict(orient="records") == [
        {"rank": 1, "num_samples": 3, "first_offset_us": 5.0, "last_offset_us": -5.0, "max_drift_us": 30.0,
         "failed": False},
        {"rank": 2, "num_samples": 4, "first_offset_us": 1.0, "last_offset_us": 904.0, "max_drift_us": 4.0,
         "failed": False},
        {"rank": 3, "num_samples": 1, "first_offset_us": 7.0, "last_offset_us": 7.0, "max_drift_us": 0.0,
         "failed": True},
    ]


@pytest.mark.parametrize("rows", [[], ROWS[:1], [ROWS[1]]])
def test_clock_resync_is_empty_when_offsets_were_only_measured_at_attach(rows):
    out = clock_resync(frame_from_rows("clock", rows))
    assert out.empty and list(out.columns) == RESYNC_COLUMNS


def write_run(run_dir: Path, clock_rows: list[dict]) -> Path:
    create_manifest(run_dir, run_id="r", command=["train.py"], config={}, world_size=4)
    for rank in range(4):
        write_rank_info(run_dir, rank, host=f"h{rank}", node_rank=rank, local_rank=0, device="cpu", pid=rank,
                        clock_offset_ns=0)
        writer = RankWriter(run_dir, rank)
        for row in clock_rows:
            if row["rank"] == rank:
                writer.write("clock", {k: v for k, v in row.items() if k != "rank"})
        for step in range(4):
            writer.write("steps", {"step": step, "start_ns": T0 + step * S, "end_ns": T0 + step * S + S // 2})
        writer.close()
    return run_dir


def test_metrics_run_adds_clock_resync_and_keeps_clock_aligned_host(tmp_path):
    metrics = RunAnalysis.open(write_run(tmp_path / "r", ROWS)).metrics()
    assert metrics["run"]["clock_aligned"] == "host"
    resync = metrics["run"]["clock_resync"]
    assert [(r["rank"], r["num_samples"], r["max_drift_us"], r["failed"]) for r in resync] == [
        (1, 3, 30.0, False), (2, 4, 4.0, False), (3, 1, 0.0, True)]


def test_metrics_run_has_no_clock_resync_when_nothing_was_remeasured(tmp_path):
    metrics = RunAnalysis.open(write_run(tmp_path / "r", ROWS[:2])).metrics()
    assert metrics["run"]["clock_aligned"] == "host" and "clock_resync" not in metrics["run"]
