"""How well a run used its hardware and its time: MFU / HFU and goodput with badput by cause.

Both are computed in SQL from the rank-step records (per-step aggregates over ranks), the run's
description (model size, world size, dense peak) and its events, so they are reproducible from the
database alone. A step's wall time is its slowest rank's step time: synchronous training waits for
that rank.

Goodput = productive training time / wall time, wall time running from the first launch
(`runs.started_at`) to the end of the run (its run_finished event, else its latest record).
Badput, by cause:
  - startup: launch to the start of the first step;
  - checkpoint_stall: time steps were blocked saving checkpoints;
  - restart: time lost to restarts, i.e. the gap between an attempt's last record and the next
    attempt's first step, plus the steps an attempt computed and a later one had to compute again;
  - replay: time spent replaying suspicious steps, and steps whose batch was skipped;
  - data_wait: time steps waited for their batch;
  - other: whatever the above do not explain (logging, the end of the run, gaps without records).
Per step, each cause counts the slowest rank's time in it, and the step's causes together never
exceed its wall time.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

from sqlalchemy import ColumnElement, Select, Subquery, case, false, func, or_, select, true

from scaletrain.errors import NotFound
from telemetry import mfu as flops
from telemetry.models import Event, RankStep, Run
from telemetry.queries import LATEST_ATTEMPT, Bind, connection_of

BADPUT_CAUSES = ("startup", "checkpoint_stall", "restart", "replay", "data_wait", "other")
# The event whose attributes say the trainer threw a step's update away (its batch was skipped).
SKIPPING_EVENT = "loss_spike"
SKIPPED = "skipped"


@dataclass(frozen=True)
class Mfu:
    """Model and hardware FLOPs utilisation of a run over some steps (ratios, 0-1; NaN: unknown)."""

    mfu: float
    hfu: float
    tokens_per_s: float
    devices: int
    # Dense peak FLOP/s of one device, the precision it is for, and where the figure comes from
    # ("datasheet: ...", "calibrated: ..." on CPU, "--peak-flops").
    peak_flops: float
    precision: str
    peak_flops_source: str
    steps: int

    @property
    def label(self) -> str:
        """One line saying what the figure is relative to, e.g. for a report or a chart title."""
        if math.isnan(self.mfu):
            return f"MFU unknown: no dense peak for this hardware in {self.precision or '?'}"
        return (
            f"MFU {self.mfu:.1%} (HFU {self.hfu:.1%}) of {self.peak_flops / 1e12:,.3g} TFLOP/s "
            f"x {self.devices} devices in {self.precision}, peak {self.peak_flops_source}"
        )


@dataclass(frozen=True)
class Goodput:
    """Where a run's wall time went, in seconds; `goodput` is productive / wall (NaN: no wall)."""

    wall_s: float
    productive_s: float
    badput_s: dict[str, float] = field(default_factory=dict)

    @property
    def goodput(self) -> float:
        return self.productive_s / self.wall_s if self.wall_s > 0 else math.nan


def mfu(bind: Bind, run_id: str, *, last_steps: int | None = None) -> Mfu:
    """MFU and HFU of `run_id` over its latest `last_steps` steps (all by default).

    tokens/s = tokens of all ranks / the steps' wall time (each step its slowest rank's step time).
    NotFound when no such run was registered.
    """
    with connection_of(bind) as connection:
        run = connection.execute(
            select(
                Run.model_params,
                Run.world_size,
                Run.peak_flops,
                Run.recompute_fraction,
                Run.precision,
                Run.peak_flops_source,
            ).where(Run.run_id == run_id)
        ).first()
        if run is None:
            raise NotFound(f"run {run_id!r} is not registered")
        per_step = _per_step(run_id, LATEST_ATTEMPT)
        if last_steps is not None:
            newest = select(func.max(RankStep.step)).where(RankStep.run_id == run_id)
            cutoff = connection.execute(newest).scalar()
            if cutoff is not None:
                per_step = per_step.where(RankStep.step > cutoff - last_steps)
        steps = per_step.subquery()
        count, tokens, seconds = connection.execute(
            select(func.count(), func.sum(steps.c.tokens), func.sum(steps.c.wall_s))
        ).one()
    tokens_per_s = float(tokens) / float(seconds) if seconds else math.nan
    return Mfu(
        mfu=flops.utilization(
            flops.model_flops_per_token(run.model_params),
            tokens_per_s,
            run.world_size,
            run.peak_flops,
        ),
        hfu=flops.utilization(
            flops.hardware_flops_per_token(run.model_params, run.recompute_fraction),
            tokens_per_s,
            run.world_size,
            run.peak_flops,
        ),
        tokens_per_s=tokens_per_s,
        devices=run.world_size,
        peak_flops=run.peak_flops,
        precision=run.precision,
        peak_flops_source=run.peak_flops_source,
        steps=count,
    )


