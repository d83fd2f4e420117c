"""Kernels: temporal breakdown (idle / compute / non-compute) and kernel-type breakdown from Kineto traces."""

from __future__ import annotations

import streamlit as st

from dtprobe.dashboard import charts, common


def body(source) -> None:
    analysis = common.load(source)
    common.show_findings(common.findings_for(source, analysis, ("LOW_MFU",)), key="kernels")
    temporal = analysis.temporal_breakdown()
    if temporal.empty:
        st.info("No GPU kernels: record profiler windows with `dtprobe run --profile-steps A-B` on a GPU, or "
                "open a folder of Kineto traces.")
        return
    if analysis.is_trace_folder:
        st.caption(f"Kineto trace folder: {analysis.world_size} ranks.")
    common.chart(charts.temporal_breakdown(temporal), key="kernels_temporal")
    breakdown = analysis.kernel_breakdown()
    if not breakdown.empty:
        common.chart(charts.kernel_types(breakdown), key="kernels_types")
    st.dataframe(common.worst_rows(temporal, ["idle_frac"], what="ranks, the most idle"), hide_index=True)


source = common.page_setup("Kernels")
common.render(source, body)
