"""Deletes: rules.deletes and rules.max_deletes_per_chain, connections.batch_delete_path, and
ledger.deleting (a delete went out whose answer was not recorded)

Revision ID: 0011
Revises: 0010
Create Date: 2026-12-07 13:00:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0011"
down_revision = "0010"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("rules", schema=None) as batch_op:
        batch_op.add_column(sa.Column("deletes", sa.String(length=20), server_default="ignore", nullable=False))
        batch_op.add_column(sa.Column("max_deletes_per_chain", sa.Integer(), server_default="100", nullable=False))
    with op.batch_alter_table("connections", schema=None) as batch_op:
        batch_op.add_column(sa.Column("batch_delete_path", sa.String(length=500), nullable=True))
    with op.batch_alter_table("ledger", schema=None) as batch_op:
        batch_op.add_column(sa.Column("deleting", sa.Boolean(), server_default=sa.false(), nullable=False))


def downgrade() -> None:
    with op.batch_alter_table("ledger", schema=None) as batch_op:
        batch_op.drop_column("deleting")
    with op.batch_alter_table("connections", schema=None) as batch_op:
        batch_op.drop_column("batch_delete_path")
    with op.batch_alter_table("rules", schema=None) as batch_op:
        batch_op.drop_column("max_deletes_per_chain")
        batch_op.drop_column("deletes")
