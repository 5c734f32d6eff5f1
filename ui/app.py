"""The scaletrain dashboard: runs, loss curves, per-rank step times and events.

Start it with `scaletrain ui --db URL`, or `streamlit run ui/app.py -- --db URL`, or with the URL
in SCALETRAIN_DB_URL. It opens the database read-only, so it cannot disturb a run it watches; every
problem (no database yet, no runs yet, a database it cannot read) is explained on the page instead
of a traceback.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence

import altair as alt
import pandas as pd
import streamlit as st
from sqlalchemy import Engine, inspect
from sqlalchemy.exc import SQLAlchemyError

from scaletrain.errors import UserError
from telemetry import queries
from telemetry.db import MissingDatabase, connect
from ui.launch import DB_ENV

NO_RUNS = "No runs yet: run `scaletrain run` to start one; its ranks report here as they train."
# Above this many ranks, one line per rank is unreadable: show a ranks x steps heatmap instead.
HEATMAP_FROM_RANKS = 17


def database_url(argv: Sequence[str]) -> str | None:
    """The URL given as `--db URL` after streamlit's `--`, else SCALETRAIN_DB_URL, else None."""
    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    parser.add_argument("--db")
    known, _ = parser.parse_known_args(list(argv))
    return known.db or os.environ.get(DB_ENV) or None


@st.cache_resource(show_spinner=False)
def read_only_engine(url: str) -> Engine:
    """One read-only engine per URL for the whole app (a failure is not cached: retried later)."""
    return connect(url, read_only=True)


def loss_chart(loss: pd.DataFrame) -> alt.LayerChart:
    """Mean loss over ranks as a line, with the min-max band of each downsampled bucket."""
    base = alt.Chart(loss).encode(x=alt.X("step:Q", title="step"))
    band = base.mark_area(opacity=0.2).encode(
        y=alt.Y("loss_min:Q", title="loss"), y2=alt.Y2("loss_max:Q")
    )
    line = base.mark_line().encode(
        y=alt.Y("loss:Q", title="loss"), tooltip=["step", "loss", "loss_min", "loss_max"]
    )
    return band + line


def step_time_chart(times: pd.DataFrame) -> alt.Chart:
    """Step seconds per rank: one line per rank, or a heatmap when there are many ranks."""
    if times["rank"].nunique() < HEATMAP_FROM_RANKS:
        return (
            alt.Chart(times)
            .mark_line()
            .encode(
                x=alt.X("step:Q", title="step"),
                y=alt.Y("step_s:Q", title="step seconds"),
                color=alt.Color("rank:N", title="rank"),
                tooltip=["step", "rank", "step_s"],
            )
        )
    return (
        alt.Chart(times)
        .mark_rect()
        .encode(
            x=alt.X("step:O", title="step", axis=alt.Axis(labelOverlap=True)),
            y=alt.Y("rank:O", title="rank"),
            color=alt.Color("step_s:Q", title="step seconds", scale=alt.Scale(scheme="viridis")),
            tooltip=["step", "rank", "step_s"],
        )
    )


def show_run(engine: Engine, run_id: str) -> None:
    """Loss, step times and events of one run."""
    loss_column, times_column = st.columns(2)
    with loss_column:
        st.subheader("Loss")
        loss = queries.loss_curve(engine, run_id)
        if loss.empty:
            st.info("No steps recorded for this run yet.")
        else:
            st.altair_chart(loss_chart(loss), width="stretch")
    with times_column:
        st.subheader("Step time per rank")
        times = queries.rank_step_times(engine, run_id)
        if times.empty:
            st.info("No steps recorded for this run yet.")
        else:
            st.altair_chart(step_time_chart(times), width="stretch")
    st.subheader("Events")
    run_events = queries.events(engine, run_id)
    if run_events.empty:
        st.info("No events for this run yet: checkpoints, restarts and alerts appear here.")
    else:
        # As text: Arrow cannot hold dicts whose keys differ from row to row.
        attributes = run_events["attributes"].map(lambda value: json.dumps(value, sort_keys=True))
        st.dataframe(run_events.assign(attributes=attributes), hide_index=True)


def show(url: str) -> None:
    """The runs table, the run picker and the chosen run."""
    engine = read_only_engine(url)
    if not inspect(engine).has_table("runs"):
        st.info(NO_RUNS)
        return
    runs = queries.runs_overview(engine)
    if runs.empty:
        st.info(NO_RUNS)
        return
    st.subheader("Runs")
    st.dataframe(runs, hide_index=True)
    labels = {
        row.run_id: f"{row.run_id} ({row.name or 'unnamed'}, {row.status})"
        for row in runs.itertuples()
    }
    run_id = st.selectbox("Run", list(labels), format_func=labels.__getitem__)
    if run_id is not None:
        show_run(engine, run_id)


def main() -> None:
    st.set_page_config(page_title="scaletrain", layout="wide")
    st.title("scaletrain")
    st.button("Refresh")
    url = database_url(sys.argv[1:])
    if url is None:
        st.info(
            f"No telemetry database given: start the UI with `scaletrain ui --db URL`, "
            f"or set {DB_ENV}."
        )
        return
    try:
        show(url)
    except MissingDatabase as exc:
        st.info(f"{exc}. {NO_RUNS}")
    except UserError as exc:
        st.error(str(exc))
    except SQLAlchemyError as exc:
        reason = str(getattr(exc, "orig", None) or exc).strip().splitlines()[0]
        st.error(f"Cannot read the telemetry database: {reason}")


# Streamlit runs this file as __main__; tests import it for its chart builders.
if __name__ == "__main__":
    main()
