"""Devices: NVML (GPU) or host (CPU, RSS, load) series per rank on the step axis, and device health."""

from __future__ import annotations

import streamlit as st

from dtprobe.dashboard import charts, common

SERIES = {
    "util_frac": "GPU utilisation", "mem_used_bytes": "GPU memory used (bytes)", "power_w": "power (W)",
    "temp_c": "temperature (°C)", "sm_clock_mhz": "SM clock (MHz)", "cpu_frac": "host CPU (share)",
    "rss_bytes": "host RSS (bytes)", "load1": "host load (1 min)",
}


def body(source) -> None:
    analysis = common.load(source)
    common.show_findings(common.findings_with_evidence(source, analysis, dict.fromkeys(
        ("DEVICE_THROTTLE", "DEVICE_XID", "MEMORY_PRESSURE"), "device_findings")), key="devices")
    dev = analysis.table("devices")
    if dev.empty:
        st.info("No device samples: re-run without --no-devices (Kineto trace folders carry none).")
        return
    sources = sorted(dev["source"].dropna().unique())
    if sources == ["host"]:
        st.caption("Host samples (CPU run or NVML unavailable): these are CPU figures, not GPU ones.")
    available = [c for c in SERIES if dev[c].notna().any()]
    column = st.selectbox("Series", available, format_func=SERIES.get, key="devices_series")
    common.chart(charts.device_series(dev, column=column, label=SERIES[column]), key="devices_series_chart")
    health = analysis.device_health()
    if not health.empty:
        st.subheader("Health per rank")
        st.dataframe(common.worst_rows(health, ["throttled_frac", "power_cap_frac", "max_temp_c"],
                                       what="ranks, the most throttled and hottest"), hide_index=True)


source = common.page_setup("Devices")
common.render(source, body)
