"""Read-only queries over the telemetry database, for the UI and for tests.

Each returns a pandas DataFrame whose columns are named below. Aggregation and downsampling run in
SQL, so a chart of a long run fetches a few thousand rows, not every record of every rank. Where a
step was recorded by several attempts (a restart replayed it), only each rank's latest attempt
counts. A NaN loss is stored as NULL and is left out of means, minima and maxima.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import pandas as pd
from sqlalchemy import Connection, Engine, Select, exists, func, select
from sqlalchemy.orm import Session, aliased

from scaletrain.errors import InvalidArgument, NotFound
from telemetry.models import Checkpoint, Event, RankStep, Run

Bind = Engine | Connection | Session

RUNS_COLUMNS = [
    "run_id",
    "name",
    "status",
    "world_size",
    "last_step",
    "last_loss",
    "tokens_per_s",
    "started_at",
]
LOSS_COLUMNS = ["step", "loss", "loss_min", "loss_max"]
STEP_TIME_COLUMNS = ["step", "rank", "step_s"]
EVENT_COLUMNS = [
    "time",
    "step",
    "rank",
    "kind",
    "tier",
    "bytes",
    "seconds",
    "message",
    "attributes",
]

HEATMAP_COLUMNS = ["step", "rank", "value", "relative"]
# What a per-rank heatmap can show: the rank-step columns that are per-rank figures.
HEATMAP_METRICS = (
    "step_s", "data_s", "forward_s", "backward_s", "optimizer_s", "comm_wait_s", "checkpoint_s",
    "compute_s", "replay_s", "loss", "grad_norm", "memory_bytes", "peak_memory_bytes",
)  # fmt: skip
CHECKPOINT_COLUMNS = [
    "step", "tier", "started_at", "staged_at", "committed_at", "failed_at", "bytes", "seconds",
]  # fmt: skip

_newer = aliased(RankStep)
# True for a record that no later attempt of the same run, step and rank replaced.
LATEST_ATTEMPT = ~exists().where(
    _newer.run_id == RankStep.run_id,
    _newer.step == RankStep.step,
    _newer.rank == RankStep.rank,
    _newer.attempt > RankStep.attempt,
)


def runs_overview(bind: Bind, *, window: int = 20) -> pd.DataFrame:
    """One row per run, newest first: RUNS_COLUMNS.

    last_loss is the mean over ranks at the last step; tokens_per_s is the tokens of all ranks
    over the last `window` steps divided by those steps' wall time (the slowest rank's step time).
    """
    last = (
        select(RankStep.run_id, func.max(RankStep.step).label("last_step"))
        .group_by(RankStep.run_id)
        .subquery()
    )
    per_step = (
        select(
            RankStep.run_id,
            RankStep.step,
            func.avg(RankStep.loss).label("loss"),
            func.sum(RankStep.tokens).label("tokens"),
            func.max(RankStep.step_s).label("step_s"),
        )
        .join(last, last.c.run_id == RankStep.run_id)
        .where(RankStep.step > last.c.last_step - window, LATEST_ATTEMPT)
        .group_by(RankStep.run_id, RankStep.step)
    )
    runs = select(
        Run.run_id,
        Run.name,
        Run.status,
        Run.world_size,
        last.c.last_step,
        Run.started_at,
    ).outerjoin(last, last.c.run_id == Run.run_id)
    with connection_of(bind) as connection:
        run_rows = connection.execute(runs.order_by(Run.started_at.desc())).all()
        step_rows = connection.execute(per_step).all()
    steps = pd.DataFrame(step_rows, columns=["run_id", "step", "loss", "tokens", "step_s"])
    rows = []
    for run in run_rows:
        recent = steps[steps["run_id"] == run.run_id]
        at_last = recent[recent["step"] == run.last_step]
        seconds = float(recent["step_s"].sum())
        rows.append(
            {
                "run_id": run.run_id,
                "name": run.name,
                "status": run.status,
                "world_size": run.world_size,
                "last_step": run.last_step,
                "last_loss": _float(at_last["loss"].iloc[0]) if len(at_last) else math.nan,
                "tokens_per_s": float(recent["tokens"].sum()) / seconds
                if seconds > 0
                else math.nan,
                "started_at": run.started_at,
            }
        )
    return pd.DataFrame(rows, columns=RUNS_COLUMNS)


def loss_curve(bind: Bind, run_id: str, *, max_points: int = 1000) -> pd.DataFrame:
    """Loss per step of `run_id`, averaged over ranks: LOSS_COLUMNS, at most `max_points` rows.

    Long runs are downsampled into buckets of consecutive steps; a row then stands for its bucket
    (`step` is the bucket's last step) with the mean, min and max loss in it, so spikes show.
    """
    with connection_of(bind) as connection:
        bucket = _step_bucket(connection, run_id, max_points)
        if bucket is None:
            return pd.DataFrame(columns=LOSS_COLUMNS)
        statement = (
            select(
                func.max(RankStep.step),
                func.avg(RankStep.loss),
                func.min(RankStep.loss),
                func.max(RankStep.loss),
            )
            .where(RankStep.run_id == run_id, LATEST_ATTEMPT)
            .group_by(bucket)
            .order_by(bucket)
        )
        rows = connection.execute(statement).all()
    frame = pd.DataFrame(rows, columns=LOSS_COLUMNS)
    return frame.astype({"loss": float, "loss_min": float, "loss_max": float})


def rank_step_times(bind: Bind, run_id: str, *, max_steps: int = 300) -> pd.DataFrame:
    """Step time of each rank of `run_id`: STEP_TIME_COLUMNS, at most `max_steps` steps per rank.

    Downsampled like `loss_curve`: `step_s` is a rank's mean step time in a bucket of steps, which
    keeps a persistently slow rank (a straggler) visible.
    """
    with connection_of(bind) as connection:
        bucket = _step_bucket(connection, run_id, max_steps)
        if bucket is None:
            return pd.DataFrame(columns=STEP_TIME_COLUMNS)
        statement = (
            select(func.max(RankStep.step), RankStep.rank, func.avg(RankStep.step_s))
            .where(RankStep.run_id == run_id, LATEST_ATTEMPT)
            .group_by(bucket, RankStep.rank)
            .order_by(bucket, RankStep.rank)
        )
        rows = connection.execute(statement).all()
    return pd.DataFrame(rows, columns=STEP_TIME_COLUMNS).astype({"step_s": float})


def rank_heatmap(
    bind: Bind, run_id: str, *, metric: str = "compute_s", max_steps: int = 300
) -> pd.DataFrame:
    """A ranks x steps grid of one per-rank figure of `run_id`: HEATMAP_COLUMNS.

    `metric` is one of HEATMAP_METRICS; `value` is a rank's mean of it in a bucket of steps (at
    most `max_steps` buckets, as in `loss_curve`), `relative` that value over the median of all
    ranks in the bucket: 1 is typical, 2 twice the others' (a straggler, when the metric is
    compute_s). InvalidArgument names the metrics when `metric` is not one of them.
    """
    if metric not in HEATMAP_METRICS:
        raise InvalidArgument(f"unknown metric {metric!r}: use one of {', '.join(HEATMAP_METRICS)}")
    column = getattr(RankStep, metric)
    with connection_of(bind) as connection:
        bucket = _step_bucket(connection, run_id, max_steps)
        if bucket is None:
            return pd.DataFrame(columns=HEATMAP_COLUMNS)
        statement = (
            select(bucket, func.max(RankStep.step), RankStep.rank, func.avg(column))
            .where(RankStep.run_id == run_id, LATEST_ATTEMPT)
            .group_by(bucket, RankStep.rank)
            .order_by(bucket, RankStep.rank)
        )
        rows = connection.execute(statement).all()
    frame = pd.DataFrame(rows, columns=["bucket", *HEATMAP_COLUMNS[:3]]).astype({"value": float})
    median = frame.groupby("bucket")["value"].transform("median")
    frame["relative"] = frame["value"] / median.where(median != 0)
    return frame[HEATMAP_COLUMNS]


def checkpoints(bind: Bind, run_id: str) -> pd.DataFrame:
    """Every checkpoint of `run_id` on every tier, by step then tier: CHECKPOINT_COLUMNS.

    Tier "trainer" is the save as the trainer saw it (seconds: how long training was blocked);
    the storage tiers say when the checkpoint was committed there and how long that took.
    """
    statement = (
        select(*(getattr(Checkpoint, column) for column in CHECKPOINT_COLUMNS))
        .where(Checkpoint.run_id == run_id)
        .order_by(Checkpoint.step, Checkpoint.tier)
    )
    with connection_of(bind) as connection:
        rows = connection.execute(statement).all()
    return pd.DataFrame(rows, columns=CHECKPOINT_COLUMNS)


def events(
    bind: Bind, run_id: str, *, kinds: Sequence[str] | None = None, limit: int = 500
) -> pd.DataFrame:
    """The latest `limit` events of `run_id`, newest first: EVENT_COLUMNS; only `kinds` (e.g.
    ["straggler", "sdc"]) when given."""
    statement: Select[Any] = (
        select(
            Event.time,
            Event.step,
            Event.rank,
            Event.kind,
            Event.tier,
            Event.bytes,
            Event.seconds,
            Event.message,
            Event.attributes,
        )
        .where(Event.run_id == run_id)
        .order_by(Event.time.desc(), Event.id.desc())
        .limit(limit)
    )
    if kinds is not None:
        statement = statement.where(Event.kind.in_(list(kinds)))
    with connection_of(bind) as connection:
        rows = connection.execute(statement).all()
    return pd.DataFrame(rows, columns=EVENT_COLUMNS)


@dataclass(frozen=True)
class RunSummary:
    """The headline numbers of one run, e.g. for the report at the end of `scaletrain run`."""

    run_id: str
    status: str
    # None while no step was recorded.
    last_step: int | None
    # Mean over ranks at the first and at the last recorded step; NaN when unknown.
    first_loss: float
    last_loss: float
    # All tokens of all ranks over the sum of the steps' wall times (each the slowest rank's).
    tokens_per_s: float
    # The `params_sha256` attribute of the run's latest run_finished event; "" without one.
    params_sha256: str


def run_summary(bind: Bind, run_id: str) -> RunSummary:
    """The summary of `run_id`; NotFound when no such run was registered."""
    per_step = (
        select(
            RankStep.step,
            func.avg(RankStep.loss).label("loss"),
            func.sum(RankStep.tokens).label("tokens"),
            func.max(RankStep.step_s).label("step_s"),
        )
        .where(RankStep.run_id == run_id, LATEST_ATTEMPT)
        .group_by(RankStep.step)
        .subquery()
    )
    with connection_of(bind) as connection:
        status = connection.execute(select(Run.status).where(Run.run_id == run_id)).scalar()
        if status is None:
            raise NotFound(f"run {run_id!r} is not registered")
        first_step, last_step, tokens, seconds = connection.execute(
            select(
                func.min(per_step.c.step),
                func.max(per_step.c.step),
                func.sum(per_step.c.tokens),
                func.sum(per_step.c.step_s),
            )
        ).one()
        losses = dict(
            connection.execute(
                select(per_step.c.step, per_step.c.loss).where(
                    per_step.c.step.in_([first_step, last_step])
                )
            ).all()
        )
        attributes = connection.execute(
            select(Event.attributes)
            .where(Event.run_id == run_id, Event.kind == "run_finished")
            .order_by(Event.time.desc())
            .limit(1)
        ).scalar()
    return RunSummary(
        run_id=run_id,
        status=status,
        last_step=last_step,
        first_loss=_float(losses.get(first_step)),
        last_loss=_float(losses.get(last_step)),
        tokens_per_s=float(tokens) / float(seconds) if seconds else math.nan,
        params_sha256=(attributes or {}).get("params_sha256", ""),
    )


@contextmanager
def connection_of(bind: Bind) -> Iterator[Connection | Session]:
    """A connection from an engine (closed afterwards), or the caller's connection or session."""
    if isinstance(bind, Engine):
        with bind.connect() as connection:
            yield connection
    else:
        yield bind


def _step_bucket(connection: Connection | Session, run_id: str, max_buckets: int) -> Any:
    """The SQL expression grouping the run's steps into at most `max_buckets` equal ranges;
    None when the run has no step records."""
    first, last = connection.execute(
        select(func.min(RankStep.step), func.max(RankStep.step)).where(RankStep.run_id == run_id)
    ).one()
    if first is None:
        return None
    width = max(1, math.ceil((last - first + 1) / max(1, max_buckets)))
    return ((RankStep.step - first) // width).label("bucket")


def _float(value: Any) -> float:
    return math.nan if value is None else float(value)
