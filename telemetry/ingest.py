"""The bulk path of rank-step records: validated records or columns -> row tuples -> the driver's
fastest idempotent insert.

Rank-step records are nearly all that telemetry stores (one per rank per step, thousands per second
on a large job), so they skip SQLAlchemy's per-row parameter processing, which alone costs more than
the database's own work: SQLite gets one `executemany` of tuples, PostgreSQL one binary `COPY`
(through a temporary table and `INSERT ... SELECT ... ON CONFLICT DO NOTHING` only when a resent
record is among them). The rows keep the storage
conventions of `telemetry.models` exactly (naive UTC text times on SQLite, NaN stored as NULL), so
the ORM and the queries read them back as if SQLAlchemy had written them; the store's tests check
that on both databases. Columns (`telemetry.columns`, what the client sends) are checked and
turned into rows a column at a time; only a batch that fails a check is examined record by record,
to name the record and the field.
"""

from __future__ import annotations

import functools
import math
import threading
import time
from collections.abc import Callable, Sequence
from datetime import UTC, datetime, timedelta
from typing import Any, Generic, TypeVar

import psycopg
from sqlalchemy import Connection

from scaletrain.errors import InvalidArgument
from scaletrain.v1 import telemetry_pb2
from telemetry.columns import COLUMN_NAMES, PHASES, READ, records_of

_COUNTS = ("step", "rank", "attempt", "tokens", "memory_bytes", "peak_memory_bytes")
_OFFSETS = ("global_sample", "rank_sample", "epoch")
# Column order of the row tuples; the positions below index into it. The same as COLUMN_NAMES,
# with the time's two columns made one.
STEP_COLUMNS = (
    "run_id",
    "step",
    "rank",
    "attempt",
    "loss",
    "grad_norm",
    "tokens",
    *(f"{phase}_s" for phase in PHASES),
    "memory_bytes",
    "peak_memory_bytes",
    "lr",
    "time",
    "param_checksum",
    "global_sample",
    "rank_sample",
    "epoch",
    "dropped_records",
)
RUN_ID, STEP, RANK, ATTEMPT, LOSS, GRAD_NORM, TOKENS, TIME = (
    STEP_COLUMNS.index(name)
    for name in ("run_id", "step", "rank", "attempt", "loss", "grad_norm", "tokens", "time")
)
MEMORY, PEAK_MEMORY, DROPPED = (
    STEP_COLUMNS.index(name) for name in ("memory_bytes", "peak_memory_bytes", "dropped_records")
)
PHASE = {phase: STEP_COLUMNS.index(f"{phase}_s") for phase in PHASES}
# Seconds of 0001-01-01 and 9999-12-31T23:59:59 since the epoch: the range a datetime can hold.
_MIN_SECONDS, _MAX_SECONDS = -62_135_596_800, 253_402_300_799
_TEMP_TABLE = "rank_steps_incoming"
# The identifying columns (run_id, step, rank, attempt) lead every row.
_KEY_WIDTH = 4

_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
_NAIVE_EPOCH = _EPOCH.replace(tzinfo=None)

T = TypeVar("T")
R = TypeVar("R")

# A record's time as the driver stores it, from the Timestamp's seconds and microseconds.
TimeFormat = Callable[[int, int], Any]


def aware_time(seconds: int, microseconds: int) -> datetime:
    """The time as an aware UTC datetime: what PostgreSQL's driver and SQLAlchemy take."""
    return _aware_second(seconds).replace(microsecond=microseconds)


def sqlite_time(seconds: int, microseconds: int) -> str:
    """The time as SQLAlchemy's SQLite DATETIME stores it: naive UTC text with microseconds."""
    return f"{_sqlite_second(seconds)}.{microseconds:06d}"


# Every rank reports each step at about the same time, so a second's calendar fields are worked
# out once for many records: formatting a time from scratch costs more than the rest of a row.
@functools.lru_cache(maxsize=4096)
def _aware_second(seconds: int) -> datetime:
    return _EPOCH + timedelta(seconds=seconds)


@functools.lru_cache(maxsize=4096)
def _sqlite_second(seconds: int) -> str:
    return (_NAIVE_EPOCH + timedelta(seconds=seconds)).isoformat(" ")


def time_format(dialect: str) -> TimeFormat:
    """How `dialect` stores a time: text on SQLite, an aware datetime on PostgreSQL."""
    return sqlite_time if dialect == "sqlite" else aware_time


