"""`dtprobe export tensorboard RUN -o DIR`: the event file read back with TensorBoard's own reader
(``event_accumulator``), every series checked against the run's tables, the facade, and `dtprobe analyze --format
json`."""

from __future__ import annotations

import json
import statistics

import pytest
from tensorboard.backend.event_processing import event_accumulator as ea

from dtprobe.analysis.facade import RunAnalysis
from dtprobe.store import RunStore


def read_events(log_dir) -> ea.EventAccumulator:
    acc = ea.EventAccumulator(str(log_dir), size_guidance={ea.SCALARS: 0, ea.TENSORS: 0})
    acc.Reload()
    return acc


def points(acc: ea.EventAccumulator, tag: str) -> dict[int, float]:
    return {e.step: e.value for e in acc.Scalars(tag)}


@pytest.fixture(scope="module")
def exported(tmp_path_factory, sample_traces_dir, run_cli, sample_trace_analyze):
    """scenario -> (its run directory, TensorBoard's reader over the exported events, analyze's JSON document)."""
    out = {}
    for scenario in ("fp16_overflow", "dp4_straggler_rank2"):
        run = sample_traces_dir / scenario
        log_dir = tmp_path_factory.mktemp("tb") / scenario
        res = run_cli("export", "tensorboard", run, "-o", log_dir)
        assert res.returncode == 0, res.stderr
        assert f"to {log_dir}" in res.stdout and "tensorboard --logdir" in res.stdout
        analyzed = sample_trace_analyze(scenario)
        out[scenario] = (run, read_events(log_dir), json.loads(analyzed.stdout))
    return out


def test_tensorboard_export_writes_the_documented_tags_for_each_rank_and_group(exported):
    _, acc, _ = exported["fp16_overflow"]
    assert sorted(acc.Tags()["scalars"]) == [
        "exposed_comm_frac/rank0", "exposed_comm_frac/rank1", "lateness_frac/world/rank0",
        "lateness_frac/world/rank1", "loss", "loss_scale", "step_time_ms/rank0", "step_time_ms/rank1",
        "tokens_per_s"]
    _, acc4, _ = exported["dp4_straggler_rank2"]
    assert {t for t in acc4.Tags()["scalars"] if t.startswith("step_time_ms/")} == {
        f"step_time_ms/rank{r}" for r in range(4)}
    assert "loss_scale" not in acc4.Tags()["scalars"]          # no AMP rows in that run: nothing made up


@pytest.mark.parametrize("scenario", ["fp16_overflow", "dp4_straggler_rank2"])
def test_tensorboard_step_time_per_rank_equals_the_steps_table_with_step_ends_as_wall_time(exported, scenario):
    run, acc, _ = exported[scenario]
    steps = RunStore.open(run).table("steps")
    for rank, rows in steps.groupby("rank"):
        events = {e.step: e for e in acc.Scalars(f"step_time_ms/rank{rank}")}
        assert sorted(events) == sorted(rows["step"])
        for r in rows.itertuples():
            assert events[r.step].value == pytest.approx((r.end_ns - r.start_ns) / 1e6, rel=1e-6)
    ends = steps.groupby("step")["end_ns"].max()
    for e in acc.Scalars("step_time_ms/rank0"):
        assert e.wall_time == pytest.approx(ends[e.step] / 1e9, abs=1e-3)


def test_tensorboard_tokens_per_s_median_over_analysed_steps_equals_analyze_json(exported):
    for scenario, (_, acc, doc) in exported.items():
        analysed = doc["metrics"]["steps_analyzed"]
        tokens = points(acc, "tokens_per_s")
        median = statistics.median(v for s, v in tokens.items() if analysed["first"] <= s <= analysed["last"])
        assert median == pytest.approx(doc["metrics"]["throughput"]["tokens_per_s"], rel=1e-6), scenario


