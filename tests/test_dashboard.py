"""Dashboard (Streamlit AppTest): every page renders on every sample_traces scenario and on the DLRM GPU traces
and shows the findings `dtprobe analyze` reports; finding links carry the ranks to mark; live refresh reads new
steps; a finished run's Overview comes from its stored summary; run choices (picker and URL) are re-validated;
charts export to PNG; the command's safe server flags, and its server stops with it."""

from __future__ import annotations

import base64
import dataclasses
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import streamlit
from streamlit.testing.v1 import AppTest

from dtprobe import overview as ov
from dtprobe import summary_store
from dtprobe.dashboard import charts, data, export
from dtprobe.dashboard.nav import FINDING_PAGE, PAGES
from dtprobe.dashboard.paths import ROOT_ENV, list_sources, resolve_choice
from dtprobe.synthetic import SyntheticRun, dp_stall_tables, write_run, write_synthetic_run
from dtprobe.analysis.facade import RunAnalysis
from dtprobe.store.errors import ConfigError

REPO = Path(__file__).resolve().parents[1]
APP = REPO / "dashboard" / "app.py"
SAMPLE_TRACES = REPO / "sample_traces"
DLRM = REPO / "tests/data/traces/dlrm_8rank_v100"



def _scenario_sources() -> list[Path]:
    """Each scenario folder that is a run or trace folder, and the runs inside a scenario that holds several
    (e.g. topk_vs_baseline: a compressed run and its baseline)."""
    found = []
    for folder in sorted(p for p in SAMPLE_TRACES.iterdir() if p.is_dir()) if SAMPLE_TRACES.is_dir() else []:
        inner = sorted(p for p in folder.iterdir() if (p / "run.json").is_file())
        found += inner if not (folder / "run.json").is_file() and inner else [folder]
    return found


SCENARIOS = _scenario_sources()
STRAGGLER_RANK = 2


@pytest.fixture
def user_cache(tmp_path) -> Path:
    """This test's per-user cache folder (beside its tmp_path, which tests use as the dashboard's root)."""
    return tmp_path.parent / f"{tmp_path.name}-user-cache"


@pytest.fixture(autouse=True)
def _fresh_streamlit(monkeypatch, user_cache):
    """Show full exceptions in AppTest (the server hides them) and start every test with empty caches, the
    per-user summary cache included."""
    streamlit.config.set_option("client.showErrorDetails", "full")
    streamlit.cache_data.clear()
    streamlit.cache_resource.clear()
    data.clear()
    monkeypatch.delenv(ROOT_ENV, raising=False)
    monkeypatch.setenv(summary_store.CACHE_ENV, str(user_cache))


def app(root: Path, monkeypatch, **query: str) -> AppTest:
    monkeypatch.setenv(ROOT_ENV, str(root))
    at = AppTest.from_file(str(APP), default_timeout=240)
    for key, value in query.items():
        at.query_params[key] = value
    return at.run()


def page_text(at: AppTest) -> str:
    parts = [m.value for m in at.markdown] + [c.value for c in at.caption] + [t.value for t in at.title]
    parts += [h.value for h in (*at.header, *at.subheader)]
    parts += [e.value for e in (*at.info, *at.error, *at.warning, *at.success)]
    return "\n".join(str(p) for p in parts)


def figures(at: AppTest) -> dict[str, dict]:
    return {el.proto.id.split("-")[-1] if not getattr(el, "key", None) else el.key: json.loads(el.proto.spec)
            for el in at.get("plotly_chart")}


def page_links(at: AppTest) -> list:
    return [el.proto for el in at.get("page_link")]


