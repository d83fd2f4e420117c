"""CLI: `dtprobe runs`, `dtprobe compact`, `dtprobe export tables|perfetto` through dtprobe.cli.main."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest

from dtprobe import cli
from dtprobe.store import RunStore
from dtprobe.store.manifest import create_manifest, set_status, write_rank_info
from dtprobe.store.writer import RankWriter

T0 = 1_700_000_000_000_000_000


@pytest.fixture(autouse=True)
def only_store_commands(monkeypatch):
    """Build the real parser with only the STORE-owned commands, so these tests do not depend on the
    import state of other commands' modules; wide rich tables so rows are not wrapped."""
    monkeypatch.setattr(cli, "COMMANDS", ("runs", "compact", "export"))
    monkeypatch.setenv("COLUMNS", "250")


def make_run(run_dir: Path, *, world_size: int = 2, steps: int = 3, status: str | None = None) -> Path:
    create_manifest(run_dir, run_id=run_dir.name, command=["x"], config={}, world_size=world_size)
    for rank in range(world_size):
        write_rank_info(run_dir, rank, host="h", node_rank=0, local_rank=rank, device="cpu", pid=rank,
                        clock_offset_ns=1000 * rank)
        w = RankWriter(run_dir, rank)
        w.write("groups", {"pg": "world", "name": "world", "pg_ranks": ",".join(map(str, range(world_size))),
                           "pg_size": world_size})
        for s in range(steps):
            w.write("steps", {"step": s, "start_ns": T0 + s, "loss": 1.5})
            w.write("collectives", {"pg": "world", "seq": s + 1, "op": "allreduce", "num_bytes": 64,
                                    "enqueue_ns": T0 + s})
        w.close()
    if status:
        set_status(run_dir, status)
    return run_dir


def test_runs_prints_a_row_per_run_with_status_ranks_and_steps(tmp_path, capsys):
    make_run(tmp_path / "alpha", world_size=2, steps=7, status="finished")
    make_run(tmp_path / "beta", world_size=4, steps=2, status="crashed")
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "run.json").write_text("[]")
    assert cli.main(["runs", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    lines = {line.split()[1]: line for line in out.splitlines() if line.startswith("│")}
    assert lines["alpha"].split("│")[2:5] == [" finished ", "     2 ", "     7 "]
    assert lines["beta"].split("│")[2:5] == [" crashed  ", "     4 ", "     2 "]
    assert "invalid" in lines["broken"]
    assert "broken: '" in out and "holds a JSON list" in out


def test_runs_says_so_when_root_has_no_runs(tmp_path, capsys):
    assert cli.main(["runs", str(tmp_path)]) == 0
    assert "No dtprobe runs in" in capsys.readouterr().out


def test_runs_missing_root_is_a_clean_error_with_exit_2(tmp_path, capsys):
    assert cli.main(["runs", str(tmp_path / "nope")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("dtprobe runs: error: '") and "is not a directory" in err


def test_compact_prints_rows_per_table_and_leaves_status_alone(tmp_path, capsys):
    run = make_run(tmp_path / "r", world_size=2, steps=3)
    assert cli.main(["compact", str(run)]) == 0
    out = capsys.readouterr().out
    rows = {line.split("│")[1].strip(): line.split("│")[2].strip() for line in out.splitlines()
            if line.startswith("│")}
    assert rows == {"steps": "6", "collectives": "6", "groups": "2"}
    assert (run / "tables" / "steps" / "step_block=0" / "rank_block=0" / "part-0.parquet").is_file()
    assert RunStore.open(run).manifest.status == "running"


def test_compact_of_a_non_run_is_a_clean_error(tmp_path, capsys):
    assert cli.main(["compact", str(tmp_path)]) == 2
    assert "is not a dtprobe run: no run.json" in capsys.readouterr().err


@pytest.mark.parametrize("fmt", ["csv", "parquet"])
def test_export_tables_writes_one_file_per_nonempty_table(tmp_path, fmt):
    run = make_run(tmp_path / "r", world_size=2, steps=3)
    out = tmp_path / "out"
    assert cli.main(["export", "tables", str(run), "-o", str(out), "--format", fmt]) == 0
    assert sorted(p.name for p in out.iterdir()) == [f"collectives.{fmt}", f"groups.{fmt}", f"steps.{fmt}"]
    read = pd.read_csv if fmt == "csv" else pd.read_parquet
    steps = read(out / f"steps.{fmt}")
    assert list(steps.columns) == list(RunStore.open(run).table("steps").columns)
    assert steps[["rank", "step"]].values.tolist() == [[0, 0], [0, 1], [0, 2], [1, 0], [1, 1], [1, 2]]
    assert steps.loc[steps["rank"] == 1, "start_ns"].tolist() == [T0 + 1000, T0 + 1001, T0 + 1002]  # aligned
    assert steps["fwd_ns"].isna().all()


def test_export_tables_of_run_without_events_is_an_error_not_an_empty_folder(tmp_path, capsys):
    run = tmp_path / "r"
    create_manifest(run, run_id="r", command=["x"], config={}, world_size=1)
    assert cli.main(["export", "tables", str(run), "-o", str(tmp_path / "out")]) == 2
    assert "has no events yet" in capsys.readouterr().err


def test_export_perfetto_calls_the_analysis_exporter(tmp_path, monkeypatch):
    import sys
    import types

    calls = []
    fake = types.ModuleType("dtprobe.analysis.perfetto")
    fake.export_perfetto = lambda store, out_path: calls.append((store.path, out_path))
    monkeypatch.setitem(sys.modules, "dtprobe.analysis.perfetto", fake)
    run = make_run(tmp_path / "r")
    assert cli.main(["export", "perfetto", str(run), "-o", str(tmp_path / "t.json")]) == 0
    assert calls == [(run, tmp_path / "t.json")]


def test_export_help_lists_both_subcommands(capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["export", "--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    assert "tables" in out and "perfetto" in out


def test_manifest_json_unchanged_by_export(tmp_path):
    run = make_run(tmp_path / "r")
    before = (run / "run.json").read_text()
    assert cli.main(["export", "tables", str(run), "-o", str(tmp_path / "o")]) == 0
    assert json.loads((run / "run.json").read_text()) == json.loads(before)
