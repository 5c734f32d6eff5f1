"""Checkpoint replicas: a node's copy of another node's part gets a checkpoint row of its own.

With peer replicas, a node holds on its memory and SSD tiers its own part of a checkpoint and
copies of other nodes' parts; `part` (the node whose part the row's copy is, "" for the node's
own) joins the key. Every row recorded before this revision is a node's own part: "".

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-01 21:05:00.000000
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0005"
down_revision: str | None = "0004"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("checkpoints", schema=None) as batch_op:
        batch_op.add_column(
            sa.Column("part", sa.String(length=128), server_default="", nullable=False)
        )
        batch_op.drop_constraint("pk_checkpoints", type_="primary")
        batch_op.create_primary_key("pk_checkpoints", ["run_id", "step", "tier", "node", "part"])


def downgrade() -> None:
    # The older key holds a node's own part only: the replicas' rows go.
    op.execute("DELETE FROM checkpoints WHERE part <> ''")
    with op.batch_alter_table("checkpoints", schema=None) as batch_op:
        batch_op.drop_constraint("pk_checkpoints", type_="primary")
        batch_op.create_primary_key("pk_checkpoints", ["run_id", "step", "tier", "node"])
        batch_op.drop_column("part")