@pytest.fixture(scope="module")
def straggler_root(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("runs")
    write_synthetic_run(root / "dp4_straggler", num_ranks=4, num_steps=40, straggler_rank=STRAGGLER_RANK)
    write_synthetic_run(root / "dp4_clean", num_ranks=4, num_steps=30)
    return root


# ------------------------------------------------------------------------------------------------ every page


@pytest.mark.parametrize("source", [*SCENARIOS, DLRM], ids=lambda p: p.parent.name + "/" + p.name)
def test_dashboard_every_page_renders_and_overview_shows_analyze_findings(source: Path, monkeypatch):
    report = RunAnalysis.open(source).report()  # exactly what `dtprobe analyze --format json` prints
    at = app(source, monkeypatch)
    assert not at.exception, [e.message for e in at.exception]
    text = page_text(at)
    assert f"Findings ({len(report['findings'])})" in text
    for finding in report["findings"]:
        assert f"{finding['code']}**" in text and finding["title"] in text, finding
    linked = [json.loads(json.dumps(p.query_string)) for p in page_links(at)]
    expected = [f for f in report["findings"] if f["code"] in FINDING_PAGE]
    assert len(linked) == len(expected)
    for page in PAGES[1:]:
        at.switch_page(page.path).run()
        assert not at.exception, (page.title, [e.message for e in at.exception])
        assert at.title[0].value == page.title


def test_overview_key_figures_come_from_the_facade(straggler_root, monkeypatch):
    at = app(straggler_root, monkeypatch, run="dp4_straggler")
    metrics = {m.label: m.value for m in at.metric}
    k = RunAnalysis.open(straggler_root / "dp4_straggler").key_figures()
    assert metrics["steps"] == "40"
    assert metrics["step time"] == f"{k.step_time_ms:.1f} ms"
    assert metrics["exposed comm"] == f"{k.exposed_comm_frac:.1%}"
    assert metrics["comm"] == f"{k.comm_frac:.1%}" and 0 < k.comm_frac < 1
    assert metrics["MFU"] == "-" and metrics["bubble"] == "-"  # CPU run, no pipeline: unknown, not zero
    trend = sparklines(at)
    per_step = RunAnalysis.open(straggler_root / "dp4_straggler").throughput().sort_values("step")
    step_ms = [v / 1e6 for v in per_step["step_ns"]]
    assert set(trend) == {"step time", "tokens/s"}  # no trend for a figure without a series (MFU)
    xs, ys = zip(*trend["step time"])
    assert len(xs) == 40 and xs == tuple(sorted(xs))  # one point per step, left to right
    slowest, fastest = step_ms.index(max(step_ms)), step_ms.index(min(step_ms))
    assert ys[slowest] == min(ys) and ys[fastest] == max(ys)  # SVG y grows downwards: the slowest step on top
    assert len(trend["tokens/s"]) == 40


SPARKLINE = re.compile(r"!\[(.+?) over \d+ points, [^\]]*\]\(data:image/svg\+xml;base64,([A-Za-z0-9+/=]+)\)")


def svg_points(b64: str) -> list[tuple[float, float]]:
    """The (x, y) points of the polyline in a base64 SVG sparkline."""
    svg = base64.b64decode(b64).decode()
    return [tuple(float(v) for v in p.split(",")) for p in re.search(r'points="([^"]+)"', svg).group(1).split()]


def sparklines(at) -> dict[str, list[tuple[float, float]]]:
    """The Overview's sparklines: label -> the points of its SVG polyline."""
    return {m.group(1): svg_points(m.group(2)) for m in (SPARKLINE.fullmatch(md.value) for md in at.markdown) if m}


def test_sparkline_scales_to_its_box_and_draws_a_flat_series_midway():
    from dtprobe.dashboard import common

    def points(values):
        return svg_points(SPARKLINE.fullmatch(common.sparkline("x", values)).group(2))

    width, height = common.SPARK_SIZE
    assert points([1.0, 3.0, 2.0]) == [(0.0, height - 2), (width / 2, 2.0), (width, height / 2)]
    assert {y for _, y in points([5.0, 5.0, 5.0])} == {height / 2}
    assert "x over 3 points, 1 to 3" in common.sparkline("x", [1.0, 3.0, 2.0])


def test_key_figure_trends_of_a_long_run_are_binned(tmp_path):
    run = write_synthetic_run(tmp_path / "long", num_ranks=2, num_steps=450)
    trends = ov.trends(RunAnalysis.open(run))
    assert len(trends["step time"]) == ov.TREND_POINTS and len(trends["tokens/s"]) == ov.TREND_POINTS
    per_step = RunAnalysis.open(run).throughput().sort_values("step")
    first_bin = per_step["step_ns"].iloc[:3] / 1e6  # 450 steps in 200 bins: steps 0, 1 and 2 (0*200//450 ...)
    assert trends["step time"][0] == pytest.approx(first_bin.mean(), abs=1e-3)


# ------------------------------------------------------------------------------------------------ drill down


def test_straggler_finding_links_to_stragglers_page_with_its_rank(straggler_root, monkeypatch):
    at = app(straggler_root, monkeypatch, run="dp4_straggler")
    assert "Unhealthy" in page_text(at)
    link = next(p for p in page_links(at) if "STRAGGLER" in p.label)
    assert link.page.endswith("stragglers")
    assert f"ranks={STRAGGLER_RANK}" in link.query_string and "run=dp4_straggler" in link.query_string

    at = app(straggler_root, monkeypatch, run="dp4_straggler", finding="STRAGGLER", ranks=str(STRAGGLER_RANK))
    at.switch_page("views/stragglers.py").run()
    assert not at.exception
    assert f":red[rank {STRAGGLER_RANK}] (from the finding link)" in page_text(at)
    heat = figures(at)["stragglers_heatmap"]
    rows = heat["data"][0]["y"]
    box = [s for s in heat["layout"]["shapes"] if s["type"] == "rect"]
    assert len(box) == 1 and box[0]["y0"] == rows.index(f"rank {STRAGGLER_RANK}") - 0.5
    table = next(d.value for d in at.dataframe if "role" in d.value.columns)
    assert table.loc[table["role"] == "culprit", "rank"].tolist() == [STRAGGLER_RANK]
    assert sorted(table.loc[table["role"] == "victim", "rank"]) == [0, 1, 3]


def test_rank_stall_links_to_the_stragglers_page_which_shows_it_with_its_stalls(tmp_path, monkeypatch):
    write_run(tmp_path / "dp4_stall", dp_stall_tables(rank=2, step=15, delay_ms=400.0), world_size=4)
    at = app(tmp_path, monkeypatch, run="dp4_stall")
    assert not at.exception, [e.message for e in at.exception]
    link = next(p for p in page_links(at) if "RANK_STALL" in p.label)
    assert link.page.endswith("stragglers") and "ranks=2" in link.query_string
    at.switch_page("views/stragglers.py").run()
    assert not at.exception, [e.message for e in at.exception]
    assert "RANK_STALL** · ranks 2 · group dp" in page_text(at)
    assert "rank 2 stalled once, for up to 0.4 s (step 15)" in page_text(at)
    rows = next(d.value for d in at.dataframe if "stall_ns" in d.value.columns)
    assert rows[["rank", "step", "kind", "phase"]].values.tolist() == [[2, 15, "late_arrival", "fwd"]]


def test_stragglers_page_marks_the_ranks_of_the_url_not_the_detected_ones(straggler_root, monkeypatch):
    at = app(straggler_root, monkeypatch, run="dp4_straggler", ranks="1")
    at.switch_page("views/stragglers.py").run()
    assert ":red[rank 1] (from the finding link)" in page_text(at)


def test_stragglers_page_of_a_run_without_its_overview_draws_the_heatmap_before_analyzing(tmp_path, monkeypatch):
    write_synthetic_run(tmp_path / "dp4_straggler", num_ranks=4, num_steps=40, straggler_rank=STRAGGLER_RANK)
    drawn, asked = [], []          # the heatmaps' marked ranks; the heatmaps drawn when the findings were asked for
    heatmap, lines = charts.lateness_heatmap, data.finding_lines
    monkeypatch.setattr(charts, "lateness_heatmap", lambda *a, **k: drawn.append(k["marked"]) or heatmap(*a, **k))
    monkeypatch.setattr(data, "finding_lines", lambda *a, **k: asked.append(list(drawn)) or lines(*a, **k))
    monkeypatch.setenv(ROOT_ENV, str(tmp_path))
    at = AppTest.from_file(str(APP), default_timeout=240)
    at.query_params["run"] = "dp4_straggler"
    at.switch_page("views/stragglers.py").run()   # the first page drawn: no Overview made or stored yet
    assert not at.exception, [e.message for e in at.exception]
    assert asked[0] == [[]] and drawn == [[], [STRAGGLER_RANK]]    # unmarked before the analysis, then marked
    assert f":red[rank {STRAGGLER_RANK}] (detected culprits)" in page_text(at)
    figs = figures(at)
    assert "stragglers_heatmap_unmarked" not in figs and "stragglers_step_time_unmarked" not in figs
    heat = figs["stragglers_heatmap"]
    box = [s for s in heat["layout"]["shapes"] if s["type"] == "rect"]
    assert len(box) == 1 and box[0]["y0"] == heat["data"][0]["y"].index(f"rank {STRAGGLER_RANK}") - 0.5

    asked.clear(), drawn.clear()
    at.run()                                      # the Overview is made now: the culprits are known at once
    assert drawn == [[STRAGGLER_RANK]] and all(a == [[STRAGGLER_RANK]] for a in asked)


# ------------------------------------------------------------------------------------------------ live


def test_live_run_shows_new_steps_on_rerun(tmp_path, monkeypatch):
    run = SyntheticRun(tmp_path / "live", num_ranks=2)
    run.write_steps(5)
    at = app(tmp_path, monkeypatch)
    assert "● live" in page_text(at) and "| live | running |" in page_text(at)
    assert {m.label: m.value for m in at.metric}["steps"] == "5"
    run.write_steps(3)
    at.run()
    assert {m.label: m.value for m in at.metric}["steps"] == "8"
    run.finish()
    at.run()
    assert "● live" not in page_text(at) and "| live | finished |" in page_text(at)


def test_live_refresh_parses_only_the_new_lines(tmp_path, monkeypatch):
    from dtprobe.dashboard import data

    run = SyntheticRun(tmp_path / "live", num_ranks=2)
    run.write_steps(10)
    app(tmp_path, monkeypatch)
    store = data.open_store(resolve_choice(tmp_path, "live"))
    before = store.cursors()
    run.write_steps(1)
    app(tmp_path, monkeypatch)
    after = store.cursors()
    steps_file = "events/steps/rank00000.jsonl"
    assert after[steps_file][1] - before[steps_file][1] == 1  # one new line read, not the whole file again


def test_live_run_longer_than_the_window_is_analyzed_over_its_newest_steps(tmp_path, monkeypatch):
    monkeypatch.setenv(data.LIVE_WINDOW_ENV, "25")
    run = SyntheticRun(tmp_path / "live", num_ranks=4, straggler_rank=2)
    run.write_steps(60)
    at = app(tmp_path, monkeypatch)
    assert "Live view of steps 35-59 (the last 25) of 60 steps" in page_text(at)
    assert {m.label: m.value for m in at.metric}["steps"] == "60"
    assert "STRAGGLER" in page_text(at) and "ranks 2 " in page_text(at)
    source = resolve_choice(tmp_path, "live")
    window = data.load_analysis(source)
    assert sorted(window.table("steps")["step"].unique()) == list(range(35, 60))
    assert data.open_store(source).is_partial  # opened at the tail: steps before 35 were never parsed
    assert data.open_store(source).num_rows()["steps"] == 25 * 4
    rows_before = len(window.table("collectives"))
    run.write_steps(5)  # the run grows; a refresh still analyzes 25 steps
    window = data.load_analysis(source)
    assert sorted(window.table("steps")["step"].unique()) == list(range(40, 65))
    assert len(window.table("collectives")) == rows_before == 25 * 4 * 2
    at.toggle(key="whole_run").set_value(True).run()  # the sidebar switch: every step
    assert "Live view" not in page_text(at) and "STRAGGLER" in page_text(at)
    whole = data.load_analysis(source, whole_run=True)
    assert whole.table("steps")["step"].nunique() == 65 and data.window_of(whole) is None
    assert not data.open_store(source).is_partial  # the skipped head was read for the whole run
    run.finish()
    at.toggle(key="whole_run").set_value(False).run()
    assert "Live view" not in page_text(at)  # a finished run is always analyzed whole
    assert data.load_analysis(source).table("steps")["step"].nunique() == 65


def test_live_window_keeps_whole_run_events(tmp_path, monkeypatch):
    from dtprobe.analysis.window import StepWindow
    from dtprobe.store import RunStore
    from dtprobe.store.writer import RankWriter

    run = SyntheticRun(tmp_path / "live", num_ranks=2)
    run.write_steps(30)
    w = RankWriter(run.run_dir, 1)
    w.write("faults", {"time_ns": run.t_ns, "step": 3, "kind": "restart", "injected": False,
                       "detail": '{"steps_lost": 2}'})
    w.close()
    window = StepWindow(RunStore.open(run.run_dir), 10)
    assert (window.first_step, window.last_step, window.total_steps) == (20, 29, 30)
    assert window.table("steps")["step"].min() == 20 and len(window.table("faults")) == 1


def test_step_time_overview_draws_the_spread_and_the_slowest_ranks_beyond_eight_ranks(tmp_path):
    from dtprobe.store import RunStore

    run = write_synthetic_run(tmp_path / "r", num_ranks=16, num_steps=12, straggler_rank=11)
    steps = RunStore.open(run).table("steps")
    fig = charts.step_time_overview(steps, marked=[11])
    names = [t.name for t in fig.data]
    assert names[1:3] == ["min-max over ranks", "median over ranks"]
    assert names[3] == "rank 11" and fig.data[3].line.width == 4 and len(names) == 3 + 1 + 3
    assert len(fig.data[2].x) == 12  # one median point per step, not one per (rank, step)
    step_ms = (steps["end_ns"] - steps["start_ns"]) / 1e6
    assert list(fig.data[2].y) == list(step_ms.groupby(steps["step"]).median())
    assert len(charts.step_time_overview(steps[steps["rank"] < 4]).data) == 4  # few ranks: a line each


def test_summary_command_prints_the_overview_of_the_newest_run(tmp_path, child_env):
    old = write_synthetic_run(tmp_path / "old", num_ranks=2, num_steps=4)
    os.utime(old, (1, 1))
    new = write_synthetic_run(tmp_path / "new", num_ranks=4, num_steps=12, straggler_rank=STRAGGLER_RANK)
    env = child_env(**{ROOT_ENV: str(tmp_path)})
    done = subprocess.run([sys.executable, "-m", "dtprobe.dashboard.summary"], env=env, capture_output=True, timeout=120)
    assert done.returncode == 0, done.stderr.decode()
    child = ov.Overview.from_json(done.stdout)
    here = ov.summarize(RunAnalysis.open(new), path=str(new.resolve()))
    assert child.path == str(new.resolve()) and child.whole and child.window is None
    assert child.figures == pytest.approx(here.figures) and child.num_steps == here.num_steps == 12
    assert child.trends == here.trends and len(child.trends["step time"]) == 12
    assert child.findings == here.findings and "STRAGGLER" in [f.code for f in child.findings]
    assert Path(child.path).name == "new"

    done = subprocess.run([sys.executable, "-m", "dtprobe.dashboard.summary", str(old)], env=env, capture_output=True,
                          timeout=120)
    assert done.returncode == 0 and ov.Overview.from_json(done.stdout).num_steps == 4  # a named folder

    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "run.json").write_text("{not json")
    done = subprocess.run([sys.executable, "-m", "dtprobe.dashboard.summary"], env=env, capture_output=True, timeout=120)
    assert done.returncode == 2 and b"run.json" in done.stderr and not done.stdout
    done = subprocess.run([sys.executable, "-m", "dtprobe.dashboard.summary", str(tmp_path / "nothing")], env=env,
                          capture_output=True, timeout=120)
    assert done.returncode == 2 and b"neither a run" in done.stderr and not done.stdout
    for text in ("[]", '{"schema": "dtprobe.findings/1"}', '{"schema": "dtprobe.overview/1", "path": "/r"}', "{"):
        with pytest.raises(ValueError):
            ov.Overview.from_json(text)


