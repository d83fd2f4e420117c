"""Streamlit entry point of `dtprobe dashboard`: routes to the pages, nothing else."""

from __future__ import annotations

import streamlit as st

from dtprobe.dashboard.nav import PAGES


def main() -> None:
    st.set_page_config(page_title="dtprobe", page_icon="📈", layout="wide")
    pages = [st.Page(page.path, title=page.title, icon=page.icon, url_path=page.url_path, default=page.default)
             for page in PAGES]
    st.navigation(pages).run()


main()
