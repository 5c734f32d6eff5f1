"""How well a run used its hardware and its time: MFU / HFU and goodput with badput by cause.

Both are computed in SQL from the step rollups (`telemetry.rollup`: per-step aggregates over
ranks, kept for the whole run, one row per step however many ranks), the run's description (model
size, world size, dense peak) and its events, so they are reproducible from the database alone and
read one row per step, never every rank's record. A step's wall time is its slowest rank's step
time: synchronous training waits for that rank. Where a step was computed by several attempts, the
latest attempt's rollup counts.

Goodput = productive training time / wall time, wall time running from the first launch
(`runs.started_at`) to the end of the run (its run_finished event, else its latest record).
Badput, by cause:
  - startup: launch to the start of the first step;
  - checkpoint_stall: time steps were blocked saving checkpoints;
  - restart: time lost to restarts, i.e. the gap between an attempt's last record and the next
    attempt's first step, plus the steps an attempt computed and a later one had to compute again;
  - replay: time spent replaying suspicious steps, and steps whose batch was skipped;
  - data_wait: time steps waited for their batch;
  - reduced_size: the share of each step's productive time the ranks it lacked would have done,
    for steps an elastic job ran on fewer ranks than the most it had (a node lost and no spare:
    `scaletrain run --nodes MIN:MAX`): productive x (most - ranks) / most;
  - evaluation: time spent on the held-out validation loss between steps (the trainer's eval
    events' seconds, every attempt's);
  - other: whatever the above do not explain: mostly the end of the run after its last step
    (waiting for the final checkpoint, the digests of the final parameters), then logging and
    gaps without records.
Per step, each cause counts the slowest rank's time in it, and the step's causes together never
exceed its wall time.

Badput by fault: what each kind of injected fault cost, the sum of its `recovery` events' badput_s
(`scaletrain.app.recovery`: the wall time from the strike to the first step after it, less the
steps kept meanwhile, plus the compute of the steps it lost). It attributes the same wall time
the causes above split (a restart's cost is in "restart" too), so it is not added to them.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import ColumnElement, case, exists, func, select
from sqlalchemy.orm import aliased

from scaletrain.errors import NotFound
from telemetry import mfu as flops
from telemetry.models import Event, Run, StepRollup
from telemetry.queries import Bind, connection_of

BADPUT_CAUSES = (
    "startup",
    "checkpoint_stall",
    "restart",
    "replay",
    "data_wait",
    "reduced_size",
    "evaluation",
    "other",
)
# What "other" is, told wherever a run's badput by cause is shown.
OTHER_BADPUT = (
    "the end of the run after its last step (the final checkpoint, the digests), logging, "
    "gaps without records"
)
# The event whose attributes say the trainer threw a step's update away (its batch was skipped).
SKIPPING_EVENT = "loss_spike"
SKIPPED = "skipped"
# A fault's recovery record (attributes: kind, badput_s, ...), one per fault a drill injected.
RECOVERY_EVENT = "recovery"
# The trainer's validation loss after a step, with the seconds it took (`Reporter.evaluated`).
EVAL_EVENT = "eval"


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
    # Fault kind -> seconds its recoveries cost (see the module docstring); empty without any.
    badput_by_fault_s: dict[str, float] = field(default_factory=dict)

    @property
    def goodput(self) -> float:
        return self.productive_s / self.wall_s if self.wall_s > 0 else math.nan


_newer = aliased(StepRollup)
# True for a rollup that no later attempt of the same run and step replaced.
LATEST_ROLLUP = ~exists().where(
    _newer.run_id == StepRollup.run_id,
    _newer.step == StepRollup.step,
    _newer.attempt > StepRollup.attempt,
)


def mfu(bind: Bind, run_id: str, *, last_steps: int | None = None) -> Mfu:
    """MFU and HFU of `run_id` over its latest `last_steps` steps (all by default).

    tokens/s = tokens of all ranks / the steps' wall time (each step its slowest rank's step time).
    NotFound when no such run was registered.
    """
    with connection_of(bind) as connection:
        run = registered_run(
            connection,
            run_id,
            Run.model_params,
            Run.world_size,
            Run.peak_flops,
            Run.recompute_fraction,
            Run.precision,
            Run.peak_flops_source,
            Run.attempt,
        )
        conditions = [StepRollup.run_id == run_id, *_latest(run.attempt)]
        if last_steps is not None:
            newest = select(func.max(StepRollup.step)).where(StepRollup.run_id == run_id)
            cutoff = connection.execute(newest).scalar()
            if cutoff is not None:
                conditions.append(StepRollup.step > cutoff - last_steps)
        count, tokens, seconds = connection.execute(
            select(func.count(), func.sum(StepRollup.tokens), func.sum(StepRollup.step_max)).where(
                *conditions
            )
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
    """Goodput and badput by cause of `run_id` (see the module docstring); NotFound if no run.

    Three aggregate queries over the run's rollups (each attempt's span; the latest attempts'
    sums; the steps a later attempt computed again), and one over its skipped steps.
    """
    with connection_of(bind) as connection:
        run = registered_run(connection, run_id, Run.started_at, Run.finished_at, Run.attempt)
        spans = connection.execute(
            select(StepRollup.attempt, func.min(StepRollup.step), func.max(StepRollup.ended_at))
            .where(StepRollup.run_id == run_id)
            .group_by(StepRollup.attempt)
            .order_by(StepRollup.attempt)
        ).all()
        attempts = [
            (attempt, _step_start(connection, run_id, attempt, first), _aware(last))
            for attempt, first, last in spans
        ]
        # Records of several attempts (a restart, registered or not): each step's latest counts.
        latest = [StepRollup.run_id == run_id, *_latest(len(spans) - 1)]
        sums = dict(
            zip(
                _SUMMED,
                connection.execute(
                    select(*(func.sum(c) for c in per_step().values())).where(*latest)
                ).one(),
                strict=True,
            )
        )
        lost = 0.0
        if len(spans) > 1:
            lost = connection.execute(
                select(func.sum(StepRollup.step_max)).where(
                    StepRollup.run_id == run_id, ~LATEST_ROLLUP
                )
            ).scalar()
        skipped = _skipped_steps_seconds(connection, run_id, latest)
        reduced = _reduced_size_seconds(connection, run_id, latest)
        by_fault = _badput_by_fault(connection, run_id)
        evaluation = _evaluation_seconds(connection, run_id)
    if not attempts:
        return Goodput(
            wall_s=0.0,
            productive_s=0.0,
            badput_s=dict.fromkeys(BADPUT_CAUSES, 0.0),
            badput_by_fault_s=by_fault,
        )
    sums = {name: float(value or 0.0) for name, value in sums.items()}
    end = run.finished_at or attempts[-1][2]
    wall_s = max((end - run.started_at).total_seconds(), 0.0)
    startup = max((attempts[0][1] - run.started_at).total_seconds(), 0.0)
    gaps = sum(
        max((first - previous_last).total_seconds(), 0.0)
        for (_, _, previous_last), (_, first, _) in itertools.pairwise(attempts)
    )
    productive_s = max(sums["productive_s"] - skipped - reduced, 0.0)
    badput = {
        "startup": startup,
        "checkpoint_stall": sums["checkpoint_s"],
        "restart": gaps + float(lost or 0.0),
        "replay": sums["replay_s"] + skipped,
        "data_wait": sums["data_s"],
        "reduced_size": reduced,
        "evaluation": evaluation,
    }
    accounted = productive_s + sum(badput.values())
    # Per-step time is measured on each rank; clocks and rounding can make the parts exceed the
    # whole by a hair, which is not "negative other".
    badput["other"] = max(wall_s - accounted, 0.0)
    return Goodput(
        wall_s=wall_s, productive_s=productive_s, badput_s=badput, badput_by_fault_s=by_fault
    )


# The per-step figures that goodput sums over a run.
_SUMMED = ("data_s", "checkpoint_s", "replay_s", "productive_s")


def registered_run(connection: Any, run_id: str, *columns: Any) -> Any:
    """`columns` of run `run_id`'s row; NotFound when no such run was registered."""
    run = connection.execute(select(*columns).where(Run.run_id == run_id)).first()
    if run is None:
        raise NotFound(f"run {run_id!r} is not registered")
    return run