def _stored_overview(path: Path, **changes) -> ov.Overview:
    """The Overview of ``path`` with a title no analysis writes, stored in the run directory as `dtprobe compact`
    stores it (valid for the run as it is now)."""
    key = summary_store.key_of(path)
    made = ov.summarize(RunAnalysis.open(path), path=str(path.resolve()))
    lines = tuple(dataclasses.replace(f, title="from the stored summary") for f in made.findings)
    stored = dataclasses.replace(made, findings=lines, **changes)
    assert summary_store.store(path, stored, key=key, in_run_dir=True) == path.resolve() / summary_store.SUMMARY_FILE
    return stored


def test_finished_runs_overview_is_drawn_from_its_stored_summary_without_analyzing_it(tmp_path, monkeypatch):
    run = write_synthetic_run(tmp_path / "dp4_straggler", num_ranks=4, num_steps=40, straggler_rank=STRAGGLER_RANK)
    _stored_overview(run)
    at = app(tmp_path, monkeypatch)
    assert not at.exception and "from the stored summary" in page_text(at)
    assert {m.label: m.value for m in at.metric}["steps"] == "40"
    source = resolve_choice(tmp_path, "dp4_straggler")
    assert data.open_store(source) is None  # the run was never opened, let alone analyzed
    at.switch_page("views/stragglers.py").run()  # a page that needs the analysis makes it
    assert not at.exception and data.open_store(source) is not None


