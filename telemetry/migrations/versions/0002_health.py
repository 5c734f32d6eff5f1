"""Run health: a checkpoints table, MFU inputs and restart attempts of runs, compute and replay
times and dropped-record counts of rank steps.

Existing rows get neutral values (0, ""): a run recorded before this revision has an unknown peak,
attempt 0, and no compute or replay times, which the queries treat as "not measured".

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-30 12:27:12.161681
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0002"
down_revision: str | None = "0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "checkpoints",
        sa.Column("run_id", sa.String(length=128), nullable=False),
        sa.Column("step", sa.BigInteger(), autoincrement=False, nullable=False),
        sa.Column("tier", sa.String(length=16), nullable=False),
        sa.Column("started_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("staged_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("committed_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("failed_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("bytes", sa.BigInteger(), nullable=False),
        sa.Column("seconds", sa.Double(), nullable=False),
        sa.ForeignKeyConstraint(
            ["run_id"], ["runs.run_id"], name=op.f("fk_checkpoints_run_id_runs"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("run_id", "step", "tier", name=op.f("pk_checkpoints")),
    )
    with op.batch_alter_table("rank_steps", schema=None) as batch_op:
        batch_op.add_column(sa.Column("compute_s", sa.Double(), server_default="0", nullable=False))
        batch_op.add_column(sa.Column("replay_s", sa.Double(), server_default="0", nullable=False))
        batch_op.add_column(
            sa.Column("dropped_records", sa.BigInteger(), server_default="0", nullable=False)
        )

    with op.batch_alter_table("runs", schema=None) as batch_op:
        batch_op.add_column(
            sa.Column("precision", sa.String(length=16), server_default="", nullable=False)
        )
        batch_op.add_column(
            sa.Column("peak_flops", sa.Double(), server_default="0", nullable=False)
        )
        batch_op.add_column(
            sa.Column("peak_flops_source", sa.String(length=128), server_default="", nullable=False)
        )
        batch_op.add_column(
            sa.Column("recompute_fraction", sa.Double(), server_default="0", nullable=False)
        )
        batch_op.add_column(sa.Column("attempt", sa.Integer(), server_default="0", nullable=False))


def downgrade() -> None:
    with op.batch_alter_table("runs", schema=None) as batch_op:
        batch_op.drop_column("attempt")
        batch_op.drop_column("recompute_fraction")
        batch_op.drop_column("peak_flops_source")
        batch_op.drop_column("peak_flops")
        batch_op.drop_column("precision")

    with op.batch_alter_table("rank_steps", schema=None) as batch_op:
        batch_op.drop_column("dropped_records")
        batch_op.drop_column("replay_s")
        batch_op.drop_column("compute_s")

    op.drop_table("checkpoints")
