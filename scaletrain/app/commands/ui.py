"""`scaletrain ui`: the run-health UI."""

from __future__ import annotations

import argparse
import os

from scaletrain.app.commands.common import telemetry_db_url, workdir_arg


def register(sub: argparse._SubParsersAction) -> None:
    ui = sub.add_parser("ui", help="open the run-health UI")
    ui.set_defaults(handler=_ui)
    workdir_arg(ui)
    ui.add_argument("--db", help="database URL (overrides --workdir)")
    ui.add_argument("--host", default="127.0.0.1", help="address to serve on (127.0.0.1)")
    ui.add_argument("--port", type=int, default=8501, help="port to serve on (8501)")


def _ui(args: argparse.Namespace) -> int:
    from ui.launch import run_ui

    db = telemetry_db_url(args.db or os.environ.get("SCALETRAIN_DB_URL"), args)
    return run_ui(db, host=args.host, port=args.port)
