"""A record's history: delivery_attempts, one row per request a record's step made; and
target_traffic.resumed_at / resumed_note, the last pause an operator ended by hand; chains.running_at,
when a launched chain's run began to run

Revision ID: 0012
Revises: 0011
Create Date: 2026-12-07 13:30:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0012"
down_revision = "0011"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "delivery_attempts",
        sa.Column("id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), primary_key=True, autoincrement=True),
        sa.Column("rule_id", sa.Integer(), nullable=False),
        sa.Column("record_id", sa.BigInteger(), nullable=False),
        sa.Column("at", sa.DateTime(), nullable=False),
        sa.Column("chain_run_id", sa.String(length=64), nullable=True),
        sa.Column("verb", sa.String(length=20), nullable=False),
        sa.Column("method", sa.String(length=10), nullable=False),
        sa.Column("path", sa.String(length=2000), nullable=False),
        sa.Column("status_code", sa.Integer(), nullable=True),
        sa.Column("error", sa.Text(), nullable=True),
        sa.Column("duration_ms", sa.Integer(), nullable=False),
        sa.Column("answer_excerpt", sa.Text(), nullable=True),
        sa.Column("outcome", sa.String(length=20), nullable=False),
    )
    op.create_index(
        "ix_delivery_attempts_rule_id_record_id_at_id", "delivery_attempts", ["rule_id", "record_id", "at", "id"]
    )
    op.create_index("ix_delivery_attempts_at_id", "delivery_attempts", ["at", "id"])
    with op.batch_alter_table("chains", schema=None) as batch_op:
        batch_op.add_column(sa.Column("running_at", sa.DateTime(), nullable=True))
    with op.batch_alter_table("target_traffic", schema=None) as batch_op:
        batch_op.add_column(sa.Column("resumed_at", sa.DateTime(), nullable=True))
        batch_op.add_column(sa.Column("resumed_note", sa.String(length=1000), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("chains", schema=None) as batch_op:
        batch_op.drop_column("running_at")
    with op.batch_alter_table("target_traffic", schema=None) as batch_op:
        batch_op.drop_column("resumed_note")
        batch_op.drop_column("resumed_at")
    op.drop_index("ix_delivery_attempts_at_id", table_name="delivery_attempts")
    op.drop_index("ix_delivery_attempts_rule_id_record_id_at_id", table_name="delivery_attempts")
    op.drop_table("delivery_attempts")
