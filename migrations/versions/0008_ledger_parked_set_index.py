"""ledger index (rule_id, status, updated_at, id): a rule's parked set, latest change first

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-12 10:00:00
"""

from __future__ import annotations

from alembic import op

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("ledger", schema=None) as batch_op:
        batch_op.create_index(
            batch_op.f("ix_ledger_rule_id_status_updated_at_id"),
            ["rule_id", "status", "updated_at", "id"],
            unique=False,
        )


def downgrade() -> None:
    with op.batch_alter_table("ledger", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_ledger_rule_id_status_updated_at_id"))
