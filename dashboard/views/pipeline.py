"""Pipeline: stage × time Gantt of F/B/W per micro-batch for one step, measured vs ideal bubble."""

from __future__ import annotations

import streamlit as st

from dtprobe.dashboard import charts, common


def body(source) -> None:
    analysis = common.load(source)
    common.show_findings(common.findings_with_evidence(source, analysis, {"PIPELINE_BUBBLE": "pipeline_findings"}),
                         key="pipeline")
    pipe = analysis.table("pipeline")
    if pipe.empty:
        st.info("This run has no pipeline actions: it is not pipeline-parallel (run with --pp 2 or more).")
        return
    shape = analysis.pipeline_shape()
    ideal = (analysis.metrics().get("pipeline") or {}).get("ideal_bubble_frac")
    if shape is not None:
        st.caption(f"Schedule {shape.schedule} ({shape.schedule_source}), {shape.num_ranks} ranks, "
                   f"{shape.num_stages} stages, {shape.num_microbatches} micro-batches")
    step_ids = sorted(int(s) for s in pipe["step"].dropna().unique())
    step = step_ids[-1] if len(step_ids) == 1 else st.select_slider("Step", step_ids, value=step_ids[-1],
                                                                       key="pipeline_step")
    common.chart(charts.pipeline_gantt(pipe[pipe["step"] == step]), key="pipeline_gantt")
    by_rank = analysis.bubble_by_rank()
    if not by_rank.empty:
        common.chart(charts.bubble_measured_vs_ideal(by_rank, ideal_frac=ideal), key="pipeline_bubble")


source = common.page_setup("Pipeline")
common.render(source, body)
