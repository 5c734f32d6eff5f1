"""The loss curve with markers for checkpoints, restarts, loss spikes, SDC events, replays and
recoveries, and the throughput, both from the step rollups (one row per step, whatever the world
size)."""

from __future__ import annotations

import streamlit as st
from sqlalchemy import Engine

from telemetry.views import run
from ui import charts

MAX_POINTS = 1000


def render(engine: Engine, run_id: str) -> None:
    st.subheader("Loss and throughput")
    points = run.loss_points(engine, run_id, max_points=MAX_POINTS)
    if points.empty:
        st.info(
            "No steps recorded for this run yet: its ranks report each step as they train. "
            "If the run started minutes ago, check that its telemetry service is reachable."
        )
        return
    markers = run.markers(engine, run_id)
    evals = run.eval_points(engine, run_id)
    recoveries = run.recoveries(engine, run_id)
    st.altair_chart(charts.loss_chart(points, markers, evals, recoveries), width="stretch")
    first, last = int(points["step"].min()), int(points["step"].max())
    sampled = len(points) < last - first + 1
    st.altair_chart(charts.throughput_chart(points), width="stretch")
    st.caption(
        "From the step rollups. Mean loss over ranks, the band spans the ranks' minimum to "
        "maximum; tokens/s is all ranks' tokens over the slowest rank's step time"
        + (
            " (dashed grey, on the right: the ranks that trained each step, where an elastic "
            "job changed size). "
            if points["ranks"].nunique() > 1
            else ". "
        )
        + (
            f"{len(points):,} of the {last - first + 1:,} steps are drawn, spread evenly; "
            "loss spikes the detector found are marked whether drawn or not. "
            if sampled
            else f"Every one of the {len(points):,} steps is drawn. "
        )
        + (
            f"Dashed with points: the validation loss on held-out data, at each of its "
            f"{len(evals):,} evaluations. "
            if not evals.empty
            else ""
        )
        + "Green triangles along the bottom: checkpoints; lines: grey restarts, orange loss "
        "spikes, red silent data corruption, purple replays"
        + ("; pink bands: recoveries from injected faults" if not recoveries.empty else "")
        + ". Scroll to zoom, drag to pan."
    )