@pytest.mark.parametrize("spoil", ["new events", "status changed", "other version", "other analysis code",
                                   "other options", "corrupt file", "foreign schema", "another run's", "window only"])
def test_a_stale_or_corrupt_stored_summary_is_made_again_never_shown(tmp_path, monkeypatch, spoil):
    run = SyntheticRun(tmp_path / "r", num_ranks=4, straggler_rank=STRAGGLER_RANK)
    run.write_steps(30)
    run.finish()
    path = run.run_dir.resolve()
    stored = _stored_overview(path)
    file = path / summary_store.SUMMARY_FILE
    doc = json.loads(file.read_text())
    if spoil == "new events":
        from dtprobe.store.writer import RankWriter

        w = RankWriter(path, 1)
        w.write("faults", {"time_ns": run.t_ns, "step": 3, "kind": "restart", "injected": False, "detail": "{}"})
        w.close()
    elif spoil == "status changed":
        from dtprobe.store.manifest import set_status

        time.sleep(0.01)
        set_status(path, "crashed")
    elif spoil == "other version":
        doc["key"]["dtprobe_version"] = "0.0.1"
    elif spoil == "other analysis code":         # e.g. made before a detector was added, same version number
        assert doc["key"]["analysis_code"] == summary_store.analysis_code()
        doc["key"]["analysis_code"] = "0" * 32
    elif spoil == "other options":
        doc["key"]["options"]["window_steps"] += 1
    elif spoil == "corrupt file":
        file.write_text(file.read_text()[:200])
    elif spoil == "foreign schema":
        doc["schema"] = "dtprobe.summary/0"
    elif spoil == "another run's":
        doc["path"] = str(tmp_path / "elsewhere")
    elif spoil == "window only":
        doc["overview"]["whole"] = False
    if spoil in ("other version", "other analysis code", "other options", "foreign schema", "another run's",
                 "window only"):
        file.write_text(json.dumps(doc))
    spoiled = file.read_bytes()
    assert summary_store.load(path) is None
    shown = data.load_overview(resolve_choice(tmp_path, "r"))
    assert "from the stored summary" not in {f.title for f in shown.findings}
    fresh = ov.summarize(RunAnalysis.open(path), path=str(path))
    assert shown.findings == fresh.findings and shown.num_steps == fresh.num_steps == 30
    assert summary_store.load(path) == shown  # what the dashboard made is kept for the next start ...
    assert file.read_bytes() == spoiled  # ... in the per-user cache: the dashboard only reads run folders
    assert stored.findings[0].title == "from the stored summary"