def goodput(bind: Bind, run_id: str) -> Goodput:
    """Goodput and badput by cause of `run_id` (see the module docstring); NotFound if no run."""
    with connection_of(bind) as connection:
        run = connection.execute(
            select(Run.started_at, Run.finished_at, Run.attempt).where(Run.run_id == run_id)
        ).first()
        if run is None:
            raise NotFound(f"run {run_id!r} is not registered")
        totals = _single_attempt_totals(connection, run_id) if run.attempt == 0 else None
        if totals is None:
            totals = _restarted_totals(connection, run_id)
        skipped = _skipped_steps_seconds(connection, run_id, totals.latest)
    attempts = totals.attempts
    if not attempts:
        return Goodput(wall_s=0.0, productive_s=0.0, badput_s=dict.fromkeys(BADPUT_CAUSES, 0.0))
    end = run.finished_at or attempts[-1][2]
    wall_s = max((end - run.started_at).total_seconds(), 0.0)
    startup = max((attempts[0][1] - run.started_at).total_seconds(), 0.0)
    gaps = sum(
        max((first - previous_last).total_seconds(), 0.0)
        for (_, _, previous_last), (_, first, _) in itertools.pairwise(attempts)
    )
    productive_s = max(totals.sums["productive_s"] - skipped, 0.0)
    badput = {
        "startup": startup,
        "checkpoint_stall": totals.sums["checkpoint_s"],
        "restart": gaps + totals.lost_s,
        "replay": totals.sums["replay_s"] + skipped,
        "data_wait": totals.sums["data_s"],
    }
    accounted = productive_s + sum(badput.values())
    # Per-step time is measured on each rank; clocks and rounding can make the parts exceed the
    # whole by a hair, which is not "negative other".
    badput["other"] = max(wall_s - accounted, 0.0)
    return Goodput(wall_s=wall_s, productive_s=productive_s, badput_s=badput)


# The per-step figures of `_per_step` that goodput sums over a run.
_SUMMED = ("data_s", "checkpoint_s", "replay_s", "productive_s")


@dataclass(frozen=True)
class _Totals:
    """What goodput adds up over a run's records: the _SUMMED per-step figures over its latest
    attempts, the wall time of the steps a later attempt computed again, and each attempt's span
    as (attempt, start of its first step, time of its last record), in order. `latest` is the
    condition that keeps only records no later attempt replaced."""

    sums: dict[str, float]
    lost_s: float
    attempts: list[tuple[int, datetime, datetime]]
    latest: ColumnElement[bool]


def _single_attempt_totals(connection: Any, run_id: str) -> _Totals | None:
    """The totals of a run whose records all belong to one attempt, in one pass over them; None
    when they turn out not to (records of several attempts), for `_restarted_totals` to redo.

    With one attempt every record is its rank's latest: no per-record probe for a newer attempt,
    no superseded steps, and the only span runs from the first step to the latest record. That
    pass is the least a whole-run figure can read; the general way first reads every record
    once more for the attempts' spans.
    """
    per_step = (
        _per_step(run_id, true())
        .add_columns(
            func.min(RankStep.attempt).label("low"),
            func.max(RankStep.attempt).label("high"),
            func.max(RankStep.time).label("last"),
        )
        .subquery()
    )
    row = connection.execute(
        select(
            *_sums(per_step),
            func.min(per_step.c.low),
            func.max(per_step.c.high),
            func.max(per_step.c.last),
            func.min(per_step.c.step),
        )
    ).one()
    low, high, last, first_step = row[len(_SUMMED) :]
    if low != high:
        return None
    attempts = []
    if first_step is not None:
        start = _first_step_start(connection, run_id, low, first_step)
        attempts.append((low, start, _aware(last)))
    return _Totals(
        sums=_summed(row),
        lost_s=0.0,
        attempts=attempts,
        latest=true(),
    )


