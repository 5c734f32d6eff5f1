"""Each fault's recovery (the `recovery` records a `scaletrain chaos` drill writes): when it struck,
when the job saw it, when it trained again, what it lost and where its state came back from."""

from __future__ import annotations

import streamlit as st
from sqlalchemy import Engine

from ckptd.readpath import describe_sources
from telemetry.views.run import recoveries

NO_RECOVERIES = (
    "No recoveries recorded for this run: `scaletrain chaos` writes one per fault it injects "
    "(injected, detected, first step after, MTTR, steps lost, what restored the state)."
)
# The table's columns, as the page names them.
SHOWN = {
    "kind": "kind", "target": "target", "step": "step", "injected": "injected",
    "detected_s": "detected s", "first_step": "first step", "first_step_s": "first step s",
    "mttr_s": "MTTR s", "steps_lost": "steps lost", "restored_from": "restored from",
    "spare": "spare", "in_job": "in-job", "badput_s": "cost s",
}  # fmt: skip


def render(engine: Engine, run_id: str) -> None:
    st.subheader("Recoveries")
    records = recoveries(engine, run_id)
    if records.empty:
        st.info(NO_RECOVERIES)
        return
    # As text: Arrow cannot hold dicts whose keys differ from row to row.
    restored = records["restored_from"].map(
        lambda copies: describe_sources(copies) if copies else ""
    )
    st.dataframe(
        records.assign(restored_from=restored)[list(SHOWN)].rename(columns=SHOWN),
        hide_index=True,
    )
    st.caption(
        f"{len(records)} fault(s), oldest first; seconds after each fault struck. Detected: its "
        "first sign (a rank's failure, a watchdog, a failed save, ckptd's S3 error, ...); first "
        "step: the first completed after the restart, or after the fault ended for one the job "
        "rode through; steps lost: computed again; cost: the fault's badput. Pink bands on the "
        "loss curve: the steps each recovery spans."
    )
