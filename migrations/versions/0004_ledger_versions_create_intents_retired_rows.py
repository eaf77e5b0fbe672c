"""ledger row versions, create intents, key epochs, retired ledger rows

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-03 14:15:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("rules", schema=None) as batch_op:
        batch_op.add_column(sa.Column("key_epoch", sa.Integer(), server_default="0", nullable=False))
    with op.batch_alter_table("ledger", schema=None) as batch_op:
        batch_op.add_column(sa.Column("version", sa.Integer(), server_default="0", nullable=False))
        batch_op.add_column(sa.Column("create_fingerprint", sa.String(length=64), nullable=True))
    op.create_table(
        "retired_ledger_rows",
        sa.Column("id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), autoincrement=True, nullable=False),
        sa.Column("rule_id", sa.Integer(), nullable=False),
        sa.Column("record_id", sa.BigInteger(), nullable=False),
        sa.Column("source_id", sa.Integer(), nullable=False),
        sa.Column("domain", sa.String(length=200), nullable=False),
        sa.Column("external_id", sa.String(length=500), nullable=False),
        sa.Column("status", sa.String(length=20), nullable=False),
        sa.Column("remote_id", sa.String(length=500), nullable=True),
        sa.Column("attempts", sa.Integer(), nullable=False),
        sa.Column("last_error", sa.Text(), nullable=True),
        sa.Column("key_epoch", sa.Integer(), nullable=False),
        sa.Column("create_generation", sa.Integer(), nullable=False),
        sa.Column("retired_at", sa.DateTime(), nullable=False),
        sa.Column("reason", sa.Text(), nullable=False),
        sa.ForeignKeyConstraint(["rule_id"], ["rules.id"], name=op.f("fk_retired_ledger_rows_rule_id_rules")),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_retired_ledger_rows")),
    )
    with op.batch_alter_table("retired_ledger_rows", schema=None) as batch_op:
        batch_op.create_index(
            batch_op.f("ix_retired_ledger_rows_rule_id_retired_at"), ["rule_id", "retired_at"], unique=False
        )


def downgrade() -> None:
    with op.batch_alter_table("retired_ledger_rows", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_retired_ledger_rows_rule_id_retired_at"))
    op.drop_table("retired_ledger_rows")
    with op.batch_alter_table("ledger", schema=None) as batch_op:
        batch_op.drop_column("create_fingerprint")
        batch_op.drop_column("version")
    with op.batch_alter_table("rules", schema=None) as batch_op:
        batch_op.drop_column("key_epoch")
