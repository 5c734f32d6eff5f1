"""Retention: per-rank rows for a recent window, rollups for the whole run.

A job of 16,384 ranks at a 2 s step stores 700M rank rows a day; what the run's charts, goodput
and MFU need over the whole run is in `step_rollups`, one row per step. So the service keeps rank
rows (and node rows) only for each run's latest `keep_steps` steps, and deletes older ones in the
background, in bounded batches: each delete is one short transaction over a range of steps (at
most `batch_rows` rows, by the primary key's (run_id, step) prefix), and the store's writes take
their turn between two batches, so ingest never waits for more than one batch.

It never deletes a rank row a rollup still needs: only rows of a (step, attempt) that has its
rollup go. Nor the rows of the run's latest `keep_checkpoints` committed checkpoints: a resume
reads each rank's data-loader offset there.

On PostgreSQL, whose rank_steps is partitioned by run and step range (`telemetry.partitions`),
rank rows go a range partition at a time, once every step of it is past the window: a DROP frees
its space at once, where deleting the same rows and vacuuming took 10x longer and left the space
with the table (`bench/telemetry_layout.py`). The window is thus rounded out to whole partitions:
up to `partition_steps - 1` steps more than `keep_steps` keep their rows (deleting the older part
of a partition row by row first would be the plain table's cost again, for every row). A
partition holding rows that must stay (a step not rolled up, a protected checkpoint's step) is
rewritten with only those rows; the run's default partition (steps outside every prepared range)
is trimmed by the bounded batch deletes. Each drop waits at most `lock_timeout_s` for its lock,
which readers and writers of the run hold for a moment: behind a long read it gives up until the
next sweep rather than queue ingest behind it.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Connection, MetaData, Table, delete, exists, func, select, text

from scaletrain.errors import ScaletrainError, Unavailable
from telemetry import partitions
from telemetry.models import TRAINER_TIER, Checkpoint, NodeStep, RankStep, Run, StepRollup
from telemetry.store import TelemetryStore

_log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RetentionPolicy:
    """How much per-rank detail to keep, and how much to delete at a time."""

    keep_steps: int = 1000
    keep_checkpoints: int = 3
    batch_rows: int = 50_000
    # Seconds between two sweeps of every run, and between two batches of one sweep.
    every_s: float = 30.0
    pause_s: float = 0.05
    # The longest a partition drop waits for its lock (PostgreSQL): ingest queues behind it.
    lock_timeout_s: float = 0.5

    def __post_init__(self) -> None:
        if self.keep_steps < 1:
            raise ValueError(f"keep_steps must be at least 1, got {self.keep_steps}")
        if self.keep_checkpoints < 0 or self.batch_rows < 1:
            raise ValueError("keep_checkpoints must be >= 0 and batch_rows >= 1")


class Retention:
    """Deletes what the policy no longer keeps, run by run; `sweep` once, or `start` a thread."""

    def __init__(self, store: TelemetryStore, policy: RetentionPolicy | None = None) -> None:
        self.store = store
        self.policy = policy or RetentionPolicy()
        # Per run, the first step a sweep may still find rows at: sweeps resume where they ended.
        self._from_step: dict[str, int] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def sweep(self) -> int:
        """One pass over every run; returns the rank rows deleted."""
        with self.store.transaction() as session:
            runs = session.execute(select(Run.run_id, Run.world_size)).all()
        return sum(self.sweep_run(run_id, world) for run_id, world in runs)

    def sweep_run(self, run_id: str, world_size: int) -> int:
        """Delete the rows of `run_id` the policy no longer keeps, a batch (or a partition) at a
        time; returns the rank rows deleted."""
        policy = self.policy
        partitioned = self.store.partitioned()
        if partitioned:
            # Catch up on ranges the store's thread could not make (rows in the default partition
            # move into them), so that what follows finds them where the drops look.
            try:
                self.store.prepare_partitions(run_id)
            except Unavailable as exc:
                _log.warning("telemetry: preparing partitions of %r failed: %s", run_id, exc)
        with self.store.transaction() as session:
            latest = session.scalar(
                select(func.max(StepRollup.step)).where(StepRollup.run_id == run_id)
            )
            if latest is None:
                return 0
            protected = list(
                session.scalars(
                    select(Checkpoint.step)
                    .where(
                        Checkpoint.run_id == run_id,
                        Checkpoint.committed_at.is_not(None),
                        Checkpoint.tier != TRAINER_TIER,
                    )
                    .distinct()
                    .order_by(Checkpoint.step.desc())
                    .limit(policy.keep_checkpoints)
                )
            )
            start = self._from_step.get(run_id)
            default = None
            if partitioned:
                # Batches trim the run's default partition and the node rows; the ranges go whole.
                default = _partition_table(partitions.run_table(run_id) + "_default")
                firsts = [
                    session.scalar(
                        select(func.min(default.c.step)).where(default.c.step.not_in(protected))
                    ),
                    start
                    if start is not None
                    else session.scalar(
                        select(func.min(NodeStep.step)).where(NodeStep.run_id == run_id)
                    ),
                ]
                start = min((f for f in firsts if f is not None), default=None)
            elif start is None:
                start = session.scalar(
                    select(func.min(RankStep.step)).where(
                        RankStep.run_id == run_id, RankStep.step.not_in(protected)
                    )
                )
        horizon = latest - policy.keep_steps
        deleted = 0
        if partitioned:
            deleted += self._drop_partitions(run_id, horizon, protected)
        if start is None or start > horizon:
            return deleted
        per_batch = max(1, policy.batch_rows // max(1, world_size))
        while start <= horizon and not self._stop.is_set():
            end = min(start + per_batch - 1, horizon)
            deleted += self._delete(run_id, start, end, protected, default)
            start = end + 1
            self._from_step[run_id] = start
            self._stop.wait(policy.pause_s)
        return deleted

    def _drop_partitions(self, run_id: str, horizon: int, protected: list[int]) -> int:
        """Drop (or rewrite with only the rows that must stay) each range partition of the run
        whose steps are all at or below `horizon`; returns the rank rows that went."""
        with self.store.transaction() as session:
            spans = partitions.ranges(session.connection(), run_id)
            restarted = bool(session.scalar(select(Run.attempt).where(Run.run_id == run_id)))
        deleted = 0
        for span in spans:
            if span.end - 1 > horizon or self._stop.is_set():
                break
            try:
                with self.store.transaction() as session:
                    deleted += _drop_range(
                        session.connection(),
                        run_id,
                        span,
                        protected,
                        self.policy.lock_timeout_s,
                        restarted=restarted,
                    )
            except Unavailable as exc:
                # A lock not had in time: readers or writers of the run; the next sweep retries.
                _log.info("telemetry: retention left %s for the next sweep: %s", span.name, exc)
                break
            self._stop.wait(self.policy.pause_s)
        return deleted

    def _delete(
        self, run_id: str, first: int, last: int, protected: list[int], table: Table | None = None
    ) -> int:
        """One batch: the rolled-up rank rows (of `table`, a partition, when given) and the node
        rows of steps first..last."""
        rows_of = RankStep.__table__ if table is None else table
        rolled_up = exists().where(
            StepRollup.run_id == rows_of.c.run_id,
            StepRollup.step == rows_of.c.step,
            StepRollup.attempt == rows_of.c.attempt,
        )
        with self.store.transaction() as session:
            rows = session.execute(
                delete(rows_of)
                .where(
                    rows_of.c.run_id == run_id,
                    rows_of.c.step.between(first, last),
                    rows_of.c.step.not_in(protected),
                    rolled_up,
                )
                .execution_options(synchronize_session=False)
            ).rowcount
            session.execute(
                delete(NodeStep)
                .where(NodeStep.run_id == run_id, NodeStep.step.between(first, last))
                .execution_options(synchronize_session=False)
            )
        return rows

    def start(self) -> None:
        """Sweep every `every_s` seconds in a daemon thread until `stop`."""
        self._thread = threading.Thread(target=self._run, name="telemetry-retention", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)

    def _run(self) -> None:
        while not self._stop.wait(self.policy.every_s):
            try:
                self.sweep()
            except ScaletrainError as exc:
                # The database is down or locked for long: the next sweep tries again.
                _log.warning("telemetry: retention sweep failed: %s", exc)


def _partition_table(name: str) -> Table:
    """A partition as a Core table with rank_steps' columns, to delete from it alone."""
    return RankStep.__table__.to_metadata(MetaData(), name=name)


