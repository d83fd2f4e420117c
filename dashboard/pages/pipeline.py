"""Pipeline: placeholder until the page is drawn."""

from __future__ import annotations

import streamlit as st

from dashboard import common

source = common.page_setup("Pipeline")
st.info("This page is not drawn yet.")
