"""The health page of one run (/run?run=RUN_ID): headline, loss and throughput, nodes and their
ranks, checkpoints, recoveries from faults, events."""

from __future__ import annotations

import streamlit as st
from sqlalchemy import Engine, select

from telemetry.models import Run
from telemetry.views.common import live
from ui.panels import checkpoints, events, headline, loss, nodes, recoveries
from ui.routes import RUN_PARAM, runs_page
from ui.source import NO_RUNS, REFRESH_S, explained_errors, open_database


def render() -> None:
    with explained_errors():
        engine = open_database()
        if engine is None:
            return
        run_id = pick_run(engine)
        if run_id is None:
            return
        running = live(engine, run_id)
        st.fragment(lambda: show(engine, run_id), run_every=REFRESH_S if running else None)()


def pick_run(engine: Engine) -> str | None:
    """The run named in the address (?run=ID), else the newest; a picker switches runs."""
    with engine.connect() as connection:
        ids = list(connection.execute(select(Run.run_id).order_by(Run.started_at.desc())).scalars())
    if not ids:
        st.info(NO_RUNS)
        return None
    wanted = st.query_params.get(RUN_PARAM)
    if wanted is not None and wanted not in ids:
        st.warning(f"No run {wanted!r} in this database: showing the newest run instead.")
    index = ids.index(wanted) if wanted in ids else 0
    top = st.columns([4, 1], vertical_alignment="bottom")
    run_id = top[0].selectbox("Run", ids, index=index)
    top[1].page_link(runs_page(), label="All runs", icon=":material/list:")
    st.query_params[RUN_PARAM] = run_id
    return run_id


def show(engine: Engine, run_id: str) -> None:
    """Every section of the page, top to bottom; the whole-run goodput is filled in last."""
    with explained_errors():
        fill_goodput = headline.render(engine, run_id)
        loss.render(engine, run_id)
        nodes.render(engine, run_id)
        checkpoints.render(engine, run_id)
        recoveries.render(engine, run_id)
        events.render(engine, run_id)
        fill_goodput()


# Streamlit runs this file as the page; tests import it.
if __name__ == "__main__":
    render()