def test_trace_folders_summary_is_stored_in_the_per_user_cache_not_beside_the_traces(user_cache):
    traces = DLRM
    before = sorted(p.name for p in traces.iterdir())
    first = data.load_overview(resolve_choice(traces, "."))
    assert sorted(p.name for p in traces.iterdir()) == before  # nothing written into the trace folder
    cached = list((user_cache / "dtprobe" / "summaries").glob("*.json"))
    assert len(cached) == 1 and json.loads(cached[0].read_text())["path"] == str(traces.resolve())
    data.clear()
    assert data.load_overview(resolve_choice(traces, ".")) == first and data.open_store(
        resolve_choice(traces, ".")) is None  # read back without parsing the traces


def test_a_running_run_has_no_stored_summary(tmp_path, user_cache):
    run = SyntheticRun(tmp_path / "live", num_ranks=2)
    run.write_steps(5)
    overview = data.load_overview(resolve_choice(tmp_path, "live"))
    assert overview.num_steps == 5 and summary_store.load(run.run_dir) is None
    assert summary_store.store(run.run_dir, overview, key=summary_store.key_of(run.run_dir)) is None
    assert not user_cache.exists() and not (run.run_dir / summary_store.SUMMARY_FILE).exists()


def test_compact_command_stores_a_finished_runs_summary(tmp_path, capsys):
    from dtprobe.cli import main

    run = write_synthetic_run(tmp_path / "r", num_ranks=4, num_steps=30, straggler_rank=STRAGGLER_RANK)
    assert main(["compact", str(run)]) == 0
    assert "Stored its summary (1 findings)" in capsys.readouterr().out
    stored = summary_store.load(run)
    assert stored is not None and [f.code for f in stored.findings] == ["STRAGGLER"]
    assert stored == dataclasses.replace(ov.summarize(RunAnalysis.open(run), path=str(run.resolve())),
                                         made_s=stored.made_s)
    live = SyntheticRun(tmp_path / "live", num_ranks=2)
    live.write_steps(3)
    assert main(["compact", str(live.run_dir)]) == 0
    assert not (live.run_dir / summary_store.SUMMARY_FILE).exists()  # a running run has none