def _drop_range(
    connection: Connection,
    run_id: str,
    span: partitions.StepRange,
    protected: list[int],
    lock_timeout_s: float,
    *,
    restarted: bool,
) -> int:
    """Drop one range partition past the window, keeping the rows a rollup or a resume needs.

    Writes into the partition are locked out first (SHARE: readers go on), so no row arrives
    between the check and the drop. Without rows to keep, the partition is dropped; otherwise,
    unless they are all it holds, a new table gets them and takes the partition's place. Returns
    the rows that went.
    """
    connection.exec_driver_sql(f"SET LOCAL lock_timeout = '{int(lock_timeout_s * 1000)}ms'")
    connection.exec_driver_sql(f'LOCK TABLE "{span.name}" IN SHARE MODE')
    params = {"run_id": run_id, "first": span.first, "end": span.end, "protected": protected}
    if restarted:
        total, kept, must_stay = _rows_to_keep_by_scan(connection, span, params)
    else:
        total, kept, must_stay = _rows_to_keep_by_index(connection, span, params)
    if total == kept and total:
        return 0
    parent = partitions.run_table(run_id)
    if kept:
        staying = f"{span.name}_kept"
        connection.exec_driver_sql(
            f'CREATE TABLE "{staying}" (LIKE {partitions.TABLE} INCLUDING DEFAULTS) '
            f"{partitions.RANGE_OPTIONS}"
        )
        connection.execute(
            text(f'INSERT INTO "{staying}" SELECT * FROM "{span.name}" r WHERE {must_stay}'),
            params,
        )
    connection.exec_driver_sql(f'DROP TABLE "{span.name}"')
    if kept:
        connection.exec_driver_sql(f'ALTER TABLE "{staying}" RENAME TO "{span.name}"')
        connection.exec_driver_sql(
            f'ALTER TABLE "{parent}" ATTACH PARTITION "{span.name}" '
            f"FOR VALUES FROM ({span.first}) TO ({span.end})"
        )
    return int(total - kept)


