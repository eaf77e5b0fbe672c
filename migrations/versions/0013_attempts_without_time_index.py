"""delivery_attempts without its index on (at, id): the pruning reads the oldest rows by id, on the
primary key, and every request a record's step makes no longer writes a second index (a
per_record settle's history row cost half as much again with it, docs/performance.md)

Revision ID: 0013
Revises: 0012
Create Date: 2026-12-07 21:00:00
"""

from __future__ import annotations

from alembic import op

revision = "0013"
down_revision = "0012"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.drop_index("ix_delivery_attempts_at_id", table_name="delivery_attempts")


def downgrade() -> None:
    op.create_index("ix_delivery_attempts_at_id", "delivery_attempts", ["at", "id"])
