"""Checkpoints: a timeline of saves with blocking and background time, the tiers that hold each
one with sizes (and, for a run on several nodes, which nodes hold their part on each, the copies
of each part on other nodes and whether the step is node-loss safe), and every rank's data-loader
offset at the latest (the resume point)."""

from __future__ import annotations

import streamlit as st
from sqlalchemy import Engine

from telemetry.views.checkpoints import (
    TIERS,
    checkpoint_copies,
    checkpoint_timeline,
    resume_offsets,
)
from ui import charts

NO_CHECKPOINTS = (
    "No checkpoints for this run yet: `scaletrain run --ckpt-every N` saves one every N steps; "
    "each appears here once ckptd has committed it on a tier."
)


def render(engine: Engine, run_id: str) -> None:
    st.subheader("Checkpoints")
    timeline = checkpoint_timeline(engine, run_id)
    if timeline.empty:
        st.info(NO_CHECKPOINTS)
        return
    chart, tiers = st.columns([3, 2])
    with chart:
        st.altair_chart(charts.checkpoint_chart(timeline), width="stretch")
        st.caption(
            "Red: training blocked while the state was staged; blue: streamed to ckptd in the "
            "background while training went on."
        )
    with tiers:
        # Node names only for a run spread over several nodes: with one, they say nothing.
        spread = bool((timeline["nodes"] != "").any())
        shown = ["step", "tiers", *(["nodes"] if spread else []), "failed_tiers"]
        sizes = timeline[shown].assign(
            **{f"{tier} MB": timeline[f"{tier}_bytes"] / 1e6 for tier in TIERS}
        )
        if spread:
            copies = checkpoint_copies(engine, run_id)
            sizes = sizes.merge(copies, on="step", how="left")
            sizes["node_loss_safe"] = sizes["node_loss_safe"].map({True: "yes", False: "no"})
        st.dataframe(
            sizes.sort_values("step", ascending=False),
            hide_index=True,
            column_config={
                **{f"{tier} MB": st.column_config.NumberColumn(format="%.2f") for tier in TIERS},
                "failed_tiers": st.column_config.TextColumn("failed on"),
                "nodes": st.column_config.TextColumn("held by nodes"),
                "copies": st.column_config.TextColumn("copies of each node's part"),
                "node_loss_safe": st.column_config.TextColumn("node-loss safe"),
            },
        )
        st.caption(
            "Tiers each checkpoint was committed on, with its size there (blank: not on it)."
            + (
                " Each node holds its part (its ranks' files) on its own memory and SSD tiers: "
                '"held by nodes" names them; "copies" names every node holding a copy of each '
                "part (its own and its peer replicas), and a step is node-loss safe when each "
                "part is on 2 nodes or more. S3 holds the whole checkpoint."
                if spread
                else ""
            )
        )
    step, offsets = resume_offsets(engine, run_id)
    if step is None:
        st.info(NO_CHECKPOINTS)
        return
    st.markdown(f"**Resume point: step {step:,}** — each rank's data-loader offset there")
    if offsets.empty:
        st.warning(
            f"No rank recorded its offset at step {step}: a resume from it could not be checked."
        )
    else:
        st.dataframe(offsets, hide_index=True)