def per_step() -> dict[str, ColumnElement[Any]]:
    """Each step's badput phases (the slowest rank in each) and its productive rest, never below
    zero, from its rollup."""
    wall = StepRollup.step_max
    lost = StepRollup.data_max + StepRollup.checkpoint_max + StepRollup.replay_max
    return {
        "data_s": StepRollup.data_max,
        "checkpoint_s": StepRollup.checkpoint_max,
        "replay_s": StepRollup.replay_max,
        "productive_s": wall - case((lost < wall, lost), else_=wall),
    }


def _latest(attempt: int) -> list[ColumnElement[bool]]:
    """LATEST_ROLLUP, or no condition for a run of one attempt (every rollup is its step's)."""
    return [LATEST_ROLLUP] if attempt else []


def _step_start(connection: Any, run_id: str, attempt: int, step: int) -> datetime:
    """When `attempt` started `step`: its rollup's start (one primary-key lookup)."""
    started = connection.execute(
        select(StepRollup.started_at).where(
            StepRollup.run_id == run_id, StepRollup.step == step, StepRollup.attempt == attempt
        )
    ).scalar_one()
    return _aware(started)


def _skipped_steps_seconds(
    connection: Any, run_id: str, latest: list[ColumnElement[bool]]
) -> float:
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
    seconds = connection.execute(
        select(func.sum(per_step()["productive_s"])).where(*latest, StepRollup.step.in_(skipped))
    ).scalar()
    return float(seconds or 0.0)


