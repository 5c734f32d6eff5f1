"""The run's events and alerts, filterable by kind, rank and text."""

from __future__ import annotations

import json

import streamlit as st
from sqlalchemy import Engine

from telemetry import queries
from telemetry.health import HEALTH_EVENT_KINDS
from telemetry.views.run import event_kinds

LIMIT = 500


def render(engine: Engine, run_id: str) -> None:
    st.subheader("Events and alerts")
    kinds = event_kinds(engine, run_id)
    if not kinds:
        st.info(
            "No events for this run yet: run starts, checkpoints, restarts and the detectors' "
            "alerts (stragglers, loss spikes, silent data corruption) appear here."
        )
        return
    by_kind, by_rank, by_text = st.columns([3, 1, 2])
    chosen = by_kind.multiselect("Kinds", kinds, placeholder="all kinds")
    only_health = by_kind.toggle(
        "Only alerts", help=f"only {', '.join(HEALTH_EVENT_KINDS)}", value=False
    )
    rank = by_rank.text_input("Rank", placeholder="any", help="-1: events of the whole run")
    text = by_text.text_input("Message contains")
    wanted = list(chosen or kinds)
    if only_health:
        wanted = [kind for kind in wanted if kind in HEALTH_EVENT_KINDS]
    shown = queries.events(engine, run_id, kinds=wanted, limit=LIMIT)
    if rank.strip():
        try:
            shown = shown[shown["rank"] == int(rank)]
        except ValueError:
            st.error(f"Rank must be a whole number, got {rank!r}.")
            return
    if text:
        shown = shown[shown["message"].str.contains(text, case=False, regex=False)]
    st.caption(f"{len(shown)} event(s), newest first (at most the latest {LIMIT}).")
    # As text: Arrow cannot hold dicts whose keys differ from row to row.
    attributes = shown["attributes"].map(lambda value: json.dumps(value, sort_keys=True))
    st.dataframe(shown.assign(attributes=attributes), hide_index=True)
