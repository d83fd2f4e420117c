"""The ranks' own per-step, per-group summaries (``comm_steps``, issue 17 item 1): what ``collectors.comm_summaries``
writes, when the recorder writes it, that it equals the raw rows it summarizes on recorded runs, and that the
Overview's communication share read from it equals the one the analysis derives from the raw rows. The summaries of
the session's hung and restarted runs are checked in ``test_hang`` and ``test_recovery``, which read those runs."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from dtprobe.analysis.comm_steps import comm_by_rank, mean_comm_frac
from dtprobe.analysis.facade import RunAnalysis
from dtprobe.analysis.window import StepWindow
from dtprobe.collectors.comm_summaries import StepSummaries
from dtprobe.intervals import union_length, union_of_spans
from dtprobe.store import RunStore

from collector_fakes import ListWriter
from comm_summary_checks import assert_summaries_equal_raw_rows


def _tuple(pg: str, step: int, enqueue: int, end: int | None = None, num_bytes: int = 8) -> tuple:
    """A gloo collective's row as the recorder queues it (``collective_recorder.ROW_COLUMNS``; no ``end_ns`` when None)."""
    row = (pg, 1, "allreduce", num_bytes, "float32", step, "host", enqueue, 0)
    return row if end is None else row + (end,)


def _drain_twice(s: StepSummaries, in_flight=()) -> list[dict]:
    first = s.due(in_flight)
    assert first == [], "a step is written at the second drain that finds it over, not the first"
    return s.due(in_flight)


def _comm_ns(spans: list[tuple[int, int]]) -> int | None:
    """``comm_ns`` of a one-group step whose collectives ran over ``spans`` (None: no completed one)."""
    s = StepSummaries()
    s.add([_tuple("dp", 1, start, end) for start, end in spans])
    return s.rest()[0].get("comm_ns") if spans else None


def test_time_in_collectives_counts_overlaps_once():
    assert _comm_ns([]) is None
    assert _comm_ns([(0, 10), (5, 20), (30, 40)]) == 30
    assert _comm_ns([(0, 100), (10, 20), (30, 40)]) == 100      # nested
    assert _comm_ns([(10, 20), (0, 10)]) == 20                   # touching, given out of order


def test_the_drain_thread_s_union_equals_the_analysis_union_on_random_spans():
    rng = np.random.default_rng(7)
    for n in [1, 2, 3, 5, 20, 200]:
        for _ in range(50):
            starts = rng.integers(0, 1_000, n)
            ends = starts + rng.integers(0, 300, n)          # zero-length spans too
            spans = list(zip(starts.tolist(), ends.tolist()))
            assert union_of_spans(spans) == union_length(starts, ends), spans


def test_a_step_is_summarized_per_group_and_over_all_its_groups():
    s = StepSummaries(restart=2)
    s.add([_tuple("tp", 3, 100, 300, num_bytes=10), _tuple("tp", 3, 200, 500, num_bytes=20),   # overlapping
           _tuple("dp", 3, 400, 900, num_bytes=5),
           {"pg": "pp", "seq": 1, "op": "send", "num_bytes": 7, "step": 3, "enqueue_ns": 1000, "peer": 1,
            "end_ns": 1100},
           _tuple("dp", 3, 950),                               # in flight at close: counted, not completed
           _tuple("tp", -1, 0, 50), _tuple("tp", None, 0, 50)])  # outside steps: left out
    s.end_step(3)
    rows = _drain_twice(s)
    by_pg = {r.get("pg"): r for r in rows}
    assert [r.get("pg") for r in rows] == ["dp", "pp", "tp", None] and all(r["restart"] == 2 for r in rows)
    assert by_pg["tp"] == {"restart": 2, "step": 3, "pg": "tp", "num_collectives": 2, "num_completed": 2,
                           "num_bytes": 30, "first_enqueue_ns": 100, "last_enqueue_ns": 200, "last_end_ns": 500,
                           "comm_ns": 400, "longest_ns": 300}
    assert by_pg["dp"] == {"restart": 2, "step": 3, "pg": "dp", "num_collectives": 2, "num_completed": 1,
                           "num_bytes": 13, "first_enqueue_ns": 400, "last_enqueue_ns": 950, "last_end_ns": 900,
                           "comm_ns": 500, "longest_ns": 500}
    # all groups: [100, 500] and [400, 900] overlap (800 ns), then the send's 100 ns
    assert by_pg[None] == {"restart": 2, "step": 3, "all_groups": True, "num_collectives": 5, "num_completed": 4,
                           "num_bytes": 50, "first_enqueue_ns": 100, "last_enqueue_ns": 1000, "last_end_ns": 1100, "comm_ns": 900,
                           "longest_ns": 500}
    assert s.due([]) == [] and s.rest() == []       # written once


