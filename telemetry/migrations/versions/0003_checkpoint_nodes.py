"""Checkpoint nodes: the node of each checkpoint row (part of its key) and of each event.

A checkpoint is spread over nodes, each node's ckptd holding its part on its memory and SSD tiers,
so those tiers get one row per node. Rows recorded before this revision, S3's (the whole
checkpoint) and the trainer's get node "". Every node's ckptd reports its own commits, at times
that may coincide, so the node joins the unique key that recognises a resent event.

Revision ID: 0003
Revises: 0002
Create Date: 2026-12-01 09:14:52.407315
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0003"
down_revision: str | None = "0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_EVENT_KEY = ["run_id", "kind", "step", "rank", "time"]


def upgrade() -> None:
    with op.batch_alter_table("checkpoints", schema=None) as batch_op:
        batch_op.add_column(
            sa.Column("node", sa.String(length=128), server_default="", nullable=False)
        )
        batch_op.drop_constraint("pk_checkpoints", type_="primary")
        batch_op.create_primary_key("pk_checkpoints", ["run_id", "step", "tier", "node"])

    with op.batch_alter_table("events", schema=None) as batch_op:
        batch_op.add_column(
            sa.Column("node", sa.String(length=128), server_default="", nullable=False)
        )
        batch_op.drop_constraint("uq_events_run_id_kind_step_rank_time", type_="unique")
        batch_op.create_unique_constraint(
            "uq_events_run_id_kind_step_rank_time_node", [*_EVENT_KEY, "node"]
        )


def downgrade() -> None:
    # The older keys hold one row per checkpoint tier and per event time: keep each key's row of
    # the first node by name.
    op.execute(
        "DELETE FROM checkpoints WHERE EXISTS (SELECT 1 FROM checkpoints AS other "
        "WHERE other.run_id = checkpoints.run_id AND other.step = checkpoints.step "
        "AND other.tier = checkpoints.tier AND other.node < checkpoints.node)"
    )
    op.execute(
        "DELETE FROM events WHERE EXISTS (SELECT 1 FROM events AS other "
        "WHERE other.run_id = events.run_id AND other.kind = events.kind "
        "AND other.step = events.step AND other.rank = events.rank "
        "AND other.time = events.time AND other.node < events.node)"
    )
    with op.batch_alter_table("events", schema=None) as batch_op:
        batch_op.drop_constraint("uq_events_run_id_kind_step_rank_time_node", type_="unique")
        batch_op.create_unique_constraint("uq_events_run_id_kind_step_rank_time", _EVENT_KEY)
        batch_op.drop_column("node")

    with op.batch_alter_table("checkpoints", schema=None) as batch_op:
        batch_op.drop_constraint("pk_checkpoints", type_="primary")
        batch_op.create_primary_key("pk_checkpoints", ["run_id", "step", "tier"])
        batch_op.drop_column("node")