# ------------------------------------------------------------------------------------------------ run choice


def test_run_choice_refuses_traversal_absolute_paths_and_symlinks_out(tmp_path):
    root = tmp_path / "root"
    write_synthetic_run(root / "ok", num_ranks=2, num_steps=2)
    outside = write_synthetic_run(tmp_path / "outside", num_ranks=2, num_steps=2)
    (root / "escape").symlink_to(outside, target_is_directory=True)
    assert resolve_choice(root, "ok").path == (root / "ok").resolve()
    for bad in ["../outside", str(outside), "/etc", "ok/../../outside", "escape", "", ".."]:
        with pytest.raises(ConfigError, match="refused"):
            resolve_choice(root, bad)
    assert [s.name for s in list_sources(root)] == ["ok"]  # the symlink is never offered


@pytest.mark.parametrize("bad", ["../outside", "/etc", "escape"])
def test_url_run_parameter_out_of_the_root_is_refused_on_the_page(tmp_path, monkeypatch, bad):
    root = tmp_path / "root"
    write_synthetic_run(root / "ok", num_ranks=2, num_steps=3)
    outside = write_synthetic_run(tmp_path / "outside", num_ranks=2, num_steps=3)
    (root / "escape").symlink_to(outside, target_is_directory=True)
    at = app(root, monkeypatch, run=bad)
    assert not at.exception
    assert any("refused" in e.value for e in at.sidebar.error)
    assert at.sidebar.selectbox(key="run").value == "ok"
    assert at.sidebar.selectbox(key="run").options == ["ok"]
    assert at.query_params["run"] == ["ok"] or at.query_params["run"] == "ok"


