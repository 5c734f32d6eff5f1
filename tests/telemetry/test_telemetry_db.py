"""The database layer: migrations match the models, read-only engines, readable URL errors."""

from __future__ import annotations

from pathlib import Path

import pytest
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import Engine, inspect, text
from sqlalchemy.exc import SQLAlchemyError

from scaletrain.errors import UserError
from telemetry.db import VERSION_TABLE, MissingDatabase, connect, migrate
from telemetry.models import Base


def test_migrations_create_exactly_the_schema_of_the_models(engine: Engine) -> None:
    with engine.connect() as connection:
        context = MigrationContext.configure(
            connection, opts={"compare_type": True, "version_table": VERSION_TABLE}
        )
        assert compare_metadata(context, Base.metadata) == []
        tables = set(inspect(connection).get_table_names())
    assert tables == {*Base.metadata.tables, VERSION_TABLE}


def test_migrating_an_up_to_date_database_again_changes_nothing(engine: Engine) -> None:
    migrate(engine)
    with engine.connect() as connection:
        versions = connection.execute(text(f"SELECT version_num FROM {VERSION_TABLE}")).all()
    assert versions == [("0002",)]


def test_a_read_only_engine_reads_but_refuses_to_write(engine: Engine, db_url: str) -> None:
    reader = connect(db_url, read_only=True)
    try:
        with reader.connect() as connection:
            assert connection.execute(text("SELECT count(*) FROM runs")).scalar() == 0
        with pytest.raises(SQLAlchemyError), reader.begin() as connection:
            connection.execute(text("DELETE FROM runs"))
    finally:
        reader.dispose()


def test_opening_a_missing_sqlite_file_read_only_says_there_is_no_database_yet(
    tmp_path: Path,
) -> None:
    with pytest.raises(MissingDatabase, match=r"no telemetry database at .*missing\.db yet"):
        connect(f"sqlite:///{tmp_path / 'missing.db'}", read_only=True)
    assert not (tmp_path / "missing.db").exists()


def test_a_writable_sqlite_database_creates_its_directory_and_uses_wal(tmp_path: Path) -> None:
    engine = connect(f"sqlite:///{tmp_path / 'new' / 'dir' / 'telemetry.db'}")
    try:
        with engine.connect() as connection:
            assert connection.exec_driver_sql("PRAGMA journal_mode").scalar() == "wal"
            assert connection.exec_driver_sql("PRAGMA foreign_keys").scalar() == 1
    finally:
        engine.dispose()


@pytest.mark.parametrize(
    ("url", "problem"),
    [
        ("not a url", "bad database URL"),
        ("mysql://localhost/db", "unsupported database 'mysql'"),
        ("sqlite://", "SQLite needs a file path"),
        ("sqlite:///:memory:", "SQLite needs a file path"),
    ],
)
def test_a_bad_database_url_is_refused_with_one_line(url: str, problem: str) -> None:
    with pytest.raises(UserError, match=problem) as caught:
        connect(url)
    assert "\n" not in str(caught.value)
