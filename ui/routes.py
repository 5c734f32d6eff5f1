"""The dashboard's pages and their addresses: the runs overview at /, a run's health page at
/run?run=RUN_ID (a link an on-call engineer can paste)."""

from __future__ import annotations

from pathlib import Path

import streamlit as st

RUN_PARAM = "run"
PAGES = Path(__file__).resolve().with_name("pages")


def runs_page() -> st.Page:
    return st.Page(PAGES / "overview.py", title="Runs", icon=":material/list:", default=True)


def run_page() -> st.Page:
    return st.Page(
        PAGES / "run_health.py", title="Run health", icon=":material/monitor_heart:", url_path="run"
    )
