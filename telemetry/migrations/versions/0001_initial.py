"""Initial schema: runs, ranks, rank_steps, events.

Revision ID: 0001
Revises: (none)
Create Date: 2026-11-30 12:03:19.823922
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0001"
down_revision: str | None = None
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "runs",
        sa.Column("run_id", sa.String(length=128), nullable=False),
        sa.Column("name", sa.String(length=256), nullable=False),
        sa.Column("config_json", sa.Text(), nullable=False),
        sa.Column("world_size", sa.Integer(), nullable=False),
        sa.Column("dp_replicate", sa.Integer(), nullable=False),
        sa.Column("dp_shard", sa.Integer(), nullable=False),
        sa.Column("tp", sa.Integer(), nullable=False),
        sa.Column("pp", sa.Integer(), nullable=False),
        sa.Column("cp", sa.Integer(), nullable=False),
        sa.Column("ep", sa.Integer(), nullable=False),
        sa.Column("model_params", sa.BigInteger(), nullable=False),
        sa.Column("hardware", sa.String(length=128), nullable=False),
        sa.Column("started_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("status", sa.String(length=16), nullable=False),
        sa.Column("finished_at", sa.DateTime(timezone=True), nullable=True),
        sa.CheckConstraint(
            "status IN ('running', 'finished', 'failed')", name=op.f("ck_runs_status")
        ),
        sa.PrimaryKeyConstraint("run_id", name=op.f("pk_runs")),
    )
    op.create_table(
        "events",
        sa.Column(
            "id",
            sa.BigInteger().with_variant(sa.Integer(), "sqlite"),
            autoincrement=True,
            nullable=False,
        ),
        sa.Column("run_id", sa.String(length=128), nullable=False),
        sa.Column("step", sa.BigInteger(), nullable=False),
        sa.Column("rank", sa.Integer(), nullable=False),
        sa.Column("kind", sa.String(length=32), nullable=False),
        sa.Column("message", sa.Text(), nullable=False),
        sa.Column("time", sa.DateTime(timezone=True), nullable=False),
        sa.Column("attributes", sa.JSON(), nullable=False),
        sa.Column("tier", sa.String(length=16), nullable=True),
        sa.Column("bytes", sa.BigInteger(), nullable=True),
        sa.Column("seconds", sa.Double(), nullable=True),
        sa.ForeignKeyConstraint(
            ["run_id"], ["runs.run_id"], name=op.f("fk_events_run_id_runs"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_events")),
        sa.UniqueConstraint(
            "run_id",
            "kind",
            "step",
            "rank",
            "time",
            name=op.f("uq_events_run_id_kind_step_rank_time"),
        ),
    )
    with op.batch_alter_table("events", schema=None) as batch_op:
        batch_op.create_index("ix_events_run_id_time", ["run_id", "time"], unique=False)

    op.create_table(
        "rank_steps",
        sa.Column("run_id", sa.String(length=128), nullable=False),
        sa.Column("step", sa.BigInteger(), autoincrement=False, nullable=False),
        sa.Column("rank", sa.Integer(), autoincrement=False, nullable=False),
        sa.Column("attempt", sa.Integer(), autoincrement=False, nullable=False),
        sa.Column("loss", sa.Double(), nullable=True),
        sa.Column("grad_norm", sa.Double(), nullable=True),
        sa.Column("tokens", sa.BigInteger(), nullable=False),
        sa.Column("step_s", sa.Double(), nullable=False),
        sa.Column("data_s", sa.Double(), nullable=False),
        sa.Column("forward_s", sa.Double(), nullable=False),
        sa.Column("backward_s", sa.Double(), nullable=False),
        sa.Column("optimizer_s", sa.Double(), nullable=False),
        sa.Column("comm_wait_s", sa.Double(), nullable=False),
        sa.Column("checkpoint_s", sa.Double(), nullable=False),
        sa.Column("memory_bytes", sa.BigInteger(), nullable=False),
        sa.Column("peak_memory_bytes", sa.BigInteger(), nullable=False),
        sa.Column("lr", sa.Double(), nullable=False),
        sa.Column("time", sa.DateTime(timezone=True), nullable=False),
        sa.Column("param_checksum", sa.String(length=128), nullable=False),
        sa.Column("global_sample", sa.BigInteger(), nullable=False),
        sa.Column("rank_sample", sa.BigInteger(), nullable=False),
        sa.Column("epoch", sa.BigInteger(), nullable=False),
        sa.ForeignKeyConstraint(
            ["run_id"], ["runs.run_id"], name=op.f("fk_rank_steps_run_id_runs"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("run_id", "step", "rank", "attempt", name=op.f("pk_rank_steps")),
    )
    op.create_table(
        "ranks",
        sa.Column("run_id", sa.String(length=128), nullable=False),
        sa.Column("rank", sa.Integer(), nullable=False),
        sa.Column("host", sa.String(length=256), nullable=False),
        sa.Column("device", sa.String(length=128), nullable=False),
        sa.ForeignKeyConstraint(
            ["run_id"], ["runs.run_id"], name=op.f("fk_ranks_run_id_runs"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("run_id", "rank", name=op.f("pk_ranks")),
    )


def downgrade() -> None:
    op.drop_table("ranks")
    op.drop_table("rank_steps")
    with op.batch_alter_table("events", schema=None) as batch_op:
        batch_op.drop_index("ix_events_run_id_time")

    op.drop_table("events")
    op.drop_table("runs")
