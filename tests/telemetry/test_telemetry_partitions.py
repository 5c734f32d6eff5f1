"""PostgreSQL's partitioned rank_steps (`telemetry.partitions`, migration 0006): a run's ranges
exist before its records, a read of the latest steps scans one partition, retention drops whole
ranges but never a row a rollup or a resume needs, a step beyond the prepared ranges is stored
and moves into its range later, and a populated database migrates without losing a row."""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from typing import Any

import pytest
from alembic import command
from sqlalchemy import Engine, event, func, insert, select, text

from scaletrain.v1 import telemetry_pb2
from telemetry import partitions
from telemetry.client import event as telemetry_event
from telemetry.client import rank_step
from telemetry.db import alembic_config, connect, migrate
from telemetry.models import RankStep
from telemetry.retention import Retention, RetentionPolicy
from telemetry.store import TelemetryStore
from telemetry.views.common import spread
from telemetry.views.nodes import rank_phases, rank_steps

RegisterRun = Callable[..., telemetry_pb2.RegisterRunRequest]
RANKS = 4
NOW = datetime(2026, 12, 2, 10, 0, tzinfo=UTC)


def records(run_id: str, steps: range, *, attempt: int = 0) -> list[telemetry_pb2.RankStep]:
    return [
        rank_step(run_id, step, rank, attempt=attempt,
                  loss=math.nan if (step, rank) == (7, 1) else 1.0 + step / 100 + rank,
                  tokens=10 + rank, times={"step": 0.5, "compute": 0.4 + rank / 100},
                  offset=(step * RANKS + rank, step, 0))
        for step in steps
        for rank in range(RANKS)
    ]  # fmt: skip


def every_row(engine: Engine) -> list[tuple[Any, ...]]:
    """Every rank row, every column, in key order."""
    with engine.connect() as connection:
        return [
            tuple(row)
            for row in connection.execute(
                select(*RankStep.__table__.columns).order_by(
                    RankStep.run_id, RankStep.step, RankStep.rank, RankStep.attempt
                )
            )
        ]


def range_rows(engine: Engine, run_id: str) -> dict[int, int]:
    """Rows per range partition of the run, by its first step."""
    with engine.connect() as connection:
        return {
            span.first: connection.exec_driver_sql(f'SELECT count(*) FROM "{span.name}"').scalar()
            for span in partitions.ranges(connection, run_id)
        }


def default_rows(engine: Engine, run_id: str) -> int:
    with engine.connect() as connection:
        return connection.exec_driver_sql(
            f'SELECT count(*) FROM "{partitions.run_table(run_id)}_default"'
        ).scalar()


@pytest.fixture
def pg_engine(pg_schema_url: str) -> Iterator[Engine]:
    engine = connect(pg_schema_url)
    migrate(engine)
    yield engine
    engine.dispose()


@pytest.fixture
def pg_store(pg_engine: Engine) -> TelemetryStore:
    return TelemetryStore(pg_engine, partition_steps=10)


@pytest.mark.postgres
def test_a_run_has_its_ranges_before_its_records_and_only_postgresql_partitions(
    pg_store: TelemetryStore, pg_engine: Engine, run_request: RegisterRun, tmp_path: Any
) -> None:
    pg_store.register_run(run_request("run-1", world_size=RANKS))
    # Its range and the AHEAD_RANGES after it, before the first record.
    assert sorted(range_rows(pg_engine, "run-1")) == [1, 11, 21]
    sqlite = connect(f"sqlite:///{tmp_path / 'telemetry.db'}")
    migrate(sqlite)
    with sqlite.connect() as connection:
        assert not partitions.is_partitioned(connection)
    assert TelemetryStore(sqlite).partitioned() is False
    sqlite.dispose()


@pytest.mark.postgres
def test_a_read_of_the_latest_steps_scans_one_partition(
    pg_store: TelemetryStore, pg_engine: Engine, run_request: RegisterRun
) -> None:
    pg_store.register_run(run_request("run-1", world_size=RANKS))
    pg_store.add_steps(records("run-1", range(1, 36)))
    pg_store.roll_up()
    statements: list[tuple[str, Any]] = []

    def capture(_c: Any, _cursor: Any, statement: str, parameters: Any, *_: Any) -> None:
        if "avg(rank_steps.step_s)" in statement:
            statements.append((statement, parameters))

    event.listen(pg_engine, "before_cursor_execute", capture)
    try:
        # Every rank, the latest 5 steps: 31-35, all in the range of steps 31-40.
        phases = rank_phases(pg_engine, "run-1", list(range(RANKS)), window=5)
    finally:
        event.remove(pg_engine, "before_cursor_execute", capture)
    assert list(phases["rank"]) == list(range(RANKS))
    ((statement, parameters),) = statements
    with pg_engine.connect() as connection:
        cursor = connection.connection.driver_connection.cursor()
        cursor.execute(f"EXPLAIN (COSTS OFF) {statement}", parameters)
        plan = "\n".join(row[0] for row in cursor.fetchall())
    scanned = {name for name in plan.replace('"', " ").split() if name.startswith("rank_steps_r")}
    scanned = {name.removesuffix("_pkey") for name in scanned}
    assert scanned == {f"{partitions.run_table('run-1')}_31"}, plan


