"""The runs overview page's view: every run with its status and latest figures."""

from __future__ import annotations

from typing import Any

import pandas as pd
from sqlalchemy import and_, func, select

from telemetry.efficiency import mfu
from telemetry.health import data_spike
from telemetry.models import Checkpoint, Event, Run
from telemetry.queries import Bind, connection_of
from telemetry.views.common import (
    COMMITTED,
    last_loss,
    last_step_of,
    recent_steps,
    run_status,
    throughput,
)

# Events that say something is wrong now; counted as a run's open alerts since its latest start.
ALERT_KINDS = ("alert", "straggler", "sdc", "loss_spike", "quarantine")
OVERVIEW_COLUMNS = [
    "run_id", "name", "status", "world_size", "attempt", "step", "loss", "tokens_per_s", "mfu",
    "last_checkpoint", "last_checkpoint_at", "open_alerts", "started_at",
]  # fmt: skip


def runs_table(bind: Bind, *, window: int = 20) -> pd.DataFrame:
    """One row per run, newest first: OVERVIEW_COLUMNS.

    status is the stored one, except "restarting" for a running run whose latest attempt has not
    recorded a step yet. loss, tokens_per_s and mfu are over the latest `window` steps;
    last_checkpoint is the latest step committed on any tier; open_alerts counts ALERT_KINDS
    events since the run's latest start (its current attempt).
    """
    with connection_of(bind) as connection:
        runs = connection.execute(
            select(
                Run.run_id, Run.name, Run.status, Run.world_size, Run.attempt, Run.started_at
            ).order_by(Run.started_at.desc())
        ).all()
        # Each run's latest committed step, when it was first committed on any tier of any node.
        latest = (
            select(Checkpoint.run_id, func.max(Checkpoint.step).label("step"))
            .where(*COMMITTED)
            .group_by(Checkpoint.run_id)
            .subquery()
        )
        committed = {
            run_id: (step, time)
            for run_id, step, time in connection.execute(
                select(Checkpoint.run_id, Checkpoint.step, func.min(Checkpoint.committed_at))
                .join(
                    latest,
                    and_(Checkpoint.run_id == latest.c.run_id, Checkpoint.step == latest.c.step),
                )
                .where(*COMMITTED)
                .group_by(Checkpoint.run_id, Checkpoint.step)
            )
        }
        rows = []
        for run in runs:
            last_step = last_step_of(connection, run.run_id)
            recent = recent_steps(connection, run.run_id, last_step, window)
            checkpoint, checkpoint_at = committed.get(run.run_id, (None, None))
            rows.append(
                {
                    "run_id": run.run_id,
                    "name": run.name,
                    "status": run_status(connection, run.run_id, run.status, run.attempt),
                    "world_size": run.world_size,
                    "attempt": run.attempt,
                    "step": last_step,
                    "loss": last_loss(recent),
                    "tokens_per_s": throughput(recent),
                    "mfu": mfu(connection, run.run_id, last_steps=window).mfu,
                    "last_checkpoint": checkpoint,
                    "last_checkpoint_at": checkpoint_at,
                    "open_alerts": _open_alerts(connection, run.run_id),
                    "started_at": run.started_at,
                }
            )
    return pd.DataFrame(rows, columns=OVERVIEW_COLUMNS)


def _open_alerts(connection: Any, run_id: str) -> int:
    """ALERT_KINDS events since the run's latest (re)start event, less the loss spikes the step
    guard found to be the data's (`DATA_SPIKE`): their alert closed itself."""
    started = func.coalesce(
        select(func.max(Event.time))
        .where(Event.run_id == run_id, Event.kind.in_(("run_started", "restart")))
        .scalar_subquery(),
        select(Run.started_at).where(Run.run_id == run_id).scalar_subquery(),
    )
    return int(
        connection.execute(
            select(func.count()).where(
                Event.run_id == run_id,
                Event.kind.in_(ALERT_KINDS),
                Event.time >= started,
                ~data_spike(),
            )
        ).scalar()
        or 0
    )
