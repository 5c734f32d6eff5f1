"""Starts the dashboard (ui/app.py) as a Streamlit server in a child process.

A child process because Streamlit owns its process (its own event loop, signal handlers and script
reruns); the caller only chooses the database, host and port. The database URL goes to the child
in its environment (SCALETRAIN_DB_URL), not on its command line, which any user can read with `ps`
and which would show a PostgreSQL password.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

# The variable that carries the database URL to the dashboard; kept here, away from Streamlit's
# imports, so that `scaletrain ui` can report a bad command line without starting Streamlit.
DB_ENV = "SCALETRAIN_DB_URL"

APP_PATH = Path(__file__).resolve().with_name("app.py")
# How long Streamlit may take to stop after Ctrl-C before it is killed.
_STOP_TIMEOUT_S = 10.0


def ui_command(host: str = "127.0.0.1", port: int = 8501) -> list[str]:
    """The command line that serves the dashboard on http://HOST:PORT (the database comes from
    SCALETRAIN_DB_URL in its environment)."""
    return [
        sys.executable,
        "-m",
        "streamlit",
        "run",
        str(APP_PATH),
        "--server.headless",
        "true",
        "--server.address",
        host,
        "--server.port",
        str(port),
        "--browser.gatherUsageStats",
        "false",
    ]


def ui_environment(db_url: str) -> dict[str, str]:
    """This process's environment with the database URL for the dashboard."""
    return {**os.environ, DB_ENV: db_url}


def run_ui(db_url: str, host: str = "127.0.0.1", port: int = 8501) -> int:
    """Serve the dashboard until Streamlit exits; return its exit status.

    On Ctrl-C, Streamlit (in the same process group, so it got the signal too) is given time to
    stop, killed if it does not, and KeyboardInterrupt is raised again for the caller to handle.
    """
    process = subprocess.Popen(ui_command(host, port), env=ui_environment(db_url))
    try:
        return process.wait()
    except KeyboardInterrupt:
        process.terminate()
        try:
            process.wait(timeout=_STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        raise
