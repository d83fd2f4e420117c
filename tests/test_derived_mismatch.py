"""COLLECTIVE_MISMATCH of a compacted run reads the suspect collectives kept at compaction (``derived_tables``
``suspects``: the collectives whose members' calls differ) and then only the rows of their groups, read from
their members' files; findings and mismatch frames equal those computed from every row."""

from __future__ import annotations

import orjson
import pandas as pd
import pytest

from dtprobe.analysis import RunAnalysis
from dtprobe.analysis.derived_tables import KEY, SUSPECTS, deriver
from dtprobe.store import RunStore, compact
from dtprobe.store.resolve import open_source
from dtprobe.synthetic import lockstep_tables, write_rows_run

WORLD = 64
NUM_STEPS = 25
"""Two step blocks (steps 0-19, 20-24)."""


@pytest.fixture
def calls_read(compacted_files_read) -> list[str]:
    """The compacted collectives files read with the columns only the mismatch reads (``dtype``)."""
    return compacted_files_read(lambda table, columns: table == "collectives"
                                and (columns is None or "dtype" in columns))


def pairs_run(tmp_path, *, odd: tuple[int, int] | None = None):
    """A finished, compacted run of ``WORLD`` ranks in groups of two ("0,1", "2,3", ...) that all-reduce once per
    step; ``odd`` = (rank, step): that rank issues float16 where its peer issues float32."""
    rows = lockstep_tables(world=WORLD, num_steps=NUM_STEPS)
    for row in rows["collectives"]:
        first = row["rank"] - row["rank"] % 2
        row.update(pg="tp", pg_ranks=f"{first},{first + 1}", pg_size=2)
        if odd is not None and (row["rank"], row["step"]) == odd:
            row["dtype"] = "float16"
    run = write_rows_run(tmp_path / "run", rows, world_size=WORLD, status="finished")
    compact(run, derive=deriver())
    derived = orjson.loads((run / "tables" / "_compacted.json").read_bytes())["derived"]
    assert "skipped" not in derived, derived
    return run


def from_rows(run) -> RunAnalysis:
    store = RunStore.open(run)
    store.derived_table = lambda *args, **kwargs: None
    return RunAnalysis(store)


def test_a_clean_compacted_run_reads_no_call_of_any_group_for_the_mismatch(tmp_path, calls_read):
    run = pairs_run(tmp_path)
    calls_read.clear()
    kept = RunAnalysis(open_source(run))
    assert kept.source.derived_table(SUSPECTS, KEY).empty
    assert kept.collective_mismatches().empty and kept.mismatch_findings() == []
    assert calls_read == []
    raw = from_rows(run)
    assert raw.collective_mismatches().empty
    assert calls_read                                   # computed from the rows, every call is read


def test_a_mismatch_is_judged_on_its_group_alone_read_from_its_members_files(tmp_path, calls_read):
    run = pairs_run(tmp_path, odd=(41, 22))
    calls_read.clear()
    kept = RunAnalysis(open_source(run))
    suspects = kept.source.derived_table(SUSPECTS, KEY)
    assert list(zip(suspects["pg_ranks"].astype(str), suspects["seq"])) == [("40,41", 23)]
    [f] = kept.mismatch_findings()
    assert (f.code, f.ranks, f.evidence["seq"], f.evidence["step"]) == ("COLLECTIVE_MISMATCH", (41,), 23, 22)
    assert f.evidence["issued"]["41"]["dtype"] == "float16" and f.evidence["issued"]["40"]["dtype"] == "float32"
    # only the files of rank block 1 (ranks 32-63), of both step blocks; only group 40,41's rows compared
    assert calls_read and all("rank_block=1/" in rel for rel in calls_read)
    assert {rel.split("/")[1] for rel in calls_read} == {"step_block=0", "step_block=1"}
    calls = kept._mismatch_calls()
    assert set(calls["pg_ranks"].astype(str)) == {"40,41"} and len(calls) == 2 * NUM_STEPS
    raw = from_rows(run)
    pd.testing.assert_frame_equal(kept.collective_mismatches(), raw.collective_mismatches())
    assert [x.to_json() for x in kept.findings()] == [x.to_json() for x in raw.findings()]
