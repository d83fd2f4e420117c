"""Compare: two or more runs side by side: step time, memory, loss curves, bytes communicated per step."""

from __future__ import annotations

import pandas as pd
import streamlit as st

from dtprobe.dashboard import charts, common


def _per_step(name: str, analysis) -> dict[str, pd.DataFrame]:
    steps = analysis.completed_table("steps")     # a step redone after a restart: the attempt that redid it
    out = {}
    if not steps.empty:
        s = steps.dropna(subset=["start_ns", "end_ns"])
        out["step_ms"] = (s.assign(step_ms=(s["end_ns"] - s["start_ns"]).astype("float64") / 1e6)
                          .groupby("step", as_index=False)["step_ms"].max())
        out["loss"] = steps.dropna(subset=["loss"]).groupby("step", as_index=False)["loss"].mean()
    mem = analysis.completed_table("memory")
    if not mem.empty:
        col = "peak_bytes" if mem["peak_bytes"].notna().any() else "rss_bytes"
        out["memory_gib"] = (mem.groupby("step", as_index=False)[col].max()
                             .assign(memory_gib=lambda d: d[col].astype("float64") / 2**30))
    coll = analysis.completed_table("collectives")
    if not coll.empty:
        c = coll[coll["step"].fillna(-1) >= 0]
        out["comm_mib"] = (c.groupby("step", as_index=False)["num_bytes"].sum()
                           .assign(comm_mib=lambda d: d["num_bytes"].astype("float64") / 2**20))
    return {k: v.assign(run=name) for k, v in out.items()}


def body(source) -> None:
    others = [s for s in common.other_sources(source)]
    if not others:
        st.info("Only one run under this root: compare needs two or more.")
        return
    by_name = {s.name: s for s in others}
    picked = st.multiselect("Compare with", list(by_name), default=list(by_name)[:1], key="compare_runs")
    runs = [source] + [by_name[n] for n in picked]
    frames: dict[str, list[pd.DataFrame]] = {}
    rows = []
    for run in runs:
        overview, pending = common.load_overview(run)   # a finished run's stored figures: no detector runs here
        analysis = common.load(run)
        k = overview.figures
        rows.append({"run": run.name, "status": analysis.status, "ranks": analysis.world_size,
                     "steps": overview.num_steps, "step time (ms)": k["step_time_ms"], "tokens/s": k["tokens_per_s"],
                     "exposed comm": k["exposed_comm_frac"],
                     "findings": None if pending else len(overview.findings)})
        for key, df in _per_step(run.name, analysis).items():
            frames.setdefault(key, []).append(df)
    st.dataframe(pd.DataFrame(rows), hide_index=True)
    for key, label, title in (("step_ms", "step time (ms, slowest rank)", "Step time"),
                              ("memory_gib", "peak memory (GiB, max over ranks)", "Memory"),
                              ("loss", "loss (mean over ranks)", "Loss"),
                              ("comm_mib", "bytes communicated (MiB, all ranks)", "Bytes communicated per step")):
        if key in frames:
            common.chart(charts.compare_lines(pd.concat(frames[key], ignore_index=True), y=key, label=label,
                                              title=title), key=f"compare_{key}")


source = common.page_setup("Compare")
common.render(source, body)
