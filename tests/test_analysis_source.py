"""One source model: every source (run store, Kineto trace folder, step window, or an in-memory one) is read
through ``dtprobe.store.source.Source``, and what differs between them is data (``SourceInfo``), not a branch."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

import pandas as pd
import pytest

from dtprobe.analysis import RunAnalysis
from dtprobe.analysis.window import StepWindow
from dtprobe.store import RunStore
from dtprobe.store.kineto import load_trace_dir
from dtprobe.store.resolve import open_source
from dtprobe.store.schema import SCHEMAS
from dtprobe.store.source import Source, SourceInfo

REPO = Path(__file__).resolve().parents[1]
STRAGGLER_RUN = REPO / "sample_traces" / "dp4_straggler_rank2"
TRACES = REPO / "tests" / "data" / "traces"


@dataclass
class FrameSource:
    """A source held in memory: tables and facts given as they are (what a later engine would hand over)."""

    path: Path
    info: SourceInfo
    frames: dict[str, pd.DataFrame]

    def table(self, name: str) -> pd.DataFrame:
        return self.frames[name]


def _in_memory(store: RunStore, **facts) -> FrameSource:
    return FrameSource(path=store.path, info=dataclasses.replace(store.info, **facts),
                       frames={name: store.table(name) for name in SCHEMAS})


@pytest.mark.parametrize("make", [
    lambda: RunStore.open(STRAGGLER_RUN),
    lambda: StepWindow(RunStore.open(STRAGGLER_RUN), 5),
    lambda: load_trace_dir(TRACES / "nccl_metadata_1rank_a100"),
    lambda: open_source(STRAGGLER_RUN),
])
def test_every_reader_is_a_source_with_every_schema_table(make):
    source = make()
    assert isinstance(source, Source)
    for name in SCHEMAS:
        assert list(source.table(name).columns) == list(SCHEMAS[name])


def test_run_store_facts_come_from_its_manifest():
    info = RunStore.open(STRAGGLER_RUN).info
    assert (info.kind, info.status, info.world_size) == ("dtprobe_run", "finished", 4)
    assert info.clock_aligned and info.whole_record and info.warmup_recorded
    assert info.device_name == "cpu" and [r.rank for r in info.ranks] == [0, 1, 2, 3]


def test_trace_folder_facts_say_unaligned_clocks_window_cut_per_rank_and_every_step_counted():
    info = load_trace_dir(TRACES / "nccl_metadata_1rank_a100").info
    assert (info.kind, info.status, info.manifest, info.ranks) == ("kineto_traces", "trace", None, ())
    assert not (info.clock_aligned or info.whole_record or info.warmup_recorded)
    assert "A100" in info.device_name


def test_an_in_memory_source_with_the_same_tables_and_facts_gives_the_same_report():
    store = RunStore.open(STRAGGLER_RUN)
    ours = RunAnalysis(_in_memory(store)).report()
    assert ours == RunAnalysis(store).report()
    assert [f["code"] for f in ours["findings"]] == ["STRAGGLER"]


def test_facts_not_the_kind_of_source_decide_which_analyses_apply():
    store = RunStore.open(STRAGGLER_RUN)
    window_like = RunAnalysis(_in_memory(store, clock_aligned=False, whole_record=False, warmup_recorded=False))
    assert window_like.stragglers() == [] and window_like.hangs() == [] and window_like.comm_exposure().empty
    assert window_like.skipped_warmup_steps == 0
    assert window_like.steps_analyzed()[0] == RunAnalysis(store).steps_analyzed()[0] - 1
    assert not window_like.is_trace_folder   # a label of the kind, read by no analysis


def _attempts(table: str, make_row, *, ranks=(0, 1), steps=range(10), redone=range(5, 8)) -> pd.DataFrame:
    """Rows of ``table``: attempt 0 ran steps 0-7 and crashed; attempt 1 resumed after step 4, redid 5-7, ran on."""
    from dtprobe.store.frames import frame_from_rows

    return frame_from_rows(table, [make_row(r, s, a) for r in ranks for s in steps for a in (0, 1)
                                   if (a == 0 and s <= max(redone)) or (a == 1 and s >= min(redone))])


def test_compression_figures_and_the_loss_gap_read_a_redone_step_from_the_attempt_that_redid_it():
    store = RunStore.open(STRAGGLER_RUN)
    mib = 1 << 20
    # the first attempt sent twice the bytes and its loss diverged: its redone steps may show in no figure
    compression = _attempts("compression", lambda r, s, a: {
        "rank": r, "step": s, "bucket": 0, "method": "topk", "raw_bytes": 4 * mib, "sent_bytes": (2 - a) * mib // 2,
        "encode_ns": 1_000_000, "decode_ns": 1_000_000, "restart": a})
    steps = _attempts("steps", lambda r, s, a: {"rank": r, "step": s, "loss": 9.0 if a == 0 and s >= 5 else 2.0,
                                                 "restart": a})
    base_steps = _attempts("steps", lambda r, s, a: {"rank": r, "step": s, "loss": 9.0 if a == 0 and s >= 8 else 1.6,
                                                      "restart": a}, redone=range(8, 10))
    frames = {name: store.table(name) for name in SCHEMAS}
    run = FrameSource(path=store.path, info=store.info, frames={**frames, "compression": compression,
                                                               "steps": steps})
    baseline = FrameSource(path=store.path, info=store.info, frames={**frames, "steps": base_steps})
    a = RunAnalysis(run, baseline=baseline)
    [row] = a.compression().to_dict("records")
    # 2 ranks x 10 steps, each once (16 rows of attempt 0 and 10 of attempt 1 were recorded): steps 0-4 of
    # attempt 0 sent 1 MiB, steps 5-9 of attempt 1 half that
    assert (row["num_steps"], row["raw_bytes"], row["sent_bytes"]) == (10, 20 * 4 * mib, 15 * mib)
    assert row["ratio"] == pytest.approx(80 / 15) and row["raw_bytes_per_step"] == pytest.approx(4 * mib)
    assert row["encode_ns_per_step"] == pytest.approx(1_000_000)
    # the last 5 common steps (5-9), each from its last attempt in either run: 2.0 against 1.6
    [gap] = a.loss_gap().to_dict("records")
    assert (gap["loss"], gap["baseline_loss"]) == (pytest.approx(2.0), pytest.approx(1.6))
    assert gap["loss_gap_frac"] == pytest.approx(0.25)
