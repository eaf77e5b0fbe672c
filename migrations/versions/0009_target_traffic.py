"""Traffic control per target: connections.rate_per_second / rate_per_day / max_pause_seconds and
the batch endpoints; target_traffic (the shared rate budget and a Retry-After pause)

Revision ID: 0009
Revises: 0008
Create Date: 2026-12-05 16:30:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0009"
down_revision = "0008"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("connections", schema=None) as batch_op:
        batch_op.add_column(sa.Column("rate_per_second", sa.Float(), nullable=True))
        batch_op.add_column(sa.Column("rate_per_day", sa.Integer(), nullable=True))
        batch_op.add_column(sa.Column("max_pause_seconds", sa.Float(), server_default="900", nullable=False))
        batch_op.add_column(sa.Column("batch_create_path", sa.String(length=500), nullable=True))
        batch_op.add_column(sa.Column("batch_update_path", sa.String(length=500), nullable=True))
        batch_op.add_column(sa.Column("batch_max_items", sa.Integer(), nullable=True))
    op.create_table(
        "target_traffic",
        sa.Column("connection_id", sa.Integer(), sa.ForeignKey("connections.id"), primary_key=True),
        sa.Column("next_send_at", sa.DateTime(), nullable=True),
        sa.Column("day", sa.String(length=10), nullable=True),
        sa.Column("day_count", sa.Integer(), server_default="0", nullable=False),
        sa.Column("paused_at", sa.DateTime(), nullable=True),
        sa.Column("paused_until", sa.DateTime(), nullable=True),
        sa.Column("pause_reason", sa.String(length=1000), nullable=True),
    )


def downgrade() -> None:
    op.drop_table("target_traffic")
    with op.batch_alter_table("connections", schema=None) as batch_op:
        for column in (
            "batch_max_items",
            "batch_update_path",
            "batch_create_path",
            "max_pause_seconds",
            "rate_per_day",
            "rate_per_second",
        ):
            batch_op.drop_column(column)
