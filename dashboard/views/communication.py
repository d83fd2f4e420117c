"""Communication: bandwidth by op, group and size, exposed communication and overlap per rank, compression."""

from __future__ import annotations

import streamlit as st

from dtprobe.dashboard import charts, common


def body(source) -> None:
    analysis = common.load(source)
    common.show_findings(common.findings_with_evidence(source, analysis, {
        "EXPOSED_COMM": "exposed_comm", "COMM_INEFFICIENT": "comm_findings", "COMPRESSION": "compression_findings"}),
        key="communication")
    marked = common.marked_ranks()
    bw = analysis.collective_bandwidth()
    if bw.empty:
        st.info("No collectives recorded: re-run without --no-collectives to see bandwidth and exposure.")
    else:
        fit = analysis.bandwidth_fit()
        if fit is not None:
            st.caption(f"Latency-bandwidth fit on the most common op: latency {fit[0] / 1e3:.1f} µs, "
                       f"bandwidth {fit[1] / 1e9:.2f} GB/s")
        left, right = st.columns(2)
        with left:
            common.chart(charts.bandwidth_by_size(analysis.bandwidth_by_size()), key="comm_bw_size")
        with right:
            common.chart(charts.bandwidth_by_group(bw), key="comm_bw_group")
    exposure = analysis.exposure_by_rank()
    if not exposure.empty:
        common.chart(charts.exposure_by_rank(exposure, marked=marked), key="comm_exposure")
    overlap = analysis.comm_comp_overlap()
    if not overlap.empty:
        st.caption("Overlap from GPU kernels (communication kernels overlapped by compute kernels).")
        common.chart(charts.overlap_by_rank(overlap), key="comm_overlap")
    elif not exposure.empty:
        common.chart(charts.overlap_by_rank(exposure), key="comm_overlap")
    comp = analysis.compression()
    if not comp.empty:
        st.subheader("Compression")
        common.chart(charts.compression(comp), key="comm_compression")
        st.dataframe(comp, hide_index=True)


source = common.page_setup("Communication")
common.render(source, body)