def _rows_to_keep_by_index(
    connection: Connection, span: partitions.StepRange, params: dict[str, Any]
) -> tuple[int, int, str]:
    """A run never restarted has attempt 0 only: the steps whose rows must stay are those of the
    range without a rollup, or protected, that have rows; a few primary-key lookups find them,
    not a read of the partition. The rows that go are counted as their rollups counted them
    (`ranks`). Returns (rows, rows to keep, the condition on `r` of the rows to keep)."""
    rolled = dict(
        connection.execute(
            text(
                "SELECT step, ranks FROM step_rollups WHERE run_id = :run_id AND attempt = 0 "
                "AND step >= :first AND step < :end"
            ),
            params,
        ).all()
    )
    # The steps that have rows: one primary-key descent each.
    present = set(
        connection.execute(
            text(
                "SELECT w.step FROM unnest(CAST(:steps AS bigint[])) AS w(step) WHERE EXISTS "
                f'(SELECT 1 FROM "{span.name}" r WHERE r.run_id = :run_id AND r.step = w.step)'
            ),
            {**params, "steps": list(range(span.first, span.end))},
        ).scalars()
    )
    protected = set(params["protected"])
    keep = sorted(step for step in present if step not in rolled or step in protected)
    kept = 0
    if keep:
        kept = connection.execute(
            text(f'SELECT count(*) FROM "{span.name}" WHERE step = ANY(:keep)'), {"keep": keep}
        ).scalar_one()
    params["keep"] = keep
    gone = sum(rolled[step] for step in present if step not in keep)
    return gone + kept, kept, "r.step = ANY(:keep)"


def _rows_to_keep_by_scan(
    connection: Connection, span: partitions.StepRange, params: dict[str, Any]
) -> tuple[int, int, str]:
    """A restarted run's rows may be of several attempts, each with a rollup of its own or not:
    one read of the partition joined to the range's rollups counts its rows and those to keep
    (their attempt's rollup missing, or a protected step). Returns as `_rows_to_keep_by_index`."""
    missing_rollup = (
        "NOT EXISTS (SELECT 1 FROM step_rollups s WHERE s.run_id = r.run_id "
        "AND s.step = r.step AND s.attempt = r.attempt)"
    )
    must_stay = f"({missing_rollup} OR r.step = ANY(:protected))"
    rolled = (
        f'FROM "{span.name}" r LEFT JOIN step_rollups s ON s.run_id = r.run_id '
        "AND s.step = r.step AND s.attempt = r.attempt "
        "AND s.run_id = :run_id AND s.step >= :first AND s.step < :end"
    )
    total, kept = connection.execute(
        text(
            f"SELECT count(*), count(*) FILTER (WHERE s.run_id IS NULL "
            f"OR r.step = ANY(:protected)) {rolled}"
        ),
        params,
    ).one()
    return int(total), int(kept), must_stay
