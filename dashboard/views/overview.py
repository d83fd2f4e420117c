"""Overview: every crash and restart of the run (the RANK_CRASH titles, as `dtprobe analyze` heads its report) and
an interrupt of its launcher, how the ranks' clocks were aligned and which clock arrivals were read on, health,
findings by severity (each naming the clock of its timing evidence and linking to its page), key figures of the
chosen run with the trend of step time and tokens/s (per-rank charts are on the pages the findings link to). Drawn
from an ``Overview`` (a finished run's stored summary when valid; a large run's steps figures alone while its first
analysis runs, live or finished), with no chart library; an empty chart after the run picker makes the browser load
that library meanwhile, for the pages the findings link to."""

from __future__ import annotations

import streamlit as st

from dtprobe.dashboard import clocks, common
from dtprobe.analysis.render import INTERRUPTED
from dtprobe.dashboard.nav import FINDING_PAGE


def body(source) -> None:
    overview, pending = common.load_overview(source)
    for crash in (f for f in overview.findings if f.code == "RANK_CRASH"):   # every crash and restart, first
        st.markdown(f"**:{common.SEVERITY_BADGE[crash.severity]}[crash]** {crash.title}")
    for line in overview.restarts:                                          # restarts no crash line tells
        st.markdown(f"**:orange[restart]** {line}")
    if overview.interrupted:                                                # a healthy job stopped by its operator
        st.markdown(f"**:blue[interrupted]** {INTERRUPTED}")
    if not pending:   # the arrival clock is known once the collectives are analyzed
        st.caption(clocks.run_clocks(overview.clock_aligned, overview.arrival_clock))
    items = list(common.key_figures(overview).items())
    for row in (items[:5], items[5:]):
        for col, (label, value) in zip(st.columns(5, border=True), row):
            col.metric(label, value)
            if label in overview.trends:
                col.markdown(common.sparkline(label, overview.trends[label]))
    reason = overview.figures["mfu_reason"]
    if overview.figures["mfu"] is None and reason:
        st.caption(f"MFU: {reason}")
    if pending:       # no health verdict before the findings are known
        return
    findings = overview.findings
    worst = findings[0].severity if findings else None
    if worst == "critical":
        st.error(f"Unhealthy: {sum(f.severity == 'critical' for f in findings)} critical finding(s).")
    elif worst == "warning":
        st.warning(f"Degraded: {sum(f.severity == 'warning' for f in findings)} warning(s).")
    else:
        st.success("Healthy: no critical finding or warning.")
    st.subheader(f"Findings ({len(findings)})")
    for severity in ("critical", "warning", "info"):
        for finding in (f for f in findings if f.severity == severity):
            with st.container(border=True):
                st.markdown(f"**:{common.SEVERITY_BADGE[severity]}[{severity.upper()}] {finding.code}** · "
                            f"ranks {common.ranks_text(finding.ranks)} · group {finding.group or '-'}  \n{finding.title}")
                common.evidence_clock(finding.clock)
                st.caption(finding.recommendation)
                page = FINDING_PAGE.get(finding.code)
                if page is not None:
                    st.page_link(page, label=f"Open evidence for {finding.code}", icon=":material/arrow_forward:",
                                 query_params=common.finding_params(source, finding))


source = common.page_setup("Overview")
common.render(source, body, pending=common.overview_pending)
common.preload_chart_library()
