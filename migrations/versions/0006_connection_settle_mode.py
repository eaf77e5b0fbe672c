"""connections.settle: how chains commit the ledger writes of what they deliver (grouped, per_record)

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-03 17:40:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("connections", schema=None) as batch_op:
        batch_op.add_column(sa.Column("settle", sa.String(length=20), nullable=False, server_default="grouped"))


def downgrade() -> None:
    with op.batch_alter_table("connections", schema=None) as batch_op:
        batch_op.drop_column("settle")
