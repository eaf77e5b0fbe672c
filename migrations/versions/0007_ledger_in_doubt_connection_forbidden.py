"""ledger.in_doubt (a write whose answer was never recorded), connections.forbidden (what a 403 means)

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-04 19:00:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("ledger", schema=None) as batch_op:
        batch_op.add_column(sa.Column("in_doubt", sa.Boolean(), server_default=sa.false(), nullable=False))
    with op.batch_alter_table("connections", schema=None) as batch_op:
        batch_op.add_column(sa.Column("forbidden", sa.String(length=20), server_default="token", nullable=False))


def downgrade() -> None:
    with op.batch_alter_table("connections", schema=None) as batch_op:
        batch_op.drop_column("forbidden")
    with op.batch_alter_table("ledger", schema=None) as batch_op:
        batch_op.drop_column("in_doubt")
