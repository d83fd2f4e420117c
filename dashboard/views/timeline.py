"""Timeline: per-rank Gantt of steps (phases), collectives and pipeline actions over a chosen step window."""

from __future__ import annotations

import streamlit as st

from dtprobe.dashboard import charts, common

MAX_RANKS = 16  # ranks drawn at once (a 64-rank Gantt is unreadable); the rest are chosen in the rank filter


def body(source) -> None:
    analysis = common.load(source)
    common.show_findings(common.findings_for(analysis, ("HANG", "RANK_CRASH")), key="timeline")
    steps = analysis.table("steps")
    if steps.empty:
        st.info("No steps recorded yet.")
        return
    step_ids = sorted(int(s) for s in steps["step"].dropna().unique())
    first, last = step_ids[0], step_ids[-1]
    if first == last:
        window = (first, last)
    else:
        window = st.slider("Steps", first, last, (max(first, last - 2), last), key="timeline_steps",
                           help="Zoom: pick one step (both ends equal) or a few.")
    ranks = sorted(int(r) for r in steps["rank"].unique())
    marked = common.marked_ranks()
    default = sorted(set(marked) | set(ranks[:MAX_RANKS - len(marked)])) if len(ranks) > MAX_RANKS else ranks
    chosen = st.multiselect("Ranks", ranks, default=default, key="timeline_ranks")

    def cut(df, col="step"):
        return df[df[col].between(*window) & df["rank"].isin(chosen)]

    fig = charts.timeline(cut(steps), cut(analysis.table("collectives")), cut(analysis.table("pipeline")),
                          marked=marked)
    common.chart(fig, key="timeline_gantt")
    last_seen = analysis.last_seen()
    if analysis.status != "finished" and not last_seen.empty:
        st.subheader("Last activity per rank")
        st.dataframe(last_seen, hide_index=True)


source = common.page_setup("Timeline")
common.render(source, body)
