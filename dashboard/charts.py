"""Pure chart builders: DataFrame in, plotly figure out (no streamlit, no I/O); drawn by the pages.

Times on chart axes are milliseconds; ranks are categorical ("rank 3") so plotly never interpolates them.
"""

from __future__ import annotations

import numpy as np
import pandas as pd
import plotly.express as px
import plotly.graph_objects as go

from dtprobe.analysis.tables import LISTED_MEMBERS_MAX, group_members, group_phrase, text_or
from dtprobe.dashboard.clocks import clock_words

PALETTE = ["#0068c9", "#83c9ff", "#ff2b2b", "#ffabab", "#29b09d", "#7defa1", "#ff8700", "#ffd16a", "#6d3fc0",
           "#d5dae5"]
"""Categorical colors of every chart (Streamlit's default chart palette): set on the traces themselves, so a
figure has the same colors on the page and in its PNG export whatever template draws it."""
SEVERITY_COLORS = {"critical": "#d62728", "warning": "#ff7f0e", "info": "#1f77b4"}
PHASE_COLORS = {"data": "#8c564b", "fwd": "#1f77b4", "bwd": "#ff7f0e", "opt": "#2ca02c", "step": "#c7c7c7",
                "comm": "#9467bd", "F": "#1f77b4", "B": "#ff7f0e", "W": "#2ca02c", "I": "#17becf"}
MARK_COLOR = "#d62728"
_MARGIN = dict(l=10, r=10, t=40, b=10)


def _layout(fig: go.Figure, title: str, *, height: int = 360) -> go.Figure:
    fig.update_layout(title=title, height=height, margin=_MARGIN, legend=dict(orientation="h", y=-0.2))
    return fig


def _rank_label(rank) -> str:
    return f"rank {int(rank)}"


MAX_RANK_BARS = 64
"""Per-rank bar charts draw at most this many bars: more ranks are binned into blocks of consecutive ranks."""


