"""The database layer: migrations match the models and upgrade older databases, read-only
engines, readable URL errors."""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path

import pytest
from alembic import command
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import JSON, Engine, column, inspect, table, text
from sqlalchemy.exc import SQLAlchemyError

from scaletrain.errors import UserError
from telemetry import queries
from telemetry.client import event
from telemetry.db import VERSION_TABLE, MissingDatabase, alembic_config, connect, migrate
from telemetry.models import Base, UTCDateTime
from telemetry.partitions import is_partition
from telemetry.store import TelemetryStore
from telemetry.views.checkpoints import checkpoint_timeline

COMPARE_OPTIONS = {
    "compare_type": True,
    "version_table": VERSION_TABLE,
    # rank_steps' partitions on PostgreSQL are data the service makes, not schema.
    "include_name": lambda name, kind, _parents: kind != "table" or not is_partition(name),
}


def test_migrations_create_exactly_the_schema_of_the_models(engine: Engine) -> None:
    with engine.connect() as connection:
        context = MigrationContext.configure(
            connection,
            opts=COMPARE_OPTIONS,
        )
        assert compare_metadata(context, Base.metadata) == []
        tables = {t for t in inspect(connection).get_table_names() if not is_partition(t)}
    assert tables == {*Base.metadata.tables, VERSION_TABLE}


def test_migrating_an_up_to_date_database_again_changes_nothing(engine: Engine) -> None:
    migrate(engine)
    with engine.connect() as connection:
        versions = connection.execute(text(f"SELECT version_num FROM {VERSION_TABLE}")).all()
    assert versions == [("0006",)]


def test_a_database_from_before_checkpoint_nodes_upgrades_and_keeps_its_checkpoints(
    db_url: str,
) -> None:
    at = datetime(2026, 11, 30, 12, 0, tzinfo=UTC)
    engine = connect(db_url)
    try:
        config = alembic_config()
        with engine.begin() as connection:
            config.attributes["connection"] = connection
            command.upgrade(config, "0002")
            # What revision 0002 stored: a run, its SSD and trainer checkpoint rows, the event.
            connection.execute(_OLD_RUNS.insert().values({**_OLD_RUN, "started_at": at}))
            connection.execute(
                _OLD_CHECKPOINTS.insert(),
                [
                    {
                        "run_id": "old",
                        "step": 4,
                        "tier": tier,
                        "committed_at": committed,
                        "bytes": 900,
                        "seconds": 1.0,
                    }
                    for tier, committed in (("ssd", at), ("trainer", None))
                ],
            )
            connection.execute(
                _OLD_EVENTS.insert().values(
                    run_id="old",
                    step=4,
                    rank=-1,
                    kind="checkpoint_committed",
                    message="",
                    time=at,
                    attributes={},
                    tier="ssd",
                    bytes=900,
                    seconds=1.0,
                )
            )
        migrate(engine)

        with engine.connect() as connection:
            context = MigrationContext.configure(connection, opts=COMPARE_OPTIONS)
            assert compare_metadata(context, Base.metadata) == []
            # Autogenerate does not compare primary keys.
            key = inspect(connection).get_pk_constraint("checkpoints")["constrained_columns"]
            assert key == ["run_id", "step", "tier", "node", "part"]
        store = TelemetryStore(engine)
        # The resent old event is still recognised; two nodes' parts of a new step are two rows.
        resent = event("old", "checkpoint_committed", step=4, tier="ssd", bytes=900, seconds=1.0)
        resent.time.FromDatetime(at)
        assert store.add_events([resent]) == 0
        store.add_events(
            [
                event("old", "checkpoint_committed", step=8, tier="ssd", node=f"node{n}")
                for n in (0, 1)
            ]
        )
        stored = queries.checkpoints(engine, "old")
        assert stored[["step", "tier", "node"]].values.tolist() == [
            [4, "ssd", ""], [4, "trainer", ""], [8, "ssd", "node0"], [8, "ssd", "node1"],
        ]  # fmt: skip
        assert checkpoint_timeline(engine, "old")["nodes"].tolist() == [
            "ssd",
            "ssd: node0, node1",
        ]
    finally:
        engine.dispose()


# The tables of revision 0002 as far as the test above writes them (the models are newer).
_OLD_RUN = {
    "run_id": "old", "name": "", "config_json": "{}", "world_size": 2, "dp_replicate": 1,
    "dp_shard": 2, "tp": 1, "pp": 1, "cp": 1, "ep": 1, "model_params": 0, "hardware": "cpu",
    "status": "running",
}  # fmt: skip
_OLD_RUNS = table("runs", *map(column, _OLD_RUN), column("started_at", UTCDateTime()))
_OLD_CHECKPOINTS = table(
    "checkpoints",
    *map(column, ("run_id", "step", "tier", "bytes", "seconds")),
    column("committed_at", UTCDateTime()),
)
_OLD_EVENTS = table(
    "events",
    *map(column, ("run_id", "step", "rank", "kind", "message", "tier", "bytes", "seconds")),
    column("time", UTCDateTime()),
    column("attributes", JSON()),
)


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
