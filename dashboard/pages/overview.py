"""Overview: health, findings by severity (each linking to its page), key figures of the chosen run."""

from __future__ import annotations

import streamlit as st

from dashboard import charts, common
from dashboard.nav import FINDING_PAGE


def body(source) -> None:
    analysis = common.load(source)
    figures = common.key_figures(analysis)
    cols = st.columns(len(figures))
    for col, (label, value) in zip(cols, figures.items()):
        col.metric(label, value)
    findings = analysis.findings()
    worst = findings[0].severity if findings else None
    if worst == "critical":
        st.error(f"Unhealthy: {sum(f.severity == 'critical' for f in findings)} critical finding(s).")
    elif worst == "warning":
        st.warning(f"Degraded: {sum(f.severity == 'warning' for f in findings)} warning(s).")
    else:
        st.success("Healthy: no critical finding or warning.")
    st.subheader(f"Findings ({len(findings)})")
    for index, finding in enumerate(findings):
        with st.container(border=True):
            ranks = ", ".join(str(r) for r in finding.ranks) or "-"
            group = finding.group or "-"
            st.markdown(f"**:{common.SEVERITY_BADGE[finding.severity]}[{finding.severity.upper()}] "
                        f"{finding.code}** · ranks {ranks} · group {group}  \n{finding.title}")
            st.caption(finding.recommendation)
            page = FINDING_PAGE.get(finding.code)
            if page is not None:
                st.page_link(page, label=f"Open evidence for {finding.code}",
                             query_params=common.finding_params(source, finding))
    steps = analysis.table("steps")
    if not steps.empty:
        st.plotly_chart(charts.step_time_by_rank(steps), key="overview_step_time")


source = common.page_setup("Overview")
common.render(source, body)