def test_run_picker_is_drawn_also_when_the_page_stops_on_unreadable_data(tmp_path, monkeypatch):
    root = tmp_path / "root"
    write_synthetic_run(root / "ok", num_ranks=2, num_steps=3)
    broken = root / "broken"
    shutil.copytree(root / "ok", broken)
    (broken / "ranks" / "rank00001.json").unlink()  # unreadable: the page stops with an error
    at = app(root, monkeypatch, run="broken")
    assert any("Cannot read broken" in e.value for e in at.error)
    assert sorted(at.sidebar.selectbox(key="run").options) == ["broken", "ok"]  # drawn although the page stopped
    at.sidebar.selectbox(key="run").set_value("ok").run()  # the user can still pick another run
    assert not at.exception and not at.error and at.query_params["run"] in ("ok", ["ok"])
    assert at.sidebar.selectbox(key="run").value == "ok"
    assert at.title[0].value == "Overview" and at.metric  # the other run's Overview


def test_dashboard_without_root_says_how_to_start_it(monkeypatch):
    at = AppTest.from_file(str(APP), default_timeout=60).run()
    assert not at.exception
    assert "dtprobe dashboard ROOT" in at.error[0].value


# ------------------------------------------------------------------------------------------------ export, command


def test_chart_exports_a_png(straggler_root):
    steps = RunAnalysis.open(straggler_root / "dp4_clean").table("steps")
    try:
        png = export.figure_png(charts.step_time_by_rank(steps), width=800)
    finally:
        export.stop()
    assert png[:8] == export.PNG_MAGIC
    assert int.from_bytes(png[16:20], "big") == 800  # IHDR width


def test_dashboard_command_passes_safe_server_flags():
    from dtprobe.commands.dashboard import streamlit_argv

    argv = streamlit_argv(host="127.0.0.1", port=8599)
    flags = {argv[i]: argv[i + 1] for i in range(len(argv) - 1) if argv[i].startswith("--")}
    assert flags["--server.address"] == "127.0.0.1"
    assert flags["--browser.gatherUsageStats"] == "false"
    assert flags["--client.showErrorDetails"] == "type"
    assert "--server.allowedHosts" in argv


def test_dashboard_command_rejects_a_missing_root(tmp_path, capsys):
    from dtprobe.cli import main

    assert main(["dashboard", str(tmp_path / "nope")]) == 2
    assert "is not a directory" in capsys.readouterr().err


@pytest.mark.parametrize("flag,value,match", [("--live-window", "-1", "--live-window -1 is negative"),
                                              ("--refresh-s", "0", "--refresh-s 0.0 must be a positive")])
def test_dashboard_command_rejects_bad_live_settings(tmp_path, capsys, flag, value, match):
    from dtprobe.cli import main

    assert main(["dashboard", str(tmp_path), flag, value]) == 2
    assert match in capsys.readouterr().err


def test_dashboard_server_command_is_streamlit_run_of_the_app_through_the_serve_entry_point():
    from dtprobe.commands.dashboard import streamlit_argv

    argv = streamlit_argv(host="127.0.0.1", port=8599)
    assert argv[:5] == [sys.executable, "-m", "dtprobe.dashboard.serve", "run", str(APP)]


def test_server_loads_the_overview_of_the_run_the_picker_shows_first_while_it_starts(tmp_path, monkeypatch):
    from dtprobe.dashboard import serve

    old = SyntheticRun(tmp_path / "old", num_ranks=2)
    old.write_steps(4)
    os.utime(old.run_dir, (1, 1))
    new = SyntheticRun(tmp_path / "new", num_ranks=2)
    new.write_steps(4)
    monkeypatch.setenv(ROOT_ENV, str(tmp_path))
    serve._warm_first_page()
    assert data.open_store(resolve_choice(tmp_path, "new")) is not None  # analyzed, in the pages' shared cache
    assert data.open_store(resolve_choice(tmp_path, "old")) is None
    monkeypatch.setenv(ROOT_ENV, str(tmp_path / "missing"))
    serve._warm_first_page()  # the page says what is wrong with the root