def _restarted_totals(connection: Any, run_id: str) -> _Totals:
    """The totals of any run: one pass for each attempt's steps and last record, then one over
    the latest attempts' steps, which checks for a newer record only at contested steps (those
    in the step ranges of two attempts: elsewhere a step's records all come from one attempt)."""
    spans = connection.execute(
        select(
            RankStep.attempt,
            func.min(RankStep.step),
            func.max(RankStep.step),
            func.max(RankStep.time),
        )
        .where(RankStep.run_id == run_id)
        .group_by(RankStep.attempt)
        .order_by(RankStep.attempt)
    ).all()
    contested = or_(
        false(),
        *(
            RankStep.step.between(low, high)
            for low, high in _overlaps([(first, last) for _, first, last, _ in spans])
        ),
    )
    latest = or_(~contested, LATEST_ATTEMPT)
    sums = connection.execute(select(*_sums(_per_step(run_id, latest).subquery()))).one()
    # Steps an attempt computed and a later attempt computed again: lost progress.
    superseded = (
        select(func.max(RankStep.step_s).label("wall_s"))
        .where(RankStep.run_id == run_id, contested, ~LATEST_ATTEMPT)
        .group_by(RankStep.attempt, RankStep.step)
        .subquery()
    )
    lost = connection.execute(select(func.sum(superseded.c.wall_s))).scalar()
    return _Totals(
        sums=_summed(sums),
        lost_s=float(lost or 0.0),
        attempts=[
            (attempt, _first_step_start(connection, run_id, attempt, first), _aware(last_time))
            for attempt, first, _, last_time in spans
        ],
        latest=latest,
    )


def _sums(steps: Subquery) -> list[ColumnElement[Any]]:
    """The SQL sums of the _SUMMED columns of a `_per_step` subquery."""
    return [func.sum(steps.c[name]) for name in _SUMMED]


def _summed(row: Sequence[Any]) -> dict[str, float]:
    """The _SUMMED figures from the head of a row that starts with `_sums` (0 for no steps)."""
    return {name: float(value or 0.0) for name, value in zip(_SUMMED, row, strict=False)}


def _overlaps(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The steps covered by two or more of `ranges` (inclusive), as disjoint ranges."""
    shared = sorted(
        (max(a[0], b[0]), min(a[1], b[1]))
        for a, b in itertools.combinations(ranges, 2)
        if max(a[0], b[0]) <= min(a[1], b[1])
    )
    merged: list[tuple[int, int]] = []
    for low, high in shared:
        if merged and low <= merged[-1][1] + 1:
            merged[-1] = (merged[-1][0], max(merged[-1][1], high))
        else:
            merged.append((low, high))
    return merged


def _first_step_start(connection: Any, run_id: str, attempt: int, step: int) -> datetime:
    """When `attempt` started its first step `step`: the earliest rank's record time minus its
    step time (a few primary-key lookups)."""
    return min(
        time - timedelta(seconds=step_s)
        for time, step_s in connection.execute(
            select(RankStep.time, RankStep.step_s).where(
                RankStep.run_id == run_id, RankStep.step == step, RankStep.attempt == attempt
            )
        )
    )


def _per_step(run_id: str, latest: ColumnElement[bool]) -> Select[Any]:
    """One row per step of the run's records that satisfy `latest` (their ranks' latest attempts):
    tokens, wall time (slowest rank), the badput phases (slowest rank in each), and the productive
    rest, never below zero."""
    wall = func.max(RankStep.step_s)
    data = func.max(RankStep.data_s)
    checkpoint = func.max(RankStep.checkpoint_s)
    replay = func.max(RankStep.replay_s)
    lost = data + checkpoint + replay
    return (
        select(
            RankStep.step,
            func.sum(RankStep.tokens).label("tokens"),
            wall.label("wall_s"),
            data.label("data_s"),
            checkpoint.label("checkpoint_s"),
            replay.label("replay_s"),
            (wall - case((lost < wall, lost), else_=wall)).label("productive_s"),
        )
        .where(RankStep.run_id == run_id, latest)
        .group_by(RankStep.step)
    )


def _skipped_steps_seconds(connection: Any, run_id: str, latest: ColumnElement[bool]) -> float:
    """Productive-looking seconds of steps whose update the trainer threw away (a skipped batch)."""
    skipped = {
        step
        for step, attributes in connection.execute(
            select(Event.step, Event.attributes).where(
                Event.run_id == run_id, Event.kind == SKIPPING_EVENT
            )
        )
        if (attributes or {}).get("action") == SKIPPED
    }
    if not skipped:
        return 0.0
    steps = _per_step(run_id, latest).subquery()
    seconds = connection.execute(
        select(func.sum(steps.c.productive_s)).where(steps.c.step.in_(skipped))
    ).scalar()
    return float(seconds or 0.0)


def _aware(value: datetime) -> datetime:
    """func.max over a time column loses its type on SQLite (text comes back): parse it as UTC."""
    if isinstance(value, str):
        value = datetime.fromisoformat(value)
    return value if value.tzinfo is not None else value.replace(tzinfo=UTC)