def test_a_step_waits_until_it_ended_and_no_collective_of_it_or_before_it_is_in_flight():
    s = StepSummaries()
    s.add([_tuple("dp", 4, 100, 200), _tuple("dp", 5, 300, 400)])
    assert s.due([]) == [] and s.due([]) == []          # neither step ended
    s.end_step(5)
    assert s.due([4]) == [] and s.due([4]) == []        # step 4 still has a collective in flight: 5 waits too
    assert s.due([5]) == []                             # step 4 over (first drain); step 5 in flight
    assert [(r["step"], r["all_groups"]) for r in s.due([5])] == [(4, True)]   # one group: its row covers step 4
    assert [r["step"] for r in _drain_twice(s)] == [5]


def test_a_collective_completed_after_its_step_was_written_gives_a_second_row_the_reader_adds():
    s = StepSummaries()
    s.add([_tuple("dp", 2, 100, 300), _tuple("dp", 3, 1100, 1200), _tuple("tp", 3, 1150, 1400)])
    s.end_step(3)
    first = _drain_twice(s)
    s.add([_tuple("dp", 2, 500, 600), _tuple("dp", 3, 1500, 1600)])   # completed late
    second = _drain_twice(s)
    # step 2 used one group: its group rows are its total; step 3 was written with an all-groups row, and so is
    # its late row
    assert [(r["step"], r.get("pg"), r["comm_ns"]) for r in first + second] == [
        (2, "dp", 200), (3, "dp", 100), (3, "tp", 250), (3, None, 300), (2, "dp", 100), (3, "dp", 100),
        (3, None, 100)]
    rows = pd.DataFrame([{"rank": 0, **r} for r in first + second])
    steps = pd.DataFrame({"rank": [0, 0], "step": [2, 3], "start_ns": [0, 1000], "end_ns": [1000, 2000]})
    by_rank = comm_by_rank(rows, steps)
    assert by_rank["comm_ns"].tolist() == [700.0] and by_rank["comm_frac"].tolist() == [pytest.approx(0.35)]
    assert comm_by_rank(rows, steps, step_ids=[3])["comm_ns"].tolist() == [400.0]



def test_a_checkpoint_group_gets_its_own_rows_and_is_in_no_all_groups_row():
    s = StepSummaries()
    s.add([_tuple("dp", 4, 100, 200), _tuple("ckpt", 4, 150, 900),       # an async save's call beside the step
           _tuple("tp", 5, 300, 400), _tuple("dp", 5, 350, 500), _tuple("ckpt#2", 5, 320, 800),
           _tuple("ckpt", 6, 600, 700)])                                 # a step with the save's calls alone
    s.end_step(6)
    rows = [(r["step"], r.get("pg"), r.get("all_groups", False), r["comm_ns"]) for r in _drain_twice(s)]
    assert rows == [(4, "ckpt", False, 750), (4, "dp", True, 100),
                    (5, "ckpt#2", False, 480), (5, "dp", False, 150), (5, "tp", False, 100), (5, None, True, 200),
                    (6, "ckpt", False, 100)]

def test_rest_gives_every_step_still_held_at_close():
    s = StepSummaries()
    s.add([_tuple("dp", 7, 100, 200), _tuple("dp", 8, 300)])   # step 8 never ended: the job stopped in it
    assert [(r["step"], r.get("pg"), r["num_completed"]) for r in s.rest()] == [(7, "dp", 1), (8, "dp", 0)]
    assert s.rest() == []


def test_the_recorder_writes_a_step_s_summaries_once_the_step_ended_and_its_collectives_completed():
    from dtprobe.collectors.collective_recorder import CollectiveRecorder

    recorder, writer = CollectiveRecorder(), ListWriter()
    recorder.start(writer, flush_interval_s=3600, restart=1)
    try:
        recorder.step = 5
        row = _tuple("k0", 5, 1_000)[:-1] + (1,)           # restart 1, as the recorder stamps it
        key = recorder.track(row)
        recorder.step = -1
        recorder.step_ended(5)
        recorder.tick()
        recorder.tick()
        assert writer.table("comm_steps") == []             # its collective is still in flight
        recorder.complete(key, row, 4_000)
        recorder.step = 6
        recorder.emit(_tuple("k0", 6, 5_000, 5_500)[:-2] + (1, 5_500))
        recorder.tick()
        assert writer.table("comm_steps") == []             # over at one drain: written at the next
        recorder.tick()
        assert [(r["step"], r.get("pg"), r["comm_ns"]) for r in writer.table("comm_steps")] == [(5, "k0", 3_000)]
        assert all(r["restart"] == 1 for r in writer.table("comm_steps"))
    finally:
        recorder.stop()
    # step 6 never ended: written at close
    assert [(r["step"], r.get("pg")) for r in writer.table("comm_steps")][1:] == [(6, "k0")]
    tables = [table for table, _ in writer.rows]
    assert tables.index("comm_steps") > tables.index("collectives")   # after the rows they summarize


