"""The runs overview: every run with its status and latest figures, sortable, linked to its page."""

from __future__ import annotations

import pandas as pd
import streamlit as st
from pandas.io.formats.style import Styler

from telemetry.views.common import live
from telemetry.views.overview import runs_table
from ui.routes import RUN_PARAM, run_page
from ui.source import (
    NO_RUNS,
    REFRESH_S,
    cached_goodput,
    database_url,
    explained_errors,
    open_database,
)

STATUS_COLOURS = {
    "running": "#1a7f37",
    "restarting": "#bf8700",
    "finished": "#0969da",
    "failed": "#cf222e",
}


def render() -> None:
    st.title("Runs")
    with explained_errors():
        engine = open_database()
        if engine is None:
            return
        running = live(engine)
        st.fragment(show, run_every=REFRESH_S if running else None)()


def show() -> None:
    """The table of runs, filled in twice: at once, then with each run's goodput."""
    with explained_errors():
        engine = open_database()
        if engine is None:
            return
        runs = runs_table(engine)
        if runs.empty:
            st.info(NO_RUNS)
            return
        st.caption(
            "Figures are over each run's latest 20 steps; open alerts are alert, straggler, SDC "
            "and loss-spike events since the run's latest (re)start, less the loss spikes the "
            "data caused (closed once the replay found them). Click a column to sort."
        )
        table = st.empty()
        table.dataframe(_display(runs, goodputs=None), **_TABLE)
        ids = list(runs["run_id"])
        chosen = st.selectbox("Open a run", ids, format_func=lambda r: _label(runs, r))
        if chosen is not None:
            st.page_link(
                run_page(),
                label=f"Open the health page of {chosen}",
                icon=":material/monitor_heart:",
                query_params={RUN_PARAM: chosen},
            )
        url = database_url() or ""
        goodputs = [cached_goodput(url, run_id).goodput for run_id in ids]
        table.dataframe(_display(runs, goodputs=goodputs), **_TABLE)


_TABLE = {
    "hide_index": True,
    "column_config": {
        "open": st.column_config.LinkColumn("open", display_text="health page"),
        "status": st.column_config.TextColumn("status"),
        "loss": st.column_config.NumberColumn("loss", format="%.4f"),
        "tokens_per_s": st.column_config.NumberColumn("tokens/s", format="%.0f"),
        "mfu": st.column_config.NumberColumn("MFU", format="percent"),
        "goodput": st.column_config.NumberColumn("goodput", format="percent"),
        "last_checkpoint": st.column_config.NumberColumn("last checkpoint", format="%d"),
        "last_checkpoint_at": st.column_config.DatetimeColumn("checkpoint committed"),
        "open_alerts": st.column_config.NumberColumn("open alerts", format="%d"),
        "started_at": st.column_config.DatetimeColumn("started"),
    },
}


def _display(runs: pd.DataFrame, goodputs: list[float] | None) -> Styler:
    """The overview as shown: coloured status, goodput (None while it is computed), a link."""
    shown = runs.assign(
        goodput=goodputs if goodputs is not None else None,
        open=[f"./run?{RUN_PARAM}={run_id}" for run_id in runs["run_id"]],
    )
    columns = ["open", "run_id", "name", "status", "step", "loss", "tokens_per_s", "mfu",
               "goodput", "last_checkpoint", "last_checkpoint_at", "open_alerts", "world_size",
               "attempt", "started_at"]  # fmt: skip
    return shown[columns].style.map(
        lambda status: f"color: {STATUS_COLOURS.get(status, 'inherit')}; font-weight: bold",
        subset=["status"],
    )


def _label(runs: pd.DataFrame, run_id: str) -> str:
    row = runs[runs["run_id"] == run_id].iloc[0]
    return f"{run_id} ({row['name'] or 'unnamed'}, {row['status']})"


# Streamlit runs this file as the page; tests import it.
if __name__ == "__main__":
    render()
