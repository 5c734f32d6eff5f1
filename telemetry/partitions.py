"""PostgreSQL partitions of `rank_steps`: one per run (LIST), each split into step ranges (RANGE).

Why: per-rank rows are kept for a recent window only (`telemetry.retention`), and a window that
moves over a plain table means deleting rows (hundreds of thousands a minute at 16,384 ranks) and
vacuuming the space they leave, which the table then keeps. Dropping a partition whose steps are
all past the window frees its space at once and costs about the same whatever its size
(`bench/telemetry_layout.py`). Partitioning by run first keeps each run's ranges its own: a query
for one run's latest steps is pruned to the partitions holding them (the run, then the range),
and each run's default partition stays small.

The layout, under `rank_steps PARTITION BY LIST (run_id)`:
  rank_steps_default          rows of a run that has no partition yet (never in normal use)
  rank_steps_r<hash of run>   the run's rows, PARTITION BY RANGE (step), holding:
    ..._<first step>          steps first .. first + size - 1, for size `steps_per_partition`
    ..._default               steps outside every prepared range

Partitions are made ahead of ingest, never per record: when a run registers (its range and the
next ones), and by a background thread of the store when a batch's step nears the end of what is
prepared. A step beyond the prepared ranges lands in the run's default partition, so ingest never
fails for want of a partition; making the range later moves those rows into it. Tables are made
standalone and then attached: ATTACH PARTITION takes a lock that writers and readers of the
parent do not conflict with, where CREATE TABLE ... PARTITION OF would lock them all out. Every
change to a run's partitions holds the run's advisory lock, so two threads or services never race
on them.

SQLite keeps the plain table; every function here is for a connection to PostgreSQL whose
`rank_steps` is partitioned (`is_partitioned`).
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Sequence
from dataclasses import dataclass

from sqlalchemy import Connection, text

TABLE = "rank_steps"
TOP_DEFAULT = f"{TABLE}_default"
# Steps per range partition: at 16,384 ranks about 1.6M rows (~480 MB). Retention drops a range
# once all its steps are past the window, so up to this many steps more than the window are kept.
DEFAULT_PARTITION_STEPS = 100
# How many ranges beyond the one being written are kept prepared.
AHEAD_RANGES = 2
# First key of the advisory locks that serialise changes to a run's partitions (the second is the
# run's); not the migrations' key.
_LAYOUT_LOCK_KEY = 0x5C41E7E2
# Storage options of a range partition. No parallel workers: a read of one range is short (the
# run page's widest, every rank's latest 20 steps, is ~0.1 s at 4,096 ranks), and starting workers
# for it cost more than they saved when measured (`bench/telemetry_layout.py`: the plain table's
# bitmap scan of the same rows ran without them).
RANGE_OPTIONS = "WITH (parallel_workers = 0)"
_BOUNDS = re.compile(r"FROM \('?(-?\d+)'?\) TO \('?(-?\d+)'?\)")
_PARTITION_NAME = re.compile(rf"{TABLE}_(default|r[0-9a-f]{{16}}(_\w+)?)")


def is_partition(table: str) -> bool:
    """Whether `table` is one of rank_steps' partitions, which belong to the data the service
    manages, not to the schema the models and migrations describe."""
    return _PARTITION_NAME.fullmatch(table) is not None


@dataclass(frozen=True)
class StepRange:
    """One range partition of a run: steps `first` <= step < `end`."""

    name: str
    first: int
    end: int


def is_partitioned(connection: Connection) -> bool:
    """Whether `rank_steps` is the partitioned table (PostgreSQL at revision 0006 or later)."""
    if connection.dialect.name != "postgresql":
        return False
    kind = connection.execute(
        text("SELECT relkind FROM pg_class WHERE oid = to_regclass(:table)"), {"table": TABLE}
    ).scalar()
    return kind == "p"


def run_table(run_id: str) -> str:
    """The name of the run's partition: a hash, as run ids may be longer than a table name
    (63 bytes) or hold any character."""
    return f"{TABLE}_r{hashlib.md5(run_id.encode()).hexdigest()[:16]}"


def range_of(step: int, size: int) -> tuple[int, int]:
    """(first, end) of the range partition of `step`: ranges hold steps k*size+1 .. (k+1)*size,
    so a window of a multiple of `size` steps ends on a boundary (steps count from 1)."""
    k = (step - 1) // size
    return k * size + 1, (k + 1) * size + 1


def ranges(connection: Connection, run_id: str) -> list[StepRange]:
    """The run's range partitions by step (its default partition not among them)."""
    rows = connection.execute(
        text(
            "SELECT c.relname, pg_get_expr(c.relpartbound, c.oid) FROM pg_inherits i "
            "JOIN pg_class c ON c.oid = i.inhrelid WHERE i.inhparent = to_regclass(:parent)"
        ),
        {"parent": run_table(run_id)},
    ).all()
    found = []
    for name, bound in rows:
        match = _BOUNDS.search(bound or "")
        if match:
            found.append(StepRange(name, int(match[1]), int(match[2])))
    return sorted(found, key=lambda r: r.first)


def lock_run(connection: Connection, run_id: str) -> None:
    """Hold the advisory lock of the run's partitions (in this schema) until the transaction
    ends: one per run, so that preparing one run's ranges never waits for another's."""
    connection.execute(
        text("SELECT pg_advisory_xact_lock(:key, hashtext(current_schema() || '/' || :run_id))"),
        {"key": _LAYOUT_LOCK_KEY, "run_id": run_id},
    )


