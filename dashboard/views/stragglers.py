"""Stragglers: the clock lateness is read on, a rank × step heatmap of arrival lateness, the culprit (marked) and
its victims, with the cause; on a trace folder, arrivals on the device clock aligned from the collectives."""

from __future__ import annotations

import streamlit as st

from dtprobe.dashboard import charts, clocks, common, data


MAX_SCORE_ROWS = 50
"""Rows of the culprits-and-victims table above ``charts.MAX_RANK_BARS`` ranks (culprits first, then the latest)."""


def _culprits(lines: list) -> list[int]:
    return sorted({r for f in lines if f.code == "STRAGGLER" for r in f.ranks})


def _show_marked(marked: list[int]) -> None:
    if marked:
        shown = marked if len(marked) <= common.MAX_LISTED_RANKS else []
        st.markdown("**Marked:** " + (", ".join(f":red[rank {r}]" for r in shown)
                                      or f":red[{common.ranks_text(marked)}]")
                    + (" (from the finding link)" if common.marked_ranks() else " (detected culprits)"))


def body(source) -> None:
    analysis = common.load(source)
    # the run's STRAGGLER lines (of a finished run, its stored Overview's) name the culprits at once; their evidence
    # rows and the culprits table need the detector, run last so that the charts are drawn first, in slots above.
    # A finished run whose Overview is still to be made: its charts are drawn unmarked first, then again once that
    # Overview's analysis (the page's longest wait) names the culprits
    lines = data.finding_lines_known(source, analysis)
    marked = common.marked_ranks() or _culprits(lines or [])
    marked_slot = st.empty()
    with marked_slot.container():
        _show_marked(marked)
    clock, aligned = analysis.arrival_clock(), analysis.clock_alignment()
    st.caption(clocks.run_clocks(aligned, clock))
    findings_slot = st.container()
    if analysis.is_trace_folder or analysis.rank_lateness().empty:
        if lines is None:
            with marked_slot.container():
                _show_marked(common.marked_ranks() or _culprits(data.finding_lines(source, analysis)))
        _show_findings(source, analysis, findings_slot)
        if analysis.is_trace_folder:
            _trace_folder_arrivals(analysis, aligned=aligned)
        else:
            st.info("No collective arrivals recorded yet: the heatmap needs the collectives table "
                    "(re-run without --no-collectives).")
        return
    lateness = analysis.rank_lateness()
    heatmap_slot = st.empty()
    key = "" if lines is not None else "_unmarked"
    with heatmap_slot.container():
        common.chart(charts.lateness_heatmap(lateness, marked=marked, clock=clock), key=f"stragglers_heatmap{key}")
    table_slot = st.container()
    exposure = analysis.comm_exposure()   # per rank and step (kept at compaction), not per collective and member
    if not exposure.empty:
        common.chart(charts.straggler_wait(exposure, clock=clock), key="stragglers_victims")
    else:
        waits = analysis.collective_waits()
        if not waits.empty:
            common.chart(charts.victims_wait(waits, clock=clock), key="stragglers_victims")
    steps = analysis.table("steps")
    step_slot = st.empty()
    if not steps.empty:
        with step_slot.container():
            common.chart(charts.step_time_overview(steps, marked=marked), key=f"stragglers_step_time{key}")
    if lines is None:
        marked = common.marked_ranks() or _culprits(data.finding_lines(source, analysis))
        with marked_slot.container():
            _show_marked(marked)
        with heatmap_slot.container():
            common.chart(charts.lateness_heatmap(lateness, marked=marked, clock=clock), key="stragglers_heatmap")
        if not steps.empty:
            with step_slot.container():
                common.chart(charts.step_time_overview(steps, marked=marked), key="stragglers_step_time")
    with table_slot:
        _culprits_table(analysis, marked=marked, clock=clock)
    _show_findings(source, analysis, findings_slot)


def _show_findings(source, analysis, slot) -> None:
    with slot:
        common.show_findings(common.findings_with_evidence(source, analysis, {"STRAGGLER": "stragglers",
                                                                              "RANK_STALL": "rank_stall_findings"}),
                             key="stragglers")


def _culprits_table(analysis, *, marked: list[int], clock: str | None) -> None:
    """Per (group, rank): lateness, share of steps late, the wait imposed on peers, the cause; the culprits first."""
    words = clocks.clock_words(clock)
    scores = analysis.straggler_scores()
    causes = analysis.straggler_causes()
    st.subheader("Culprits and victims")
    table = scores.merge(causes, on=["pg", "pg_ranks", "rank"], how="left") if not causes.empty else scores
    table = table.assign(role=lambda d: d["rank"].isin(marked).map({True: "culprit", False: "victim"}))
    if table["rank"].nunique() > charts.MAX_RANK_BARS:  # culprits first, then the latest ranks
        total = len(table)
        table = table.sort_values(["role", "median_lateness_frac"], ascending=[True, False],
                                  kind="stable").head(MAX_SCORE_ROWS)
        st.caption(f"The culprits and the latest ranks: {len(table)} of {total:,} (group, rank) rows.")
    table = charts.named_groups(table)   # a large group by its axis and size, never its members
    st.dataframe(table[["role", "group", "rank", "median_lateness_frac", "positive_frac", "mean_victims_wait_ns",
                        *[c for c in ("cause",) if c in table.columns]]],
                 hide_index=True, column_config={
                     "median_lateness_frac": st.column_config.NumberColumn(f"median lateness ({words})",
                                                                           format="percent"),
                     "positive_frac": st.column_config.NumberColumn("steps late", format="percent")})


def _trace_folder_arrivals(analysis, *, aligned: str) -> None:
    """A trace folder's arrivals: on the device clock when the collectives aligned the ranks' clocks (``aligned``),
    else why not."""
    if aligned.startswith("not aligned"):
        st.info("No arrival lateness for this trace folder: its ranks' clocks could not be aligned from the "
                "collectives (see above). Trace every member of a group, or record the job with `dtprobe run` "
                "or `dtprobe.attach`, whose store aligns the ranks' clocks.")
        return
    arrivals = analysis.arrival_summary()
    if arrivals.empty:
        st.info("No collective was matched on every member of its group, so no arrival lateness is measured.")
        return
    common.chart(charts.device_arrival_lateness(arrivals), key="stragglers_device_arrivals")
    words = clocks.clock_words("device")
    st.dataframe(arrivals[["pg", "rank", "num_collectives", "last_frac", "median_lateness_us", "caused_wait_us"]],
                 hide_index=True, column_config={
                     "num_collectives": st.column_config.NumberColumn("matched collectives"),
                     "last_frac": st.column_config.NumberColumn("started last", format="percent"),
                     "median_lateness_us": st.column_config.NumberColumn(f"median lateness (µs, {words})",
                                                                         format="%.1f"),
                     "caused_wait_us": st.column_config.NumberColumn(f"peers' wait it caused, total (µs, {words})",
                                                                     format="%.1f")})


source = common.page_setup("Stragglers")
common.render(source, body)
