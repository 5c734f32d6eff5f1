"""Engines, sessions and migrations of the telemetry database (SQLite or PostgreSQL).

Every engine of the project is made by `connect`, so both databases get the same guarantees:
foreign keys enforced, writers that wait for each other instead of failing, and a read-only mode
that the database itself enforces (the UI must never write).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from alembic import command
from alembic.config import Config
from sqlalchemy import Connection, Engine, create_engine, event
from sqlalchemy.engine import URL, make_url
from sqlalchemy.exc import ArgumentError
from sqlalchemy.orm import Session, sessionmaker

from scaletrain.errors import UserError
from scaletrain.security import redact_url

MIGRATIONS_DIR = Path(__file__).resolve().with_name("migrations")
# Not Alembic's default name: the telemetry schema may share a PostgreSQL database with others.
VERSION_TABLE = "telemetry_alembic_version"
# How long an SQLite writer waits for another one before giving up.
SQLITE_BUSY_TIMEOUT_MS = 10_000
# Key of the PostgreSQL advisory lock that serialises concurrent migrations of one database.
_MIGRATION_LOCK_KEY = 0x5C41E7E1


class MissingDatabase(UserError):
    """A read-only open of an SQLite file that does not exist (yet): nothing has been recorded."""


@contextmanager
def reading(url: str) -> Iterator[Engine]:
    """A read-only engine on `url` for one query or report, disposed after it (a command that
    reads and exits, a test or a benchmark reading a finished run)."""
    engine = connect(url, read_only=True)
    try:
        yield engine
    finally:
        engine.dispose()


def connect(url: str, *, read_only: bool = False) -> Engine:
    """An engine for `url`: `sqlite:///PATH` or `postgresql+psycopg://USER@HOST:PORT/DB`.

    `postgresql://` means psycopg (version 3), the driver the project installs. With `read_only`
    the database refuses writes: SQLite opens the file with `mode=ro` (and never creates it),
    PostgreSQL starts every transaction read-only. Raises UserError with one line for a bad URL,
    MissingDatabase when a read-only SQLite file does not exist.
    """
    try:
        parsed = make_url(url)
    except (ArgumentError, ValueError):  # ValueError: a port that is not a number
        raise UserError(
            f"bad database URL {redact_url(url)!r}: expected sqlite:///PATH or "
            "postgresql+psycopg://HOST/DB"
        ) from None
    backend = parsed.get_backend_name()
    if backend == "sqlite":
        return _connect_sqlite(parsed, read_only)
    if backend == "postgresql":
        return _connect_postgresql(parsed, read_only)
    raise UserError(
        f"unsupported database {backend!r} in {parsed.render_as_string()}: "
        "use sqlite:///PATH or postgresql+psycopg://HOST/DB"
    )


def sessions(engine: Engine) -> sessionmaker[Session]:
    """A session factory: open one session per request or query, never share one across threads.

    Objects stay readable after commit, so a caller may return what it just wrote.
    """
    return sessionmaker(engine, expire_on_commit=False)


def migrate(engine: Engine) -> None:
    """Bring the schema to the newest Alembic revision; a no-op when it is there already."""
    config = alembic_config()
    with engine.begin() as connection:
        if connection.dialect.name == "postgresql":
            # Two services starting at once against one database would race on CREATE TABLE.
            connection.exec_driver_sql(f"SELECT pg_advisory_xact_lock({_MIGRATION_LOCK_KEY})")
        config.attributes["connection"] = connection
        command.upgrade(config, "head")


def alembic_config() -> Config:
    """The Alembic configuration of the telemetry migrations, without any ini file."""
    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS_DIR))
    return config


def _connect_sqlite(url: URL, read_only: bool) -> Engine:
    database = url.database or ""
    if database in ("", ":memory:") or database.startswith("file:"):
        raise UserError(
            f"SQLite needs a file path, e.g. sqlite:///runs/telemetry.db (got {url!s}): "
            "the service and the UI must open the same file"
        )
    path = Path(database)
    if read_only:
        if not path.is_file():
            raise MissingDatabase(f"no telemetry database at {path} yet")
        # The URI form is the only way to ask SQLite itself for a read-only connection.
        url = url.set(
            database=f"file:{path.resolve().as_posix()}",
            query={**url.query, "mode": "ro", "uri": "true"},
        )
    else:
        path.parent.mkdir(parents=True, exist_ok=True)
    engine = create_engine(url)

    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_connection: Any, _record: Any) -> None:
        # pysqlite's own transaction handling starts transactions late and never as IMMEDIATE;
        # turning it off lets the "begin" hook below choose.
        dbapi_connection.isolation_level = None
        cursor = dbapi_connection.cursor()
        cursor.execute("PRAGMA foreign_keys = ON")
        cursor.execute(f"PRAGMA busy_timeout = {SQLITE_BUSY_TIMEOUT_MS}")
        if not read_only:
            # WAL lets the UI read while the service writes.
            cursor.execute("PRAGMA journal_mode = WAL")
            cursor.execute("PRAGMA synchronous = NORMAL")
        cursor.close()

    @event.listens_for(engine, "begin")
    def _on_begin(connection: Connection) -> None:
        # A writer takes the write lock up front: a deferred transaction that reads and then
        # writes fails with "database is locked" at once instead of waiting for busy_timeout.
        connection.exec_driver_sql("BEGIN" if read_only else "BEGIN IMMEDIATE")

    return engine


def _connect_postgresql(url: URL, read_only: bool) -> Engine:
    if url.drivername == "postgresql":
        url = url.set(drivername="postgresql+psycopg")
    connect_args: dict[str, Any] = {}
    if read_only:
        # Keep options given in the URL (a search_path, say) and add the read-only default.
        options = str(url.query.get("options", ""))
        connect_args["options"] = f"{options} -c default_transaction_read_only=on".strip()
    return create_engine(url, pool_pre_ping=True, connect_args=connect_args)
