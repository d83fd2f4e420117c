"""The dashboard at 1,024 ranks (issue 17, item 4): what a page draws is bounded whatever the number of ranks
(per-rank bars binned into at most 64 blocks, the bandwidth box plot drawn from per-group quartiles, tables cut to
1,000 rows, the Timeline's default ranks the named and the slowest), large groups are named by axis and size, never
by their members; small runs are drawn as before. Asserted on the figure objects, never on time."""

from __future__ import annotations

import base64
import json
import re
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import streamlit
from streamlit.testing.v1 import AppTest

from dtprobe import summary_store
from dtprobe.analysis.facade import RunAnalysis
from dtprobe.dashboard import charts, common, data
from dtprobe.dashboard.paths import ROOT_ENV
from dtprobe.synthetic import SyntheticRun

REPO = Path(__file__).resolve().parents[1]
APP = REPO / "dashboard" / "app.py"
RANKS = 1024
TP = 8
STRAGGLER = 700


def _tp_dp_groups(world: int = RANKS) -> list[tuple[str, list[int]]]:
    tp = [("tp", list(range(n * TP, (n + 1) * TP))) for n in range(world // TP)]
    dp = [("dp", list(range(local, world, TP))) for local in range(TP)]
    return tp + dp


def _bandwidth_rows(world: int = RANKS, per_group: int = 40) -> pd.DataFrame:
    """``collective_bandwidth``-like rows: ``per_group`` collectives per group, dp 4x slower than tp."""
    rows = []
    for pg, members in _tp_dp_groups(world):
        base = 100e9 if pg == "tp" else 25e9
        for i in range(per_group):
            rows.append({"pg": pg, "pg_ranks": ",".join(map(str, members)), "op": "allgather",
                         "busbw_bytes_per_s": base * (1 + 0.01 * (i % 5))})
    return pd.DataFrame(rows)


# ------------------------------------------------------------------------------------------------ chart builders


def test_bandwidth_by_group_at_1024_ranks_draws_one_box_per_group_axis_from_quartiles():
    bw = _bandwidth_rows()
    assert len(bw) > charts.BOX_MAX_POINTS
    fig = charts.bandwidth_by_group(bw)
    [box] = fig.data                                            # one op
    assert list(box.x) == ["dp: 8 group(s) of 128 ranks", "tp: 128 group(s) of 8 ranks"]
    assert box.y is None                                        # quartiles, not one point per collective
    assert list(box.median) == pytest.approx([25.5, 102.0])     # GB/s: the middle of the 1.00..1.04 jitter
    assert list(box.q1) == pytest.approx([25.25, 101.0]) and list(box.q3) == pytest.approx([25.75, 103.0])
    assert len(fig.to_json()) < 10_000


def test_bandwidth_by_group_names_a_few_large_groups_by_size_and_first_rank_and_small_ones_by_members():
    few = _bandwidth_rows(world=256)
    few = few[few["pg"] == "dp"]                                # 8 dp groups of 32 ranks: each its own box
    labels = sorted(charts.group_labels(few).unique())
    assert labels[:2] == ["dp group of 32 ranks from rank 0", "dp group of 32 ranks from rank 1"]
    assert len(labels) == 8
    small = pd.DataFrame({"pg": ["0"] * 6, "pg_ranks": ["0,1,2,3"] * 6, "op": ["allreduce"] * 6,
                          "busbw_bytes_per_s": np.linspace(1e9, 2e9, 6)})
    fig = charts.bandwidth_by_group(small)                      # a small run: every collective, as before
    assert list(fig.data[0].x) == ["0 [0,1,2,3]"] * 6 and len(fig.data[0].y) == 6


def test_a_table_names_its_groups_by_axis_and_size_not_by_members():
    rows = _bandwidth_rows(world=RANKS, per_group=1)
    rows = rows[rows["pg"] == "dp"].assign(rank=range(8))        # 8 dp groups of 128 ranks
    shown = charts.named_groups(rows)
    assert list(shown.columns) == ["pg", "group", "op", "busbw_bytes_per_s", "rank"]
    assert list(shown["group"]) == [f"dp group of 128 ranks from rank {r}" for r in range(8)]
    one = charts.named_groups(rows.iloc[[3]])
    assert list(one["group"]) == ["dp group of 128 ranks"]
    small = pd.DataFrame({"pg": ["0"], "pg_ranks": ["0,1,2,3"], "rank": [1]})
    assert list(charts.named_groups(small)["group"]) == ["0 [0,1,2,3]"]
    assert charts.named_groups(small[["rank"]]).equals(small[["rank"]])


def test_group_labels_of_the_stores_category_members_with_a_null_row():
    # The store gives pg_ranks as a category column; a row without members (a version-1 run) must not raise
    rows = pd.DataFrame({"pg": ["dp", "dp", "tp"], "pg_ranks": pd.Series(["0,1", None, "0,2"], dtype="category")})
    assert list(charts.group_labels(rows)) == ["dp [0,1]", "dp []", "tp [0,2]"]
    assert list(charts.group_labels(rows.astype({"pg_ranks": object}))) == ["dp [0,1]", "dp []", "tp [0,2]"]


def _per_rank(world: int, late: int) -> pd.DataFrame:
    ranks = np.arange(world)
    exposed = np.full(world, 0.10)
    exposed[late] = 0.90
    return pd.DataFrame({"rank": ranks, "comm_frac": 0.5 + 0 * exposed, "exposed_frac": exposed / 2,
                         "straggler_wait_frac": np.zeros(world), "overlap_frac": 1 - exposed})


def test_per_rank_bars_at_1024_ranks_are_64_blocks_of_16_holding_the_mean():
    df = _per_rank(RANKS, late=STRAGGLER)
    fig = charts.exposure_by_rank(df)
    assert [len(t.x) for t in fig.data] == [64, 64, 64]
    assert fig.data[0].x[0] == "ranks 0-15" and fig.data[0].x[-1] == "ranks 1008-1023"
    block = STRAGGLER // 16                                     # the late rank's block: its mean, not a rank's value
    assert fig.data[0].y[block] == pytest.approx((15 * 0.05 + 0.45) / 16)
    assert fig.data[0].y[0] == pytest.approx(0.05)
    assert "mean of each block of 16 ranks" in fig.layout.title.text
    overlap = charts.overlap_by_rank(df)
    assert len(overlap.data[0].x) == 64 and overlap.data[0].y[block] == pytest.approx((15 * 0.9 + 0.1) / 16)
    waits = pd.DataFrame({"rank": np.repeat(np.arange(RANKS), 3), "wait_ns": np.tile([1e6, 2e6, 3e6], RANKS)})
    victims = charts.victims_wait(waits)
    assert len(victims.data[0].x) == 64 and list(victims.data[0].y) == pytest.approx([2.0] * 64)


def test_victims_chart_at_1024_ranks_is_the_mean_straggler_wait_per_step_of_64_rank_blocks():
    ranks = np.repeat(np.arange(RANKS), 2)
    wait = np.tile([1e6, 3e6], RANKS)                           # 2 ms per step on average
    wait[ranks == STRAGGLER] = 0.0                              # the late rank itself does not wait
    exposure = pd.DataFrame({"rank": ranks, "step": np.tile([0, 1], RANKS), "straggler_wait_ns": wait})
    fig = charts.straggler_wait(exposure, clock="device")
    [bars] = fig.data
    assert len(bars.x) == 64 and bars.x[0] == "ranks 0-15"
    block = STRAGGLER // 16
    assert bars.y[block] == pytest.approx(15 * 2.0 / 16) and bars.y[0] == pytest.approx(2.0)
    assert fig.layout.yaxis.title.text == "mean wait for the latest arrival per step (ms, device clock)"
    assert "mean of each block of 16 ranks" in fig.layout.title.text


def test_per_rank_bars_of_a_small_run_are_one_per_rank():
    df = _per_rank(16, late=3)
    fig = charts.exposure_by_rank(df)
    assert list(fig.data[0].x) == [f"rank {r}" for r in range(16)]
    assert fig.data[0].y[3] == pytest.approx(0.45)
    assert "block" not in fig.layout.title.text
    assert len(charts.overlap_by_rank(_per_rank(64, late=3)).data[0].x) == 64  # 64 ranks: still one bar each


def test_device_series_at_1024_ranks_draws_the_spread_and_the_ranks_furthest_from_the_median():
    ranks, steps = np.repeat(np.arange(RANKS), 4), np.tile(np.arange(4), RANKS)
    temp = 60.0 + steps                                         # every rank 60..63 °C
    temp[ranks == STRAGGLER] += 20.0                            # one hot rank, one a bit warm
    temp[ranks == 5] += 3.0
    devices = pd.DataFrame({"rank": ranks, "step": steps, "temp_c": temp})
    fig = charts.device_series(devices, column="temp_c", label="temperature (°C)", outliers=2)
    assert [t.name for t in fig.data][1:] == ["min-max over ranks", "median over ranks", f"rank {STRAGGLER}",
                                              "rank 5"]
    assert list(fig.data[0].y) == [80.0, 81.0, 82.0, 83.0] and list(fig.data[1].y) == [60.0, 61.0, 62.0, 63.0]
    assert list(fig.data[2].y) == [60.0, 61.0, 62.0, 63.0]
    assert fig.layout.title.text == "temperature (°C) over 1024 ranks (the 2 furthest from the median drawn)"
    few = charts.device_series(devices[devices["rank"] < 4], column="temp_c", label="t")
    assert sorted(t.name for t in few.data) == [f"rank {r}" for r in range(4)]     # a line per rank, as before


def test_checkpoint_times_at_1024_ranks_show_the_slowest_and_mean_rank_per_event_not_a_panel_per_rank():
    ranks = np.tile(np.arange(RANKS), 2)
    blocking = np.full(2 * RANKS, 100e6)
    blocking[RANKS + STRAGGLER] = 900e6                         # the second save: one rank blocks 900 ms
    ckpt = pd.DataFrame({"rank": ranks, "step": np.repeat([10, 20], RANKS), "kind": "save",
                         "blocking_ns": blocking, "async_ns": np.full(2 * RANKS, 50e6)})
    fig = charts.checkpoint_times(ckpt)
    assert [t.name for t in fig.data] == ["blocking, slowest rank", "blocking, mean over ranks", "async, slowest rank"]
    assert list(fig.data[0].x) == ["save @ step 10", "save @ step 20"]
    assert list(fig.data[0].y) == pytest.approx([100.0, 900.0])
    assert list(fig.data[1].y) == pytest.approx([100.0, 100.0 + 800.0 / RANKS])
    assert "over 1024 ranks" in fig.layout.title.text and not fig.layout.annotations     # no facet titles
    small = charts.checkpoint_times(ckpt[ckpt["rank"] < 2])
    assert len(small.layout.annotations) == 2                   # a panel per rank up to a few ranks


def test_pipeline_gantt_of_1024_ranks_draws_the_lowest_rank_of_each_stage():
    stages, mbs = 4, 2
    rank = np.repeat(np.arange(RANKS), 2 * mbs)                 # rank r is stage r % 4 of pipeline r // 4
    start = np.tile(np.arange(2 * mbs), RANKS) * 10_000_000
    pipe = pd.DataFrame({"rank": rank, "stage": rank % stages, "step": 0, "microbatch": np.tile([0, 1, 0, 1], RANKS),
                         "action": np.tile(["F", "F", "B", "B"], RANKS), "start_ns": start,
                         "end_ns": start + 9_000_000})
    fig = charts.pipeline_gantt(pipe)
    assert list(fig.layout.yaxis.categoryarray) == [f"stage {s} (rank {s})" for s in range(stages)][::-1]
    assert sum(len(t.x) for t in fig.data) == stages * 2 * mbs
    assert fig.layout.title.text.endswith("the lowest rank of each stage, of 1024 ranks")


def test_temporal_breakdown_and_bubble_at_1024_ranks_are_64_blocks():
    idle = np.full(RANKS, 0.1)
    idle[STRAGGLER] = 0.9
    temporal = pd.DataFrame({"rank": np.arange(RANKS), "idle_frac": idle, "compute_frac": 1 - idle,
                             "non_compute_frac": 0.0})
    fig = charts.temporal_breakdown(temporal)
    assert [len(t.x) for t in fig.data] == [64, 64, 64]
    assert fig.data[2].y[STRAGGLER // 16] == pytest.approx((15 * 0.1 + 0.9) / 16)
    bubble = charts.bubble_measured_vs_ideal(pd.DataFrame({"rank": np.arange(RANKS), "bubble_frac": idle}),
                                             ideal_frac=0.1)
    assert len(bubble.data[0].x) == 64 and "mean of each block of 16 ranks" in bubble.layout.title.text


def test_a_finding_card_names_many_ranks_by_count_and_range():
    assert common.ranks_text([3, 1]) == "3, 1"
    assert common.ranks_text([]) == "-"
    assert common.ranks_text(range(RANKS)) == "1024 ranks (0-1023)"


def _timeline_module():
    """The Timeline page's functions without running the page (its last lines draw it)."""
    source = (REPO / "dashboard/views/timeline.py").read_text()
    namespace: dict = {}
    exec(compile(source.split("\nsource = common.page_setup")[0], "timeline.py", "exec"), namespace)
    return namespace


def test_timeline_default_ranks_bounded_and_chosen_by_what_matters():
    tl = _timeline_module()
    ranks = np.repeat(np.arange(RANKS), 3)
    start = np.tile([0, 100, 200], RANKS) * 1_000_000
    dur = np.full(len(ranks), 90_000_000)
    dur[ranks == 900] = 99_000_000                              # the slowest two ranks
    dur[ranks == 17] = 98_000_000
    steps = pd.DataFrame({"rank": ranks, "step": np.tile([0, 1, 2], RANKS), "start_ns": start,
                          "end_ns": start + dur})
    chosen = tl["default_ranks"](steps, [5], [700])
    assert len(chosen) == tl["MAX_RANKS"]
    assert {5, 700, 900, 17} <= set(chosen) and chosen == sorted(chosen)
    small = steps[steps["rank"] < 40]                           # up to 64 ranks: as before (marked + lowest)
    assert tl["default_ranks"](small, [30], [17]) == sorted({30, *range(15)})
    assert tl["default_ranks"](steps[steps["rank"] < 8], [], []) == list(range(8))


# ------------------------------------------------------------------------------------------------ every page


@pytest.fixture(scope="module")
def big_root(tmp_path_factory) -> Path:
    """A finished 1,024-rank x 6-step data-parallel run (one group of every rank, a straggler) and an 8-rank one."""
    root = tmp_path_factory.mktemp("runs1024")
    run = SyntheticRun(root / "r1024", num_ranks=RANKS, straggler_rank=STRAGGLER)
    run.write_steps(6)
    run.finish()
    small = SyntheticRun(root / "r8", num_ranks=8)            # what the Compare page puts beside it
    small.write_steps(6)
    small.finish()
    summary_store.make(root / "r8")
    return root


def _no_findings(self):
    raise AssertionError("a page of a finished run made the analysis find every finding")


@pytest.fixture(autouse=True)
def _fresh(monkeypatch, tmp_path):
    streamlit.config.set_option("client.showErrorDetails", "full")
    streamlit.cache_data.clear()
    data.clear()
    monkeypatch.setenv(summary_store.CACHE_ENV, str(tmp_path / "user-cache"))


LONG_LIST = re.compile(r"\d+(?:\s*,\s*\d+){16,}")
"""17 or more comma-separated integers: a listed group or set of ranks."""


def _texts(at: AppTest) -> list[str]:
    parts = [m.value for m in at.markdown] + [c.value for c in at.caption] + [t.value for t in at.title]
    parts += [h.value for h in (*at.header, *at.subheader)]
    parts += [e.value for e in (*at.info, *at.error, *at.warning, *at.success)]
    return [str(p) for p in parts]


def _size(values) -> int:
    """Values in a plotly figure's JSON: a list, or a typed array ``{"dtype", "bdata", "shape"}``."""
    if isinstance(values, dict):
        if values.get("shape"):
            return int(np.prod([int(n) for n in str(values["shape"]).split(",")]))
        return np.frombuffer(base64.b64decode(values["bdata"]), dtype=values["dtype"]).size
    if values and isinstance(values[0], list):
        return len(values) * len(values[0])
    return len(values or [])


def _figure_texts(spec: dict) -> list[str]:
    layout = spec.get("layout", {})
    texts = [json.dumps(layout.get("title", ""))]
    texts += [json.dumps(v.get("title", "")) for k, v in layout.items() if k.startswith(("xaxis", "yaxis"))]
    for trace in spec["data"]:
        texts.append(str(trace.get("name", "")))
        for axis in ("x", "y"):
            values = trace.get(axis)
            if isinstance(values, list) and values and isinstance(values[0], str):
                texts += values
    return texts


PAGES_AT_SCALE = ["overview", "stragglers", "timeline", "communication", "pipeline", "precision", "checkpoints",
                  "devices", "kernels", "compare"]


def test_every_page_renders_a_1024_rank_run_bounded_and_without_listing_the_group(big_root, monkeypatch):
    # one session over every page, as a user's: the run is analyzed once
    monkeypatch.setenv(ROOT_ENV, str(big_root))
    at = AppTest.from_file(str(APP), default_timeout=240)
    at.query_params["run"] = "r1024"
    at.run()
    # a finished run's page asks only for what it draws: every finding is read from the stored Overview
    monkeypatch.setattr(RunAnalysis, "findings", _no_findings)
    for page in PAGES_AT_SCALE:
        if page != "overview":
            at.switch_page(f"views/{page}.py").run()
        _check_page_at_scale(at, page)


def _check_page_at_scale(at: AppTest, page: str) -> None:
    assert not at.exception, (page, [e.message for e in at.exception])
    assert at.title[0].value == page.capitalize()
    texts = _texts(at)
    if page in ("overview", "stragglers"):
        assert any("STRAGGLER" in t for t in texts)
    for spec in (json.loads(el.proto.spec) for el in at.get("plotly_chart")):
        assert len(spec["data"]) <= 16, (page, spec["layout"].get("title"))
        for trace in spec["data"]:
            z = trace.get("z")
            cells = _size(z) if z is not None else _size(trace.get("x") or trace.get("q1"))
            bound = charts.HEATMAP_MAX_ROWS * charts.HEATMAP_MAX_COLS if z is not None else 10_000
            assert cells <= bound, (page, spec["layout"].get("title"), trace.get("name"))
        texts += _figure_texts(spec)
    for text in texts:
        assert not LONG_LIST.search(text), (page, text[:300])
    for frame in at.dataframe:          # tables too, the findings' evidence rows among them
        assert len(frame.value) <= common.MAX_TABLE_ROWS, page
        for cell in map(str, frame.value.to_numpy().ravel()):
            assert not LONG_LIST.search(cell), (page, list(frame.value.columns), cell[:300])
    if page == "stragglers":   # the culprit's evidence rows first, of its whole group's
        evidence = at.dataframe[0].value
        assert len(evidence) == common.MAX_TABLE_ROWS and evidence["rank"].iloc[0] == STRAGGLER
    if page == "timeline":
        [ranks] = [w for w in at.multiselect if w.key == "timeline_ranks"]
        assert len(ranks.value) == 16 and STRAGGLER in ranks.value
    if page == "communication":
        assert [c.key for c in at.get("plotly_chart")][:2] == ["comm_bw_size", "comm_bw_group"]
    if page == "devices":
        [chart] = [json.loads(el.proto.spec) for el in at.get("plotly_chart") if el.key == "devices_series_chart"]
        assert "over 1024 ranks" in chart["layout"]["title"]["text"]
        assert [len(frame.value) for frame in at.dataframe] == [common.MAX_WORST_ROWS]
    if page == "compare":
        [table] = [frame.value for frame in at.dataframe]
        assert list(table["run"]) == ["r1024", "r8"] and list(table["ranks"]) == [RANKS, 8]


def test_a_timeline_of_thousands_of_collectives_draws_them_as_segments_of_one_line():
    ranks, steps, per_step = 16, 4, 100
    rank, step, k = (a.ravel() for a in np.meshgrid(np.arange(ranks), np.arange(steps), np.arange(per_step),
                                                    indexing="ij"))
    start = (step * 1000 + k * 5).astype("int64") * 1_000_000
    coll = pd.DataFrame({"rank": rank, "step": step, "enqueue_ns": start, "end_ns": start + 2_000_000,
                         "op": "allgather", "pg": "dp", "seq": k, "num_bytes": 1024})
    s_rank, s_step = (a.ravel() for a in np.meshgrid(np.arange(ranks), np.arange(steps), indexing="ij"))
    stp = pd.DataFrame({"rank": s_rank, "step": s_step, "start_ns": s_step * 1_000_000_000,
                        "end_ns": s_step * 1_000_000_000 + 900_000_000, "data_ns": 100_000_000,
                        "fwd_ns": 300_000_000, "bwd_ns": 400_000_000, "opt_ns": 100_000_000})
    fig = charts.timeline(stp, coll, pd.DataFrame(columns=["rank", "start_ns", "end_ns", "action", "microbatch",
                                                           "stage"]))
    [comm] = [t for t in fig.data if t.name == "comm"]
    assert comm.type == "scatter" and len(comm.x) == 3 * ranks * steps * per_step
    assert comm.x[0] == 0.0 and comm.x[1] == 2.0 and np.isnan(comm.x[2])     # ms since the window's start
    assert comm.x.dtype == np.float32 and comm.hovertext[1] == comm.hovertext[0] and comm.hovertext[2] is None
    assert all(t.type == "bar" and len(t.x) == ranks * steps for t in fig.data if t.name != "comm")
    few = charts.timeline(stp, coll[coll["seq"] < 2], stp.iloc[:0].reindex(columns=["rank", "start_ns", "end_ns",
                                                                                      "action", "microbatch", "stage"]))
    assert [t.type for t in few.data if t.name == "comm"] == ["bar"]           # few collectives: a bar each


def test_a_timeline_merges_a_rows_collectives_closer_than_a_pixel():
    # 4 ranks x 1,000 collectives of 1 ms, 10 µs apart in two bursts per rank (a 50 ms pause between): a pixel of a
    # ~2 s window is ~1 ms, so each burst is one segment; the bursts stay apart
    ranks, per_burst = 4, 500
    rank = np.repeat(np.arange(ranks), 2 * per_burst)
    k = np.tile(np.arange(2 * per_burst), ranks)
    start = (k * 1_010_000 + (k >= per_burst) * 50_000_000 + rank * 7_000).astype("int64")
    coll = pd.DataFrame({"rank": rank, "step": 0, "enqueue_ns": start, "end_ns": start + 1_000_000,
                         "op": "allreduce", "pg": "dp", "seq": k, "num_bytes": 64})
    no_rows = pd.DataFrame(columns=["rank", "start_ns", "end_ns", "action", "microbatch", "stage"])
    no_steps = pd.DataFrame(columns=["rank", "step", "start_ns", "end_ns", "data_ns", "fwd_ns", "bwd_ns", "opt_ns"])
    fig = charts.timeline(no_steps, coll, no_rows)
    [comm] = [t for t in fig.data if t.name == "comm"]
    assert len(comm.x) == 3 * ranks * 2                     # a segment per burst and rank
    t0 = start.min()
    for r in range(ranks):
        label = f"rank {r} comm"
        ends = [(comm.x[i], comm.x[i + 1]) for i in range(0, len(comm.x), 3) if comm.y[i].startswith(label)]
        mine = coll[coll["rank"] == r]
        bursts = [mine[mine["seq"] < per_burst], mine[mine["seq"] >= per_burst]]
        assert ends == [pytest.approx(((b["enqueue_ns"].min() - t0) / 1e6, (b["end_ns"].max() - t0) / 1e6), abs=1e-3)
                        for b in bursts]
    assert comm.hovertext[0] == "500 intervals from allreduce dp seq 0 64 B"
