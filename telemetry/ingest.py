"""The bulk path of rank-step records: validated protobuf -> row tuples -> the driver's fastest
idempotent insert.

Rank-step records are nearly all that telemetry stores (one per rank per step, thousands per second
on a large job), so they skip SQLAlchemy's per-row parameter processing, which alone costs more than
the database's own work: SQLite gets one `executemany` of tuples, PostgreSQL a `COPY` into a
temporary table and one `INSERT ... SELECT ... ON CONFLICT DO NOTHING`. The rows keep the storage
conventions of `telemetry.models` exactly (naive UTC text times on SQLite, NaN stored as NULL), so
the ORM and the queries read them back as if SQLAlchemy had written them; the store's tests check
that on both databases.
"""

from __future__ import annotations

import functools
import math
import operator
import threading
import time
from collections.abc import Callable, Sequence
from datetime import UTC, datetime, timedelta
from typing import Any

from sqlalchemy import Connection

from scaletrain.errors import InvalidArgument
from scaletrain.v1 import telemetry_pb2

PHASES = (
    "step", "data", "forward", "backward", "optimizer", "comm_wait", "checkpoint", "compute",
    "replay",
)  # fmt: skip
_COUNTS = ("step", "rank", "attempt", "tokens", "memory_bytes", "peak_memory_bytes")
_OFFSETS = ("global_sample", "rank_sample", "epoch")
# Column order of the tuples `step_values` returns; the positions below index into it.
STEP_COLUMNS = (
    "run_id", "step", "rank", "attempt", "loss", "grad_norm", "tokens",
    *(f"{phase}_s" for phase in PHASES),
    "memory_bytes", "peak_memory_bytes", "lr", "time", "param_checksum",
    "global_sample", "rank_sample", "epoch", "dropped_records",
)  # fmt: skip
RUN_ID, RANK = STEP_COLUMNS.index("run_id"), STEP_COLUMNS.index("rank")
# Seconds of 0001-01-01 and 9999-12-31T23:59:59 since the epoch: the range a datetime can hold.
_MIN_SECONDS, _MAX_SECONDS = -62_135_596_800, 253_402_300_799
_TEMP_TABLE = "rank_steps_incoming"
# Every field of a RankStep that a row needs, read in one call (the loop runs in C).
_READ = operator.attrgetter(
    "run_id", "step", "rank", "attempt", "loss", "grad_norm", "tokens",
    *(f"times.{phase}" for phase in PHASES),
    "memory_bytes", "peak_memory_bytes", "lr", "time.seconds", "time.nanos", "param_checksum",
    "data_offset.global_sample", "data_offset.rank_sample", "data_offset.epoch",
    "dropped_records",
)  # fmt: skip

_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
_NAIVE_EPOCH = _EPOCH.replace(tzinfo=None)

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
    ) = _READ(record)  # fmt: skip
    phase_seconds = (
        step_s, data_s, forward_s, backward_s, optimizer_s, comm_wait_s, checkpoint_s, compute_s,
        replay_s,
    )  # fmt: skip
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
        now = time.time_ns() // 1000
        stored_time = time_format(now // 1_000_000, now % 1_000_000)
    return (
        run_id, step, rank, attempt,
        None if loss != loss else loss, None if grad_norm != grad_norm else grad_norm,
        tokens, *phase_seconds, memory_bytes, peak_memory_bytes, lr, stored_time,
        param_checksum, global_sample, rank_sample, epoch, dropped_records,
    )  # fmt: skip


def insert_steps(connection: Connection, rows: Sequence[tuple[Any, ...]]) -> int:
    """Insert rows (from `step_values` with the dialect's time format) in the connection's open
    transaction, skipping those whose (run, step, rank, attempt) is stored already. Returns how
    many were new."""
    if not rows:
        return 0
    columns = ", ".join(f'"{column}"' for column in STEP_COLUMNS)
    raw = connection.connection.driver_connection
    if connection.dialect.name == "sqlite":
        placeholders = ", ".join("?" * len(STEP_COLUMNS))
        cursor = raw.cursor()
        try:
            cursor.executemany(
                f"INSERT INTO rank_steps ({columns}) VALUES ({placeholders}) "
                "ON CONFLICT DO NOTHING",
                rows,
            )
            return cursor.rowcount
        finally:
            cursor.close()
    with raw.cursor() as cursor:
        # A temporary table per connection, emptied at every commit: COPY cannot skip conflicts,
        # the INSERT from it can.
        cursor.execute(
            f"CREATE TEMP TABLE IF NOT EXISTS {_TEMP_TABLE} "
            "(LIKE rank_steps INCLUDING DEFAULTS) ON COMMIT DELETE ROWS"
        )
        with cursor.copy(f"COPY {_TEMP_TABLE} ({columns}) FROM STDIN") as copy:
            for row in rows:
                copy.write_row(row)
        cursor.execute(
            f"INSERT INTO rank_steps ({columns}) SELECT {columns} FROM {_TEMP_TABLE} "
            "ON CONFLICT DO NOTHING"
        )
        accepted = cursor.rowcount
        cursor.execute(f"DELETE FROM {_TEMP_TABLE}")
        return accepted


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


class _Submission:
    """One caller's rows, and what became of them."""

    def __init__(self, rows: Sequence[tuple[Any, ...]]) -> None:
        self.rows = rows
        self.done = threading.Event()
        self.accepted = 0
        self.error: BaseException | None = None

    def outcome(self) -> int:
        self.done.wait()
        if self.error is not None:
            raise self.error
        return self.accepted


class GroupCommit:
    """Writes the rows of concurrent callers together: one transaction for all that are waiting.

    Each rank's client streams its own batches, so a service receives many small batches at once;
    one transaction per batch would spend more on transactions (and, on SQLite, on taking turns
    for the single write lock) than on rows. The first caller to arrive writes what every caller
    submitted meanwhile, until none is left; the others wait for it. When a group's transaction
    fails, each submission is tried alone, so that one caller's bad rows fail only that caller.
    `write(submissions)` writes the rows of each submission in one transaction and returns how
    many rows of each were new.
    """

    def __init__(self, write: Callable[[list[Sequence[tuple[Any, ...]]]], list[int]]) -> None:
        self._write = write
        self._lock = threading.Lock()
        self._pending: list[_Submission] = []
        self._writing = False

    def submit(self, rows: Sequence[tuple[Any, ...]]) -> int:
        """Write `rows` (with whatever else is waiting); return how many were new."""
        mine = _Submission(rows)
        with self._lock:
            self._pending.append(mine)
            if self._writing:
                leader = False
            else:
                self._writing = leader = True
        if leader:
            self._lead()
        return mine.outcome()

    def _lead(self) -> None:
        while True:
            with self._lock:
                group, self._pending = self._pending, []
                if not group:
                    self._writing = False
                    return
            self._write_group(group)

    def _write_group(self, group: list[_Submission]) -> None:
        try:
            counts = self._write([submission.rows for submission in group])
        except BaseException as exc:
            if len(group) == 1:
                group[0].error = exc
                group[0].done.set()
                return
            for submission in group:
                self._write_group([submission])
            return
        for submission, accepted in zip(group, counts, strict=True):
            submission.accepted = accepted
            submission.done.set()
