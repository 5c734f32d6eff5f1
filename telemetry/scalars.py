"""A run's training curves as one row per step: what `telemetry.tensorboard` writes.

Read from the step rollups (kept for the whole run, one row per step; where a restart computed a
step again, the latest attempt's), the run's description (for MFU) and, for the learning rate,
the per-rank records (kept for the retention window: older steps have no learning rate). The
validation loss is the trainer's eval events' (`views.run.eval_points`); steps without one are NaN.
"""

from __future__ import annotations

import pandas as pd
from sqlalchemy import func, select

from telemetry import mfu as flops
from telemetry.efficiency import LATEST_ROLLUP, per_step, registered_run
from telemetry.models import RankStep, Run, StepRollup
from telemetry.queries import LATEST_ATTEMPT, Bind, connection_of
from telemetry.views.run import eval_points

SCALAR_COLUMNS = [
    "step", "loss", "eval_loss", "lr", "grad_norm", "tokens_per_s", "mfu", "goodput",
    "checkpoint_stall_s",
]  # fmt: skip


def step_scalars(bind: Bind, run_id: str) -> pd.DataFrame:
    """SCALAR_COLUMNS per step of `run_id`, oldest first; NotFound if no such run.

    tokens/s is the step's tokens over its wall time (its slowest rank's step time), MFU that
    throughput's model FLOP/s over the devices' dense peak, goodput the step's productive share
    of its wall time (`telemetry.efficiency`), checkpoint stall its slowest rank's seconds
    blocked saving.
    """
    productive = per_step()["productive_s"]
    with connection_of(bind) as connection:
        run = registered_run(connection, run_id, Run.model_params, Run.world_size, Run.peak_flops)
        rollups = pd.DataFrame(
            connection.execute(
                select(
                    StepRollup.step,
                    StepRollup.loss_mean.label("loss"),
                    StepRollup.grad_norm_median.label("grad_norm"),
                    StepRollup.tokens,
                    StepRollup.step_max.label("wall_s"),
                    productive.label("productive_s"),
                    StepRollup.checkpoint_max.label("checkpoint_stall_s"),
                )
                .where(StepRollup.run_id == run_id, LATEST_ROLLUP)
                .order_by(StepRollup.step)
            ).all(),
            columns=[
                "step",
                "loss",
                "grad_norm",
                "tokens",
                "wall_s",
                "productive_s",
                "checkpoint_stall_s",
            ],
        )
        lr = dict(
            connection.execute(
                select(RankStep.step, func.max(RankStep.lr))
                .where(RankStep.run_id == run_id, LATEST_ATTEMPT)
                .group_by(RankStep.step)
            ).all()
        )
        evals = eval_points(connection, run_id, limit=None)
    wall = rollups["wall_s"].astype(float)
    tokens_per_s = (rollups["tokens"].astype(float) / wall).where(wall > 0)
    per_token = flops.model_flops_per_token(run.model_params)
    scalars = pd.DataFrame(
        {
            "step": rollups["step"],
            "loss": rollups["loss"].astype(float),
            "eval_loss": rollups["step"].map(dict(evals.values.tolist())).astype(float),
            "lr": rollups["step"].map(lr).astype(float),
            "grad_norm": rollups["grad_norm"].astype(float),
            "tokens_per_s": tokens_per_s,
            "mfu": tokens_per_s.map(
                lambda t: flops.utilization(per_token, t, run.world_size, run.peak_flops)
            ),
            "goodput": (rollups["productive_s"].astype(float) / wall).where(wall > 0),
            "checkpoint_stall_s": rollups["checkpoint_stall_s"].astype(float),
        }
    )
    return scalars[SCALAR_COLUMNS]
