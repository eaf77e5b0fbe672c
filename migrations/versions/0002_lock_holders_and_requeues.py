"""lock holders and requeues

Revision ID: 0002
Revises: 0001
Create Date: 2026-12-02 20:50:26.217604
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "requeues",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("rule_id", sa.Integer(), nullable=False),
        sa.Column("requested_by", sa.String(length=200), nullable=False),
        sa.Column("requested_at", sa.DateTime(), nullable=False),
        sa.Column("criteria", sa.JSON(), nullable=False),
        sa.Column("count", sa.Integer(), nullable=False),
        sa.Column("external_ids", sa.JSON(), nullable=False),
        sa.ForeignKeyConstraint(["rule_id"], ["rules.id"], name=op.f("fk_requeues_rule_id_rules")),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_requeues")),
    )
    with op.batch_alter_table("requeues", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_requeues_rule_id_requested_at"), ["rule_id", "requested_at"], unique=False)

    with op.batch_alter_table("chains", schema=None) as batch_op:
        batch_op.add_column(sa.Column("lease_id", sa.String(length=64), nullable=True))
        batch_op.add_column(sa.Column("holder_host", sa.String(length=255), nullable=True))
        batch_op.add_column(sa.Column("holder_pid", sa.Integer(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("chains", schema=None) as batch_op:
        batch_op.drop_column("holder_pid")
        batch_op.drop_column("holder_host")
        batch_op.drop_column("lease_id")

    with op.batch_alter_table("requeues", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_requeues_rule_id_requested_at"))

    op.drop_table("requeues")