@pytest.mark.postgres
def test_one_nodes_ranks_are_read_range_by_range_and_all_of_them(
    pg_store: TelemetryStore, pg_engine: Engine, run_request: RegisterRun
) -> None:
    pg_store.register_run(run_request("run-1", world_size=RANKS))
    pg_store.add_steps(records("run-1", range(1, 56)))
    pg_store.roll_up()
    frame = rank_steps(pg_engine, "run-1", [1, 2], max_steps=100)
    assert list(zip(frame["step"], frame["rank"], strict=True)) == [
        (step, rank) for step in range(1, 56) for rank in (1, 2)
    ]
    # Sampled steps across the ranges: each range's steps, in order.
    sampled = rank_steps(pg_engine, "run-1", [3], max_steps=7)
    assert list(sampled["step"]) == spread(1, 55, 7)


@pytest.mark.postgres
def test_retention_drops_whole_ranges_but_keeps_what_a_rollup_or_a_resume_needs(
    pg_store: TelemetryStore, pg_engine: Engine, run_request: RegisterRun
) -> None:
    pg_store.register_run(run_request("run-1", world_size=RANKS))
    pg_store.add_steps(records("run-1", range(1, 61)))
    # Every step rolled up but 25 (a step still waiting for a rank, say).
    pg_store.add_rollups([], [("run-1", 0, step) for step in range(1, 61) if step != 25])
    pg_store.add_events([telemetry_event("run-1", "checkpoint_committed", step=14, tier="ssd")])
    before = {row[:4]: row for row in every_row(pg_engine)}
    retention = Retention(pg_store, RetentionPolicy(keep_steps=25, pause_s=0))
    # The window is steps 36-60: ranges 1-10 and 11-20 and 21-30 are past it, 31-40 is not.
    assert retention.sweep() == RANKS * (10 + 9 + 9)
    ranges = range_rows(pg_engine, "run-1")
    # 1-10 dropped; 11-20 and 21-30 rewritten with the checkpoint's and the unrolled step's rows.
    assert ranges[11] == ranges[21] == RANKS and 1 not in ranges
    assert ranges[31] == 10 * RANKS
    after = every_row(pg_engine)
    assert {row[1] for row in after} == {14, 25, *range(31, 61)}
    # What stays is unchanged, column for column.
    assert all(before[row[:4]] == row for row in after)
    resume = pg_store.resume_point("run-1")
    assert (resume.step, len(resume.offsets)) == (14, RANKS)
    # Nothing more to drop: the kept rows stay, the next sweep rewrites nothing.
    assert retention.sweep() == 0
    assert range_rows(pg_engine, "run-1") == ranges


@pytest.mark.postgres
def test_a_step_beyond_the_prepared_ranges_is_stored_and_moves_into_its_range(
    pg_store: TelemetryStore, pg_engine: Engine, run_request: RegisterRun
) -> None:
    pg_store.register_run(run_request("run-1", world_size=RANKS))
    # A batch far beyond the prepared ranges gets its range made before it is written.
    assert pg_store.add_steps(records("run-1", range(200, 202))) == (2 * RANKS, 0)
    assert range_rows(pg_engine, "run-1")[191] == RANKS
    # When that range cannot be made at once (a long read holds the run's default partition,
    # which making a range must lock), the batch neither fails nor waits long: its rows go to
    # the run's default partition, and into their range once it is made.
    with pg_engine.connect() as reader:
        reader.exec_driver_sql(f'SELECT count(*) FROM "{partitions.run_table("run-1")}_default"')
        started = time.monotonic()
        assert pg_store.add_steps(records("run-1", range(500, 502))) == (2 * RANKS, 0)
        assert time.monotonic() - started < 5
        assert default_rows(pg_engine, "run-1") == 2 * RANKS
        reader.rollback()
    pg_store.wait_for_partitions()
    pg_store.prepare_partitions("run-1")
    assert default_rows(pg_engine, "run-1") == 0
    assert range_rows(pg_engine, "run-1")[491] == range_rows(pg_engine, "run-1")[501] == RANKS
    # A resent record is still recognised after the move.
    assert pg_store.add_steps(records("run-1", range(500, 501))) == (0, RANKS)
    assert len(every_row(pg_engine)) == 4 * RANKS


