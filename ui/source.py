"""Where the dashboard reads from: the database URL (from the environment only), one read-only
engine per URL, and every database problem turned into a message on the page.

The URL travels in SCALETRAIN_DB_URL, never on the command line: a PostgreSQL URL may hold a
password, and every user of the machine can read a process's arguments (`ps`).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

import streamlit as st
from sqlalchemy import Engine, inspect
from sqlalchemy.exc import SQLAlchemyError

from scaletrain.errors import UserError
from telemetry.db import MissingDatabase, connect
from telemetry.efficiency import Goodput, goodput
from ui.launch import DB_ENV

NO_RUNS = "No runs yet: run `scaletrain run` to start one; its ranks report here as they train."
NO_URL = (
    f"No telemetry database given: start the UI with `scaletrain ui --db URL` "
    f"(or `--workdir DIR`), or set {DB_ENV}."
)


def database_url() -> str | None:
    """The URL in SCALETRAIN_DB_URL, or None."""
    return os.environ.get(DB_ENV) or None


@st.cache_resource(show_spinner=False)
def read_only_engine(url: str) -> Engine:
    """One read-only engine per URL for the whole app (a failure is not cached: retried later)."""
    return connect(url, read_only=True)


def open_database() -> Engine | None:
    """The read-only engine of a database that holds the telemetry schema; None after telling
    the user why there is nothing to show."""
    url = database_url()
    if url is None:
        st.info(NO_URL)
        return None
    engine = read_only_engine(url)
    if not inspect(engine).has_table("runs"):
        st.info(NO_RUNS)
        return None
    return engine


@contextmanager
def explained_errors() -> Iterator[None]:
    """Show a database problem as one line on the page instead of a traceback."""
    try:
        yield
    except MissingDatabase as exc:
        st.info(f"{exc}. {NO_RUNS}")
    except UserError as exc:
        st.error(str(exc))
    except SQLAlchemyError as exc:
        reason = str(getattr(exc, "orig", None) or exc).strip().splitlines()[0]
        st.error(f"Cannot read the telemetry database: {reason}")


# How often a page showing a live run reruns, and how long a whole-run figure is reused.
REFRESH_S = 10
GOODPUT_TTL_S = 60


@st.cache_data(ttl=GOODPUT_TTL_S, show_spinner=False, max_entries=256)
def cached_goodput(url: str, run_id: str) -> Goodput:
    """Goodput of `run_id`, at most GOODPUT_TTL_S old.

    Cached because it is the one figure that reads the whole run (its step rollups: one row per
    step, a million on a long run): a live page refreshing every REFRESH_S must not recompute it
    each time. Pages draw everything else first and fill it in last.
    """
    return goodput(read_only_engine(url), run_id)