def step_values(
    index: int, record: telemetry_pb2.RankStep, time_format: TimeFormat = aware_time
) -> tuple[Any, ...]:
    """The row of one record in STEP_COLUMNS order, or InvalidArgument naming the record and field.

    An unset time becomes now; `time_format` turns it into what the driver stores.
    A NaN loss or gradient norm becomes None (NULL), as NanDouble stores it. One C-level read of
    every field, then a handful of combined checks: only a record that fails one is examined field
    by field, so that the common case costs a few microseconds.
    """
    (
        run_id, step, rank, attempt, loss, grad_norm, tokens,
        step_s, data_s, forward_s, backward_s, optimizer_s, comm_wait_s, checkpoint_s, compute_s,
        replay_s, memory_bytes, peak_memory_bytes, lr, seconds, nanos, param_checksum,
        global_sample, rank_sample, epoch, dropped_records,
    ) = READ(record)  # fmt: skip
    phase_seconds = (
        step_s,
        data_s,
        forward_s,
        backward_s,
        optimizer_s,
        comm_wait_s,
        checkpoint_s,
        compute_s,
        replay_s,
    )
    if not (
        run_id
        and math.isfinite(sum(phase_seconds) + lr)
        and min(*phase_seconds, lr) >= 0
        and min(step, rank, attempt, tokens, memory_bytes, peak_memory_bytes, dropped_records,
                global_sample, rank_sample, epoch) >= 0
        and not grad_norm < 0
        and len(param_checksum) <= 128
        and _MIN_SECONDS <= seconds <= _MAX_SECONDS
        and 0 <= nanos < 1_000_000_000
    ):  # fmt: skip
        _raise_problem(index, record)
    if seconds or nanos or record.HasField("time"):
        stored_time = time_format(seconds, nanos // 1000)
    else:
        stored_time = _now(time_format)
    return (
        run_id,
        step,
        rank,
        attempt,
        None if loss != loss else loss,
        None if grad_norm != grad_norm else grad_norm,
        tokens,
        *phase_seconds,
        memory_bytes,
        peak_memory_bytes,
        lr,
        stored_time,
        param_checksum,
        global_sample,
        rank_sample,
        epoch,
        dropped_records,
    )


def column_rows(
    columns: telemetry_pb2.StepColumns, time_format: TimeFormat = aware_time
) -> list[tuple[Any, ...]]:
    """The rows of a batch of columns, or InvalidArgument naming the bad record and field.

    Every check runs over a whole column at once (min, max, sum in C); a batch that fails one is
    examined record by record, which names the record.
    """
    values = [list(getattr(columns, name)) for name in COLUMN_NAMES]
    count = len(values[0])
    uneven = [
        name for name, column in zip(COLUMN_NAMES, values, strict=True) if len(column) != count
    ]
    if uneven:
        raise InvalidArgument(
            f"columns: {uneven[0]} has {len(getattr(columns, uneven[0]))} values, "
            f"run_id has {count}: every column needs one value per record"
        )
    if not count:
        return []
    (
        run_id, step, rank, attempt, loss, grad_norm, tokens,
        step_s, data_s, forward_s, backward_s, optimizer_s, comm_wait_s, checkpoint_s, compute_s,
        replay_s, memory_bytes, peak_memory_bytes, lr, seconds, nanos, param_checksum,
        global_sample, rank_sample, epoch, dropped_records,
    ) = values  # fmt: skip
    phase_seconds = (
        step_s,
        data_s,
        forward_s,
        backward_s,
        optimizer_s,
        comm_wait_s,
        checkpoint_s,
        compute_s,
        replay_s,
        lr,
    )
    counts = (
        step,
        rank,
        attempt,
        tokens,
        memory_bytes,
        peak_memory_bytes,
        dropped_records,
        global_sample,
        rank_sample,
        epoch,
    )
    if not (
        all(run_id)
        and all(math.isfinite(sum(column)) and min(column) >= 0 for column in phase_seconds)
        and all(min(column) >= 0 for column in counts)
        and not any(norm < 0 for norm in grad_norm)
        and max(map(len, param_checksum)) <= 128
        and min(seconds) >= _MIN_SECONDS
        and max(seconds) <= _MAX_SECONDS
        and min(nanos) >= 0
        and max(nanos) < 1_000_000_000
    ):
        return [
            step_values(index, record, time_format)
            for index, record in enumerate(records_of(columns))
        ]
    times = [
        time_format(s, ns // 1000) if s or ns else _now(time_format)
        for s, ns in zip(seconds, nanos, strict=True)
    ]
    return list(
        zip(
            run_id,
            step,
            rank,
            attempt,
            [None if x != x else x for x in loss],
            [None if x != x else x for x in grad_norm],
            tokens,
            *phase_seconds[:-1],
            memory_bytes,
            peak_memory_bytes,
            lr,
            times,
            param_checksum,
            global_sample,
            rank_sample,
            epoch,
            dropped_records,
            strict=True,
        )
    )


def _now(time_format: TimeFormat) -> Any:
    """Now, as `time_format` stores it: the time of a record nobody stamped."""
    now = time.time_ns() // 1000
    return time_format(now // 1_000_000, now % 1_000_000)


def insert_steps(connection: Connection, batches: Sequence[Sequence[tuple[Any, ...]]]) -> list[int]:
    """Insert the rows of several batches (from `step_values` with the dialect's time format) in
    the connection's open transaction, skipping those whose (run, step, rank, attempt) is stored
    already (a resent batch). Returns per batch how many of its rows were new."""
    if not any(batches):
        return [0 for _ in batches]
    columns = ", ".join(f'"{column}"' for column in STEP_COLUMNS)
    raw = connection.connection.driver_connection
    if connection.dialect.name == "sqlite":
        placeholders = ", ".join("?" * len(STEP_COLUMNS))
        cursor = raw.cursor()
        try:
            accepted = []
            for rows in batches:
                cursor.executemany(
                    f"INSERT INTO rank_steps ({columns}) VALUES ({placeholders}) "
                    "ON CONFLICT DO NOTHING",
                    rows,
                )
                accepted.append(max(cursor.rowcount, 0))
            return accepted
        finally:
            cursor.close()
    with raw.cursor() as cursor:
        return _copy_steps(cursor, columns, batches)


# How often a write that met a partition being attached concurrently is tried again.
_ROUTING_RETRIES = 3


def _copy_steps(
    cursor: Any, columns: str, batches: Sequence[Sequence[tuple[Any, ...]]]
) -> list[int]:
    """`_copy_steps_once`, again if a partition was attached under it (PostgreSQL's partitioned
    rank_steps): a row routed to a run's default partition just as the range it belongs to was
    attached fails the default's new partition constraint; written again, it goes to the range.
    Only steps beyond the prepared ranges meet this (`telemetry.partitions`)."""
    for attempt in range(_ROUTING_RETRIES + 1):
        cursor.execute("SAVEPOINT rank_steps_routing")
        try:
            accepted = _copy_steps_once(cursor, columns, batches)
        except psycopg.errors.CheckViolation:
            cursor.execute("ROLLBACK TO SAVEPOINT rank_steps_routing")
            if attempt == _ROUTING_RETRIES:
                raise
        else:
            cursor.execute("RELEASE SAVEPOINT rank_steps_routing")
            return accepted
    raise AssertionError("unreachable")


def _copy_steps_once(
    cursor: Any, columns: str, batches: Sequence[Sequence[tuple[Any, ...]]]
) -> list[int]:
    """PostgreSQL: one binary COPY of every row straight into rank_steps, the common case where
    none is stored yet: the database writes each row once instead of twice (a temporary table,
    then the table), and formatting a row costs the service about 1 µs instead of a text COPY's
    11-15 µs (measured at 16,384 ranks). A resent row makes that COPY fail on the primary key;
    then, back at the savepoint, the rows go through a temporary table and one
    `INSERT ... SELECT ... ON CONFLICT DO NOTHING`, whose RETURNING says which were new."""
    cursor.execute(
        "SELECT array_agg(atttypid::int ORDER BY array_position(%s::text[], attname::text)) "
        "FROM pg_attribute WHERE attrelid = 'rank_steps'::regclass AND attname = ANY(%s)",
        (list(STEP_COLUMNS), list(STEP_COLUMNS)),
    )
    (types,) = cursor.fetchone()
    cursor.execute("SAVEPOINT rank_steps_copy")
    try:
        _copy_rows(cursor, f"rank_steps ({columns})", types, batches)
    except psycopg.errors.UniqueViolation:
        cursor.execute("ROLLBACK TO SAVEPOINT rank_steps_copy")
    else:
        cursor.execute("RELEASE SAVEPOINT rank_steps_copy")
        return [len(rows) for rows in batches]
    # A temporary table per connection, emptied at every commit: COPY cannot skip conflicts, the
    # INSERT from it can.
    cursor.execute(
        f"CREATE TEMP TABLE IF NOT EXISTS {_TEMP_TABLE} "
        "(LIKE rank_steps INCLUDING DEFAULTS) ON COMMIT DELETE ROWS"
    )
    _copy_rows(cursor, f"{_TEMP_TABLE} ({columns})", types, batches)
    cursor.execute(
        f"INSERT INTO rank_steps ({columns}) SELECT {columns} FROM {_TEMP_TABLE} "
        "ON CONFLICT DO NOTHING RETURNING run_id, step, rank, attempt"
    )
    new = set(cursor.fetchall())
    cursor.execute(f"DELETE FROM {_TEMP_TABLE}")
    accepted = []
    for rows in batches:
        # A row twice in the group (two copies of one batch) is new for the first batch only.
        fresh = {key for key in (row[:_KEY_WIDTH] for row in rows) if key in new}
        new -= fresh
        accepted.append(len(fresh))
    return accepted


def _copy_rows(
    cursor: Any, target: str, types: list[int], batches: Sequence[Sequence[tuple[Any, ...]]]
) -> None:
    with cursor.copy(f"COPY {target} FROM STDIN (FORMAT BINARY)") as copy:
        copy.set_types(types)
        for rows in batches:
            for row in rows:
                copy.write_row(row)


def _raise_problem(index: int, record: telemetry_pb2.RankStep) -> None:
    """Raise InvalidArgument for the first thing wrong with `record` (the combined checks of
    `step_values` failed); return quietly if nothing is (a sum that overflowed, say)."""

    def bad(problem: str) -> InvalidArgument:
        return InvalidArgument(
            f"record {index} (step {record.step}, rank {record.rank}): {problem}"
        )

    if not record.run_id:
        raise bad("run_id is empty")
    for field in (*_COUNTS, "dropped_records"):
        if getattr(record, field) < 0:
            raise bad(f"{field} must not be negative, got {getattr(record, field)}")
    for field in _OFFSETS:
        value = getattr(record.data_offset, field)
        if value < 0:
            raise bad(f"data_offset.{field} must not be negative, got {value}")
    for phase in PHASES:
        seconds = getattr(record.times, phase)
        if not (math.isfinite(seconds) and seconds >= 0):
            raise bad(f"times.{phase} must be finite and >= 0, got {seconds}")
    if not (math.isfinite(record.lr) and record.lr >= 0):
        raise bad(f"lr must be finite and >= 0, got {record.lr}")
    # A NaN or infinite loss or gradient norm is a real observation (divergence, overflow, SDC).
    if record.grad_norm < 0:
        raise bad(f"grad_norm must not be negative, got {record.grad_norm}")
    if len(record.param_checksum) > 128:
        raise bad("param_checksum is longer than 128 characters")
    stamp = record.time
    if not (_MIN_SECONDS <= stamp.seconds <= _MAX_SECONDS and 0 <= stamp.nanos < 1_000_000_000):
        raise bad(f"time is not a valid time ({stamp.seconds} s, {stamp.nanos} ns)")


class _Submission(Generic[T, R]):
    """One caller's item, and what became of it."""

    def __init__(self, item: T) -> None:
        self.item = item
        self.done = threading.Event()
        self.result: R | None = None
        self.error: BaseException | None = None

    def outcome(self) -> R:
        self.done.wait()
        if self.error is not None:
            raise self.error
        return self.result  # type: ignore[return-value]


class GroupCommit(Generic[T, R]):
    """Handles the items of concurrent callers together, one caller's thread at a time.

    Every rank's client streams its own small batches, so a service receives many at once; a
    transaction per batch costs more than its rows (and on SQLite the writers queue for the single
    write lock anyway), and threads taking turns at Python work contend for the interpreter. So the
    first caller to arrive handles, in one call of `handle`, what every caller submitted
    meanwhile, until none is left; the others wait, idle. When `handle` fails on a group, each item
    is tried alone, so that one caller's bad batch fails only that caller.
    `handle(items)` returns one result per item, in order.
    """

    def __init__(self, handle: Callable[[list[T]], list[R]]) -> None:
        self._handle = handle
        self._lock = threading.Lock()
        self._pending: list[_Submission[T, R]] = []
        self._handling = False

    def submit(self, item: T) -> R:
        """Handle `item` (with whatever else is waiting); return its result or raise its error."""
        mine: _Submission[T, R] = _Submission(item)
        with self._lock:
            self._pending.append(mine)
            if self._handling:
                leader = False
            else:
                self._handling = leader = True
        if leader:
            self._lead()
        return mine.outcome()

    def _lead(self) -> None:
        while True:
            with self._lock:
                group, self._pending = self._pending, []
                if not group:
                    self._handling = False
                    return
            self._handle_group(group)

    def _handle_group(self, group: list[_Submission[T, R]]) -> None:
        try:
            results = self._handle([submission.item for submission in group])
        except BaseException as exc:
            if len(group) == 1:
                group[0].error = exc
                group[0].done.set()
                return
            for submission in group:
                self._handle_group([submission])
            return
        for submission, result in zip(group, results, strict=True):
            submission.result = result
            submission.done.set()