@pytest.mark.postgres
def test_a_run_registered_after_rows_arrived_for_it_takes_them_into_its_partition(
    pg_store: TelemetryStore, pg_engine: Engine, run_request: RegisterRun
) -> None:
    # Rows of a run with no partition yet (written around the store) wait in rank_steps_default.
    pg_store.register_run(run_request("run-1", world_size=RANKS))
    with pg_engine.begin() as connection:
        connection.exec_driver_sql(f'DROP TABLE "{partitions.run_table("run-1")}"')
        connection.execute(
            insert(RankStep),
            [
                {"run_id": "run-1", "step": step, "rank": rank, "attempt": 0, "time": NOW}
                for step in (1, 2)
                for rank in range(RANKS)
            ],
        )
    with pg_engine.connect() as connection:
        top_default = f"SELECT count(*) FROM {partitions.TOP_DEFAULT}"
        assert connection.exec_driver_sql(top_default).scalar() == 2 * RANKS
    pg_store.register_run(run_request("run-1", world_size=RANKS))
    with pg_engine.connect() as connection:
        assert connection.exec_driver_sql(top_default).scalar() == 0
    assert range_rows(pg_engine, "run-1")[1] == 2 * RANKS


def test_a_populated_database_migrates_to_partitions_keeping_every_row(
    db_url: str, run_request: RegisterRun
) -> None:
    engine = connect(db_url)
    try:
        config = alembic_config()
        with engine.begin() as connection:
            config.attributes["connection"] = connection
            command.upgrade(config, "0005")
        # Three runs at revision 0005, the plain table: one restarted (two attempts), one whose
        # steps go beyond a range, one with no rows.
        old = TelemetryStore(engine)
        assert not old.partitioned()
        old.register_run(run_request("run-a", world_size=RANKS))
        old.add_steps(records("run-a", range(1, 151)))
        old.register_run(run_request("run-a", world_size=RANKS))
        old.add_steps(records("run-a", range(140, 161), attempt=1))
        old.register_run(run_request("run-b", world_size=RANKS))
        old.add_steps(records("run-b", range(1000, 1031)))
        old.register_run(run_request("run-c", world_size=RANKS))
        old.roll_up()
        before = every_row(engine)
        assert len(before) == RANKS * (150 + 21 + 31)

        migrate(engine)
        assert every_row(engine) == before
        store = TelemetryStore(engine, partition_steps=10)
        postgres = engine.dialect.name == "postgresql"
        assert store.partitioned() is postgres
        if postgres:
            # Each run's rows are in its ranges (of the migration's size), none in a default.
            for run_id in ("run-a", "run-b"):
                assert sum(range_rows(engine, run_id).values()) == len(
                    [row for row in before if row[0] == run_id]
                )
                assert default_rows(engine, run_id) == 0
        # Then ingest and retention work as on a new database.
        store.register_run(run_request("run-a", world_size=RANKS))
        assert store.add_steps(records("run-a", range(161, 171), attempt=2)) == (10 * RANKS, 0)
        store.roll_up()
        deleted = Retention(store, RetentionPolicy(keep_steps=20, pause_s=0)).sweep_run(
            "run-a", RANKS
        )
        # Everything up to step 150 went, whole ranges on PostgreSQL (of 100 steps there: the
        # migration's size), row batches on SQLite.
        kept_from = 101 if postgres else 151
        assert deleted == len([row for row in before if row[0] == "run-a" and row[1] < kept_from])
        with engine.connect() as connection:
            first = connection.execute(
                select(func.min(RankStep.step)).where(RankStep.run_id == "run-a")
            ).scalar()
        assert first == kept_from
        # And back: the downgrade to 0005 keeps every row too.
        rows = every_row(engine)
        with engine.begin() as connection:
            config.attributes["connection"] = connection
            command.downgrade(config, "0005")
        assert every_row(engine) == rows
        with engine.connect() as connection:
            assert not partitions.is_partitioned(connection)
            if postgres:
                leftovers = connection.execute(
                    text(
                        "SELECT count(*) FROM pg_class WHERE relname LIKE 'rank\\_steps\\_%' "
                        "AND relnamespace = CAST(current_schema() AS regnamespace)"
                    )
                ).scalar()
                assert leftovers == 0
    finally:
        engine.dispose()