def _reduced_size_seconds(connection: Any, run_id: str, latest: list[ColumnElement[bool]]) -> float:
    """What the steps run on fewer ranks than the run's most would have gained from the ranks
    they lacked: each one's productive time x (most - ranks) / most."""
    most = connection.execute(
        select(func.max(StepRollup.ranks)).where(StepRollup.run_id == run_id)
    ).scalar()
    if not most:
        return 0.0
    share = (most - StepRollup.ranks) * 1.0 / most
    seconds = connection.execute(
        select(func.sum(per_step()["productive_s"] * share)).where(*latest, StepRollup.ranks < most)
    ).scalar()
    return float(seconds or 0.0)


def _evaluation_seconds(connection: Any, run_id: str) -> float:
    """The seconds the run's validation losses took (its "eval" events)."""
    return sum(
        (
            float((attributes or {}).get("seconds") or 0.0)
            for (attributes,) in connection.execute(
                select(Event.attributes).where(Event.run_id == run_id, Event.kind == EVAL_EVENT)
            )
        ),
        0.0,
    )


def _badput_by_fault(connection: Any, run_id: str) -> dict[str, float]:
    """Fault kind -> the summed badput_s of the run's recovery records (one event per fault)."""
    costs: dict[str, float] = {}
    for (attributes,) in connection.execute(
        select(Event.attributes).where(Event.run_id == run_id, Event.kind == RECOVERY_EVENT)
    ):
        kind = (attributes or {}).get("kind", "")
        costs[kind] = costs.get(kind, 0.0) + float((attributes or {}).get("badput_s") or 0.0)
    return costs


def _aware(value: datetime) -> datetime:
    """func.max over a time column loses its type on SQLite (text comes back): parse it as UTC."""
    if isinstance(value, str):
        value = datetime.fromisoformat(value)
    return value if value.tzinfo is not None else value.replace(tzinfo=UTC)
