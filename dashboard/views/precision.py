"""Precision: loss, loss scale and AMP overflow markers over the step axis."""

from __future__ import annotations

import streamlit as st

from dtprobe.dashboard import charts, common


def body(source) -> None:
    analysis = common.load(source)
    common.show_findings(common.findings_with_evidence(source, analysis, {"AMP_OVERFLOW": "amp_findings"}),
                         key="precision")
    amp = analysis.amp_steps()
    overflow_steps = amp.loc[amp["overflow"].fillna(False).astype(bool), "step"].tolist() if not amp.empty else []
    steps = analysis.table("steps")
    if steps["loss"].notna().any():
        common.chart(charts.loss_curve(steps, overflow_steps=overflow_steps), key="precision_loss")
    else:
        st.info("No loss recorded for this source.")
    if amp.empty:
        st.info("No loss-scale telemetry: the run did not use fp16 with a GradScaler (--precision fp16).")
        return
    st.metric("overflow steps", f"{len(overflow_steps)} of {len(amp)}")
    common.chart(charts.loss_scale(amp), key="precision_scale")


source = common.page_setup("Precision")
common.render(source, body)
