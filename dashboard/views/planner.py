"""Planner: rank parallel layouts of a model on a cluster by memory and predicted step time (dtprobe.planner)."""

from __future__ import annotations

import streamlit as st

from dtprobe.dashboard import charts, common, data
from dtprobe.planner import GPU_PRESETS, MODEL_PRESETS
from dtprobe.store.errors import ConfigError

TIME_TERMS = ["compute_s", "recompute_s", "tp_comm_s", "dp_sync_s", "zero3_gather_s", "pp_p2p_s", "bubble_s",
              "optimizer_s", "overhead_s"]
SHOWN = ["rank", "dp", "tp", "pp", "zero", "micro_batch", "grad_accum", "recompute", "schedule", "virtual_stages",
         "total_gib", "step_time_s", "tokens_per_s", "mfu_frac", "why"]


def body(source) -> None:
    st.caption("Predicted by the planner's memory and step-time model (docs/planner.md); "
               "`dtprobe plan --calibrate RUN` refits it on a measured run.")
    with st.form("planner_form"):
        left, mid, right = st.columns(3)
        model = left.selectbox("Model", list(MODEL_PRESETS), index=list(MODEL_PRESETS).index("llama3-8b"))
        gpu = left.selectbox("GPU", list(GPU_PRESETS), index=list(GPU_PRESETS).index("h100-80"))
        num_gpus = mid.number_input("GPUs", min_value=1, value=64, step=8)
        gpus_per_node = mid.number_input("GPUs per node", min_value=1, value=8)
        seq_len = right.number_input("Sequence length", min_value=128, value=4096, step=512)
        global_batch = right.number_input("Global batch (sequences)", min_value=1, value=256)
        precision = left.selectbox("Precision", ["bf16", "fp16", "fp8", "fp32"])
        top_k = mid.number_input("Layouts to show", min_value=1, max_value=20, value=5)
        submitted = st.form_submit_button("Plan", type="primary")
    if submitted or "planner_last" in st.session_state:
        inputs = (model, gpu, int(num_gpus), int(gpus_per_node), int(seq_len), int(global_batch), precision,
                  int(top_k))
        st.session_state["planner_last"] = True
        try:
            layouts, rejected = data.load_plan(*inputs)
        except ConfigError as exc:
            st.error(str(exc))
            return
        if layouts.empty:
            st.warning(f"No layout fits. Closest: {rejected['reason'].iloc[0] if not rejected.empty else '-'}")
        else:
            st.subheader("Best layouts")
            st.dataframe(layouts[SHOWN], hide_index=True, column_config={
                "mfu_frac": st.column_config.NumberColumn("MFU", format="percent")})
            common.chart(charts.plan_breakdown(layouts, terms=TIME_TERMS), key="planner_breakdown")
        if not rejected.empty:
            with st.expander(f"Layouts that do not fit ({len(rejected)})"):
                st.dataframe(rejected.head(50), hide_index=True)


source = common.page_setup("Planner")
common.render(source, body, live=False)
