"""Stragglers: rank × step heatmap of arrival lateness, the culprit (marked) and its victims, with the cause."""

from __future__ import annotations

import streamlit as st

from dtprobe.dashboard import charts, common


def body(source) -> None:
    analysis = common.load(source)
    findings = common.findings_for(analysis, ("STRAGGLER",))
    marked = common.marked_ranks() or sorted({r for f in findings for r in f.ranks})
    if marked:
        st.markdown("**Marked:** " + ", ".join(f":red[rank {r}]" for r in marked)
                    + (" (from the finding link)" if common.marked_ranks() else " (detected culprits)"))
    common.show_findings(findings, key="stragglers")
    if analysis.is_trace_folder:
        st.info("Kineto trace folders carry no cross-rank clock alignment, so arrival skew is not measured. "
                "Record the job with `dtprobe run` or `dtprobe.attach` for straggler analysis.")
        return
    lateness = analysis.rank_lateness()
    if lateness.empty:
        st.info("No collective arrivals recorded yet: the heatmap needs the collectives table "
                "(re-run without --no-collectives).")
        return
    common.chart(charts.lateness_heatmap(lateness, marked=marked), key="stragglers_heatmap")
    scores = analysis.straggler_scores()
    causes = analysis.straggler_causes()
    st.subheader("Culprits and victims")
    table = scores.merge(causes, on=["pg", "pg_ranks", "rank"], how="left") if not causes.empty else scores
    table = table.assign(role=lambda d: d["rank"].map(lambda r: "culprit" if r in marked else "victim"))
    st.dataframe(table[["role", "pg", "rank", "median_lateness_frac", "positive_frac", "mean_victims_wait_ns",
                        *[c for c in ("cause",) if c in table.columns]]],
                 hide_index=True, column_config={
                     "median_lateness_frac": st.column_config.NumberColumn("median lateness", format="percent"),
                     "positive_frac": st.column_config.NumberColumn("steps late", format="percent")})
    waits = analysis.collective_waits()
    if not waits.empty:
        common.chart(charts.victims_wait(waits), key="stragglers_victims")
    steps = analysis.table("steps")
    if not steps.empty:
        common.chart(charts.step_time_overview(steps, marked=marked), key="stragglers_step_time")


source = common.page_setup("Stragglers")
common.render(source, body)
