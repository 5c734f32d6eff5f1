"""The telemetry store: validates what ranks report and writes it to SQL; answers resume points.

A plain class with no gRPC in it: the servicer in `telemetry.server` only unpacks requests and
delegates here, so every rule is tested against SQLite and PostgreSQL without a network. Errors are
`scaletrain.errors` classes with one-line messages, which the gRPC layer maps to status codes.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from datetime import UTC, datetime, timedelta
from operator import itemgetter
from typing import Any

from google.protobuf.message import Message
from sqlalchemy import Engine, func, literal, select, update
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.exc import DataError, DBAPIError, OperationalError
from sqlalchemy.orm import Session

from scaletrain.errors import InvalidArgument, NotFound, Unavailable
from scaletrain.names import TIER_NAMES, check_run_id
from scaletrain.v1 import common_pb2, telemetry_pb2
from telemetry import partitions
from telemetry.db import sessions
from telemetry.ingest import (
    RANK,
    RUN_ID,
    STEP,
    column_rows,
    insert_steps,
    step_values,
    time_format,
)
from telemetry.models import TRAINER_TIER, WHOLE_TIER, Checkpoint, Event, Rank, RankStep, Run
from telemetry.rollup import NodeMap, StepSummary, node_map, roll_up_from_database, roll_up_missing
from telemetry.rollup import write as write_rollups

# "EVENT_KIND_CHECKPOINT_COMMITTED" is stored as "checkpoint_committed" (tiers: TIER_NAMES).
EVENT_KIND_NAMES: dict[int, str] = {
    value: name.removeprefix("EVENT_KIND_").lower()
    for name, value in telemetry_pb2.EventKind.items()
    if value != telemetry_pb2.EVENT_KIND_UNSPECIFIED
}
CHECKPOINT_COMMITTED = EVENT_KIND_NAMES[telemetry_pb2.EVENT_KIND_CHECKPOINT_COMMITTED]
# The column of the checkpoints table that each checkpoint event stamps with its time.
_CHECKPOINT_TIME_COLUMN = {
    EVENT_KIND_NAMES[telemetry_pb2.EVENT_KIND_CHECKPOINT_STARTED]: "started_at",
    EVENT_KIND_NAMES[telemetry_pb2.EVENT_KIND_CHECKPOINT_STAGED]: "staged_at",
    CHECKPOINT_COMMITTED: "committed_at",
    EVENT_KIND_NAMES[telemetry_pb2.EVENT_KIND_CHECKPOINT_FAILED]: "failed_at",
}
# Events that end a run, and the status they give it.
_FINAL_STATUS = {
    EVENT_KIND_NAMES[telemetry_pb2.EVENT_KIND_RUN_FINISHED]: "finished",
    EVENT_KIND_NAMES[telemetry_pb2.EVENT_KIND_RUN_FAILED]: "failed",
}
_MAX_NODE_CHARS = 128
# Rows per INSERT statement: far below SQLite's and PostgreSQL's limits on bound parameters.
_ROWS_PER_INSERT = 500
_LAYOUT_FIELDS = ("dp_replicate", "dp_shard", "tp", "pp", "cp", "ep")
_log = logging.getLogger(__name__)
_run_of, _step_of = itemgetter(RUN_ID), itemgetter(STEP)


class TelemetryStore:
    """Runs, per-rank step records and events in one SQL database (made by `telemetry.db`).

    Safe to share between threads: every call opens its own short transaction.
    """

    def __init__(
        self, engine: Engine, *, partition_steps: int = partitions.DEFAULT_PARTITION_STEPS
    ) -> None:
        if partition_steps < 1:
            raise ValueError(f"partition_steps must be at least 1, got {partition_steps}")
        self._sessions = sessions(engine)
        self._dialect = engine.dialect.name
        # SQLite has one writer at a time, and a writer that finds the lock taken sleeps for
        # milliseconds; taking turns in this process first costs nothing. PostgreSQL needs no turns.
        self._turns: AbstractContextManager[Any] = (
            threading.Lock() if self._dialect == "sqlite" else nullcontext()
        )
        # World size of each run seen, so that a batch of records costs no query; registering
        # here updates it, a rank outside it makes the store look again.
        self._world_size_of: dict[str, int] = {}
        # PostgreSQL's partitioned rank_steps (`telemetry.partitions`): steps per range partition,
        # whether the table is partitioned (looked up once, on first use), the last step prepared
        # per run, and the steps a background thread is asked to prepare.
        self.partition_steps = partition_steps
        self._partitioned: bool | None = None
        self._prepared: dict[str, int] = {}
        self._entered: dict[str, int] = {}
        self._retry_at: dict[str, float] = {}
        self._wanted: dict[str, int] = {}
        self._preparing = threading.Lock()
        self._preparer: threading.Thread | None = None

    def register_run(
        self, request: telemetry_pb2.RegisterRunRequest
    ) -> telemetry_pb2.RegisterRunResponse:
        """Create the run, or describe an existing one anew (a resumed run registers again).

        The reply says whether the run is new and its attempt (restart generation): 0 when new, one
        more at every later registration. Registering again sets the run running, replaces its
        description (a resumed run may have a new world size or layout), keeps its start time and
        adds or updates the ranks it lists. Race-free when several ranks register at once.
        """
        run_id = check_run_id(request.run_id, "run_id")
        if request.world_size < 1:
            raise InvalidArgument(f"world_size must be at least 1, got {request.world_size}")
        layout = _layout(request)
        if request.model_params < 0:
            raise InvalidArgument(f"model_params must not be negative, got {request.model_params}")
        _check_length(request.name, "name", 256)
        _check_length(request.hardware, "hardware", 128)
        _check_length(request.precision, "precision", 16)
        _check_length(request.peak_flops_source, "peak_flops_source", 128)
        if not (math.isfinite(request.peak_flops) and request.peak_flops >= 0):
            raise InvalidArgument(f"peak_flops must be finite and >= 0, got {request.peak_flops}")
        if not 0 <= request.recompute_fraction <= 1:
            raise InvalidArgument(
                f"recompute_fraction must be between 0 and 1, got {request.recompute_fraction}"
            )
        ranks = _rank_rows(run_id, request)
        description: dict[str, Any] = {
            "name": request.name,
            "config_json": request.config_json,
            "world_size": request.world_size,
            **layout,
            "model_params": request.model_params,
            "hardware": request.hardware,
            "precision": request.precision,
            "peak_flops": request.peak_flops,
            "peak_flops_source": request.peak_flops_source,
            "recompute_fraction": request.recompute_fraction,
            "status": "running",
            "finished_at": None,
        }
        started_at = _time(request, "started_at")
        with self._transaction() as session:
            created = (
                session.execute(
                    _insert(session, Run)
                    .values(run_id=run_id, started_at=started_at, **description)
                    .on_conflict_do_nothing(index_elements=["run_id"])
                    .returning(Run.run_id)
                ).first()
                is not None
            )
            attempt, last_step = 0, -1
            if not created:
                newest = select(func.max(RankStep.step)).where(RankStep.run_id == run_id)
                last_step = session.execute(newest).scalar()
                last_step = -1 if last_step is None else int(last_step)
                attempt = session.execute(
                    update(Run)
                    .where(Run.run_id == run_id)
                    .values(**description, attempt=Run.attempt + 1)
                    .returning(Run.attempt)
                ).scalar_one()
            # In chunks: 16,384 ranks in one statement would pass PostgreSQL's 65,535 parameters.
            for start in range(0, len(ranks), _ROWS_PER_INSERT):
                insert_ranks = _insert(session, Rank).values(
                    ranks[start : start + _ROWS_PER_INSERT]
                )
                session.execute(
                    insert_ranks.on_conflict_do_update(
                        index_elements=["run_id", "rank"],
                        set_={
                            "host": insert_ranks.excluded.host,
                            "device": insert_ranks.excluded.device,
                        },
                    )
                )
        self._world_size_of[run_id] = request.world_size
        if self.partitioned():
            # Before the run's first record: its partition and ranges from where it stands.
            self.prepare_partitions(run_id)
        return telemetry_pb2.RegisterRunResponse(
            created=created, attempt=attempt, last_step=last_step
        )

    def wait_for_partitions(self, timeout_s: float = 30.0) -> None:
        """Until the background thread made the ranges asked for (tests, benchmarks)."""
        thread = self._preparer
        if thread is not None:
            thread.join(timeout_s)

    def partitioned(self) -> bool:
        """Whether rank_steps is PostgreSQL's partitioned table (`telemetry.partitions`)."""
        if self._partitioned is None:
            with self._transaction() as session:
                self._partitioned = partitions.is_partitioned(session.connection())
        return self._partitioned

    def prepare_partitions(
        self,
        run_id: str,
        through_step: int | None = None,
        *,
        lock_timeout_s: float = 2.0,
        analyze: bool = True,
    ) -> int:
        """Make the range partitions of `run_id` from its latest stored step (0 without one)
        through `through_step` (default: AHEAD_RANGES ranges past it); the last step covered.

        Short lock waits only (`lock_timeout_s`): a reader or a retention drop in the way makes
        it give up with Unavailable, and rows meanwhile land in the run's default partition.
        With `analyze`, then takes the statistics of the ranges up to the one being written that
        have none (`partitions.analyze_written`).
        """
        size = self.partition_steps
        timeout_ms = int(lock_timeout_s * 1000)
        with self._transaction() as session:
            connection = session.connection()
            connection.exec_driver_sql(f"SET LOCAL lock_timeout = '{timeout_ms}ms'")
            latest = session.scalar(
                select(func.max(RankStep.step)).where(RankStep.run_id == run_id)
            )
            start = max(latest or 0, 1)
            if through_step is None:
                through_step = start + partitions.AHEAD_RANGES * size
            covered = partitions.prepare(connection, run_id, start, through_step, size)
        self._prepared[run_id] = covered
        if not analyze:
            return covered
        # Apart, so that the run's lock is not held while ANALYZE reads.
        with self._transaction() as session:
            connection = session.connection()
            connection.exec_driver_sql(f"SET LOCAL lock_timeout = '{timeout_ms}ms'")
            first, end = partitions.range_of(start, size)
            # The range being written too, once a tenth of it is: earlier its statistics would
            # describe almost nothing, and nothing analyses it again before autovacuum does.
            written = end if start >= first + max(1, size // 10) else first
            partitions.analyze_written(connection, run_id, written)
        return covered

    def add_steps(self, records: Sequence[telemetry_pb2.RankStep]) -> tuple[int, int]:
        """Store step records; return (accepted, duplicates). See `add_step_batches`."""
        ((accepted, duplicates, _),) = self.add_step_batches(
            [telemetry_pb2.StepBatch(records=records)]
        )
        return accepted, duplicates

    def add_step_batches(
        self, batches: Sequence[telemetry_pb2.StepBatch]
    ) -> list[tuple[int, int, list[tuple[Any, ...]]]]:
        """Store the records of several batches (records and columns) in one transaction; return
        per batch (accepted, duplicates, its rows in STEP_COLUMNS order).

        A record whose (run, step, rank, attempt) is stored already counts as a duplicate and
        changes nothing, so a client may resend a batch it is unsure about. One bad record rejects
        everything (InvalidArgument naming it and the field); an unregistered run gives NotFound.
        """
        to_stored = time_format(self._dialect)
        rows = [self._checked_rows(batch, to_stored) for batch in batches]
        if not any(rows):
            return [(0, 0, batch_rows) for batch_rows in rows]
        highest = self._highest_steps(rows) if self.partitioned() else {}
        if highest:
            self._make_room(highest)
        with self._transaction() as session:
            connection = session.connection()
            accepted = insert_steps(connection, rows)
        if highest:
            self._ask_ahead(highest)
        return [
            (new, len(batch_rows) - new, batch_rows)
            for new, batch_rows in zip(accepted, rows, strict=True)
        ]

    @staticmethod
    def _highest_steps(rows: Sequence[Sequence[tuple[Any, ...]]]) -> dict[str, int]:
        """The highest step of each run in the batches: two C-level passes over a batch of one
        run (nearly every batch), a Python loop only over one that mixes runs."""
        highest: dict[str, int] = {}
        for batch in rows:
            if not batch:
                continue
            runs = set(map(_run_of, batch))
            if len(runs) == 1:
                (run_id,) = runs
                highest[run_id] = max(highest.get(run_id, 0), max(map(_step_of, batch)))
            else:
                for row in batch:
                    highest[row[RUN_ID]] = max(highest.get(row[RUN_ID], 0), row[STEP])
        return highest

    def _make_room(self, highest: dict[str, int]) -> None:
        """Before a batch whose steps are beyond the prepared ranges (the background thread fell
        behind, or a run's first batch since the service started): make their ranges now, under
        the layout's lock, so that the rows land in them and never need moving. A lock not had
        within 0.2 s leaves the rows to the run's default partition, and this is not tried
        again for the run for 10 s; the ranges made later take the rows in."""
        size = self.partition_steps
        for run_id, step in highest.items():
            if step <= self._prepared.get(run_id, 0):
                continue
            if time.monotonic() < self._retry_at.get(run_id, 0.0):
                continue
            try:
                self.prepare_partitions(
                    run_id,
                    step + partitions.AHEAD_RANGES * size,
                    lock_timeout_s=0.2,
                    analyze=False,
                )
            except Exception as exc:  # the batch goes on into the run's default partition
                self._retry_at[run_id] = time.monotonic() + 10.0
                _log.warning("telemetry: no range for run %r step %d yet: %s", run_id, step, exc)

    def steps_written(self, highest: dict[str, int]) -> None:
        """What the store does after writing steps (the highest of each run): `_ask_ahead`;
        for a benchmark that writes rows around the store."""
        self._ask_ahead(highest)

    def _ask_ahead(self, highest: dict[str, int]) -> None:
        """Ask the background thread for the next ranges when a run's step comes within a range
        of the last one prepared, so that a batch does not wait for one."""
        size = self.partition_steps
        wanted = {}
        for run_id, step in highest.items():
            # Near the end of what is prepared, or a tenth into a new range: then the statistics
            # of the range before it (complete) and of this one are taken, which the planner
            # needs to search a range by its primary key for a few ranks' steps.
            entered = partitions.range_of(step, size)[0]
            if step + size > self._prepared.get(run_id, 0) or (
                step >= entered + max(1, size // 10) and entered > self._entered.get(run_id, 0)
            ):
                wanted[run_id] = step + partitions.AHEAD_RANGES * size
                if step >= entered + max(1, size // 10):
                    self._entered[run_id] = entered
        if not wanted:
            return
        with self._preparing:
            for run_id, through in wanted.items():
                self._wanted[run_id] = max(self._wanted.get(run_id, 0), through)
            if self._preparer is None:
                self._preparer = threading.Thread(
                    target=self._prepare_wanted, name="telemetry-partitions", daemon=True
                )
                self._preparer.start()

    def _prepare_wanted(self) -> None:
        """The background thread: prepare what was asked for, then end."""
        while True:
            with self._preparing:
                if not self._wanted:
                    self._preparer = None
                    return
                run_id, through = self._wanted.popitem()
            try:
                self.prepare_partitions(run_id, through)
            except Exception as exc:  # the next batch, or the next sweep, asks again
                _log.warning("telemetry: preparing partitions of run %r failed: %s", run_id, exc)

    def _checked_rows(
        self, batch: telemetry_pb2.StepBatch, to_stored: Any
    ) -> list[tuple[Any, ...]]:
        """The rows of a batch's records and columns, every rank checked against its run."""
        rows = [step_values(index, record, to_stored) for index, record in enumerate(batch.records)]
        if batch.HasField("columns"):
            rows += column_rows(batch.columns, to_stored)
        if not rows:
            return rows
        world_sizes = self._known_world_sizes({row[RUN_ID] for row in rows})
        for index, row in enumerate(rows):
            if row[RANK] >= world_sizes[row[RUN_ID]]:
                # Registered again elsewhere with more ranks? Ask the database before refusing.
                world_sizes = self._known_world_sizes({row[RUN_ID]}, refresh=True)
                if row[RANK] >= world_sizes[row[RUN_ID]]:
                    raise InvalidArgument(
                        f"record {index}: rank {row[RANK]} is outside run {row[RUN_ID]!r} "
                        f"of world size {world_sizes[row[RUN_ID]]}"
                    )
        return rows

    def add_events(self, events: Sequence[telemetry_pb2.Event]) -> int:
        """Store events; return how many were new.

        An event with the same run, kind, step, rank and time as a stored one is a resent copy and
        is skipped. A new run_finished or run_failed event sets the run's status.
        """
        if not events:
            return 0
        rows = [_event_row(index, event) for index, event in enumerate(events)]
        inserted: list[Any] = []
        with self._transaction() as session:
            world_sizes = self._world_sizes(session, {row["run_id"] for row in rows})
            for index, row in enumerate(rows):
                if row["rank"] >= world_sizes[row["run_id"]]:
                    raise InvalidArgument(
                        f"event {index}: rank {row['rank']} is outside run {row['run_id']!r} "
                        f"of world size {world_sizes[row['run_id']]}"
                    )
            # `part` keys the checkpoint row of a replica's event, not the event itself.
            event_rows = [{k: v for k, v in row.items() if k != "part"} for row in rows]
            for start in range(0, len(rows), _ROWS_PER_INSERT):
                statement = (
                    _insert(session, Event)
                    .values(event_rows[start : start + _ROWS_PER_INSERT])
                    .on_conflict_do_nothing()
                    .returning(Event.run_id, Event.kind, Event.time)
                )
                inserted.extend(session.execute(statement))
            for run_id, kind, time in sorted(inserted, key=lambda row: row.time):
                if kind in _FINAL_STATUS:
                    session.execute(
                        update(Run)
                        .where(Run.run_id == run_id)
                        .values(status=_FINAL_STATUS[kind], finished_at=time)
                    )
            new = {(row.run_id, row.kind, row.time) for row in inserted}
            for row in rows:
                if row["kind"] in _CHECKPOINT_TIME_COLUMN and (
                    (row["run_id"], row["kind"], row["time"]) in new
                ):
                    self._record_checkpoint(session, row)
        return len(inserted)

    def add_rollups(
        self, summaries: Sequence[StepSummary], incomplete: Sequence[tuple[str, int, int]] = ()
    ) -> None:
        """Store the rollups of complete steps, and roll up the `incomplete` (run_id, attempt,
        step)s from the rows the database holds, in one transaction."""
        if not summaries and not incomplete:
            return
        with self._transaction() as session:
            connection = session.connection()
            write_rollups(connection, summaries)
            by_run: dict[str, list[tuple[int, int]]] = {}
            for run_id, attempt, step in incomplete:
                by_run.setdefault(run_id, []).append((attempt, step))
            for run_id, steps in by_run.items():
                nodes = node_map(connection, run_id)
                write_rollups(connection, roll_up_from_database(connection, run_id, steps, nodes))

    def roll_up(self, run_id: str | None = None) -> int:
        """Roll up every step of `run_id` (every run) that has rank rows and no rollup yet; return
        how many. The service does it when it starts, for steps it never saw complete."""
        with self._transaction() as session:
            return roll_up_missing(session.connection(), run_id)

    def nodes_of(self, run_id: str) -> NodeMap:
        """Which node each rank of `run_id` is on, from the hosts its registration listed."""
        with self._transaction() as session:
            return node_map(session.connection(), run_id)

    def transaction(self) -> AbstractContextManager[Session]:
        """A short transaction of this store, taking turns with its writes (for retention)."""
        return self._transaction()

    def run_info(self, run_id: str) -> Run:
        """The run's registered description (world size, model size, peak); NotFound if none."""
        with self._transaction() as session:
            run = session.get(Run, run_id)
            if run is None:
                raise NotFound(f"run {run_id!r} is not registered: call RegisterRun first")
            return run

    def resume_point(self, run_id: str, step: int | None = None) -> telemetry_pb2.ResumePoint:
        """Where to resume `run_id`: `step`, or the latest step committed on some tier.

        The offsets are the data-loader positions each rank reported with its record of that
        step (its latest attempt), sorted by rank; a rank whose record never arrived is missing
        from them, which the trainer must notice. found is False when the run has no committed step.
        """
        run_id = check_run_id(run_id, "run_id")
        if step is not None and step < 0:
            raise InvalidArgument(f"step must not be negative, got {step}")
        with self._transaction() as session:
            self._world_sizes(session, {run_id})
            if step is None:
                step = session.scalar(
                    select(func.max(Event.step)).where(
                        Event.run_id == run_id, Event.kind == CHECKPOINT_COMMITTED
                    )
                )
                if step is None:
                    return telemetry_pb2.ResumePoint(found=False)
            rows = session.execute(
                select(RankStep.rank, RankStep.global_sample, RankStep.rank_sample, RankStep.epoch)
                .where(RankStep.run_id == run_id, RankStep.step == step)
                .order_by(RankStep.rank, RankStep.attempt)
            ).all()
        # Ordered by attempt, so the latest attempt of each rank is the one that stays.
        latest = {row.rank: row for row in rows}
        return telemetry_pb2.ResumePoint(
            found=True,
            step=step,
            offsets=[
                telemetry_pb2.RankOffset(
                    rank=rank,
                    offset=telemetry_pb2.DataLoaderOffset(
                        global_sample=row.global_sample,
                        rank_sample=row.rank_sample,
                        epoch=row.epoch,
                    ),
                )
                for rank, row in sorted(latest.items())
            ],
        )

    @staticmethod
    def _record_checkpoint(session: Session, event: dict[str, Any]) -> None:
        """Stamp the checkpoint row of the event's step, tier and node with the event's time.

        Bytes and seconds are kept unless the event carries them. A staged event of a save whose
        start was never reported sets `started_at` to the staging time minus the blocked seconds.
        The trainer's row and S3's (the whole checkpoint) have node "": every node reports S3's
        copy once it sees it there, and the row keeps the earliest report of each kind.
        """
        column = _CHECKPOINT_TIME_COLUMN[event["kind"]]
        tier = event["tier"] or TRAINER_TIER
        whole = tier in (TRAINER_TIER, WHOLE_TIER)
        values: dict[str, Any] = {
            "run_id": event["run_id"],
            "step": event["step"],
            "tier": tier,
            "node": "" if whole else event["node"],
            "part": "" if whole else event["part"],
            column: event["time"],
            "bytes": event["bytes"] or 0,
            "seconds": event["seconds"] or 0.0,
        }
        changes: dict[str, Any] = {column: event["time"]}
        if event["bytes"]:
            changes["bytes"] = event["bytes"]
        if event["seconds"]:
            changes["seconds"] = event["seconds"]
        if column == "staged_at":
            values["started_at"] = event["time"] - timedelta(seconds=event["seconds"] or 0.0)
            started = literal(values["started_at"], Checkpoint.__table__.c.started_at.type)
            changes["started_at"] = func.coalesce(Checkpoint.started_at, started)
        stamped = getattr(Checkpoint, column)
        earlier = stamped.is_(None) | (stamped > literal(event["time"], stamped.type))
        statement = _insert(session, Checkpoint).values(values)
        session.execute(
            statement.on_conflict_do_update(
                index_elements=["run_id", "step", "tier", "node", "part"],
                set_=changes,
                where=earlier if tier == WHOLE_TIER else None,
            )
        )

    @contextmanager
    def _transaction(self) -> Iterator[Session]:
        """One transaction, with database errors turned into what a client should do about them.

        A database that cannot be reached or is locked is Unavailable: retry later. Data the
        database refuses (PostgreSQL rejects NUL characters in text, say) is InvalidArgument: a
        client that retried it forever would block every record queued behind it.
        """
        try:
            with self._turns, self._sessions.begin() as session:
                yield session
        except OperationalError as exc:
            raise Unavailable(f"telemetry database unavailable: {_reason(exc)}") from exc
        except DataError as exc:
            raise InvalidArgument(f"the database refused the data: {_reason(exc)}") from exc

    def _known_world_sizes(self, run_ids: set[str], *, refresh: bool = False) -> dict[str, int]:
        """World size of each run, from memory when known; NotFound for an unregistered run."""
        unknown = run_ids if refresh else run_ids - self._world_size_of.keys()
        if unknown:
            with self._transaction() as session:
                self._world_size_of.update(self._world_sizes(session, unknown))
        return {run_id: self._world_size_of[run_id] for run_id in run_ids}

    @staticmethod
    def _world_sizes(session: Session, run_ids: set[str]) -> dict[str, int]:
        """World size of each run; NotFound names the first run that was never registered."""
        found = dict(
            session.execute(select(Run.run_id, Run.world_size).where(Run.run_id.in_(run_ids))).all()
        )
        missing = sorted(run_ids - found.keys())
        if missing:
            raise NotFound(f"run {missing[0]!r} is not registered: call RegisterRun first")
        return found


def _insert(session: Session, model: type[Any]) -> Any:
    """The dialect's INSERT, which has ON CONFLICT on both SQLite and PostgreSQL.

    Callers count inserted rows with RETURNING: psycopg reports no rowcount for these statements.
    """
    dialect = session.get_bind().dialect.name
    return postgresql.insert(model) if dialect == "postgresql" else sqlite.insert(model)


def _reason(exc: DBAPIError) -> str:
    """The first line of the driver's message: the rest repeats the SQL and its parameters."""
    lines = str(exc.orig or exc).strip().splitlines()
    return lines[0] if lines else type(exc).__name__


def _check_length(value: str, what: str, limit: int) -> None:
    if len(value) > limit:
        raise InvalidArgument(f"{what} has {len(value)} characters, at most {limit} are allowed")


def _time(message: Message, field: str) -> datetime:
    """The Timestamp `field` of `message` as aware UTC; unset means now (nobody stamped it)."""
    if not message.HasField(field):
        return datetime.now(UTC)
    timestamp = getattr(message, field)
    try:
        return timestamp.ToDatetime(tzinfo=UTC)
    except (ValueError, OverflowError):
        raise InvalidArgument(
            f"{field} is not a valid time ({timestamp.seconds} s, {timestamp.nanos} ns)"
        ) from None


def _layout(request: telemetry_pb2.RegisterRunRequest) -> dict[str, int]:
    """The parallel layout with unset (0) sizes as 1, checked against the world size."""
    layout = {field: getattr(request.layout, field) or 1 for field in _LAYOUT_FIELDS}
    negative = [field for field, size in layout.items() if size < 0]
    if negative:
        raise InvalidArgument(f"layout {negative[0]} must not be negative")
    if request.HasField("layout"):
        ranks = math.prod(layout[f] for f in ("dp_replicate", "dp_shard", "tp", "pp", "cp"))
        if ranks != request.world_size:
            raise InvalidArgument(
                f"layout dp_replicate*dp_shard*tp*pp*cp = {ranks} "
                f"but world_size is {request.world_size}"
            )
        if (layout["dp_shard"] * layout["cp"]) % layout["ep"]:
            raise InvalidArgument(
                f"layout ep={layout['ep']} does not divide dp_shard*cp = "
                f"{layout['dp_shard'] * layout['cp']}"
            )
    return layout


def _rank_rows(run_id: str, request: telemetry_pb2.RegisterRunRequest) -> list[dict[str, Any]]:
    rows: dict[int, dict[str, Any]] = {}
    for info in request.ranks:
        if not 0 <= info.rank < request.world_size:
            raise InvalidArgument(f"rank {info.rank} is outside world size {request.world_size}")
        if info.rank in rows:
            raise InvalidArgument(f"rank {info.rank} is listed twice")
        _check_length(info.host, "host", 256)
        _check_length(info.device, "device", 128)
        rows[info.rank] = {
            "run_id": run_id,
            "rank": info.rank,
            "host": info.host,
            "device": info.device,
        }
    return list(rows.values())


def _event_row(index: int, event: telemetry_pb2.Event) -> dict[str, Any]:
    """The row of one event, or InvalidArgument naming the event and the field."""

    def bad(problem: str) -> InvalidArgument:
        return InvalidArgument(f"event {index} (step {event.step}): {problem}")

    try:
        check_run_id(event.run_id, "run_id")
    except InvalidArgument as exc:
        raise bad(str(exc)) from None
    if event.step < 0:
        raise bad(f"step must not be negative, got {event.step}")
    if event.rank < -1:
        raise bad(f"rank must be -1 (the whole run) or a rank, got {event.rank}")
    kind = EVENT_KIND_NAMES.get(event.kind)
    if kind is None:
        raise bad(f"kind {event.kind} is not a known EventKind")
    tier: str | None = None
    size: int | None = None
    seconds: float | None = None
    node = part = ""
    if event.HasField("checkpoint"):
        checkpoint = event.checkpoint
        if checkpoint.tier != common_pb2.TIER_UNSPECIFIED:
            tier = TIER_NAMES.get(checkpoint.tier)
            if tier is None:
                raise bad(f"checkpoint.tier {checkpoint.tier} is not a known Tier")
        if checkpoint.bytes < 0:
            raise bad(f"checkpoint.bytes must not be negative, got {checkpoint.bytes}")
        if not (math.isfinite(checkpoint.seconds) and checkpoint.seconds >= 0):
            raise bad(f"checkpoint.seconds must be finite and >= 0, got {checkpoint.seconds}")
        for field, value in (("node", checkpoint.node), ("replica_of", checkpoint.replica_of)):
            if len(value) > _MAX_NODE_CHARS or not value.isprintable():
                raise bad(
                    f"checkpoint.{field} must be printable and at most {_MAX_NODE_CHARS} characters"
                )
        size, seconds, node = checkpoint.bytes, checkpoint.seconds, checkpoint.node
        part = checkpoint.replica_of
    try:
        time = _time(event, "time")
    except InvalidArgument as exc:
        raise bad(str(exc)) from None
    return {
        "run_id": event.run_id,
        "step": event.step,
        "rank": event.rank,
        "kind": kind,
        "message": event.message,
        "time": time,
        "attributes": dict(event.attributes),
        "tier": tier,
        "bytes": size,
        "seconds": seconds,
        "node": node,
        "part": part,
    }
