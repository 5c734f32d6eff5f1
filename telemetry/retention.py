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
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass

from sqlalchemy import delete, exists, func, select

from scaletrain.errors import ScaletrainError
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
        """Delete the rows of `run_id` the policy no longer keeps, a batch at a time."""
        policy = self.policy
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
            if start is None:
                start = session.scalar(
                    select(func.min(RankStep.step)).where(
                        RankStep.run_id == run_id, RankStep.step.not_in(protected)
                    )
                )
        horizon = latest - policy.keep_steps
        if start is None or start > horizon:
            return 0
        per_batch = max(1, policy.batch_rows // max(1, world_size))
        deleted = 0
        while start <= horizon and not self._stop.is_set():
            end = min(start + per_batch - 1, horizon)
            deleted += self._delete(run_id, start, end, protected)
            start = end + 1
            self._from_step[run_id] = start
            self._stop.wait(policy.pause_s)
        return deleted

    def _delete(self, run_id: str, first: int, last: int, protected: list[int]) -> int:
        """One batch: the rolled-up rank rows and the node rows of steps first..last."""
        rolled_up = exists().where(
            StepRollup.run_id == RankStep.run_id,
            StepRollup.step == RankStep.step,
            StepRollup.attempt == RankStep.attempt,
        )
        with self.store.transaction() as session:
            rows = session.execute(
                delete(RankStep)
                .where(
                    RankStep.run_id == run_id,
                    RankStep.step.between(first, last),
                    RankStep.step.not_in(protected),
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
