"""Read-only queries over the telemetry database: a run's checkpoints, its events, its summary, its
restarts and replays, and what the other readers (`telemetry.views`, `telemetry.efficiency`) share.

The tables come back as pandas DataFrames whose columns are named below. Where a step was recorded
by several attempts (a restart replayed it), only each rank's latest attempt counts
(LATEST_ATTEMPT). A NaN loss is stored as NULL and is left out of means.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import pandas as pd
from sqlalchemy import Connection, Engine, Select, distinct, exists, func, select
from sqlalchemy.orm import Session, aliased

from scaletrain.errors import NotFound
from telemetry.models import Checkpoint, Event, RankStep, Run

Bind = Engine | Connection | Session

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

CHECKPOINT_COLUMNS = [
    "step", "tier", "node", "part", "started_at", "staged_at", "committed_at", "failed_at", "bytes",
    "seconds",
]  # fmt: skip

_newer = aliased(RankStep)
# True for a record that no later attempt of the same run, step and rank replaced.
LATEST_ATTEMPT = ~exists().where(
    _newer.run_id == RankStep.run_id,
    _newer.step == RankStep.step,
    _newer.rank == RankStep.rank,
    _newer.attempt > RankStep.attempt,
)


def checkpoints(bind: Bind, run_id: str) -> pd.DataFrame:
    """Every checkpoint of `run_id` on every tier, by step, tier and node: CHECKPOINT_COLUMNS.

    Tier "trainer" is the save as the trainer saw it (seconds: how long training was blocked);
    the storage tiers say when the checkpoint was committed there and how long that took. Memory
    and SSD have a row per node, for the part of the checkpoint that node holds (`part` "", or,
    for a peer replica, the node whose part it copies); S3 holds the whole checkpoint, and it and
    the trainer have node "".
    """
    statement = (
        select(*(getattr(Checkpoint, column) for column in CHECKPOINT_COLUMNS))
        .where(Checkpoint.run_id == run_id)
        .order_by(Checkpoint.step, Checkpoint.tier, Checkpoint.node, Checkpoint.part)
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


@dataclass(frozen=True)
class Restart:
    """One restart of a run's job (a `restart` event): where it resumed and how it got there."""

    # The step it resumed from, and its attempt (torchrun's restart count).
    step: int
    attempt: int
    # The bytes its restore read from each copy ("memory@node0", "SSD@node1", "S3").
    restored_from: dict[str, int]
    # When (time.time()) its attempt's first step was recorded; None when it made none.
    first_step_at: float | None


def restarts(bind: Bind, run_id: str) -> list[Restart]:
    """Every restart of `run_id`, in order."""
    with connection_of(bind) as connection:
        rows = connection.execute(
            select(Event.step, Event.attributes)
            .where(Event.run_id == run_id, Event.kind == "restart")
            .order_by(Event.time)
        ).all()
        found = []
        for step, attributes in rows:
            attempt = int((attributes or {}).get("attempt", 0))
            first = connection.execute(
                select(func.min(RankStep.time)).where(
                    RankStep.run_id == run_id, RankStep.attempt == attempt
                )
            ).scalar()
            found.append(
                Restart(
                    step=step,
                    attempt=attempt,
                    restored_from=json.loads((attributes or {}).get("restored_from", "{}")),
                    first_step_at=first.timestamp() if first is not None else None,
                )
            )
    return found


@dataclass(frozen=True)
class Replays:
    """The work a run did again: after restarts, and in place (the step guard)."""

    restarts: int
    # Steps rank 0 recorded more than once (the attempts after a restart computed them again).
    steps_after_restarts: int
    # Steps the step guard replayed in place (`replay` events).
    steps_in_place: int