def rank_blocks(df: pd.DataFrame, columns: list[str]) -> tuple[pd.DataFrame, int]:
    """``df`` (one row per rank) with a ``rank`` label column: ``"rank 3"`` per rank up to ``MAX_RANK_BARS`` ranks;
    beyond that one row per block of consecutive ranks (``"ranks 0-15"``) holding the mean of ``columns``. Returns
    the frame and the block size (1: not binned)."""
    df = df.sort_values("rank")
    ranks = df["rank"].to_numpy(dtype="int64")
    block = -(-len(ranks) // MAX_RANK_BARS)
    if block <= 1:
        return df.assign(rank=df["rank"].map(_rank_label)), 1
    index = np.arange(len(ranks)) // block
    out = df[columns].astype("float64").groupby(index).mean()
    firsts, lasts = pd.Series(ranks).groupby(index).min(), pd.Series(ranks).groupby(index).max()
    out.insert(0, "rank", [f"ranks {a}-{b}" if a != b else _rank_label(a) for a, b in zip(firsts, lasts)])
    return out.reset_index(drop=True), block


def _binned_title(title: str, block: int) -> str:
    return title if block <= 1 else f"{title} (mean of each block of {block} ranks)"


def empty(title: str, message: str) -> go.Figure:
    """A blank figure that says why there is nothing to draw."""
    fig = go.Figure()
    fig.add_annotation(text=message, showarrow=False, x=0.5, y=0.5, xref="paper", yref="paper")
    fig.update_xaxes(visible=False)
    fig.update_yaxes(visible=False)
    return _layout(fig, title, height=200)


# ----------------------------------------------------------------------------------------------- steps


def step_time_by_rank(steps: pd.DataFrame, *, marked: list[int] | None = None) -> go.Figure:
    """Step duration (ms) per rank over the step axis; ``marked`` ranks drawn thick."""
    df = steps.dropna(subset=["start_ns", "end_ns"]).assign(
        step_ms=lambda d: (d["end_ns"] - d["start_ns"]).astype("float64") / 1e6,
        rank=lambda d: d["rank"].map(_rank_label))
    fig = px.line(df, color_discrete_sequence=PALETTE, x="step", y="step_ms", color="rank", markers=len(df) < 2000,
                  labels={"step_ms": "step time (ms)", "rank": ""})
    for trace in fig.data:
        if marked and trace.name in {_rank_label(r) for r in marked}:
            trace.line.width = 4
    return _layout(fig, "Step time by rank")


MAX_RANK_LINES = 8
"""Above this many ranks, step-time charts draw the spread over ranks and the slowest ranks, not a line each."""


def step_time_overview(steps: pd.DataFrame, *, marked: list[int] | None = None, slowest: int = 3) -> go.Figure:
    """Step duration (ms) over the step axis: a line per rank up to ``MAX_RANK_LINES`` ranks; beyond that the
    median over ranks, the min-max band, and the ``slowest`` ranks (by median step time) plus ``marked`` ranks as
    lines, so a 64-rank run stays readable and light to draw."""
    if steps["rank"].nunique() <= MAX_RANK_LINES:
        return step_time_by_rank(steps, marked=marked)
    df = steps.dropna(subset=["start_ns", "end_ns"]).assign(
        step_ms=lambda d: (d["end_ns"] - d["start_ns"]).astype("float64") / 1e6)
    by_rank = df.groupby("rank")["step_ms"].median().sort_values(ascending=False)
    fig = _spread_over_ranks(df, "step_ms", [*(marked or []), *by_rank.index[:slowest]], marked=marked)
    fig.update_xaxes(title="step")
    fig.update_yaxes(title="step time (ms)")
    return _layout(fig, f"Step time over {len(by_rank)} ranks (slowest {slowest} drawn)")


def _spread_over_ranks(df: pd.DataFrame, column: str, ranks: list, *, marked: list[int] | None = None) -> go.Figure:
    """``column`` (one row per rank and step) over the step axis as its median over ranks and min-max band, plus a
    line for each of ``ranks`` (``marked`` ones thick): a few traces whatever the number of ranks."""
    per_step = df.groupby("step")[column].agg(["min", "median", "max"]).reset_index()
    fig = go.Figure()
    fig.add_trace(go.Scatter(x=per_step["step"], y=per_step["max"], mode="lines", line=dict(width=0),
                             showlegend=False, hoverinfo="skip"))
    fig.add_trace(go.Scatter(x=per_step["step"], y=per_step["min"], mode="lines", line=dict(width=0),
                             fill="tonexty", fillcolor="rgba(31,119,180,0.18)", name="min-max over ranks"))
    fig.add_trace(go.Scatter(x=per_step["step"], y=per_step["median"], mode="lines", name="median over ranks",
                             line=dict(color="#1f77b4", width=2)))
    for rank in dict.fromkeys(ranks):
        one = df[df["rank"] == rank]
        fig.add_trace(go.Scatter(x=one["step"], y=one[column], mode="lines", name=_rank_label(rank),
                                 line=dict(width=4 if marked and rank in marked else 1.5)))
    return fig


def loss_curve(steps: pd.DataFrame, *, overflow_steps: list[int] | None = None) -> go.Figure:
    """Mean loss over ranks per step, with AMP overflow steps as red markers."""
    df = steps.dropna(subset=["loss"]).groupby("step", as_index=False)["loss"].mean()
    fig = px.line(df, color_discrete_sequence=PALETTE, x="step", y="loss", markers=len(df) < 500)
    if overflow_steps:
        hit = df[df["step"].isin(overflow_steps)]
        fig.add_trace(go.Scatter(x=hit["step"], y=hit["loss"], mode="markers", name="overflow (step skipped)",
                                 marker=dict(color=MARK_COLOR, size=11, symbol="x")))
    return _layout(fig, "Loss", height=320)


# ----------------------------------------------------------------------------------------------- timeline


GANTT_MAX_BARS = 2_000
"""Above this many intervals of one kind, a Gantt draws them as one thick line of segments (a single SVG path)
instead of a bar each: thousands of bars (16 ranks x 100 collectives x a few steps) take the browser seconds."""


GANTT_PIXELS = 2_000
"""Horizontal resolution a Gantt's segments are binned to: intervals of a row closer than 1/GANTT_PIXELS of the
window's span are one segment (no screen shows them apart), so a window change sends the screen, not every row."""


def _merged_by_pixel(grp: pd.DataFrame, *, resolution_ns: float) -> pd.DataFrame:
    """``grp``'s intervals with those of one row (``y``) that overlap or lie less than ``resolution_ns`` apart merged
    into one: its first start, last end and a label naming how many it holds and the first one's."""
    g = grp.sort_values(["y", "start_ns"], kind="stable")
    end = g["end_ns"].to_numpy(dtype="float64")
    reach = g.groupby("y", sort=False)["end_ns"].cummax().to_numpy(dtype="float64")
    start = g["start_ns"].to_numpy(dtype="float64")
    y = g["y"].to_numpy(dtype="object")
    begins = np.ones(len(g), dtype=bool)
    begins[1:] = (y[1:] != y[:-1]) | (start[1:] > reach[:-1] + resolution_ns)
    segment = np.cumsum(begins) - 1
    if begins.all():
        return g
    out = pd.DataFrame({"y": y[begins], "start_ns": start[begins],
                        "end_ns": np.maximum.reduceat(end, np.flatnonzero(begins))})
    count = np.bincount(segment)
    labels = g["label"].to_numpy(dtype="object")[begins]
    out["label"] = [lab if n == 1 else f"{n} intervals from {lab}" for n, lab in zip(count, labels)]
    return out


def _segments(grp: pd.DataFrame, *, t0: int, name: str) -> go.Scatter:
    """``grp``'s intervals as segments of one line trace (start, end, gap per interval), hover text on both ends;
    times as float32 ms since the window's start (1 µs resolution over 16 s, 0.25 ms over an hour) and no text at
    the gaps, so a window's figure is a quarter lighter to send and parse. Intervals of a row less than a pixel
    apart (``GANTT_PIXELS``) are drawn as one segment."""
    span = float(grp["end_ns"].max()) - float(grp["start_ns"].min())
    if span > 0:
        grp = _merged_by_pixel(grp, resolution_ns=span / GANTT_PIXELS)
    n = len(grp)
    x = np.full(3 * n, np.nan, dtype="float32")
    x[0::3] = (grp["start_ns"].to_numpy(dtype="float64") - t0) / 1e6
    x[1::3] = (grp["end_ns"].to_numpy(dtype="float64") - t0) / 1e6
    y = np.repeat(grp["y"].to_numpy(dtype="object"), 3)
    y[2::3] = None
    text = np.repeat(grp["label"].to_numpy(dtype="object"), 3)
    text[2::3] = None
    return go.Scatter(x=x, y=y, mode="lines", name=name, connectgaps=False, hovertext=text, hoverinfo="text+x",
                      line=dict(color=PHASE_COLORS.get(name), width=14))


def _bars(rows: pd.DataFrame, *, t0: int) -> go.Figure:
    """Horizontal Gantt bars: rows with y, start_ns, end_ns, kind, label (a kind with more than
    ``GANTT_MAX_BARS`` rows as line segments)."""
    fig = go.Figure()
    for kind, grp in rows.groupby("kind", sort=False):
        if len(grp) > GANTT_MAX_BARS:
            fig.add_trace(_segments(grp, t0=t0, name=str(kind)))
            continue
        fig.add_trace(go.Bar(
            y=grp["y"], x=(grp["end_ns"] - grp["start_ns"]).astype("float64") / 1e6,
            base=(grp["start_ns"] - t0).astype("float64") / 1e6, orientation="h", name=str(kind),
            marker_color=PHASE_COLORS.get(str(kind)), hovertext=grp["label"], hoverinfo="text+x"))
    fig.update_layout(barmode="overlay")
    fig.update_xaxes(title="time since window start (ms)")
    return fig


def timeline(steps: pd.DataFrame, collectives: pd.DataFrame, pipeline: pd.DataFrame, *,
             marked: list[int] | None = None) -> go.Figure:
    """Per-rank Gantt of steps split into phases, collectives and pipeline actions (already cut to a window)."""
    parts = []
    s = steps.dropna(subset=["start_ns", "end_ns"])
    if not s.empty:
        parts.append(pd.DataFrame({"y": s["rank"].map(_rank_label) + " steps", "start_ns": s["start_ns"],
                                   "end_ns": s["end_ns"], "kind": "step",
                                   "label": "step " + s["step"].astype(str)}))
        cursor = s["start_ns"].astype("float64")
        for phase in ("data", "fwd", "bwd", "opt"):
            dur = s[f"{phase}_ns"].astype("float64")
            ok = dur.notna() & (dur > 0)
            if ok.any():
                parts.append(pd.DataFrame({"y": s.loc[ok, "rank"].map(_rank_label) + " steps",
                                           "start_ns": cursor[ok], "end_ns": cursor[ok] + dur[ok], "kind": phase,
                                           "label": phase + " step " + s.loc[ok, "step"].astype(str)}))
            cursor = cursor + dur.fillna(0)
    c = collectives.dropna(subset=["enqueue_ns", "end_ns"])
    if not c.empty:
        parts.append(pd.DataFrame({"y": c["rank"].map(_rank_label) + " comm", "start_ns": c["enqueue_ns"],
                                   "end_ns": c["end_ns"], "kind": "comm",
                                   "label": c["op"].astype(str) + " " + c["pg"].astype(str) + " seq "
                                   + c["seq"].astype(str) + " " + c["num_bytes"].astype(str) + " B"}))
    p = pipeline.dropna(subset=["start_ns", "end_ns"])
    if not p.empty:
        parts.append(pd.DataFrame({"y": p["rank"].map(_rank_label) + " pipeline", "start_ns": p["start_ns"],
                                   "end_ns": p["end_ns"], "kind": p["action"].astype(str),
                                   "label": p["action"].astype(str) + " mb " + p["microbatch"].astype(str)
                                   + " stage " + p["stage"].astype(str)}))
    if not parts:
        return empty("Timeline", "No steps, collectives or pipeline actions in this window.")
    rows = pd.concat(parts, ignore_index=True)
    rows["rank_sort"] = rows["y"].str.extract(r"rank (\d+)")[0].astype(int)
    rows = rows.sort_values(["rank_sort", "y"], kind="stable")
    fig = _bars(rows, t0=int(rows["start_ns"].min()))
    order = list(dict.fromkeys(rows["y"]))
    fig.update_yaxes(categoryorder="array", categoryarray=order[::-1], autorange=True)
    _mark_rows(fig, [y for y in order if marked and int(y.split()[1]) in marked])
    return _layout(fig, "Timeline", height=max(300, 26 * len(order) + 120))


def _mark_rows(fig: go.Figure, labels: list[str]) -> None:
    for label in labels:
        fig.add_annotation(x=0, xref="paper", y=label, yref="y", text="◀ marked", showarrow=False,
                           xanchor="right", font=dict(color=MARK_COLOR))


# ----------------------------------------------------------------------------------------------- stragglers


HEATMAP_MAX_ROWS = 128
"""Rank rows a heatmap draws at most: more ranks are binned, each cell the worst (max) of its block of ranks."""
HEATMAP_MAX_COLS = 400
"""Step columns a heatmap draws at most: more steps are binned the same way."""
HEATMAP_DTYPE = "float32"
"""What a heatmap cell is sent as (plotly sends arrays as binary): 7 digits of a share of the step, far finer than
the 0.1% its hover shows, in half the bytes of float64."""


def _bin_max(z: np.ndarray, block: int, axis: int) -> np.ndarray:
    """``z`` with each run of ``block`` rows (axis 0) or columns (axis 1) reduced to its max, NaN ignored."""
    if block <= 1:
        return z
    n = z.shape[axis]
    pad = (-n) % block
    width = [(0, 0), (0, 0)]
    width[axis] = (0, pad)
    z = np.pad(z, width, constant_values=np.nan)
    shape = (z.shape[0] // block, block, z.shape[1]) if axis == 0 else (z.shape[0], z.shape[1] // block, block)
    blocks = z.reshape(shape)
    return np.fmax.reduce(blocks, axis=axis + 1)     # NaN only where the whole block is NaN


def lateness_heatmap(lateness: pd.DataFrame, *, marked: list[int] | None = None, clock: str = "host") -> go.Figure:
    """Rank × step heatmap of arrival lateness (share of the step, max over groups) read on ``clock`` (the run's
    arrival clock: ``host``, ``device`` or ``mixed``, named in the title and the color bar); marked ranks boxed.
    Binned to at most ``HEATMAP_MAX_ROWS`` x ``HEATMAP_MAX_COLS`` cells (each the latest of its block of ranks
    and steps), so a 1,024-rank run draws a screenful in which a late rank still shows."""
    words = clock_words(clock)
    grid = (lateness.groupby(["rank", "step"])["lateness_frac"].max().unstack("step").sort_index())
    ranks, steps = grid.index.to_numpy(dtype="int64"), grid.columns.to_numpy(dtype="int64")
    rank_block = -(-len(ranks) // HEATMAP_MAX_ROWS)
    step_block = -(-len(steps) // HEATMAP_MAX_COLS)
    z = _bin_max(_bin_max(grid.to_numpy(dtype="float64"), rank_block, 0), step_block, 1)
    z = z.astype(HEATMAP_DTYPE)
    if rank_block > 1:
        firsts, lasts = ranks[::rank_block], ranks[rank_block - 1::rank_block].tolist() + [ranks[-1]]
        labels = [f"ranks {a}-{b}" if a != b else _rank_label(a) for a, b in zip(firsts, lasts)]
    else:
        labels = [_rank_label(r) for r in ranks]
    x = steps[::step_block].tolist()
    binned = rank_block > 1 or step_block > 1
    hover_x = f"steps %{{x}}+{step_block - 1}" if step_block > 1 else "step %{x}"
    fig = go.Figure(go.Heatmap(z=z, x=x, y=labels, colorscale="RdBu_r", zmid=0,
                               colorbar=dict(title=f"late / step<br>({words})", tickformat=".0%"),
                               hovertemplate=f"%{{y}} {hover_x}: %{{z:.1%}} of the step late ({words})"
                                             "<extra></extra>"))
    for rank in marked or []:
        hits = np.flatnonzero(ranks == rank)
        if len(hits):
            row = int(hits[0]) // rank_block
            fig.add_shape(type="rect", xref="paper", x0=0, x1=1, yref="y", y0=row - 0.5, y1=row + 0.5,
                          line=dict(color=MARK_COLOR, width=3))
    fig.update_yaxes(autorange="reversed", title="")
    fig.update_xaxes(title="step")
    title = f"Arrival lateness on the {words} (rank × step): red = arrives after its peers"
    if binned:
        title += f" (each cell the latest of {rank_block} rank(s) x {step_block} step(s))"
    return _layout(fig, title, height=max(300, 22 * len(labels) + 140) if len(labels) <= 40 else 1000)


def victims_wait(waits: pd.DataFrame, *, clock: str = "host") -> go.Figure:
    """Mean time (ms) each rank waited for the last arrival of its collectives, arrivals read on ``clock``."""
    col = "wait_ns" if "wait_ns" in waits.columns else [c for c in waits.columns if c.endswith("_ns")][-1]
    per_rank = waits.groupby("rank", as_index=False)[col].mean().assign(
        wait_ms=lambda d: d[col].astype("float64") / 1e6)
    df, block = rank_blocks(per_rank, ["wait_ms"])
    fig = px.bar(df, color_discrete_sequence=PALETTE, x="rank", y="wait_ms",
                 labels={"wait_ms": f"mean wait per collective (ms, {clock_words(clock)})", "rank": ""})
    return _layout(fig, _binned_title("Who waits (victims)", block), height=300)


def straggler_wait(exposure: pd.DataFrame, *, clock: str = "host") -> go.Figure:
    """Mean time (ms) per step each rank waited at the end of its step for the latest arrival of its group's
    collectives (``straggler_wait_ns`` of ``RunAnalysis.comm_exposure``: one row per rank and step, whatever the
    number of collectives), arrivals read on ``clock``."""
    per_rank = exposure.groupby("rank", as_index=False)["straggler_wait_ns"].mean().assign(
        wait_ms=lambda d: d["straggler_wait_ns"].astype("float64") / 1e6)
    df, block = rank_blocks(per_rank, ["wait_ms"])
    fig = px.bar(df, color_discrete_sequence=PALETTE, x="rank", y="wait_ms",
                 labels={"wait_ms": f"mean wait for the latest arrival per step (ms, {clock_words(clock)})",
                         "rank": ""})
    return _layout(fig, _binned_title("Who waits (victims)", block), height=300)


def device_arrival_lateness(arrivals: pd.DataFrame) -> go.Figure:
    """Per rank and group of a trace folder: median arrival lateness (µs) on the device clock aligned from the
    collectives (``RunAnalysis.arrival_summary``)."""
    df = arrivals.assign(rank=lambda d: d["rank"].map(_rank_label),
                         group=group_labels)
    fig = px.bar(df, color_discrete_sequence=PALETTE, x="rank", y="median_lateness_us", color="group",
                 barmode="group", hover_data=["num_collectives", "last_frac"],
                 labels={"median_lateness_us": f"median lateness (µs, {clock_words('device')})", "rank": "",
                         "group": ""})
    return _layout(fig, f"Arrival lateness on the {clock_words('device')}: above 0 = after its peers' median",
                   height=320)


# ----------------------------------------------------------------------------------------------- communication


def bandwidth_by_size(by_size: pd.DataFrame) -> go.Figure:
    """Median bus bandwidth (GB/s) per op over message size (log axes); latency-bound buckets hollow."""
    df = by_size.assign(busbw_gbs=lambda d: d["busbw_bytes_per_s"].astype("float64") / 1e9)
    fig = px.scatter(df, color_discrete_sequence=PALETTE,
                     x="size_bytes", y="busbw_gbs", color="op", size="count", log_x=True,
                     symbol="latency_bound", hover_data=["size", "count", "median_ns"],
                     labels={"size_bytes": "message size (bytes)", "busbw_gbs": "median busbw (GB/s)"})
    return _layout(fig, "Bus bandwidth by op and size")


BOX_MAX_POINTS = 5_000
"""Above this many collectives, the bandwidth box plot is drawn from each box's quartiles computed here (one box per
(group, op)), not from every collective: a 1,024-rank run has hundreds of thousands."""


def group_label(pg, pg_ranks) -> str:
    """A group on a chart axis: ``"0 [0,1,2,3]"`` for a small group, its axis and size above
    ``LISTED_MEMBERS_MAX`` members (``"dp group of 128 ranks"``): a large group's members are never listed."""
    members = group_members(None if pd.isna(pg_ranks) else str(pg_ranks))
    if len(members) <= LISTED_MEMBERS_MAX:
        return f"{pg} [{pg_ranks}]"
    return group_phrase(str(pg), members)


MAX_GROUPS = 24
"""Above this many groups, a chart's group axis has one entry per group axis (``pg`` name) and size instead."""


def named_groups(rows: pd.DataFrame) -> pd.DataFrame:
    """``rows`` (e.g. a finding's evidence) for a table: a ``pg_ranks`` column replaced by ``group``
    (``group_labels``), so a large group is named by its axis and size, never by its members."""
    if not {"pg", "pg_ranks"} <= set(rows.columns):
        return rows
    at = list(rows.columns).index("pg_ranks")
    out = rows.drop(columns="pg_ranks")
    out.insert(at, "group", group_labels(rows))
    return out


def group_labels(df: pd.DataFrame) -> pd.Series:
    """The label of every row's group (computed once per distinct group): ``group_label``, with the first member
    added where two large groups would read the same; above ``MAX_GROUPS`` groups, one label per group axis and
    size (``"tp: 128 groups of 8 ranks"``), so the axis does not grow with the number of ranks."""
    codes, names = _group_codes(df)
    return pd.Series(np.array(names, dtype="object")[codes], index=df.index, dtype="object")


def _group_codes(df: pd.DataFrame) -> tuple[np.ndarray, list[str]]:
    """Per row of ``df`` (``pg``, ``pg_ranks``), the index of its group's label in the returned list of distinct
    labels (``group_labels``); the rows are grouped on their values, no string built per row."""
    if df.empty:
        return np.zeros(0, dtype="int64"), []
    by_pair = df.groupby([df["pg"], df["pg_ranks"]], sort=False, dropna=False, observed=True).ngroup().to_numpy()
    first = np.unique(by_pair, return_index=True)[1]          # the first row of each (pg, pg_ranks), in code order
    pairs = [("" if pd.isna(pg) else str(pg), "" if pd.isna(pr) else str(pr))
             for pg, pr in zip(df["pg"].iloc[first], df["pg_ranks"].iloc[first])]
    members = [group_members(pr) for _, pr in pairs]
    if len(pairs) > MAX_GROUPS:
        counts = pd.Series([(pg, len(m)) for (pg, _), m in zip(pairs, members)]).value_counts()
        names = [f"{pg}: {counts[(pg, len(m))]} group(s) of {len(m)} ranks" for (pg, _), m in zip(pairs, members)]
    else:
        names = [group_label(*pair) for pair in pairs]
        seen = pd.Series(names).value_counts()
        names = [f"{v} from rank {m[0]}" if seen[v] > 1 and m else v for v, m in zip(names, members)]
    distinct = list(dict.fromkeys(names))
    of_pair = np.array([distinct.index(n) for n in names], dtype="int64")
    return of_pair[by_pair], distinct


def bandwidth_by_group(bw: pd.DataFrame) -> go.Figure:
    """Distribution of bus bandwidth per (group, op); groups named by ``group_label``. Above ``BOX_MAX_POINTS``
    collectives, one precomputed box (quartiles, whiskers at the 1.5 IQR fences, no outlier points) per group and
    op, so the figure's size does not grow with the run."""
    df = bw.dropna(subset=["busbw_bytes_per_s"]).assign(
        busbw_gbs=lambda d: d["busbw_bytes_per_s"].astype("float64") / 1e9)
    if len(df) <= BOX_MAX_POINTS:
        df["group"] = group_labels(df)
        fig = px.box(df, color_discrete_sequence=PALETTE,
                     x="group", y="busbw_gbs", color="op", labels={"busbw_gbs": "busbw (GB/s)", "group": ""})
        return _layout(fig, "Bus bandwidth by group")
    codes, names = _group_codes(df)   # grouped on integer codes: no label string per collective
    ordered = sorted(names)
    codes = np.array([ordered.index(n) for n in names], dtype="int64")[codes]
    op_codes, ops = pd.factorize(df["op"], sort=True)     # nor an op string (an unknown op is left out)
    busbw = df["busbw_gbs"].to_numpy()
    fig = go.Figure()
    for i, op in enumerate(ops):
        one = op_codes == i
        q = pd.Series(busbw[one]).groupby(pd.Categorical.from_codes(codes[one], categories=ordered),
                                          sort=True, observed=True).quantile([0.0, 0.25, 0.5, 0.75, 1.0]).unstack()
        iqr = q[0.75] - q[0.25]
        lo = np.maximum(q[0.0], q[0.25] - 1.5 * iqr)
        hi = np.minimum(q[1.0], q[0.75] + 1.5 * iqr)
        fig.add_trace(go.Box(x=q.index.tolist(), q1=q[0.25].tolist(), median=q[0.5].tolist(), q3=q[0.75].tolist(),
                             lowerfence=lo.tolist(), upperfence=hi.tolist(), name=str(op),
                             marker_color=PALETTE[i % len(PALETTE)]))
    fig.update_layout(boxmode="group")
    fig.update_yaxes(title="busbw (GB/s)")
    return _layout(fig, f"Bus bandwidth by group ({len(df):,} collectives, quartiles)")


def exposure_by_rank(exposure: pd.DataFrame, *, marked: list[int] | None = None) -> go.Figure:
    """Per rank: exposed communication, straggler wait and hidden (overlapped) communication, share of step."""
    df = exposure.assign(hidden=lambda d: (d["comm_frac"] - d["exposed_frac"]
                                           - d["straggler_wait_frac"].fillna(0)).clip(lower=0))
    df, block = rank_blocks(df, ["exposed_frac", "straggler_wait_frac", "hidden"])
    fig = go.Figure()
    for col, name in (("exposed_frac", "exposed"), ("straggler_wait_frac", "waiting for a straggler"),
                      ("hidden", "overlapped")):
        fig.add_trace(go.Bar(x=df["rank"], y=df[col], name=name))
    fig.update_layout(barmode="stack")
    fig.update_yaxes(tickformat=".0%", title="share of the step")
    return _layout(fig, _binned_title("Communication per rank: exposed vs overlapped", block))


def overlap_by_rank(overlap: pd.DataFrame) -> go.Figure:
    """Share of communication overlapped by compute per rank (kernel level or host estimate)."""
    df, block = rank_blocks(overlap, ["overlap_frac"])
    fig = px.bar(df, color_discrete_sequence=PALETTE,
                 x="rank", y="overlap_frac", labels={"overlap_frac": "comm overlapped by compute", "rank": ""})
    fig.update_yaxes(tickformat=".0%", range=[0, 1])
    return _layout(fig, _binned_title("Compute / communication overlap per rank", block), height=300)


def compression(summary: pd.DataFrame) -> go.Figure:
    """Bytes per step before and after compression, per method."""
    df = summary.melt(id_vars="method", value_vars=["raw_bytes_per_step", "sent_bytes_per_step"],
                      var_name="bytes", value_name="value")
    fig = px.bar(df, color_discrete_sequence=PALETTE,
                 x="method", y="value", color="bytes", barmode="group", labels={"value": "bytes per step"})
    return _layout(fig, "Gradient compression", height=300)


# ----------------------------------------------------------------------------------------------- pipeline


PIPELINE_MAX_ROWS = 16
"""Above this many ranks, the pipeline Gantt draws one rank per stage (the lowest: one pipeline of the job)."""


def pipeline_gantt(pipeline: pd.DataFrame) -> go.Figure:
    """Stage × time Gantt of F/B/W actions of one step, labelled by micro-batch; above ``PIPELINE_MAX_ROWS`` ranks
    the lowest rank of each stage only, said in the title."""
    num_ranks = pipeline["rank"].nunique()
    title = "Pipeline schedule (stage × time)"
    if num_ranks > PIPELINE_MAX_ROWS:
        lowest = pipeline.groupby("stage")["rank"].transform("min")
        pipeline = pipeline[pipeline["rank"] == lowest]
        title += f": the lowest rank of each stage, of {num_ranks} ranks"
    p = pipeline.dropna(subset=["start_ns", "end_ns"]).assign(
        y=lambda d: "stage " + d["stage"].astype(str) + " (rank " + d["rank"].astype(str) + ")",
        kind=lambda d: d["action"].astype(str),
        label=lambda d: d["action"].astype(str) + d["microbatch"].astype(str))
    if p.empty:
        return empty("Pipeline", "No pipeline actions in this step.")
    t0 = int(p["start_ns"].min())
    fig = _bars(p, t0=t0)
    for trace in fig.data:
        grp = p[p["kind"] == trace.name]
        trace.text = grp["label"]
        trace.textposition = "inside"
    order = list(dict.fromkeys(p.sort_values(["stage", "rank"])["y"]))
    fig.update_yaxes(categoryorder="array", categoryarray=order[::-1])
    return _layout(fig, title, height=max(280, 50 * len(order) + 120))


def bubble_measured_vs_ideal(by_rank: pd.DataFrame, *, ideal_frac: float | None) -> go.Figure:
    """Measured bubble share per rank, with the schedule's ideal bubble as a dashed line."""
    df, block = rank_blocks(by_rank, ["bubble_frac"])
    fig = px.bar(df, color_discrete_sequence=PALETTE,
                 x="rank", y="bubble_frac", labels={"bubble_frac": "bubble (share of window)", "rank": ""})
    if ideal_frac is not None:
        fig.add_hline(y=ideal_frac, line_dash="dash", line_color=MARK_COLOR,
                      annotation_text=f"ideal {ideal_frac:.1%}")
    fig.update_yaxes(tickformat=".0%")
    return _layout(fig, _binned_title("Bubble: measured vs ideal", block), height=300)


# ----------------------------------------------------------------------------------------------- precision / ckpt


def loss_scale(amp_steps: pd.DataFrame) -> go.Figure:
    """Loss scale after each step (log axis) with overflow steps marked."""
    fig = go.Figure(go.Scatter(x=amp_steps["step"], y=amp_steps["scale_after"], mode="lines+markers",
                               name="loss scale"))
    hit = amp_steps[amp_steps["overflow"].fillna(False).astype(bool)]
    fig.add_trace(go.Scatter(x=hit["step"], y=hit["scale_after"], mode="markers", name="overflow",
                             marker=dict(color=MARK_COLOR, size=11, symbol="x")))
    fig.update_yaxes(type="log", title="scale")
    fig.update_xaxes(title="step")
    return _layout(fig, "Loss scale", height=300)


def checkpoint_times(checkpoints: pd.DataFrame) -> go.Figure:
    """Per save/load and rank: blocking and async time (ms); above ``MAX_RANK_LINES`` ranks, per save/load the
    slowest rank's and the mean over ranks (a panel per rank would not fit)."""
    df = checkpoints.assign(
        event=lambda d: d["kind"].astype(str) + " @ step " + d["step"].astype(str),
        blocking_ms=lambda d: d["blocking_ns"].astype("float64") / 1e6,
        async_ms=lambda d: d["async_ns"].astype("float64").fillna(0) / 1e6)
    num_ranks = df["rank"].nunique()
    if num_ranks > MAX_RANK_LINES:
        per_event = df.groupby("event", sort=False).agg(
            blocking_max=("blocking_ms", "max"), blocking_mean=("blocking_ms", "mean"), async_max=("async_ms", "max"))
        fig = go.Figure()
        for i, (col, name) in enumerate((("blocking_max", "blocking, slowest rank"),
                                         ("blocking_mean", "blocking, mean over ranks"),
                                         ("async_max", "async, slowest rank"))):
            fig.add_trace(go.Bar(x=per_event.index.tolist(), y=per_event[col], name=name,
                                 marker_color=PALETTE[i % len(PALETTE)]))
        fig.update_layout(barmode="group")
        fig.update_yaxes(title="ms")
        return _layout(fig, f"Checkpoint time per event over {num_ranks} ranks: blocking vs async")
    df["rank"] = df["rank"].map(_rank_label)
    long = df.melt(id_vars=["event", "rank"], value_vars=["blocking_ms", "async_ms"], var_name="time",
                   value_name="ms")
    fig = px.bar(long, color_discrete_sequence=PALETTE,
                 x="event", y="ms", color="time", facet_col="rank", barmode="stack",
                 labels={"ms": "ms", "event": ""})
    return _layout(fig, "Checkpoint time per event and rank: blocking vs async")


# ----------------------------------------------------------------------------------------------- devices


def device_series(devices: pd.DataFrame, *, column: str, label: str, outliers: int = 3) -> go.Figure:
    """One device metric per rank over the step axis (samples outside steps dropped); above ``MAX_RANK_LINES``
    ranks its median over ranks, the min-max band and the ``outliers`` ranks furthest from the median (mean
    distance over the steps)."""
    df = devices.dropna(subset=[column])
    df = df[df["step"].fillna(-1) >= 0].groupby(["rank", "step"], as_index=False)[column].mean()
    num_ranks = df["rank"].nunique()
    if num_ranks > MAX_RANK_LINES:   # the spread and the ranks furthest from the median, not a line per rank
        off = (df[column] - df.groupby("step")[column].transform("median")).abs().groupby(df["rank"]).mean()
        far = off.sort_values(ascending=False, kind="stable").index[:outliers]
        fig = _spread_over_ranks(df, column, list(far))
        fig.update_xaxes(title="step")
        fig.update_yaxes(title=label)
        return _layout(fig, f"{label} over {num_ranks} ranks (the {len(far)} furthest from the median drawn)",
                       height=300)
    df["rank"] = df["rank"].map(_rank_label)
    fig = px.line(df, color_discrete_sequence=PALETTE,
                  x="step", y=column, color="rank", labels={column: label, "rank": ""})
    return _layout(fig, f"{label} by rank", height=300)


# ----------------------------------------------------------------------------------------------- kernels


def temporal_breakdown(temporal: pd.DataFrame) -> go.Figure:
    """Per rank: idle / compute / non-compute share of the kernel span (HTA semantics)."""
    df, block = rank_blocks(temporal, ["compute_frac", "non_compute_frac", "idle_frac"])
    fig = go.Figure()
    for col, name in (("compute_frac", "compute"), ("non_compute_frac", "non-compute"), ("idle_frac", "idle")):
        fig.add_trace(go.Bar(x=df["rank"], y=df[col], name=name))
    fig.update_layout(barmode="stack")
    fig.update_yaxes(tickformat=".0%", title="share of kernel span")
    return _layout(fig, _binned_title("Temporal breakdown per rank", block))


def kernel_types(breakdown: pd.DataFrame) -> go.Figure:
    """Exclusive kernel time per kernel-type combination."""
    fig = px.pie(breakdown, color_discrete_sequence=PALETTE, names="kernel_type", values="sum_us", hole=0.4)
    return _layout(fig, "Kernel time by type", height=320)


# ----------------------------------------------------------------------------------------------- compare


def compare_lines(df: pd.DataFrame, *, y: str, label: str, title: str) -> go.Figure:
    """One line per run over the step axis (``run``, ``step``, ``y`` columns)."""
    fig = px.line(df, color_discrete_sequence=PALETTE, x="step", y=y, color="run", labels={y: label, "run": ""})
    return _layout(fig, title, height=300)


# ----------------------------------------------------------------------------------------------- planner


def plan_breakdown(layouts: pd.DataFrame, *, terms: list[str]) -> go.Figure:
    """Predicted step-time breakdown (s) of each proposed layout."""
    df = layouts.assign(layout=lambda d: "#" + d["rank"].astype(str))
    fig = go.Figure()
    for term in terms:
        if term in df.columns:
            fig.add_trace(go.Bar(x=df["layout"], y=df[term], name=term.removesuffix("_s")))
    fig.update_layout(barmode="stack")
    fig.update_yaxes(title="predicted seconds per step")
    return _layout(fig, "Predicted step time by layout")
