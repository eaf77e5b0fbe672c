"""A target described in configuration: connections.headers / requests / auth (JSON), rules.nulls,
and oauth_refresh_tokens (a refresh token an OAuth2 token endpoint rotated in)

Revision ID: 0010
Revises: 0009
Create Date: 2026-12-07 10:00:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0010"
down_revision = "0009"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("connections", schema=None) as batch_op:
        batch_op.add_column(sa.Column("headers", sa.JSON(), nullable=True))
        batch_op.add_column(sa.Column("requests", sa.JSON(), nullable=True))
        batch_op.add_column(sa.Column("auth", sa.JSON(), nullable=True))
    with op.batch_alter_table("rules", schema=None) as batch_op:
        batch_op.add_column(sa.Column("nulls", sa.String(length=10), server_default="send", nullable=False))
    op.create_table(
        "oauth_refresh_tokens",
        sa.Column("connection_id", sa.Integer(), sa.ForeignKey("connections.id"), primary_key=True),
        sa.Column("refresh_token", sa.Text(), nullable=False),
        sa.Column("updated_at", sa.DateTime(), nullable=False),
    )


def downgrade() -> None:
    op.drop_table("oauth_refresh_tokens")
    with op.batch_alter_table("rules", schema=None) as batch_op:
        batch_op.drop_column("nulls")
    with op.batch_alter_table("connections", schema=None) as batch_op:
        for column in ("auth", "requests", "headers"):
            batch_op.drop_column(column)
