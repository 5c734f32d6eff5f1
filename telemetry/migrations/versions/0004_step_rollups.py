"""Step rollups and node steps: per-step summaries across ranks kept for the whole run, and each
node's worst rank per step, so that per-rank rows need only be kept for a recent window.

Existing rank rows stay as they are; the service rolls up every step that has rank rows and no
rollup when it starts (`telemetry.rollup.roll_up_missing`), so a database from before this
revision gets its rollups from the rows it holds. The metric columns are spelled out here, not
taken from `telemetry.models`: a revision must keep meaning the same schema when the models change.

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-01 19:55:00.000000
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0004"
down_revision: str | None = "0003"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_METRICS = (
    "step",
    "compute",
    "data",
    "forward",
    "backward",
    "optimizer",
    "comm_wait",
    "checkpoint",
    "replay",
    "loss",
    "grad_norm",
    "memory",
    "peak_memory",
)
_STATISTICS = ("min", "median", "p99", "max")


def upgrade() -> None:
    op.create_table(
        "step_rollups",
        sa.Column("run_id", sa.String(length=128), nullable=False),
        sa.Column("step", sa.BigInteger(), autoincrement=False, nullable=False),
        sa.Column("attempt", sa.Integer(), autoincrement=False, nullable=False),
        sa.Column("ranks", sa.Integer(), nullable=False),
        sa.Column("tokens", sa.BigInteger(), nullable=False),
        sa.Column("loss_mean", sa.Double(), nullable=True),
        sa.Column("started_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("ended_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("slowest", sa.JSON(), nullable=False),
        *(
            sa.Column(f"{metric}_{statistic}", sa.Double(), nullable=True)
            for metric in _METRICS
            for statistic in _STATISTICS
        ),
        sa.ForeignKeyConstraint(
            ["run_id"],
            ["runs.run_id"],
            name=op.f("fk_step_rollups_run_id_runs"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("run_id", "step", "attempt", name=op.f("pk_step_rollups")),
    )
    op.create_table(
        "node_steps",
        sa.Column("run_id", sa.String(length=128), nullable=False),
        sa.Column("step", sa.BigInteger(), autoincrement=False, nullable=False),
        sa.Column("attempt", sa.Integer(), autoincrement=False, nullable=False),
        sa.Column("node", sa.String(length=256), nullable=False),
        sa.Column("ranks", sa.Integer(), nullable=False),
        sa.Column("worst_rank", sa.Integer(), nullable=False),
        sa.Column("worst_compute_s", sa.Double(), nullable=False),
        sa.Column("relative", sa.Double(), nullable=True),
        sa.ForeignKeyConstraint(
            ["run_id"], ["runs.run_id"], name=op.f("fk_node_steps_run_id_runs"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("run_id", "step", "attempt", "node", name=op.f("pk_node_steps")),
    )


def downgrade() -> None:
    op.drop_table("node_steps")
    op.drop_table("step_rollups")
