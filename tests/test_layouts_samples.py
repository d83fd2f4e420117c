"""The layout scenarios in sample_traces/ (made by ``dtprobe run``, see each README): they open as runs and
carry what their names promise -- per-axis collectives, the pipeline table, per-rank memory."""

from __future__ import annotations

from pathlib import Path

import pytest

from dtprobe.runtime.parallel.bubble import compare_bubble
from dtprobe.store import RunStore

SAMPLES = Path(__file__).resolve().parents[1] / "sample_traces"


def _open(name: str) -> RunStore:
    return RunStore.open(SAMPLES / name)


def _ops_by_group(store: RunStore) -> dict[str, set[str]]:
    coll = store.table("collectives")
    coll = coll[coll["step"] >= 0]
    return {pg: set(ops) for pg, ops in coll.groupby("pg")["op"]}


@pytest.mark.parametrize("name", ["pp4_gpipe_bubble", "dp2_tp2", "zero3_dp4"])
def test_sample_is_a_finished_run_under_1mb(name):
    store = _open(name)
    assert store.manifest.status == "finished" and store.manifest.world_size == 4
    assert sum(p.stat().st_size for p in (SAMPLES / name).rglob("*") if p.is_file()) < 1_000_000


def test_dp2_tp2_sample_has_tp_allreduce_and_dp_allreduce_on_their_groups():
    store = _open("dp2_tp2")
    assert _ops_by_group(store) == {"dp": {"allreduce"}, "tp": {"allreduce"}}
    coll = store.table("collectives")
    groups = {pg: set(r) for pg, r in coll[coll["step"] >= 0].groupby("pg")["pg_ranks"]}
    assert groups == {"tp": {"0,1", "2,3"}, "dp": {"0,2", "1,3"}}
    losses = store.table("steps").groupby("step")["loss"].mean()
    assert losses.iloc[-1] < losses.iloc[0]


def test_zero3_dp4_sample_has_fsdp_collectives_and_quarter_parameters():
    store = _open("zero3_dp4")
    ops = _ops_by_group(store)
    assert {"allgather", "reduce_scatter"} <= ops["dp"] and set(ops) == {"dp"}
    mem = store.table("memory")
    last = mem[mem["step"] == mem["step"].max()]
    assert len(last) == 4
    from dtprobe.runtime.model import PRESETS

    full_bytes = PRESETS["tiny"].num_params * 4
    assert (last["param_bytes"] / full_bytes).between(0.24, 0.27).all()
    assert (last["optim_bytes"] / (2 * full_bytes)).between(0.24, 0.28).all()   # AdamW: 2 states


def test_pp4_gpipe_bubble_sample_bubble_near_the_gpipe_ideal():
    store = _open("pp4_gpipe_bubble")
    assert _ops_by_group(store)["pp"] >= {"send", "recv"}
    pipe = store.table("pipeline")
    counts = pipe.groupby(["step", "stage", "action"]).size()
    assert (counts == 8).all() and len(counts) == 6 * 4 * 2
    cmp = compare_bubble(pipe.to_dict("records"), schedule="gpipe", num_ranks=4, num_microbatches=8,
                         virtual_stages=1)
    assert cmp.ideal_frac == pytest.approx([3 / 11] * 4, abs=0.015)
    # recorded under the full probe on CPU: p2p and host overhead add a few points above the ideal
    assert all(i - 0.01 <= m <= i + 0.08 for m, i in zip(cmp.measured_frac, cmp.ideal_frac))
