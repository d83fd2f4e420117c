"""Checkpoints: each save and load, blocking vs async, per rank; interval advice."""

from __future__ import annotations

import streamlit as st

from dtprobe.dashboard import charts, common


def body(source) -> None:
    analysis = common.load(source)
    common.show_findings(common.findings_with_evidence(source, analysis, {"CHECKPOINT_STALL": "checkpoint_findings"}),
                         key="checkpoints")
    raw = analysis.table("checkpoints")
    if raw.empty:
        st.info("No checkpoints in this run (save with --ckpt-every K, async with --ckpt-async).")
        return
    summary = analysis.checkpoint_summary()
    if summary:
        cols = st.columns(4)
        cols[0].metric("saves", summary["num_saves"])
        cols[1].metric("blocking per save", common.fmt(summary["mean_blocking_ms"], "{:.0f} ms"))
        cols[2].metric("blocking share", common.fmt(summary["blocking_share_of_wall"], "{:.1%}"))
        cols[3].metric("Young/Daly interval", common.fmt(summary["young_daly_interval_s"], "{:.0f} s"))
    common.chart(charts.checkpoint_times(raw), key="checkpoints_times")
    st.subheader("Events (slowest rank)")
    st.dataframe(analysis.checkpoint_events(), hide_index=True)


source = common.page_setup("Checkpoints")
common.render(source, body)
