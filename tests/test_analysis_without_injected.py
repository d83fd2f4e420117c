"""No verdict from a marker: every sample scenario gives the same findings (codes and ranks) with the fault
injector's rows (``faults`` rows with ``injected=true``) removed from its store as with them."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from dtprobe.analysis import RunAnalysis

SAMPLES = Path(__file__).resolve().parents[1] / "sample_traces"
SCENARIOS = sorted(p.name for p in SAMPLES.iterdir() if (p / "run.json").is_file())


def _without_injected(src: Path, dst: Path) -> int:
    """Copy the run at ``src`` to ``dst`` without its injected fault rows (compacted table and event files);
    returns how many rows were removed."""
    shutil.copytree(src, dst)
    removed = 0
    table = dst / "tables" / "faults.parquet"
    if table.is_file():
        t = pq.read_table(table)
        keep = [v is not True for v in t.column("injected").to_pylist()]
        removed += keep.count(False)
        pq.write_table(t.filter(keep), table)
        index = dst / "tables" / "_compacted.json"
        doc = json.loads(index.read_text())
        if "faults" in doc.get("tables", {}):
            doc["tables"]["faults"]["rows"] = sum(keep)
            index.write_text(json.dumps(doc))
    for events in (dst / "events" / "faults").glob("*.jsonl") if (dst / "events" / "faults").is_dir() else ():
        lines = events.read_text().splitlines(keepends=True)
        kept = [x for x in lines if not x.strip() or json.loads(x).get("injected") is not True]
        removed += len(lines) - len(kept)
        events.write_text("".join(kept))
    return removed


def _verdicts(run: Path) -> list[tuple[str, tuple[int, ...]]]:
    return sorted((f.code, f.ranks) for f in RunAnalysis.open(run).findings())


@pytest.mark.parametrize("name", SCENARIOS)
def test_findings_are_the_same_without_the_injected_fault_rows(tmp_path, name):
    stripped = tmp_path / name
    _without_injected(SAMPLES / name, stripped)
    assert _verdicts(stripped) == _verdicts(SAMPLES / name)


def test_the_stripped_copy_has_no_injected_row_left(tmp_path):
    name = "hang_rank1"
    assert _without_injected(SAMPLES / name, tmp_path / name) >= 1
    from dtprobe.store import RunStore

    faults = RunStore.open(tmp_path / name).table("faults")
    assert not faults["injected"].fillna(False).astype(bool).any() and len(faults) >= 1


@pytest.mark.parametrize("name,code,ranks,severity", [
    ("ckpt_crash_restart", "RANK_CRASH", (1,), "warning"),   # from the runtime's restart row and the rows' ends
    ("hang_rank1", "HANG", (1,), "critical"),                # from rank 0's unfinished all-reduce
])
def test_crash_and_hang_samples_keep_their_verdict_from_telemetry_alone(tmp_path, name, code, ranks, severity):
    _without_injected(SAMPLES / name, tmp_path / name)
    [f] = [f for f in RunAnalysis.open(tmp_path / name).findings() if f.code == code]
    assert (f.ranks, f.severity) == (ranks, severity)
    assert f.evidence["injected"] is False
