"""A step window's ``pending`` rows (``StepWindow``): an older spilled collective of a rank that went on is not
unfinished in the window, while a rank stuck before the window keeps its pending row (its hang is never
dropped)."""

from __future__ import annotations

import orjson
import pytest

from dtprobe.analysis.derived_tables import KEY, LATENESS
from dtprobe.analysis.facade import RunAnalysis, open_source
from dtprobe.analysis.window import StepWindow
from dtprobe.synthetic import SyntheticRun

WINDOW = 8


def _spill(run: SyntheticRun, rank: int, step: int, *, without_step: bool = False) -> None:
    """A ``pending`` row for ``rank``'s first collective of ``step`` (spilled while in flight; its completed row
    is in ``collectives`` too); ``without_step``: the row has no ``step`` (a collective outside steps)."""
    path = run.run_dir / f"events/collectives/rank{rank:05d}.jsonl"
    line = next(orjson.loads(b) for b in path.read_bytes().splitlines() if orjson.loads(b).get("step") == step)
    dropped = ("rank", "end_ns", "step") if without_step else ("rank", "end_ns")
    run.writers[rank].write("pending", {k: v for k, v in line.items() if k not in dropped})
    run.writers[rank].flush()


def test_an_older_pending_row_of_a_rank_that_went_on_is_neither_pending_nor_unfinished_in_the_window(tmp_path):
    run = SyntheticRun(tmp_path / "live", num_ranks=4)
    run.write_steps(12)
    _spill(run, 1, 1)
    _spill(run, 2, 10)
    run.close_writers()
    store = open_source(run.run_dir, live_tail_steps=WINDOW)
    window = StepWindow(store, WINDOW)
    assert window.first_step == 4 and len(store.table("pending")) == 2
    assert window.table("pending")[["rank", "step"]].values.tolist() == [[2, 10]]    # of the window's steps
    assert RunAnalysis(window).unfinished_collectives().empty                # both completed
    assert RunAnalysis(open_source(run.run_dir)).unfinished_collectives().empty     # the whole run agrees


def test_an_older_pending_row_of_a_rank_stuck_before_the_window_stays_in_it(tmp_path):
    # rank 3 wrote no step after step 2: stuck in its collective of step 2, whose completed row it never wrote
    run = SyntheticRun(tmp_path / "live", num_ranks=4)
    run.write_steps(12)
    _spill(run, 3, 2)
    run.close_writers()
    for table in ("steps", "collectives"):
        path = run.run_dir / f"events/{table}/rank00003.jsonl"
        path.write_bytes(b"".join(line + b"\n" for line in path.read_bytes().splitlines()
                                  if orjson.loads(line).get("step", -1) < 2))
    store = open_source(run.run_dir, live_tail_steps=WINDOW)
    window = StepWindow(store, WINDOW)
    assert window.first_step == 4
    assert window.table("pending")[["rank", "step"]].values.tolist() == [[3, 2]]
    unfinished = RunAnalysis(window).unfinished_collectives()
    assert unfinished[["rank", "step"]].values.tolist() == [[3, 2]]


@pytest.mark.parametrize("spills,derived", [
    ((), True),
    (((2, 10, False),), True),                            # of the window's steps
    (((1, 1, False),), False),                            # of a step before the window
    (((2, 10, False), (0, 3, False)), False),
    (((1, 5, True),), False),                             # of no step
])
def test_window_derived_table_judges_older_pending_rows_from_the_stores_step_counts_when_called(
        tmp_path, monkeypatch, spills, derived):
    # the window's derived frames are given only when no pending row lies before its first step (else ``table``
    # keeps some, and the window's collectives hold rows of no step of it): judged from the per-step counts the
    # store keeps, with no read of the pending rows on each call
    run = SyntheticRun(tmp_path / "live", num_ranks=4)
    run.write_steps(12)
    for rank, step, without_step in spills:
        _spill(run, rank, step, without_step=without_step)
    run.close_writers()
    store = open_source(run.run_dir, live_tail_steps=WINDOW)
    window = StepWindow(store, WINDOW)
    pending = store.table("pending")
    assert len(pending) == len(spills)
    assert (pending["step"].fillna(-1) < window.first_step).any() == (not derived)   # the rule, on the rows
    read = []
    real_table = store.table
    monkeypatch.setattr(store, "table", lambda name, **kw: read.append(name) or real_table(name, **kw))
    for _ in range(2):
        assert (window.derived_table(LATENESS, KEY) is not None) == derived
    assert read == []
