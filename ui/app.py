"""The scaletrain run-health dashboard: a runs overview and one health page per run.

Start it with `scaletrain ui`, or `SCALETRAIN_DB_URL=URL streamlit run ui/app.py`. It opens the
database read-only, so it cannot disturb a run it watches. The pages live in `ui.pages`; this file
only sets the page up and routes between them.
"""

from __future__ import annotations

import streamlit as st

from ui.routes import run_page, runs_page


def main() -> None:
    st.set_page_config(page_title="scaletrain", layout="wide")
    st.navigation([runs_page(), run_page()], position="top").run()


# Streamlit runs this file as __main__.
if __name__ == "__main__":
    main()