def ensure_run(connection: Connection, run_id: str) -> str:
    """Make the run's partition (with its default range partition) unless it exists; its name.

    Rows of the run that arrived before it existed (in rank_steps_default) move into it.
    """
    parent = run_table(run_id)

    def exists() -> bool:
        return (
            connection.execute(text("SELECT to_regclass(:t)"), {"t": parent}).scalar() is not None
        )

    if exists():
        return parent
    lock_run(connection, run_id)
    if exists():  # made by another thread or service while this one waited for the lock
        return parent
    connection.exec_driver_sql(
        f'CREATE TABLE "{parent}" (LIKE {TABLE} INCLUDING DEFAULTS) PARTITION BY RANGE (step)'
    )
    connection.exec_driver_sql(f'CREATE TABLE "{parent}_default" PARTITION OF "{parent}" DEFAULT')
    _attach(
        connection,
        TABLE,
        TOP_DEFAULT,
        parent,
        f"FOR VALUES IN ({_literal(run_id)})",
        "run_id = :run_id",
        {"run_id": run_id},
    )
    return parent


def prepare(connection: Connection, run_id: str, first_step: int, last_step: int, size: int) -> int:
    """Make range partitions of `size` steps covering `first_step`..`last_step` where none is;
    return the last step then covered. Rows in the run's default partition at those steps move
    into them. Ranges made with another size earlier are kept: new ones only fill the gaps."""
    parent = ensure_run(connection, run_id)
    existing = ranges(connection, run_id)
    wanted = []
    first, _ = range_of(max(first_step, 0), size)
    while first <= last_step:
        wanted.append((first, first + size))
        first += size
    # And the ranges of the steps waiting in the run's default partition (small: a step that
    # arrived ahead of its range, or behind every range), so they move into them.
    waiting = connection.execute(
        text(f'SELECT DISTINCT (step - 1) / {size} * {size} + 1 FROM "{parent}_default"')
    ).scalars()
    wanted += [(start, start + size) for start in waiting if (start, start + size) not in wanted]
    missing = [piece for span in wanted for piece in _gaps(span, existing)]
    if missing:
        lock_run(connection, run_id)
        # Another thread may have made them while this one waited for the lock.
        existing = ranges(connection, run_id)
        for span in wanted:
            for start, end in _gaps(span, existing):
                name = f"{parent}_{start}".replace("-", "m")
                connection.exec_driver_sql(
                    f'CREATE TABLE "{name}" (LIKE {TABLE} INCLUDING DEFAULTS) {RANGE_OPTIONS}'
                )
                _attach(
                    connection,
                    parent,
                    f"{parent}_default",
                    name,
                    f"FOR VALUES FROM ({start}) TO ({end})",
                    f"step >= {start} AND step < {end}",
                    {},
                )
        existing = ranges(connection, run_id)
    covered = first_step - 1
    for span in existing:
        if span.first <= covered + 1 < span.end:
            covered = span.end - 1
    return covered


def analyze_written(connection: Connection, run_id: str, before_step: int) -> list[str]:
    """Take the statistics of the run's ranges wholly before `before_step` that have none yet;
    their names. The planner needs them to use the primary key for a few ranks at sampled steps
    rather than read a whole range (measured: 14 ms for 40 rows of a new range without them, 1-2
    ms for 320 rows of one with them),
    and autovacuum analyses a new table a minute or more after it starts to fill; it keeps them
    up to date as the range grows. ANALYZE locks out neither readers nor writers."""
    names = [r.name for r in ranges(connection, run_id) if r.end <= before_step]
    if not names:
        return []
    unanalysed = list(
        connection.execute(
            text(
                "SELECT relname FROM pg_stat_user_tables WHERE relid = ANY("
                "SELECT to_regclass(n)::oid FROM unnest(CAST(:names AS text[])) AS n) "
                "AND last_analyze IS NULL AND last_autoanalyze IS NULL"
            ),
            {"names": names},
        ).scalars()
    )
    for name in unanalysed:
        connection.exec_driver_sql(f'ANALYZE "{name}"')
    return unanalysed


def _gaps(span: tuple[int, int], existing: Sequence[StepRange]) -> list[tuple[int, int]]:
    """The parts of [start, end) no existing range covers."""
    pieces = [span]
    for r in existing:
        pieces = [
            part
            for start, end in pieces
            for part in ((start, min(end, r.first)), (max(start, r.end), end))
            if part[0] < part[1]
        ]
    return pieces


def _attach(
    connection: Connection,
    parent: str,
    default: str,
    child: str,
    bound: str,
    where: str,
    params: dict[str, object],
) -> None:
    """Attach `child` to `parent` after moving into it the rows of `parent`'s default partition
    that belong to it (ATTACH refuses while the default partition holds any). The default
    partition is locked against writes first, so no row lands there between the move and the
    attach."""
    connection.exec_driver_sql(f'LOCK TABLE "{default}" IN SHARE ROW EXCLUSIVE MODE')
    connection.execute(
        text(
            f'WITH moved AS (DELETE FROM "{default}" WHERE {where} RETURNING *) '
            f'INSERT INTO "{child}" SELECT * FROM moved'
        ),
        params,
    )
    # DDL takes no bound parameters: the bound is literal SQL.
    connection.exec_driver_sql(f'ALTER TABLE "{parent}" ATTACH PARTITION "{child}" {bound}')


def _literal(value: str) -> str:
    """`value` as an SQL string literal (standard_conforming_strings, PostgreSQL's default)."""
    return "'" + value.replace("'", "''") + "'"
