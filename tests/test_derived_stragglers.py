"""The STRAGGLER path of a compacted run without the ``collectives`` table: group clocks, linked ranks and pipelines
from the ``groups`` rows kept at compaction (``arrivals.group_rows``), the causes' waits from the ``blocked`` rows
(``stragglers.blocked_outside_groups``), the late rank per step from ``late_rank``; equal to what every row gives."""

from __future__ import annotations

from pathlib import Path

import orjson
import pandas as pd
import pytest

from dtprobe.analysis import straggler_causes as sc
from dtprobe.analysis import RunAnalysis
from dtprobe.analysis import stragglers as st
from dtprobe.analysis.arrivals import arrival_clocks, group_rows
from dtprobe.analysis.derived_tables import GROUPS, KEY, deriver
from dtprobe.analysis.pipeline_delay import pipeline_groups
from dtprobe.store import RunStore, compact
from dtprobe.store.resolve import open_source
from dtprobe.synthetic import cuda_dp_tables, dp_pp_tables, dp_tables, write_run


@pytest.fixture
def files_read(compacted_files_read) -> list[str]:
    """Every compacted Parquet file the reader opens, relative to ``tables/``."""
    return compacted_files_read()


TABLES = {
    "dp_host": lambda: dp_tables(world=4, num_steps=6),
    "dp_pp_p2p": lambda: dp_pp_tables(dp=2, pp=2, num_steps=6),
    "cuda_device": lambda: cuda_dp_tables(clock="device", num_steps=6),
    "cuda_host": lambda: cuda_dp_tables(clock="host", num_steps=6),
}


@pytest.mark.parametrize("name", TABLES)
def test_group_rows_give_the_clocks_links_and_pipelines_of_every_row(name):
    coll = TABLES[name]()["collectives"]
    rows = group_rows(coll)
    assert len(rows) < len(coll)
    pd.testing.assert_frame_equal(arrival_clocks(rows), arrival_clocks(coll))
    assert st.linked_ranks(rows) == st.linked_ranks(coll)
    assert pipeline_groups(rows) == pipeline_groups(coll)
    if name == "dp_pp_p2p":
        assert (rows["peer"].notna()).any()                  # its send/recv links are rows of their own
    # per step block, then together (as derived_tables.whole_run_frame reads them): the whole run's rows
    halves = [coll[coll["step"] < 3], coll[coll["step"] >= 3]]
    pd.testing.assert_frame_equal(group_rows(pd.concat([group_rows(h) for h in halves], ignore_index=True)), rows)


def _blocked_reference(collectives: pd.DataFrame, waits: pd.DataFrame) -> dict[tuple[int, int, str], float]:
    """One (rank, step, group) at a time: the union of the rank's blocking intervals at that step, that group's
    left out (sc.OUTSIDE_NONE: none left out)."""
    rows = []
    p2p = collectives[collectives["op"].isin(["send", "recv"]) & collectives["end_ns"].notna()]
    rows += [(int(r.rank), int(r.step), "p2p", int(r.enqueue_ns), int(r.end_ns)) for r in p2p.itertuples()]
    rows += [(int(w.rank), int(w.step), str(w.pg_ranks), int(w.enqueue_ns), int(w.enqueue_ns + w.wait_ns))
             for w in waits.itertuples() if w.wait_ns > 0]
    out = {}
    for rank, step in {(r[0], r[1]) for r in rows}:
        mine = [r for r in rows if r[:2] == (rank, step)]
        for left_out in [sc.OUTSIDE_NONE, *{r[2] for r in mine if r[2] != "p2p"}]:
            covered, reach = 0, None
            for a, b in sorted((r[3], r[4]) for r in mine if r[2] != left_out):
                if reach is None or a > reach:
                    covered, reach = covered + b - a, b
                elif b > reach:
                    covered, reach = covered + b - reach, b
            out[(rank, step, left_out)] = float(covered)
    return out


@pytest.mark.parametrize("name", TABLES)
def test_blocked_outside_groups_equals_the_union_of_each_ranks_other_intervals(name):
    coll = TABLES[name]()["collectives"]
    waits = st.collective_waits(coll, st.collective_skew(coll))
    blocked = sc.blocked_outside_groups(coll, waits)
    got = {(int(r.rank), int(r.step), str(r.outside_pg_ranks)): r.blocked_ns for r in blocked.itertuples()}
    assert got == _blocked_reference(coll, waits) and len(got) > 0
    if name == "dp_pp_p2p":     # a rank in a dp and a pp group waits outside each
        assert blocked["outside_pg_ranks"].nunique() > 2


def _compacted_straggler_run(tmp_path: Path, clock: str) -> Path:
    tables = cuda_dp_tables(clock=clock, num_steps=70, straggler=2, delay_ms=15.0)
    run = write_run(tmp_path / clock, tables, world_size=4, config={"layout": {"dp": 4, "tp": 1, "pp": 1}})
    compact(run, derive=deriver())
    derived = orjson.loads((run / "tables" / "_compacted.json").read_bytes())["derived"]
    assert "skipped" not in derived and derived["tables"][GROUPS]["rows"] > 0
    return run


@pytest.mark.parametrize("clock", ["device", "host"])
def test_stragglers_of_a_compacted_run_read_no_collectives_file(tmp_path, clock, files_read):
    run = _compacted_straggler_run(tmp_path, clock)
    files_read.clear()
    kept = RunAnalysis(open_source(run))
    findings = kept.stragglers()
    late = kept.late_rank_per_step()
    assert [f for f in files_read if f.startswith(("collectives", "pending"))] == []
    raw_store = RunStore.open(run)
    raw_store.derived_table = lambda *args, **kwargs: None
    raw = RunAnalysis(raw_store)
    assert [f.to_json() for f in findings] == [f.to_json() for f in raw.stragglers()]
    assert [f.ranks for f in findings] == ([(2,)] if clock == "device" else [])
    pd.testing.assert_frame_equal(kept.straggler_causes(), raw.straggler_causes(), check_exact=True)
    if clock == "device":
        assert 2 in set(kept.straggler_causes()["rank"])
    pd.testing.assert_frame_equal(late, raw.late_rank_per_step(), check_exact=True)
    pd.testing.assert_frame_equal(kept.arrival_clocks(), raw.arrival_clocks())
    assert kept.arrival_clock() == raw.arrival_clock() == clock


def test_group_rows_are_computed_from_the_rows_of_a_run_without_derived_tables(tmp_path):
    run = write_run(tmp_path / "run", dp_pp_tables(dp=2, pp=2, num_steps=6), world_size=4)
    a = RunAnalysis(RunStore.open(run))
    assert a.source.derived_table(GROUPS, KEY) is None
    pd.testing.assert_frame_equal(a.arrival_clocks(), arrival_clocks(a.table("collectives")))
    assert a._group_rows()["peer"].notna().any()
