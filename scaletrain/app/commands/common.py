"""What the commands share: the parser that reports a bad command line in one line, the flags
several commands take (--workdir, --allow-plaintext), the work directory's telemetry database, and
the badput and tier lines of `run`'s summary and `chaos`'s report."""

from __future__ import annotations

import argparse
import contextlib
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

from scaletrain.errors import UserError

if TYPE_CHECKING:
    from sqlalchemy import Engine

DEFAULT_WORKDIR = Path(".scaletrain")


class Parser(argparse.ArgumentParser):
    """argparse that reports a bad command line in one line.

    `epilog_from` makes the epilog only when help is shown, so that a command's startup does not
    import what only its help needs.
    """

    def __init__(self, *args: Any, epilog_from: Callable[[], str] | None = None, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._epilog_from = epilog_from

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")

    def format_help(self) -> str:
        if self._epilog_from is not None:
            self.epilog = self._epilog_from()
        return super().format_help()


def workdir_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--workdir", type=Path, default=DEFAULT_WORKDIR, help="state directory (./.scaletrain)"
    )


def security_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--allow-plaintext",
        action="store_true",
        help="listen without TLS on an address other than loopback (TLS: $SCALETRAIN_TLS_DIR, "
        "tokens: $SCALETRAIN_TOKENS_FILE)",
    )


def telemetry_db_url(db: str | None, args: argparse.Namespace) -> str:
    """`db`, else the URL of the work directory's telemetry database (refused where there is
    none yet)."""
    from scaletrain.app.stack import Workdir

    if db is None:
        workdir = Workdir(args.workdir)
        if not workdir.telemetry_db.exists():
            raise UserError(f"no telemetry database in {workdir.root}; run `scaletrain run` first")
        db = workdir.db_url
    return db


def reading_db(
    db: str | None, args: argparse.Namespace
) -> contextlib.AbstractContextManager[Engine]:
    """A read-only engine on `db`, else on the work directory's telemetry database."""
    from telemetry.db import reading

    return reading(telemetry_db_url(db, args))


def print_tensorboard(db: str | None, args: argparse.Namespace, run_id: str) -> None:
    """Write `run_id`'s scalars under --tensorboard and say where."""
    from telemetry.tensorboard import write_tensorboard

    with reading_db(db, args) as engine:
        logdir, count = write_tensorboard(engine, run_id, args.tensorboard)
    print(f"tensorboard: {count} scalars of run {run_id} in {logdir} "
          f"(tensorboard --logdir {args.tensorboard})", file=sys.stderr)  # fmt: skip


def join_tiers(names: list[str]) -> str:
    return ", ".join(names) or "none"


def badput_line(seconds: dict[str, float]) -> str:
    shown = [f"{cause} {value:.1f}s" for cause, value in seconds.items() if value >= 0.05]
    return ", ".join(shown) or "none"


def print_other_badput(seconds: dict[str, float], indent: int) -> None:
    """Under a badput line that shows "other": what it is."""
    if seconds.get("other", 0.0) >= 0.05:
        from telemetry.efficiency import OTHER_BADPUT

        print(f"{'':{indent}}other: {OTHER_BADPUT}")
