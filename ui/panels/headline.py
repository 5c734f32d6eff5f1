"""Headline figures with trends: step, loss, tokens/s, MFU, goodput, time since the last
committed checkpoint."""

from __future__ import annotations

import math
from collections.abc import Callable
from datetime import UTC, datetime

import streamlit as st
from sqlalchemy import Engine
from streamlit.delta_generator import DeltaGenerator

from telemetry.views.run import headline
from ui import charts
from ui.source import cached_goodput, database_url

TREND_WINDOW = 20


def render(engine: Engine, run_id: str) -> Callable[[], None]:
    """Draw the figures; return what fills in the goodput, to call once the rest is drawn (it is
    the one figure that reads the whole run)."""
    figures = headline(engine, run_id, window=TREND_WINDOW)
    st.title(f"{run_id}")
    st.caption(
        f"Status **{figures.status}**. Trends compare the latest {TREND_WINDOW} steps with the "
        f"{TREND_WINDOW} before. {figures.mfu_label}."
    )
    step, loss, speed, mfu, goodput_column, checkpoint = st.columns(6)
    goodput_slot = goodput_column.empty()
    step.metric("step", "—" if figures.last_step is None else f"{figures.last_step:,}")
    loss.metric(
        "loss",
        _number(figures.loss, ".4f"),
        _delta(figures.loss, figures.previous_loss, ".4f"),
        delta_color="inverse",
    )
    speed.metric(
        "tokens/s",
        _number(figures.tokens_per_s, ",.0f"),
        _delta(figures.tokens_per_s, figures.previous_tokens_per_s, ",.0f"),
    )
    mfu.metric("MFU", _number(figures.mfu, ".1%"), _delta(figures.mfu, figures.previous_mfu, ".2%"))
    goodput_slot.metric("goodput", "…", help="computing: reads the whole run's step rollups")
    if figures.last_checkpoint_at is None:
        checkpoint.metric("last checkpoint", "none", help="no checkpoint committed on any tier")
    else:
        age = datetime.now(UTC) - figures.last_checkpoint_at
        checkpoint.metric(
            "since last checkpoint",
            _duration(age.total_seconds()),
            f"step {figures.last_checkpoint:,}",
            delta_color="off",
            delta_arrow="off",
        )
    return lambda: _fill_goodput(goodput_slot, run_id)


def _fill_goodput(slot: DeltaGenerator, run_id: str) -> None:
    """The whole-run goodput in its slot, and where the rest of the time went."""
    result = cached_goodput(database_url() or "", run_id)
    slot.metric(
        "goodput",
        _number(result.goodput, ".1%"),
        help="productive time over wall time since launch (whole run)",
    )
    if result.wall_s > 0:
        st.subheader("Where the time went")
        st.altair_chart(charts.badput_chart(result.badput_s, result.productive_s), width="stretch")


def _number(value: float, spec: str) -> str:
    return "—" if value is None or math.isnan(value) else format(value, spec)


def _delta(now: float, before: float, spec: str) -> str | None:
    if math.isnan(now) or math.isnan(before):
        return None
    return format(now - before, "+" + spec)


def _duration(seconds: float) -> str:
    seconds = max(seconds, 0.0)
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    if seconds < 172800:
        return f"{seconds / 3600:.1f} h"
    return f"{seconds / 86400:.1f} d"
