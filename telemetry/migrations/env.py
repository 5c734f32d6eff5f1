"""Alembic environment of the telemetry schema.

`telemetry.db.migrate` passes its open connection in `config.attributes["connection"]`; the
alembic command line (see alembic.ini) takes the database from `-x db=URL` or SCALETRAIN_DB_URL.
"""

from __future__ import annotations

import os
from logging.config import fileConfig
from typing import Any

from alembic import context
from alembic.autogenerate.api import AutogenContext
from sqlalchemy import Connection

from telemetry.db import VERSION_TABLE, connect
from telemetry.models import Base, NanDouble, UTCDateTime

config = context.config
if config.config_file_name is not None:
    fileConfig(config.config_file_name)


def include_name(name: str | None, type_: str, _parent_names: Any) -> bool:
    """Only the telemetry tables: a shared PostgreSQL database may hold other services' tables."""
    return type_ != "table" or name in Base.metadata.tables


def render_item(type_: str, obj: Any, autogen_context: AutogenContext) -> str | bool:
    """Write the project's column types as plain SQLAlchemy types.

    A revision must keep meaning the same schema when telemetry.models changes later, so it must
    not import the models; the types' Python-side conversions do not affect the schema anyway.
    """
    if type_ == "type" and isinstance(obj, UTCDateTime):
        return "sa.DateTime(timezone=True)"
    if type_ == "type" and isinstance(obj, NanDouble):
        return "sa.Double()"
    return False


def _configure(**kwargs: Any) -> None:
    context.configure(
        target_metadata=Base.metadata,
        version_table=VERSION_TABLE,
        include_name=include_name,
        render_item=render_item,
        # SQLite cannot ALTER most things; batch mode rebuilds the table instead.
        render_as_batch=True,
        compare_type=True,
        **kwargs,
    )


def _database_url() -> str:
    url = context.get_x_argument(as_dictionary=True).get("db") or os.environ.get(
        "SCALETRAIN_DB_URL"
    )
    if not url:
        raise SystemExit("give the database: alembic -x db=URL ... or set SCALETRAIN_DB_URL")
    return url


def _run_on(connection: Connection) -> None:
    _configure(connection=connection)
    with context.begin_transaction():
        context.run_migrations()


def main() -> None:
    if context.is_offline_mode():
        _configure(url=_database_url(), literal_binds=True)
        with context.begin_transaction():
            context.run_migrations()
        return
    connection = config.attributes.get("connection")
    if connection is not None:
        _run_on(connection)
        return
    engine = connect(_database_url())
    try:
        with engine.connect() as connection:
            _run_on(connection)
            connection.commit()
    finally:
        engine.dispose()


main()