def test_dashboard_command_stops_its_server_when_sent_sigterm(tmp_path, free_port, child_env):
    import psutil

    port = free_port()
    servers = []
    log = tmp_path / "dashboard.log"
    with open(log, "w") as out:  # `timeout` bounds the command should this test fail to stop it
        outer = subprocess.Popen(["timeout", "120", sys.executable, "-m", "dtprobe.cli", "dashboard", str(tmp_path),
                                  "--port", str(port)], env=child_env(), stdout=out, stderr=subprocess.STDOUT,
                                 start_new_session=True)
    try:
        deadline = time.monotonic() + 90
        while True:
            assert outer.poll() is None, log.read_text()
            try:
                if urllib.request.urlopen(f"http://127.0.0.1:{port}/_stcore/health", timeout=2).read() == b"ok":
                    break
            except OSError:
                pass
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.2)
        command = psutil.Process(outer.pid).children()[0]  # `dtprobe dashboard` itself
        servers = command.children()
        assert len(servers) == 1 and "dtprobe.dashboard.serve" in servers[0].cmdline()
        os.kill(command.pid, signal.SIGTERM)  # as a supervisor stops it: this process only
        assert outer.wait(30) == 0, log.read_text()  # the command returned 0, as after Ctrl-C
        _, alive = psutil.wait_procs(servers, timeout=15)
        assert not alive, f"the server outlived the command: {alive}"
        with socket.socket() as s:  # nothing listens on the port any more (TIME_WAIT of the probes aside)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind(("127.0.0.1", port))
            s.listen()
    finally:  # only what this test started, by PID
        started = servers + (psutil.Process(outer.pid).children(recursive=True) if outer.poll() is None else [])
        for proc in started:
            if proc.is_running():
                proc.kill()
        if outer.poll() is None:
            outer.kill()
            outer.wait(10)


def test_devices_page_plots_the_cpu_time_each_rank_used_and_lost_per_step(tmp_path, monkeypatch):
    from dtprobe.synthetic import MS, T0, lockstep_tables, write_rows_run

    rows = lockstep_tables(world=2, num_steps=20, step_ms=100.0)
    wait_share, throttle_share, busy_share = {0: 0.04, 1: 0.4}, {0: 0.0, 1: 0.1}, {0: 1.5, 1: 0.5}
    for row in rows["devices"]:                 # the kernel's counters, growing at each rank's own rate
        elapsed = row["time_ns"] - T0
        row["cpu_wait_ns"] = 5 * MS + int(wait_share[row["rank"]] * elapsed)
        row["cpu_throttled_ns"] = int(throttle_share[row["rank"]] * elapsed)
        row["cpu_time_ns"] = 20 * MS + int(busy_share[row["rank"]] * elapsed)
    at = app(write_rows_run(tmp_path / "lost_cpu", rows, world_size=2, status="finished"), monkeypatch)
    at.switch_page("views/devices.py").run()
    assert not at.exception, [e.message for e in at.exception]
    series = at.selectbox(key="devices_series")
    assert {"CPU throttled by its quota (share of the step)",
            "main thread waiting for a CPU (share of the step)"} <= set(series.options)
    for column, share, unit in (("cpu_wait_frac", wait_share, "share of the step"),
                                ("cpu_throttled_frac", throttle_share, "share of the step"),
                                ("cpu_busy_frac", busy_share, "cores' worth over the step")):
        series.set_value(column).run()
        chart = figures(at)["devices_series_chart"]
        assert unit in chart["layout"]["title"]["text"]
        got = {int(trace["name"].split()[-1]): _plotly_values(trace["y"]) for trace in chart["data"]}
        assert sorted(got) == [0, 1]
        for rank, values in got.items():
            assert len(values) == 20 and values == pytest.approx([share[rank]] * 20), (column, rank)


def _plotly_values(values) -> list[float]:
    """A plotly figure JSON's array: a list, or a typed array ``{"dtype", "bdata"}`` (base64 of the raw values)."""
    if isinstance(values, dict):
        return np.frombuffer(base64.b64decode(values["bdata"]), dtype=values["dtype"]).tolist()
    return list(values)
