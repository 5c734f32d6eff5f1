"""`scaletrain telemetry`: serve the telemetry service, export a stored run's curves, or show a
run's health."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
from pathlib import Path

from scaletrain.app.commands.common import print_tensorboard, reading_db, security_args, workdir_arg
from scaletrain.errors import UserError


def register(sub: argparse._SubParsersAction) -> None:
    tel = sub.add_parser(
        "telemetry", help="serve the telemetry service, or export a stored run's curves"
    )
    tel.set_defaults(handler=_telemetry)
    tel.add_argument(
        "action",
        nargs="?",
        choices=("serve", "export", "health"),
        default="serve",
        help="serve (default); export: write --run's scalars as TensorBoard event files; "
        "health: a run's MFU, goodput and badput by cause, stragglers, SDC and recoveries",
    )
    tel.add_argument(
        "health_run",
        nargs="?",
        metavar="RUN",
        help="health: the run (default, or latest/last: the work directory's last run)",
    )
    tel.add_argument("--tensorboard", type=Path, metavar="DIR", help="export: write under DIR/RUN")
    tel.add_argument("--run", help="export: the run")
    tel.add_argument("--json", action="store_true", help="health: print it as JSON")
    workdir_arg(tel)
    tel.add_argument("--listen", default="127.0.0.1:50052", help="HOST:PORT")
    tel.add_argument(
        "--db",
        help="database URL without a password (default: $SCALETRAIN_DB_URL, the file named by "
        "$SCALETRAIN_DB_URL_FILE, or ./telemetry.db); a password comes from "
        "$SCALETRAIN_DB_PASSWORD or $SCALETRAIN_DB_PASSWORD_FILE",
    )
    tel.add_argument(
        "--metrics",
        metavar="HOST:PORT",
        help="serve Prometheus metrics of the runs here (default: $SCALETRAIN_METRICS_LISTEN)",
    )
    tel.add_argument(
        "--keep-steps",
        metavar="N",
        help="keep per-rank rows of each run's latest N steps; rollups are kept for the whole run "
        "(default: $SCALETRAIN_TELEMETRY_KEEP_STEPS, or 1000)",
    )

    security_args(tel)


def _telemetry(args: argparse.Namespace) -> int:
    if args.action == "export":
        return _telemetry_export(args)
    if args.action == "health":
        return _telemetry_health(args)
    from scaletrain.security import ServerSecurity, database_url
    from telemetry.config import TelemetryConfig, retention_policy
    from telemetry.server import serve

    db = database_url(args.db, default="sqlite:///telemetry.db")
    metrics = args.metrics or os.environ.get("SCALETRAIN_METRICS_LISTEN") or None
    security = ServerSecurity.from_env(allow_plaintext=args.allow_plaintext)
    retention = retention_policy(args.keep_steps)
    serve(
        TelemetryConfig(
            db_url=db,
            listen=args.listen,
            metrics_listen=metrics,
            security=security,
            retention=retention,
        )
    )
    return 0


def _telemetry_export(args: argparse.Namespace) -> int:
    """`telemetry export --tensorboard DIR --run RUN`: from --db, $SCALETRAIN_DB_URL or the
    work directory's database."""
    if args.tensorboard is None or not args.run:
        raise UserError("telemetry export needs --tensorboard DIR and --run RUN")
    print_tensorboard(args.db or os.environ.get("SCALETRAIN_DB_URL"), args, args.run)
    return 0


def _telemetry_health(args: argparse.Namespace) -> int:
    """`telemetry health [RUN] [--json]`: the run's health from --db, $SCALETRAIN_DB_URL or the
    work directory's database."""
    from scaletrain.app.checkpoints import NEWEST
    from scaletrain.app.stack import Workdir
    from telemetry.health import render, run_health

    run_id = args.health_run
    if not run_id or run_id in NEWEST:
        run_id = Workdir(args.workdir).last_run_id()
        if not run_id:
            raise UserError(f"no run in {Workdir(args.workdir).root}: name one (health RUN)")
    with reading_db(args.db or os.environ.get("SCALETRAIN_DB_URL"), args) as engine:
        health = run_health(engine, run_id, max_findings=10)
    if args.json:
        print(json.dumps(dataclasses.asdict(health), indent=2, default=str))
    else:
        print(render(health))
    return 0
