"""``dtprobe analyze`` of a trace folder: what the main process holds grows far less than the JSON it reads.

Each rank's file is streamed and reduced in a worker; the main process keeps compact tables (kernel names as one
dictionary per folder, collectives handed back as columns). The property: from 8 to 32 rank files, the main
process's peak (``ru_maxrss`` of that process alone, the pool's workers excluded) grows by well under the raw JSON
added. Before these tables were compact it grew by about as much as the JSON added (0.93x on these sizes).
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest


MB_PER_RANK = 4
GROWTH_BOUND = 0.75
"""Main-process peak added / raw JSON added, 8 -> 32 ranks: the code that kept a string per kernel and a dict per
collective measured 0.93; the compact tables measure well under this bound."""

_PEAK = (
    "import resource, sys\n"
    "from dtprobe.cli import main\n"
    "if __name__ == '__main__':\n"
    "    code = main(['analyze', sys.argv[1], '--workers', '2', '--format', 'json', '-o', sys.argv[2]])\n"
    "    print('MAXRSS_KB', resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, code)\n")


def _trace_set(folder: Path, ranks: int, root: Path, env: dict[str, str]) -> int:
    """Write ``ranks`` synthetic rank files of MB_PER_RANK MB each; their total bytes."""
    proc = subprocess.run([sys.executable, str(root / "benchmarks" / "scale_data.py"), "traces", str(folder),
                           "--ranks", str(ranks), "--mb-per-rank", str(MB_PER_RANK)],
                          env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return sum(p.stat().st_size for p in folder.iterdir())


def _main_peak_kb(folder: Path, tmp_path: Path, env: dict[str, str]) -> int:
    script = tmp_path / "peak.py"      # a file, not -c: the forkserver pool re-imports the main module
    script.write_text(_PEAK)
    out = tmp_path / f"{folder.name}.json"
    proc = subprocess.run([sys.executable, str(script), str(folder), str(out)], env=env, capture_output=True,
                          text=True, timeout=300)
    match = re.search(r"MAXRSS_KB (\d+) (\d+)", proc.stdout)
    assert match and match.group(2) in ("0", "1"), proc.stdout + proc.stderr
    assert out.stat().st_size > 0
    return int(match.group(1))


@pytest.mark.multiproc
def test_main_process_peak_grows_far_less_than_the_json_added_from_8_to_32_ranks(tmp_path, repo_root, child_env):
    env = child_env()
    raw_small = _trace_set(tmp_path / "r8", 8, repo_root, env)
    raw_large = _trace_set(tmp_path / "r32", 32, repo_root, env)
    peak_small = _main_peak_kb(tmp_path / "r8", tmp_path, env) * 1024
    peak_large = _main_peak_kb(tmp_path / "r32", tmp_path, env) * 1024
    added = raw_large - raw_small
    growth = (peak_large - peak_small) / added
    assert added > 90e6, added
    assert growth < GROWTH_BOUND, (
        f"main-process peak {peak_small / 1e6:.0f} -> {peak_large / 1e6:.0f} MB for {added / 1e6:.0f} MB of JSON "
        f"added: {growth:.2f}x, bound {GROWTH_BOUND}x")


def _rows(with_trace_seq: bool) -> list[dict]:
    """Collectives of two ranks: two groups, a row without a group, p2p ops, rows without an enqueue time."""
    rows = []
    for rank in (1, 0):
        for i, (op, pg, enqueue, start) in enumerate([
                ("allreduce", "dp", 500, 510), ("send", "pp", 300, 305), ("allgather", "tp", None, 50),
                ("allreduce", "dp", 100, 120), ("recv", None, None, None), ("barrier", None, 700, 700),
                ("allreduce", "tp", 0, 40), ("allreduce", "dp", 100, 90)]):
            row = {"rank": rank, "op": op, "pg": pg, "pg_ranks": "0,1" if pg else None, "pg_size": 2,
                   "num_bytes": 64 * i, "dtype": "Float", "enqueue_ns": enqueue, "start_ns": start,
                   "end_ns": (start or 0) + 5, "step": 3, "timing": "cuda_event"}
            if with_trace_seq and op not in ("send", "recv"):
                row["trace_seq"] = 10 + i + rank
            rows.append(row)
    return rows


@pytest.mark.parametrize("with_trace_seq", [True, False], ids=["trace_seq", "order"])
def test_collective_columns_number_seq_as_the_row_dicts_are_numbered(with_trace_seq):
    from dtprobe.store.kineto_collective_frame import collective_columns, collective_table
    from dtprobe.store.kineto_collectives import number_seq, rank_collectives

    rows = _rows(with_trace_seq)
    tables = [collective_table(rank_collectives([r for r in rows if r["rank"] == rank])) for rank in (1, 0)]
    columns, n, source = collective_columns(tables)
    expected_source = number_seq(rows)
    assert (n, source) == (len(rows), expected_source) and source == ("trace" if with_trace_seq else "order")
    assert columns["seq"].tolist() == [r["seq"] if r["seq"] is not None else pd.NA for r in rows]
    assert isinstance(columns["pg_ranks"], pd.Categorical)     # as the store's reader gives it (a code per row)
    for col in ("rank", "op", "pg", "pg_ranks", "enqueue_ns", "start_ns", "num_bytes"):
        values = pd.array(columns[col], dtype="string") if col == "pg_ranks" else columns[col]
        assert values.tolist() == [r[col] if r[col] is not None else pd.NA for r in rows], col
