"""Pure chart builders: DataFrame in, plotly figure out (no streamlit, no I/O); drawn by the pages."""

from __future__ import annotations

import pandas as pd
import plotly.express as px
import plotly.graph_objects as go

SEVERITY_COLORS = {"critical": "#d62728", "warning": "#ff7f0e", "info": "#1f77b4"}


def step_time_by_rank(steps: pd.DataFrame) -> go.Figure:
    """Step duration (ms) per rank over the step axis."""
    df = steps.dropna(subset=["start_ns", "end_ns"]).assign(
        step_ms=lambda d: (d["end_ns"] - d["start_ns"]).astype("float64") / 1e6,
        rank=lambda d: d["rank"].astype(str))
    fig = px.line(df, x="step", y="step_ms", color="rank", markers=True,
                  labels={"step_ms": "step time (ms)", "rank": "rank"})
    fig.update_layout(title="Step time by rank", height=360, margin=dict(l=10, r=10, t=40, b=10))
    return fig


def loss_curve(steps: pd.DataFrame) -> go.Figure:
    """Mean loss over ranks per step."""
    df = steps.dropna(subset=["loss"]).groupby("step", as_index=False)["loss"].mean()
    fig = px.line(df, x="step", y="loss", markers=True)
    fig.update_layout(title="Loss", height=320, margin=dict(l=10, r=10, t=40, b=10))
    return fig
