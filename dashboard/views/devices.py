"""Devices: NVML (GPU) or host (CPU, RSS, load) series per rank on the step axis, the CPU time each rank used and
lost per step (to its cgroup's quota, waiting for a core), and device health."""

from __future__ import annotations

import streamlit as st

from dtprobe.dashboard import charts, common

SERIES = {
    "util_frac": "GPU utilisation", "mem_used_bytes": "GPU memory used (bytes)", "power_w": "power (W)",
    "temp_c": "temperature (°C)", "sm_clock_mhz": "SM clock (MHz)", "cpu_frac": "host CPU (share)",
    "rss_bytes": "host RSS (bytes)", "load1": "host load (1 min)",
}
PER_STEP = {
    "cpu_throttled_frac": "CPU throttled by its quota (share of the step)",
    "cpu_wait_frac": "main thread waiting for a CPU (share of the step)",
    "cpu_busy_frac": "CPU its process used (cores' worth over the step)",
}
"""Series the analysis derives per step from the host sampler's cumulative kernel counters."""


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
    per_step = {"cpu_throttled_frac": analysis.cpu_throttled(), "cpu_wait_frac": analysis.cpu_wait(),
                "cpu_busy_frac": analysis.cpu_busy()}
    labels = {**SERIES, **PER_STEP}
    available = ([c for c in SERIES if dev[c].notna().any()]
                 + [c for c, frame in per_step.items() if frame is not None])
    column = st.selectbox("Series", available, format_func=labels.get, key="devices_series")
    frame = per_step[column] if column in PER_STEP else dev
    common.chart(charts.device_series(frame, column=column, label=labels[column]), key="devices_series_chart")
    health = analysis.device_health()
    if not health.empty:
        st.subheader("Health per rank")
        st.dataframe(common.worst_rows(health, ["throttled_frac", "power_cap_frac", "max_temp_c"],
                                       what="ranks, the most throttled and hottest"), hide_index=True)


source = common.page_setup("Devices")
common.render(source, body)
