"""What the views of every page share: the steps a page samples and the chunked read of rollups
at them (`rollups_at`, and the chunks that the rank-row read uses too), each rank's latest
attempt, a run's latest figures, and whether a run is live."""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import pandas as pd
from sqlalchemy import ColumnElement, Select, and_, exists, func, select, true

from telemetry.efficiency import LATEST_ROLLUP
from telemetry.models import TRAINER_TIER, Checkpoint, RankStep, Run, StepRollup
from telemetry.queries import LATEST_ATTEMPT, Bind, connection_of

# A checkpoint row that says the checkpoint is restorable: committed on a storage tier.
COMMITTED = (Checkpoint.committed_at.is_not(None), Checkpoint.tier != TRAINER_TIER)
# The most steps one read at sampled steps binds (a parameter each): below every database's
# limit on bound parameters.
CHUNK = 500


def sampled_steps(bind: Bind, run_id: str, max_steps: int, table: Any = StepRollup) -> list[int]:
    """At most `max_steps` steps spread evenly from the run's first to its last step in `table`
    (rolled up, by default; NodeStep: the steps whose node rows are kept), both included; every
    step when there are no more than that. Empty without any."""
    with connection_of(bind) as connection:
        # Two subqueries: SQLite answers a lone MIN or MAX from the index, both at once by a scan.
        of_run = select(table.step).where(table.run_id == run_id)
        first, last = connection.execute(
            select(
                of_run.with_only_columns(func.min(table.step)).scalar_subquery(),
                of_run.with_only_columns(func.max(table.step)).scalar_subquery(),
            )
        ).one()
    return spread(first, last, max_steps)


def spread(first: int | None, last: int | None, max_steps: int) -> list[int]:
    """At most `max_steps` steps spread evenly from `first` to `last`, both included."""
    if first is None or last is None:
        return []
    count = last - first + 1
    if count <= max_steps:
        return list(range(first, last + 1))
    stride = (count - 1) / (max(max_steps, 2) - 1)
    return sorted({first + round(index * stride) for index in range(max(max_steps, 2))})


def chunks(steps: list[int]) -> Iterator[list[int]]:
    """`steps` in chunks of at most CHUNK, in order."""
    for start in range(0, len(steps), CHUNK):
        yield steps[start : start + CHUNK]


def rollups_at(bind: Bind, statement: Select[Any], run_id: str, steps: list[int]) -> list[Any]:
    """Rows of `statement` (a select of StepRollup columns) restricted to the run's rollups at
    `steps`, each step's latest attempt's, in chunks that stay below the databases' limits on
    bound parameters (one query a chunk)."""
    rows: list[Any] = []
    with connection_of(bind) as connection:
        latest = latest_rollup(connection, run_id)
        for chunk in chunks(steps):
            rows += connection.execute(
                statement.where(StepRollup.run_id == run_id, StepRollup.step.in_(chunk), *latest)
            ).all()
    return rows


def restarted(connection: Any, run_id: str) -> bool:
    """Whether the run was ever restarted (its attempt is above 0)."""
    return bool(connection.execute(select(Run.attempt).where(Run.run_id == run_id)).scalar())


def latest_attempt(connection: Any, run_id: str) -> ColumnElement[bool]:
    """LATEST_ATTEMPT, or no condition for a run never restarted (attempt 0): then every record
    is its rank's latest, and skipping the per-record check halves the time of a sampled read."""
    return LATEST_ATTEMPT if restarted(connection, run_id) else true()


def latest_rollup(connection: Any, run_id: str) -> list[ColumnElement[bool]]:
    """LATEST_ROLLUP, or no condition for a run never restarted."""
    return [LATEST_ROLLUP] if restarted(connection, run_id) else []


def last_step_of(connection: Any, run_id: str) -> int | None:
    """The run's latest step with rank rows. Looked for from its latest rollup on (rank rows may
    be ahead of it, never behind while it has any), so that on PostgreSQL one or two range
    partitions are searched, not every one the run has; from the start without a rollup."""
    statement = select(func.max(RankStep.step)).where(RankStep.run_id == run_id)
    rolled = connection.execute(
        select(func.max(StepRollup.step)).where(StepRollup.run_id == run_id)
    ).scalar()
    if rolled is not None:
        last = connection.execute(statement.where(RankStep.step >= rolled)).scalar()
        if last is not None:
            return last
    return connection.execute(statement).scalar()


def recent_steps(connection: Any, run_id: str, last_step: int | None, count: int) -> pd.DataFrame:
    """The run's latest `count` steps up to `last_step`, from their rollups: step, mean loss over
    ranks, tokens of all ranks and wall time (the slowest rank's step time)."""
    rows: list[Any] = []
    if last_step is not None:
        rows = connection.execute(
            select(
                StepRollup.step, StepRollup.loss_mean, StepRollup.tokens, StepRollup.step_max
            ).where(
                StepRollup.run_id == run_id,
                StepRollup.step > last_step - count,
                *latest_rollup(connection, run_id),
            )
        ).all()
    return pd.DataFrame(rows, columns=["step", "loss", "tokens", "wall_s"])


def last_loss(steps: pd.DataFrame) -> float:
    return as_float(steps.loc[steps["step"].idxmax(), "loss"]) if len(steps) else math.nan


def run_status(connection: Any, run_id: str, status: str, attempt: int) -> str:
    """The stored status, or "restarting" while a running run's newest attempt has no record."""
    if status != "running" or attempt == 0:
        return status
    stepping = connection.execute(
        select(exists().where(and_(RankStep.run_id == run_id, RankStep.attempt == attempt)))
    ).scalar()
    return status if stepping else "restarting"


def throughput(steps: pd.DataFrame) -> float:
    """Tokens of all ranks over the steps' wall time; NaN without time."""
    seconds = float(steps["wall_s"].sum()) if len(steps) else 0.0
    return float(steps["tokens"].sum()) / seconds if seconds > 0 else math.nan


def as_float(value: Any) -> float:
    return math.nan if value is None or pd.isna(value) else float(value)


def live(bind: Bind, run_id: str | None = None) -> bool:
    """Whether `run_id` (any run, when None) is still running, so that a page should refresh."""
    statement = select(exists().where(Run.status == "running"))
    if run_id is not None:
        statement = select(exists().where(Run.status == "running", Run.run_id == run_id))
    with connection_of(bind) as connection:
        return bool(connection.execute(statement).scalar())