# ------------------------------------------------------------------------------------------- recorded runs


def _recorded(tmp_path_factory, run_cli, name: str, *flags: str):
    """A clean tiny ``dtprobe run`` with ``flags`` into a folder ``name``."""
    run_dir = tmp_path_factory.mktemp("comm_summaries") / name
    proc = run_cli("run", "--run-dir", run_dir, "--no-devices", "--timeout", "120", *flags, "--batch-size", "2",
                   "--seq-len", "16", timeout_s=400)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return run_dir


@pytest.fixture(scope="module")
def tp_run(tmp_path_factory, run_cli):
    """A clean dp2 x tp2 ``dtprobe run``: two groups per rank, DDP's all-reduces completing through their futures
    on dp, tensor parallelism's blocking collectives on tp."""
    return _recorded(tmp_path_factory, run_cli, "dp2xtp2", "--nproc", "4", "--dp", "2", "--tp", "2", "--steps", "8")


@pytest.fixture(scope="module")
def async_ckpt_run(tmp_path_factory, run_cli):
    """A clean dp2 ``dtprobe run`` saving every 3 steps with ``--ckpt-async``: the saves' collectives on the
    ``ckpt`` group, from a thread beside the training steps."""
    return _recorded(tmp_path_factory, run_cli, "async_ckpt", "--nproc", "2", "--steps", "12", "--ckpt-every", "3",
                     "--ckpt-async")


def _comm_share_of_summaries_and_rows(run_dir) -> tuple[RunAnalysis, pd.DataFrame]:
    """The run's analysis, and its per-rank communication share from the summaries, held equal to the one the
    analysis derives from the raw rows."""
    analysis = RunAnalysis.open(run_dir)
    from_summaries = comm_by_rank(analysis.table("comm_steps"), analysis.table("steps"),
                                  step_ids=analysis.steps_analyzed())
    from_rows = analysis.exposure_by_rank()
    assert from_summaries["rank"].tolist() == from_rows["rank"].tolist()
    assert from_summaries["comm_frac"].to_numpy() == pytest.approx(from_rows["comm_frac"].to_numpy(), rel=1e-9)
    return analysis, from_summaries


@pytest.mark.multiproc
def test_summaries_equal_the_raw_rows_and_give_the_analysis_communication_share_on_a_tp_run(tp_run):
    summaries = assert_summaries_equal_raw_rows(tp_run)
    assert set(summaries["pg"].dropna()) == {"dp", "tp"}
    analysis, from_summaries = _comm_share_of_summaries_and_rows(tp_run)
    assert from_summaries["rank"].tolist() == [0, 1, 2, 3]
    assert 0.0 < analysis.key_figures().comm_frac < 1.0
    assert analysis.key_figures().comm_frac == pytest.approx(mean_comm_frac(from_summaries))


@pytest.mark.multiproc
def test_an_async_checkpoint_group_is_summarized_apart_and_counts_in_no_step_figure(async_ckpt_run):
    summaries = assert_summaries_equal_raw_rows(async_ckpt_run)
    assert set(summaries["pg"].dropna()) == {"world", "ckpt"}
    analysis, from_summaries = _comm_share_of_summaries_and_rows(async_ckpt_run)
    assert from_summaries["rank"].tolist() == [0, 1]
    assert set(analysis.rank_lateness()["pg"]) == {"world"}
    verdicts = [f for f in analysis.findings() if f.code in ("STRAGGLER", "COLLECTIVE_MISMATCH", "HANG")]
    assert verdicts == [], verdicts

def test_a_live_page_reads_the_communication_share_from_the_summaries_and_leaves_it_unknown_without_them(tmp_path):
    from dtprobe.dashboard.summary import steps_overview
    from dtprobe.synthetic import write_synthetic_run

    run = write_synthetic_run(tmp_path / "run", num_ranks=4, num_steps=12, status="running")
    quick = steps_overview(RunStore.open(run, tables=("steps", "comm_steps"), tail_steps=8), whole_run=False,
                           window=8, path=str(run))
    window = RunAnalysis(StepWindow(RunStore.open(run), 8))
    assert quick.figures["comm_frac"] == pytest.approx(window.key_figures().comm_frac, rel=1e-9)
    assert 0 < quick.figures["comm_frac"] < 1
    for f in (run / "events" / "comm_steps").glob("*.jsonl"):   # a run of an older dtprobe
        f.unlink()
    quick = steps_overview(RunStore.open(run, tables=("steps", "comm_steps"), tail_steps=8), whole_run=False,
                           window=8, path=str(run))
    assert quick.figures["comm_frac"] is None                   # known once the raw rows are analyzed
    assert RunAnalysis(StepWindow(RunStore.open(run), 8)).key_figures().comm_frac == window.key_figures().comm_frac
