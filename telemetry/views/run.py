"""The run health page's views of one run: its headline figures, the loss curve with its
evaluations and markers, the recoveries from faults, and the kinds of its events."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import pandas as pd
from sqlalchemy import case, select

from telemetry.efficiency import EVAL_EVENT, RECOVERY_EVENT, mfu
from telemetry.models import Checkpoint, Event, Run, StepRollup
from telemetry.queries import Bind, connection_of
from telemetry.views.common import (
    COMMITTED,
    as_float,
    last_loss,
    last_step_of,
    recent_steps,
    rollups_at,
    run_status,
    sampled_steps,
    throughput,
)

# Events drawn as markers on the loss curve (besides committed checkpoints).
MARKER_KINDS = ("restart", "loss_spike", "sdc", "replay", "quarantine")
LOSS_POINT_COLUMNS = ["step", "loss", "loss_min", "loss_max", "tokens_per_s", "ranks"]
EVAL_POINT_COLUMNS = ["step", "eval_loss"]
MARKER_COLUMNS = ["step", "kind", "label"]
# A fault's recovery (a drill's `recovery` event): the table's columns, then the steps its band
# spans on the loss curve (from where the job resumed, or the fault's step, to its first step).
RECOVERY_COLUMNS = [
    "kind", "target", "step", "injected", "detected_s", "first_step", "first_step_s", "mttr_s",
    "steps_lost", "restored_from", "spare", "in_job", "badput_s", "from_step", "to_step",
]  # fmt: skip


@dataclass(frozen=True)
class Headline:
    """The figures at the top of a run's page: now (the latest `window` steps) and the window
    before, for trends. NaN when unknown; `last_step` None while no step was recorded."""

    status: str
    last_step: int | None
    loss: float
    previous_loss: float
    tokens_per_s: float
    previous_tokens_per_s: float
    mfu: float
    previous_mfu: float
    mfu_label: str
    last_checkpoint: int | None
    last_checkpoint_at: datetime | None


def headline(bind: Bind, run_id: str, *, window: int = 20) -> Headline:
    """The headline figures of `run_id` (see Headline); NotFound when no such run was registered."""
    with connection_of(bind) as connection:
        now = mfu(connection, run_id, last_steps=window)
        run = connection.execute(select(Run.status, Run.attempt).where(Run.run_id == run_id)).one()
        last_step = last_step_of(connection, run_id)
        steps = recent_steps(connection, run_id, last_step, 2 * window)
        checkpoint = connection.execute(
            select(Checkpoint.step, Checkpoint.committed_at)
            .where(
                Checkpoint.run_id == run_id,
                *COMMITTED,
            )
            .order_by(Checkpoint.step.desc(), Checkpoint.committed_at)
            .limit(1)
        ).first()
        status = run_status(connection, run_id, run.status, run.attempt)
    cut = (last_step or 0) - window
    recent, before = steps[steps["step"] > cut], steps[steps["step"] <= cut]
    loss, previous_loss = last_loss(recent), last_loss(before)
    tokens_per_s, previous_tokens_per_s = throughput(recent), throughput(before)
    # MFU is proportional to tokens/s for a given run: scale the current figure.
    previous_mfu = now.mfu * previous_tokens_per_s / tokens_per_s if tokens_per_s else math.nan
    return Headline(
        status=status,
        last_step=last_step,
        loss=loss,
        previous_loss=previous_loss,
        tokens_per_s=tokens_per_s,
        previous_tokens_per_s=previous_tokens_per_s,
        mfu=now.mfu,
        previous_mfu=previous_mfu,
        mfu_label=now.label,
        last_checkpoint=None if checkpoint is None else checkpoint.step,
        last_checkpoint_at=None if checkpoint is None else checkpoint.committed_at,
    )


def loss_points(bind: Bind, run_id: str, *, max_points: int = 1000) -> pd.DataFrame:
    """Mean, min and max loss over ranks, tokens/s (all ranks' tokens over the slowest rank's
    step time) and the ranks that trained it (an elastic job's size changes) at up to
    `max_points` sampled steps, from the rollups: LOSS_POINT_COLUMNS."""
    steps = sampled_steps(bind, run_id, max_points)
    rows = rollups_at(
        bind,
        select(
            StepRollup.step,
            StepRollup.loss_mean,
            StepRollup.loss_min,
            StepRollup.loss_max,
            StepRollup.tokens / case((StepRollup.step_max > 0, StepRollup.step_max)),
            StepRollup.ranks,
        ),
        run_id,
        steps,
    )
    frame = pd.DataFrame(rows, columns=LOSS_POINT_COLUMNS)
    return frame.astype({column: float for column in LOSS_POINT_COLUMNS[1:-1]}).sort_values(
        "step", ignore_index=True
    )


def eval_points(bind: Bind, run_id: str, *, limit: int | None = 1000) -> pd.DataFrame:
    """The validation losses of `run_id` (its "eval" events): EVAL_POINT_COLUMNS by step, the
    latest report of a step when a restarted run evaluated it again; at most the `limit` latest
    steps (None: every one)."""
    query = (
        select(Event.step, Event.attributes)
        .where(Event.run_id == run_id, Event.kind == EVAL_EVENT)
        .order_by(Event.time.desc())
    )
    latest: dict[int, float] = {}
    with connection_of(bind) as connection:
        for step, attributes in connection.execute(query):
            if step not in latest and (limit is None or len(latest) < limit):
                latest[step] = float(attributes["loss"])
    frame = pd.DataFrame(sorted(latest.items()), columns=EVAL_POINT_COLUMNS)
    return frame.astype({"step": int, "eval_loss": float})


def markers(bind: Bind, run_id: str, *, limit: int = 2000) -> pd.DataFrame:
    """What to mark on the loss curve: MARKER_COLUMNS, by step. Kind "checkpoint" for a step
    committed on some tier, else one of MARKER_KINDS; at most `limit` of the latest of each."""
    checkpoint_steps = (
        select(Checkpoint.step)
        .where(
            Checkpoint.run_id == run_id,
            *COMMITTED,
        )
        .distinct()
        .order_by(Checkpoint.step.desc())
        .limit(limit)
    )
    marked = (
        select(Event.step, Event.kind, Event.message)
        .where(Event.run_id == run_id, Event.kind.in_(MARKER_KINDS))
        .order_by(Event.time.desc())
        .limit(limit)
    )
    with connection_of(bind) as connection:
        checkpoint_rows = [
            (step, "checkpoint", f"checkpoint of step {step}")
            for (step,) in connection.execute(checkpoint_steps)
        ]
        # Newest first from the database; oldest first within a step on the chart.
        event_rows = [tuple(row) for row in connection.execute(marked)][::-1]
    frame = pd.DataFrame(checkpoint_rows + event_rows, columns=MARKER_COLUMNS)
    return frame.sort_values("step", kind="stable", ignore_index=True)


def recoveries(bind: Bind, run_id: str, *, limit: int = 1000) -> pd.DataFrame:
    """The run's recovery records (one per fault a drill injected), oldest first, at most the
    latest `limit`: RECOVERY_COLUMNS. Times after the fault's strike in seconds (NaN: never);
    `restored_from` the restore's bytes per copy ({"memory@node0": 2100000}; {} without one)."""
    with connection_of(bind) as connection:
        rows = connection.execute(
            select(Event.time, Event.attributes)
            .where(Event.run_id == run_id, Event.kind == RECOVERY_EVENT)
            .order_by(Event.time.desc())
            .limit(limit)
        ).all()
    frame = [_recovery_row(at, attributes or {}) for at, attributes in reversed(rows)]
    return pd.DataFrame(frame, columns=RECOVERY_COLUMNS)


def _recovery_row(at: datetime, attributes: dict[str, str]) -> list[Any]:
    """A `recovery` event's attributes (strings, "" for None) as a row of RECOVERY_COLUMNS."""

    def number(name: str) -> float:
        return as_float(attributes.get(name) or None)

    injected, step = number("injected_at"), int(attributes.get("step") or 0)
    first = int(attributes["first_step"]) if attributes.get("first_step") else None
    resumed = int(attributes["resumed_from"]) if attributes.get("resumed_from") else step
    return [
        attributes.get("kind", ""), attributes.get("target", ""), step, at,
        number("detected_at") - injected, first, number("first_step_at") - injected,
        number("mttr_s"), int(attributes.get("steps_lost") or 0),
        json.loads(attributes.get("restored_from") or "{}"), attributes.get("spare") == "true",
        attributes.get("in_job") == "true", number("badput_s"), min(resumed, step),
        max(step, first or step),
    ]  # fmt: skip


def event_kinds(bind: Bind, run_id: str) -> list[str]:
    """The kinds of event `run_id` has, alphabetically (for a filter)."""
    with connection_of(bind) as connection:
        return list(
            connection.execute(
                select(Event.kind).where(Event.run_id == run_id).distinct().order_by(Event.kind)
            ).scalars()
        )
