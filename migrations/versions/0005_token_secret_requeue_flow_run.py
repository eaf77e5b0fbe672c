"""connections.token_secret (a Prefect Secret block), requeues.flow_run_id (the delivery-requeue run)

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-10 09:00:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("connections", schema=None) as batch_op:
        batch_op.add_column(sa.Column("token_secret", sa.String(length=200), nullable=True))
    with op.batch_alter_table("requeues", schema=None) as batch_op:
        batch_op.add_column(sa.Column("flow_run_id", sa.String(length=64), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("requeues", schema=None) as batch_op:
        batch_op.drop_column("flow_run_id")
    with op.batch_alter_table("connections", schema=None) as batch_op:
        batch_op.drop_column("token_secret")
