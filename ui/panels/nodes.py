"""Nodes and ranks at cluster size: a nodes x steps heatmap (each node coloured by its worst rank
relative to the step's median rank), the slowest ranks and nodes now and over the run, a search
box for a rank or host, and one node opened to its ranks: their heatmap, phase breakdown and
straggler scores. A job of 2,048 nodes never sends 16,384 rows to the browser: every view reads
a bounded slice and says which."""

from __future__ import annotations

import pandas as pd
import streamlit as st
from sqlalchemy import Engine

from telemetry.views.nodes import (
    find_ranks,
    node_steps,
    rank_phases,
    rank_steps,
    ranks_of_node,
    slowest_now,
    slowest_over_run,
)
from ui import charts

HEATMAP_STEPS = 100
HEATMAP_NODES = 48
PHASE_WINDOW = 20
TOP_K = 8
OVER_RUN_STEPS = 1000
# What a node's heatmap can show; own compute first: in synchronous training every rank's step
# takes as long as the slowest one's, so only the time a rank spends on its own work tells them
# apart.
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
    st.subheader("Nodes")
    grid, total = node_steps(engine, run_id, max_steps=HEATMAP_STEPS, max_nodes=HEATMAP_NODES)
    if grid.empty:
        st.info("No per-rank records yet: each rank reports its step and phase times here.")
        return
    st.altair_chart(charts.node_heatmap(grid), width="stretch")
    shown = grid["node"].nunique()
    st.caption(
        f"{shown:,} of {total:,} nodes"
        + (" (the slowest: highest worst rank over the step's median)" if shown < total else "")
        + f" x {grid['step'].nunique():,} steps spread over the latest kept steps. Each cell is "
        "the node's slowest rank's own compute time over the median rank's at that step: a slow "
        "node is a bright row."
    )
    _slowest(engine, run_id)
    node = _chosen_node(engine, run_id, grid)
    if node is not None:
        _node(engine, run_id, node)


def _slowest(engine: Engine, run_id: str) -> None:
    """The top-k slowest ranks and nodes at the latest step and over the whole run."""
    ranks_now, nodes_now = slowest_now(engine, run_id, k=TOP_K)
    ranks_run, nodes_run, sampled = slowest_over_run(
        engine, run_id, k=TOP_K, max_steps=OVER_RUN_STEPS
    )
    now, over_run = st.columns(2)
    relative = st.column_config.NumberColumn("x median", format="%.2f")
    with now:
        st.markdown(f"**Slowest now** (the latest rolled-up step; top {TOP_K})")
        st.dataframe(
            ranks_now.drop(columns=["steps"]), hide_index=True, column_config={"relative": relative}
        )
        st.dataframe(
            nodes_now.drop(columns=["steps"]), hide_index=True, column_config={"relative": relative}
        )
    with over_run:
        st.markdown(
            f"**Slowest over the run** (how often among each step's {TOP_K} slowest ranks, at "
            f"{sampled:,} steps spread over the whole run)"
        )
        st.dataframe(ranks_run, hide_index=True, column_config={"relative": relative})
        st.dataframe(nodes_run, hide_index=True, column_config={"relative": relative})


def _chosen_node(engine: Engine, run_id: str, grid: pd.DataFrame) -> str | None:
    """The node to open: the one holding the rank or host searched for, else one picked from
    the heatmap's (slowest first)."""
    search = st.text_input("Find a rank or host", placeholder="a rank number, or part of a host")
    nodes = list(
        grid.groupby("node")["relative"].max().sort_values(ascending=False, kind="stable").index
    )
    if search.strip():
        found = find_ranks(engine, run_id, search)
        if found.empty:
            st.warning(f"No rank or host of this run matches {search.strip()!r}.")
        else:
            matches = list(dict.fromkeys(found["node"]))
            listed = ", ".join(f"rank {r} on {n}" for r, n in found.head(8).itertuples(index=False))
            more = f" and {len(found) - 8} more" if len(found) > 8 else ""
            st.caption(f"Found {listed}{more}.")
            nodes = matches + [node for node in nodes if node not in matches]
    return st.selectbox("Open a node", nodes, help="its ranks' heatmap and phase breakdown")


def _node(engine: Engine, run_id: str, node: str) -> None:
    """One node's ranks: heatmap relative to the whole job's median rank, phases, scores."""
    ranks = ranks_of_node(engine, run_id, node)
    st.markdown(f"**Node {node}**: ranks {', '.join(map(str, ranks))}")
    steps = rank_steps(engine, run_id, ranks, max_steps=HEATMAP_STEPS)
    if steps.empty:
        st.info(
            f"No per-rank rows of {node} are kept for the latest steps (retention keeps per-rank "
            "rows for a recent window only; the rollups above cover the whole run)."
        )
        return
    metric = st.selectbox(
        "Heatmap of", list(HEATMAP_METRICS), format_func=HEATMAP_METRICS.__getitem__
    )
    st.altair_chart(charts.rank_heatmap(steps, metric), width="stretch")
    st.caption(
        f"{node}'s {len(ranks)} ranks x {steps['step'].nunique():,} steps spread over the latest "
        "kept steps, coloured by each rank's time over the median of all ranks at that step."
    )
    phases = rank_phases(engine, run_id, ranks, window=PHASE_WINDOW)
    breakdown, scores = st.columns(2)
    with breakdown:
        st.markdown(f"**Phase breakdown** of {node} (mean of the latest {PHASE_WINDOW} steps)")
        st.altair_chart(charts.phase_chart(phases), width="stretch")
    with scores:
        st.markdown("**Straggler scores** (all ranks' median compute time over the rank's own)")
        st.altair_chart(charts.straggler_chart(phases), width="stretch")
    slow = phases[phases["relative_score"] < charts.StragglerPolicy().slow_below]
    if len(slow):
        listed = ", ".join(
            f"rank {int(r.rank)} ({r.relative_score:.2f})" for r in slow.itertuples()
        )
        st.warning(f"Slower than their peers now: {listed}.")
