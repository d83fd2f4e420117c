"""Timeline: per-rank Gantt of steps (phases), collectives and pipeline actions over a chosen step window."""

from __future__ import annotations

import streamlit as st

from dtprobe.dashboard import charts, common, data

MAX_RANKS = 16  # ranks drawn at once (a 64-rank Gantt is unreadable); the rest are chosen in the rank filter
MANY_RANKS = 64
"""Above this many ranks, the default choice is the ranks the findings name and the slowest (by median step time),
and at most ``MAX_CHOSEN`` ranks can be chosen, so the Gantt stays bounded."""
MAX_CHOSEN = 32


def default_ranks(steps, marked: list[int], named: list[int]) -> list[int]:
    """The ranks the Timeline draws first: every rank up to ``MAX_RANKS``; up to ``MANY_RANKS`` the ``marked`` ones
    and the lowest; beyond, the ``marked`` and ``named`` ranks then the slowest by median step time, ``MAX_RANKS`` in
    all."""
    ranks = sorted(int(r) for r in steps["rank"].unique())
    if len(ranks) <= MAX_RANKS:
        return ranks
    if len(ranks) <= MANY_RANKS:
        return sorted(set(marked) | set(ranks[:MAX_RANKS - len(marked)]))
    step_ns = (steps["end_ns"] - steps["start_ns"]).astype("float64")
    slowest = step_ns.groupby(steps["rank"]).median().sort_values(ascending=False, kind="stable").index
    known = set(ranks)
    first = [r for r in dict.fromkeys([*marked, *named]) if r in known][:MAX_CHOSEN]
    chosen = list(dict.fromkeys([*first, *(int(r) for r in slowest)]))
    return sorted(chosen[:max(MAX_RANKS, len(first))])


def body(source) -> None:
    analysis = common.load(source)
    findings = common.findings_with_evidence(source, analysis, {"HANG": "hangs", "RANK_CRASH": "hangs"})
    common.show_findings(findings, key="timeline")
    steps = analysis.table("steps")
    if steps.empty:
        st.info("No steps recorded yet.")
        return
    step_ids = sorted(int(s) for s in steps["step"].dropna().unique())
    first, last = step_ids[0], step_ids[-1]
    if first == last:
        window = (first, last)
    else:
        window = st.slider("Steps", first, last, (max(first, last - 2), last), key="timeline_steps",
                           help="Zoom: pick one step (both ends equal) or a few.")
    ranks = sorted(int(r) for r in steps["rank"].unique())
    marked = common.marked_ranks()
    default = default_ranks(steps, marked, [r for f in data.finding_lines(source, analysis)
                                            if len(f.ranks) <= MAX_RANKS for r in f.ranks])
    many = len(ranks) > MANY_RANKS
    chosen = st.multiselect("Ranks", ranks, default=default, key="timeline_ranks",
                            max_selections=MAX_CHOSEN if many else None,
                            help=f"{len(ranks)} ranks: first the ranks the findings name, then the slowest by median "
                                 f"step time; at most {MAX_CHOSEN} at once." if many else None)
    rows = data.load_window(source, analysis, ("steps", "collectives", "pipeline"), steps=window, ranks=chosen)
    fig = charts.timeline(rows["steps"], rows["collectives"], rows["pipeline"], marked=marked)
    common.chart(fig, key="timeline_gantt")
    if analysis.status == "finished":  # last activity matters while a run may hang
        return
    last_seen = analysis.last_seen()
    if not last_seen.empty:
        st.subheader("Last activity per rank")
        if len(last_seen) > common.MAX_TABLE_ROWS:
            st.caption(f"The first {common.MAX_TABLE_ROWS:,} of {len(last_seen):,} ranks.")
        st.dataframe(last_seen.head(common.MAX_TABLE_ROWS), hide_index=True)


source = common.page_setup("Timeline")
common.render(source, body)