def test_tensorboard_loss_is_the_mean_over_ranks_and_loss_scale_drops_at_the_overflow(exported):
    run, acc, doc = exported["fp16_overflow"]
    store = RunStore.open(run)
    expected_loss = store.table("steps").groupby("step")["loss"].mean()
    loss = points(acc, "loss")
    assert sorted(loss) == sorted(expected_loss.index)
    assert all(loss[s] == pytest.approx(v, rel=1e-6) for s, v in expected_loss.items())
    amp = store.table("amp")
    scale = points(acc, "loss_scale")
    assert scale == {int(s): float(v) for s, v in amp.groupby("step")["scale_after"].min().items()}
    drops = [s for s in sorted(scale) if s - 1 in scale and scale[s] < scale[s - 1]]
    assert len(drops) == doc["metrics"]["amp"]["num_overflows"] == 1
    assert scale[max(scale)] == doc["metrics"]["amp"]["final_scale"]


def test_tensorboard_exposed_comm_and_lateness_equal_the_facade_per_step(exported):
    run, acc, doc = exported["dp4_straggler_rank2"]
    analysis = RunAnalysis(RunStore.open(run))
    for r in analysis.comm_exposure().dropna(subset=["exposed_frac"]).itertuples():
        assert points(acc, f"exposed_comm_frac/rank{r.rank}")[r.step] == pytest.approx(r.exposed_frac, rel=1e-5)
    lateness = analysis.rank_lateness()
    for r in lateness.itertuples():
        assert points(acc, f"lateness_frac/{r.pg}/rank{r.rank}")[r.step] == pytest.approx(r.lateness_frac,
                                                                                          rel=1e-5, abs=1e-9)
    # the straggler of the scenario is the rank whose exported lateness is highest, as analyze says
    medians = {r: statistics.median(points(acc, f"lateness_frac/world/rank{r}").values()) for r in range(4)}
    (worst,) = doc["metrics"]["latest_rank_by_group"]
    assert max(medians, key=medians.get) == worst["rank"] == 2


@pytest.mark.parametrize("scenario", ["fp16_overflow", "dp4_straggler_rank2"])
def test_tensorboard_findings_text_holds_every_finding_of_analyze_at_the_last_step(exported, scenario):
    _, acc, doc = exported[scenario]
    (text,) = acc.Tensors("findings/text_summary")
    body = text.tensor_proto.string_val[0].decode()
    assert text.step == doc["metrics"]["steps_analyzed"]["last"]
    assert doc["findings"], "the scenario has findings to show"
    for f in doc["findings"]:
        assert f"| {f['severity']} | {f['code']} |" in body and f["recommendation"] in body


def test_tensorboard_export_refuses_a_directory_that_already_holds_event_files(tmp_path, sample_traces_dir,
                                                                                 run_cli):
    log_dir = tmp_path / "tb"
    assert run_cli("export", "tensorboard", sample_traces_dir / "fp16_overflow", "-o", log_dir).returncode == 0
    again = run_cli("export", "tensorboard", sample_traces_dir / "fp16_overflow", "-o", log_dir)
    assert again.returncode == 2
    assert "already holds TensorBoard event files" in again.stderr and "Traceback" not in again.stderr
    assert len(list(log_dir.glob("events.out.tfevents.*"))) == 1


def test_tensorboard_keeps_the_last_attempt_of_a_step_re_run_after_a_restart(tmp_path, sample_traces_dir, run_cli):
    run = sample_traces_dir / "ckpt_crash_restart"
    assert run_cli("export", "tensorboard", run, "-o", tmp_path / "tb").returncode == 0
    acc = read_events(tmp_path / "tb")
    steps = RunStore.open(run).table("steps")
    rerun = steps[steps.duplicated(["rank", "step"], keep=False)]
    assert sorted(rerun["restart"]) == [0, 1]                  # the scenario: one step of rank 0 run twice
    (rank,), (step,) = rerun["rank"].unique(), rerun["step"].unique()
    last = rerun[rerun["restart"] == 1].iloc[0]
    events = [e for e in acc.Scalars(f"step_time_ms/rank{rank}") if e.step == step]
    assert len(events) == 1
    assert events[0].value == pytest.approx((last["end_ns"] - last["start_ns"]) / 1e6, rel=1e-6)
    assert len(acc.Scalars(f"step_time_ms/rank{rank}")) == steps[steps["rank"] == rank]["step"].nunique()
