"""Partitioned rank_steps on PostgreSQL: by run (LIST), each run by step range (RANGE).

Retention then drops a range of steps whose rows all left the window instead of deleting them row
by row (`telemetry.partitions`, `telemetry.retention`). The populated plain table becomes the
partitioned one in the migration's transaction, so a failure leaves the database as it was:
  1. the plain table is renamed aside (with its constraints, whose names the new table takes);
  2. `rank_steps` is made `PARTITION BY LIST (run_id)` with the same columns and defaults, with a
     default partition, and every run with rows gets its partition and step ranges covering them
     (`telemetry.partitions.prepare`: the partitions are data the service manages, made the way
     it makes them);
  3. every row is copied across, the primary key and foreign key are added (indexes built once
     over the copied rows, per partition, which is faster than maintaining them row by row),
     and the plain table is dropped.
SQLite keeps the plain table: nothing to do there.

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-02 10:20:00.000000
"""

from collections.abc import Sequence

from alembic import op

from telemetry import partitions

revision: str = "0006"
down_revision: str | None = "0005"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_OLD = "rank_steps_unpartitioned"
_KEY = "run_id, step, rank, attempt"


def upgrade() -> None:
    connection = op.get_bind()
    if connection.dialect.name != "postgresql":
        return
    connection.exec_driver_sql(f"ALTER TABLE rank_steps RENAME TO {_OLD}")
    connection.exec_driver_sql(f"ALTER TABLE {_OLD} RENAME CONSTRAINT pk_rank_steps TO pk_{_OLD}")
    connection.exec_driver_sql(
        f"ALTER TABLE {_OLD} RENAME CONSTRAINT fk_rank_steps_run_id_runs TO fk_{_OLD}_run_id_runs"
    )
    connection.exec_driver_sql(
        f"CREATE TABLE rank_steps (LIKE {_OLD} INCLUDING DEFAULTS) PARTITION BY LIST (run_id)"
    )
    connection.exec_driver_sql(
        f"CREATE TABLE {partitions.TOP_DEFAULT} PARTITION OF rank_steps DEFAULT"
    )
    spans = connection.exec_driver_sql(
        f"SELECT run_id, min(step), max(step) FROM {_OLD} GROUP BY run_id"
    ).all()
    size = partitions.DEFAULT_PARTITION_STEPS
    for run_id, first, last in spans:
        partitions.prepare(connection, run_id, first, last + partitions.AHEAD_RANGES * size, size)
    connection.exec_driver_sql(f"INSERT INTO rank_steps SELECT * FROM {_OLD}")
    _add_keys(connection)
    connection.exec_driver_sql(f"DROP TABLE {_OLD}")


def downgrade() -> None:
    connection = op.get_bind()
    if connection.dialect.name != "postgresql":
        return
    connection.exec_driver_sql(f"CREATE TABLE {_OLD} (LIKE rank_steps INCLUDING DEFAULTS)")
    connection.exec_driver_sql(f"INSERT INTO {_OLD} SELECT * FROM rank_steps")
    # Dropping the partitioned table drops every partition with it.
    connection.exec_driver_sql("DROP TABLE rank_steps")
    connection.exec_driver_sql(f"ALTER TABLE {_OLD} RENAME TO rank_steps")
    _add_keys(connection)


def _add_keys(connection: object) -> None:
    connection.exec_driver_sql(  # type: ignore[attr-defined]
        f"ALTER TABLE rank_steps ADD CONSTRAINT pk_rank_steps PRIMARY KEY ({_KEY})"
    )
    connection.exec_driver_sql(  # type: ignore[attr-defined]
        "ALTER TABLE rank_steps ADD CONSTRAINT fk_rank_steps_run_id_runs FOREIGN KEY (run_id) "
        "REFERENCES runs (run_id) ON DELETE CASCADE"
    )
