"""Every rank at a glance: a ranks x steps heatmap, each rank's phase breakdown and its straggler
score, so one slow rank stands out among 64."""

from __future__ import annotations

import streamlit as st
from sqlalchemy import Engine

from telemetry import views
from ui import charts

HEATMAP_STEPS = 150
PHASE_WINDOW = 20
# What the heatmap can show; own compute first: in synchronous training every rank's step takes
# as long as the slowest one's, so only the time a rank spends on its own work tells them apart.
HEATMAP_METRICS = {
    "compute_s": "compute (own work)",
    "step_s": "step time",
    "comm_wait_s": "communication wait",
    "data_s": "data loading",
    "forward_s": "forward",
    "backward_s": "backward",
    "optimizer_s": "optimizer",
}


def render(engine: Engine, run_id: str) -> None:
    st.subheader("Ranks")
    steps = views.rank_steps(engine, run_id, max_steps=HEATMAP_STEPS)
    if steps.empty:
        st.info("No per-rank records yet: each rank reports its step and phase times here.")
        return
    metric = st.selectbox(
        "Heatmap of", list(HEATMAP_METRICS), format_func=HEATMAP_METRICS.__getitem__
    )
    st.altair_chart(charts.rank_heatmap(steps, metric), width="stretch")
    st.caption(
        f"Ranks x steps ({steps['step'].nunique():,} steps spread over the run), coloured by "
        "each rank's time over the median rank's at that step: a straggler is a bright row."
    )
    phases = views.rank_phases(engine, run_id, window=PHASE_WINDOW)
    breakdown, scores = st.columns(2)
    with breakdown:
        st.markdown(f"**Phase breakdown** (mean of the latest {PHASE_WINDOW} steps)")
        st.altair_chart(charts.phase_chart(phases), width="stretch")
    with scores:
        st.markdown("**Straggler scores** (peers' median compute time over the rank's own)")
        st.altair_chart(charts.straggler_chart(phases), width="stretch")
    slow = phases[phases["relative_score"] < charts.StragglerPolicy().slow_below]
    if len(slow):
        listed = ", ".join(
            f"rank {int(r.rank)} ({r.relative_score:.2f})" for r in slow.itertuples()
        )
        st.warning(f"Slower than their peers now: {listed}.")