def replays(bind: Bind, run_id: str) -> Replays:
    """How often `run_id` restarted and how many steps it computed again."""
    with connection_of(bind) as connection:
        rows, steps = connection.execute(
            select(func.count(), func.count(distinct(RankStep.step))).where(
                RankStep.run_id == run_id, RankStep.rank == 0
            )
        ).one()
        counts = dict(
            connection.execute(
                select(Event.kind, func.count())
                .where(Event.run_id == run_id, Event.kind.in_(("restart", "replay")))
                .group_by(Event.kind)
            ).all()
        )
    return Replays(counts.get("restart", 0), rows - steps, counts.get("replay", 0))


def job_config(bind: Bind, run_id: str) -> dict[str, object] | None:
    """The resolved job config (trainer.options, by dest) `run_id` last registered with, as
    its rank 0 recorded it; None for a run telemetry never saw, or one registered without."""
    with connection_of(bind) as connection:
        text = connection.execute(select(Run.config_json).where(Run.run_id == run_id)).scalar()
    if not text:
        return None
    job = json.loads(text).get("job")
    return job if isinstance(job, dict) and job else None


@dataclass(frozen=True)
class KeptRankStep:
    """One rank's record of a step the run kept (`kept_steps`)."""

    rank: int
    # Where the rank's slice of the next step starts in the global sample order.
    rank_sample: int
    loss: float
    lr: float
    # The ranks of the attempt that kept the step (those that recorded any step of it): more
    # than the step's records where ranks died before they sent them (a node lost at once).
    world: int = 0


def kept_steps(bind: Bind, run_id: str) -> dict[int, list[KeptRankStep]]:
    """Step -> every rank's record of it, by rank, from the latest attempt that trained the
    step: an attempt that failed may have trained steps a later one trained again, and only the
    later one's count (its state is the one the run went on from)."""
    with connection_of(bind) as connection:
        rows = connection.execute(
            select(
                RankStep.step, RankStep.attempt, RankStep.rank, RankStep.rank_sample,
                RankStep.loss, RankStep.lr,
            ).where(RankStep.run_id == run_id)
        ).all()  # fmt: skip
    latest: dict[int, int] = {}
    ranks_of: dict[int, set[int]] = {}
    for step, attempt, rank, *_ in rows:
        latest[step] = max(latest.get(step, attempt), attempt)
        ranks_of.setdefault(attempt, set()).add(rank)
    kept: dict[int, list[KeptRankStep]] = {}
    for step, attempt, rank, sample, loss, lr in rows:
        if attempt == latest[step]:
            world = len(ranks_of[attempt])
            kept.setdefault(step, []).append(
                KeptRankStep(rank, sample, _float(loss), _float(lr), world)
            )
    return {step: sorted(ranks, key=lambda r: r.rank) for step, ranks in sorted(kept.items())}


def consumed_samples(kept: dict[int, list[KeptRankStep]], global_batch: int) -> list[int]:
    """Every index of the global sample order the kept steps read, in order: each rank's slice
    of a step is its share of the global batch, and its `rank_sample` after the step is where
    its slice of the next one starts, one global batch on. A run that resized (elastic) reads
    each sample once only if this is `range(steps x global_batch)`, less the slices of ranks
    whose records of a step were lost (`unrecorded`)."""
    consumed: list[int] = []
    for ranks in kept.values():
        share = global_batch // max(ranks[0].world, len(ranks))
        for record in ranks:
            start = record.rank_sample - global_batch
            consumed += range(start, start + share)
    return consumed


def unrecorded(kept: dict[int, list[KeptRankStep]]) -> list[int]:
    """The kept steps some of whose ranks' records never reached telemetry (a node lost right
    after the step takes its ranks' unsent records with it): what they read is not known."""
    return [step for step, ranks in kept.items() if len(ranks) < ranks[0].world]


@contextmanager
def connection_of(bind: Bind) -> Iterator[Connection | Session]:
    """A connection from an engine (closed afterwards), or the caller's connection or session."""
    if isinstance(bind, Engine):
        with bind.connect() as connection:
            yield connection
    else:
        yield bind


def _float(value: Any) -> float:
    return math.nan if value is None else float(value)
