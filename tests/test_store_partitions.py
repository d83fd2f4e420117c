"""Partitioned compaction (schema version 3) and the reader's pushdown: a step window or a rank subset of a compacted
run reads only the partition files that hold it, and gives the rows the JSONL reader gives; every sample scenario,
compacted again in this layout, gives its golden findings."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pandas as pd
import pytest
from test_sample_trace_findings import BASELINES, FIGURES, GOLDEN, SAMPLES, SCENARIOS, SHAPES, by_severity, verdicts

from dtprobe.analysis import RunAnalysis
from dtprobe.analysis.window import StepWindow
from dtprobe.store import RunStore, TraceError, compact
from dtprobe.store.manifest import create_manifest, set_status, write_rank_info
from dtprobe.store.schema import SCHEMAS, STEP_TABLES
from dtprobe.store.writer import RankWriter
from dtprobe.synthetic import dp_tables, write_run

T0 = 1_700_000_000_000_000_000


def part(table: str, step_block: int, rank_block: int = 0) -> str:
    return f"{table}/step_block={step_block}/rank_block={rank_block}/part-0.parquet"


def partitions_read(files_read: list[str]) -> list[str]:
    """The partition files of per-step tables among ``files_read`` (small tables such as groups are whole files)."""
    return [f for f in files_read if "/" in f]


@pytest.fixture
def files_read(compacted_files_read) -> list[str]:
    """Every compacted Parquet file the reader opens, relative to ``tables/``, in order."""
    return compacted_files_read()


@pytest.fixture
def dp200(tmp_path) -> tuple[Path, dict[str, pd.DataFrame]]:
    """A compacted 4-rank run of 200 steps (3 all-reduces per step and rank) and its tables as JSONL read them."""
    run = write_run(tmp_path / "dp200", dp_tables(world=4, num_steps=200), world_size=4)
    store = RunStore.open(run)
    before = {name: store.table(name) for name in SCHEMAS}
    compact(run)
    return run, before


def window_of(frame: pd.DataFrame, first: int, last: int | None = None) -> pd.DataFrame:
    step = frame["step"]
    keep = step.notna() & (step >= first) & (True if last is None else step <= last)
    return held_categories(frame[keep.fillna(False).astype(bool)].reset_index(drop=True))


def held_categories(frame: pd.DataFrame) -> pd.DataFrame:
    """``frame`` (rows picked from a store frame in pandas) with only the values its category columns hold as
    categories, as the store returns any frame (pandas keeps the whole table's categories when rows are picked)."""
    frame = frame.copy()
    for col in frame.columns:
        if isinstance(frame[col].dtype, pd.CategoricalDtype):
            frame[col] = frame[col].cat.remove_unused_categories()
    return frame


def test_step_window_of_a_compacted_run_reads_only_the_partitions_of_its_steps(dp200, files_read):
    run, before = dp200
    store = RunStore.open(run, tables=("steps",))
    window = StepWindow(store, 20)
    assert (window.first_step, window.last_step, window.total_steps) == (180, 199, 200)
    del files_read[:]
    got = window.table("collectives")
    assert partitions_read(files_read) == [part("collectives", 9)]  # steps 180-199: block 9 of 10, nothing else
    pd.testing.assert_frame_equal(got, window_of(before["collectives"], 180), check_exact=True)
    assert len(got) == 4 * 20 * 3

    del files_read[:]
    assert len(StepWindow(store, 30).table("devices")) == 4 * 30    # steps 170-199: blocks 8 and 9
    assert partitions_read(files_read) == [part("devices", 8), part("devices", 9)]
    # the whole table: every block, merged back into (rank, enqueue_ns, seq) order
    pd.testing.assert_frame_equal(RunStore.open(run).table("collectives"), before["collectives"], check_exact=True)


def test_step_window_reads_nothing_of_the_other_partitions_when_they_are_gone(dp200):
    run, before = dp200
    for path in (run / "tables").rglob("part-0.parquet"):      # a read of any other partition would now fail
        if "step_block=9" not in path.as_posix() and path.parts[-4] in STEP_TABLES:
            path.write_bytes(b"not parquet")
    analysis = RunAnalysis(StepWindow(RunStore.open(run, tail_steps=20), 20))
    for name in ("steps", "collectives", "devices"):
        pd.testing.assert_frame_equal(analysis.source.table(name), window_of(before[name], 180), check_exact=True)
    assert analysis.key_figures().num_steps == 20
    with pytest.raises(TraceError, match="part-0.parquet' is not a readable Parquet file"):
        RunStore.open(run).table("steps")


def test_tail_opened_compacted_run_reads_its_newest_partitions_until_load_head(dp200, files_read):
    run, before = dp200
    store = RunStore.open(run, tail_steps=20)
    assert sorted(partitions_read(files_read)) == sorted(part(t, 9) for t in ("steps", "collectives", "devices"))
    assert (store.is_partial, store.tail_from_step, store.last_step(), store.num_steps()) == (True, 180, 199, 200)
    assert len(store.table("steps")) == 4 * 20
    assert store.load_head() == (800 + 2400 + 800) - 4 * 20 * (1 + 3 + 1)   # all but the tail's rows
    assert (store.is_partial, store.tail_from_step, store.num_steps()) == (False, None, 200)
    for name in SCHEMAS:
        pd.testing.assert_frame_equal(store.table(name), before[name], check_exact=True, obj=name)


def test_step_counts_of_a_compacted_run_come_from_the_marker_without_reading_the_table(dp200, files_read):
    run, _ = dp200
    store = RunStore.open(run, tables=())
    assert (store.last_step("collectives"), store.num_steps("collectives")) == (199, 200)
    assert store.num_rows()["collectives"] == 2400 and "collectives" in store.tables()
    assert partitions_read(files_read) == []


def write_wide_run(run: Path) -> Path:
    """40 ranks (rank blocks 0 and 1), 45 steps (step blocks 0-2), a set-up collective at step -1, devices rows
    outside steps in the middle of the run, and rank 33 restarting after step 44 from step 15: its collectives and
    devices rows (sorted by time) are out of step-block order, so the reader sorts them again; steps rows are
    sorted by step, so they stay in order."""
    world = 40
    create_manifest(run, run_id=run.name, command=["x"], config={}, world_size=world)
    for rank in range(world):
        write_rank_info(run, rank, host="h", node_rank=0, local_rank=rank, device="cpu", pid=rank,
                        clock_offset_ns=rank * 1_000)
        w = RankWriter(run, rank)
        w.write("groups", {"pg": "world", "name": "world", "pg_ranks": ",".join(map(str, range(world))),
                           "pg_size": world, "restart": 0})
        w.write("collectives", {"pg": "world", "seq": 1, "op": "broadcast", "enqueue_ns": T0 - 5, "step": -1,
                                "restart": 0})
        plan = [(s, 0) for s in range(45)] + ([(s, 1) for s in range(15, 30)] if rank == 33 else [])
        if rank == 33:
            w.write("groups", {"pg": "world", "name": "world", "pg_ranks": ",".join(map(str, range(world))),
                               "pg_size": world, "restart": 1})
        for i, (step, restart) in enumerate(plan):
            t = T0 + i * 10_000
            w.write("steps", {"step": step, "start_ns": t, "end_ns": t + 9_000, "restart": restart})
            w.write("collectives", {"pg": "world", "seq": step + 2, "op": "allreduce", "enqueue_ns": t + 100,
                                    "end_ns": t + 5_000, "step": step, "restart": restart})
            w.write("devices", {"host": "h", "time_ns": t + 1, "source": "host", "step": None if i % 20 == 7 else step})
        w.close()
    return run


def test_compacted_partitions_read_back_equal_to_the_jsonl_read_with_rows_out_of_step_order(tmp_path, files_read):
    run = write_wide_run(tmp_path / "wide")
    store = RunStore.open(run)
    before = {name: store.table(name) for name in SCHEMAS}
    compact(run)
    marker = json.loads((run / "tables" / "_compacted.json").read_text())
    assert {t: marker["tables"][t]["ordered"] for t in ("steps", "collectives", "devices")} == {
        "steps": True, "collectives": False, "devices": False}
    assert sorted(f["path"] for f in marker["tables"]["collectives"]["files"]) == sorted(
        [part("collectives", b, r) for b in (-1, 0, 1, 2) for r in (0, 1)])
    compacted = RunStore.open(run)
    for name in SCHEMAS:
        pd.testing.assert_frame_equal(compacted.table(name), before[name], check_exact=True, obj=name)

    del files_read[:]
    lazy = RunStore.open(run, tables=())
    got = lazy.table("collectives", steps=(20, 25), ranks=[33, 35])
    assert partitions_read(files_read) == [part("collectives", 1, 1)]   # ranks 32-39, steps 20-39
    want = window_of(before["collectives"], 20, 25)
    want = want[want["rank"].isin([33, 35])].reset_index(drop=True)
    pd.testing.assert_frame_equal(got, want, check_exact=True)
    assert got.groupby("rank").size().to_dict() == {33: 6 + 6, 35: 6}   # rank 33 ran steps 20-25 twice
    assert got["pg_ranks"].eq(",".join(map(str, range(40)))).all()


@pytest.mark.parametrize("steps,ranks", [((0, 0), None), ((44, None), [0, 39]), (None, [7]), ((-1, -1), None),
                                         ((100, 200), None)])
def test_pushed_down_reads_equal_the_jsonl_rows_filtered(tmp_path, steps, ranks):
    run = write_wide_run(tmp_path / "wide")
    jsonl = RunStore.open(run)
    compact(run)
    for store in (RunStore.open(run, tables=()), RunStore.open(run)):   # from the files, and from memory
        for name in ("steps", "collectives", "devices"):
            want = jsonl.table(name)
            if steps is not None:
                want = window_of(want, *steps)
            if ranks is not None:
                want = want[want["rank"].isin(ranks)].reset_index(drop=True)
            pd.testing.assert_frame_equal(store.table(name, steps=steps, ranks=ranks), want, check_exact=True)


def test_lines_appended_after_a_partitioned_compaction_are_filtered_with_the_window(dp200):
    run, before = dp200
    w = RankWriter(run, 2)
    w.write("steps", {"step": 200, "start_ns": T0, "restart": 1})
    w.close()
    store = RunStore.open(run, tables=())
    window = store.table("steps", steps=(199, None))
    assert window[["rank", "step"]].values.tolist() == [[0, 199], [1, 199], [2, 199], [2, 200], [3, 199]]
    assert store.table("steps", steps=(0, 0), ranks=[2])["step"].tolist() == [0]
    assert len(store.table("steps")) == len(before["steps"]) + 1


@pytest.fixture(scope="module")
def samples_v3(tmp_path_factory) -> Path:
    """A copy of ``sample_traces/`` (compacted by version 1, events dropped) with every run compacted again from
    its Parquet tables: version 3, partitioned."""
    root = tmp_path_factory.mktemp("samples") / "sample_traces"
    shutil.copytree(SAMPLES, root)
    for name in SCENARIOS:
        compact(root / name)
    return root


@pytest.mark.parametrize("name", SCENARIOS)
def test_sample_scenario_compacted_in_partitions_reads_the_same_tables_and_findings(samples_v3, name):
    marker = json.loads((samples_v3 / name / "tables" / "_compacted.json").read_text())
    assert marker["schema_version"] == 3 and "steps" in marker["partitioning"]["tables"]
    old, new = RunStore.open(SAMPLES / name), RunStore.open(samples_v3 / name)
    for table in SCHEMAS:
        pd.testing.assert_frame_equal(new.table(table), old.table(table), check_exact=True, obj=table)
    base = BASELINES.get(name)
    analysis = RunAnalysis.open(samples_v3 / name, baseline=samples_v3 / base if base else None)
    got = verdicts(analysis)
    assert by_severity(got) == by_severity(GOLDEN[name])
    assert (analysis.world_size, analysis.key_figures().num_steps) == SHAPES[name]
    for (scenario, code), expected in FIGURES.items():
        if scenario == name:
            [finding] = [f for f in analysis.findings() if f.code == code]
            evidence = finding.to_json()["evidence"]
            assert {k: evidence.get(k) for k in expected} == expected


ONE_FILE_RUNS = {
    "dp2_straggler_busy_host": Path(__file__).resolve().parent / "data" / "dp2_straggler_busy_host",
    "dp4_straggler_rank2": SAMPLES / "dp4_straggler_rank2",
}
"""Checked-in runs compacted one file per table (version 1; version 2 wrote the same layout)."""


@pytest.mark.parametrize("name", sorted(ONE_FILE_RUNS))
def test_one_file_compactions_of_older_versions_answer_pushed_down_reads(name, files_read):
    run = ONE_FILE_RUNS[name]
    marker = json.loads((run / "tables" / "_compacted.json").read_text())
    assert marker["schema_version"] == 1 and "files" not in marker["tables"]["steps"]
    whole = RunStore.open(run)
    lazy = RunStore.open(run, tables=(), tail_steps=3)   # one file per table: read whole, nothing skipped
    assert not lazy.is_partial and lazy.tail_from_step is None
    for name in ("steps", "collectives"):
        frame = whole.table(name)
        last = int(frame["step"].max())
        want = window_of(frame, last - 2)
        want = want[want["rank"].isin([1])].reset_index(drop=True)
        assert len(want) > 0
        pd.testing.assert_frame_equal(lazy.table(name, steps=(last - 2, None), ranks=[1]), want, check_exact=True)
    assert "steps.parquet" in files_read
    assert (lazy.last_step(), lazy.num_steps()) == (whole.last_step(), whole.num_steps())


def test_a_store_opened_before_a_new_compaction_names_the_fix_when_it_reads_a_partition_it_listed(dp200):
    run, _ = dp200
    store = RunStore.open(run, tables=())
    shutil.rmtree(run / "tables" / "collectives")
    with pytest.raises(TraceError, match=r"collectives/step_block=9/rank_block=0/part-0.parquet', listed in .*"
                                         r"_compacted.json, is missing: the run was compacted again"):
        store.table("collectives", steps=(190, None))


def test_a_version_2_compaction_one_file_per_table_reads_equal_to_the_jsonl_read(tmp_path, monkeypatch):
    from dtprobe.store import compaction

    run = write_wide_run(tmp_path / "wide")
    before = {name: RunStore.open(run).table(name) for name in SCHEMAS}
    monkeypatch.setattr(compaction, "SCHEMA_VERSION", 2)       # what dtprobe wrote before version 3
    monkeypatch.setattr(compaction, "STEP_TABLES", ())
    compact(run)
    marker = json.loads((run / "tables" / "_compacted.json").read_text())
    assert marker["schema_version"] == 2 and marker["tables"]["collectives"] == {"rows": 40 * 46 + 15}
    assert (run / "tables" / "collectives.parquet").is_file() and not (run / "tables" / "collectives").exists()
    store = RunStore.open(run)
    for name in SCHEMAS:
        pd.testing.assert_frame_equal(store.table(name), before[name], check_exact=True, obj=name)
    pd.testing.assert_frame_equal(RunStore.open(run, tables=()).table("collectives", steps=(40, None)),
                                  window_of(before["collectives"], 40), check_exact=True)


@pytest.mark.parametrize("status", ["finished", "running"])
def test_a_finished_runs_compacted_rows_are_held_once_as_a_frame_and_reread_only_when_needed(dp200, files_read,
                                                                                             status):
    run, before = dp200
    set_status(run, status)
    whole = RunStore.open(run)
    counts = (whole.num_rows(), whole.last_step("collectives"), whole.num_steps("collectives"))
    store = RunStore.open(run, tables=())
    store.list_tables()
    pd.testing.assert_frame_equal(store.table("collectives"), before["collectives"])
    state = store._states["collectives"]
    # finished: the Arrow copy is dropped once the frame holds the rows; running: kept for the refreshes
    assert (len(state.chunks), bool(state.unread)) == ((0, True) if status == "finished" else (1, False))
    assert (store.num_rows(), store.last_step("collectives"), store.num_steps("collectives")) == counts
    del files_read[:]
    pd.testing.assert_frame_equal(store.table("collectives"), before["collectives"])
    assert files_read == []                                   # the frame is served again without a read
    pd.testing.assert_frame_equal(store.table("collectives", steps=(190, 199)),
                                  window_of(before["collectives"], 190, 199))
    if status == "finished":   # pushed down to the window's files; a running run's held rows are filtered
        assert files_read and all("step_block=9/" in f for f in files_read)
    else:
        assert files_read == []
    assert whole.aligned_arrow("collectives").equals(store.aligned_arrow("collectives"))
