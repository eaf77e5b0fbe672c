"""initial schema

Revision ID: 0001
Revises:
Create Date: 2026-12-02 20:06:04.970618
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "connections",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("name", sa.String(length=200), nullable=False),
        sa.Column("driver", sa.String(length=200), nullable=True),
        sa.Column("status", sa.String(length=20), nullable=False),
        sa.Column("base_url", sa.String(length=2000), nullable=True),
        sa.Column("token_env", sa.String(length=200), nullable=True),
        sa.Column("timeout_seconds", sa.Float(), nullable=False),
        sa.Column("id_field", sa.String(length=200), nullable=False),
        sa.Column("breaker_fail_max", sa.Integer(), nullable=False),
        sa.Column("breaker_reset_seconds", sa.Float(), nullable=False),
        sa.Column("created_at", sa.DateTime(), nullable=False),
        sa.Column("updated_at", sa.DateTime(), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_connections")),
        sa.UniqueConstraint("name", name=op.f("uq_connections_name")),
    )
    op.create_table(
        "breaker_states",
        sa.Column("connection_id", sa.Integer(), nullable=False),
        sa.Column("state", sa.String(length=20), nullable=False),
        sa.Column("fail_counter", sa.Integer(), nullable=False),
        sa.Column("success_counter", sa.Integer(), nullable=False),
        sa.Column("opened_at", sa.DateTime(), nullable=True),
        sa.ForeignKeyConstraint(
            ["connection_id"], ["connections.id"], name=op.f("fk_breaker_states_connection_id_connections")
        ),
        sa.PrimaryKeyConstraint("connection_id", name=op.f("pk_breaker_states")),
    )
    op.create_table(
        "mirror_records",
        sa.Column("id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), autoincrement=True, nullable=False),
        sa.Column("source_id", sa.Integer(), nullable=False),
        sa.Column("domain", sa.String(length=200), nullable=False),
        sa.Column("external_id", sa.String(length=500), nullable=False),
        sa.Column("payload", sa.JSON(), nullable=False),
        sa.Column("content_hash", sa.String(length=64), nullable=False),
        sa.Column("deleted", sa.Boolean(), nullable=False),
        sa.Column("changed_at", sa.DateTime(), nullable=False),
        sa.Column("created_at", sa.DateTime(), nullable=False),
        sa.ForeignKeyConstraint(
            ["source_id"], ["connections.id"], name=op.f("fk_mirror_records_source_id_connections")
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_mirror_records")),
        sa.UniqueConstraint(
            "source_id", "domain", "external_id", name=op.f("uq_mirror_records_source_id_domain_external_id")
        ),
    )
    with op.batch_alter_table("mirror_records", schema=None) as batch_op:
        batch_op.create_index(
            batch_op.f("ix_mirror_records_source_id_domain_changed_at_id"),
            ["source_id", "domain", "changed_at", "id"],
            unique=False,
        )

    op.create_table(
        "rules",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("name", sa.String(length=200), nullable=False),
        sa.Column("source_id", sa.Integer(), nullable=False),
        sa.Column("domain", sa.String(length=200), nullable=False),
        sa.Column("target_id", sa.Integer(), nullable=False),
        sa.Column("collection", sa.String(length=500), nullable=False),
        sa.Column("policy", sa.String(length=40), nullable=False),
        sa.Column("batch_size", sa.Integer(), nullable=False),
        sa.Column("overlap_seconds", sa.Integer(), nullable=False),
        sa.Column("max_attempts", sa.Integer(), nullable=False),
        sa.Column("retry_schedule", sa.JSON(), nullable=False),
        sa.Column("fields", sa.JSON(), nullable=True),
        sa.Column("enabled", sa.Boolean(), nullable=False),
        sa.Column("cursor_changed_at", sa.DateTime(), nullable=True),
        sa.Column("cursor_record_id", sa.BigInteger(), nullable=True),
        sa.Column("chain_token", sa.String(length=64), nullable=True),
        sa.Column("created_at", sa.DateTime(), nullable=False),
        sa.Column("updated_at", sa.DateTime(), nullable=False),
        sa.ForeignKeyConstraint(["source_id"], ["connections.id"], name=op.f("fk_rules_source_id_connections")),
        sa.ForeignKeyConstraint(["target_id"], ["connections.id"], name=op.f("fk_rules_target_id_connections")),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_rules")),
        sa.UniqueConstraint("name", name=op.f("uq_rules_name")),
    )
    op.create_table(
        "chains",
        sa.Column("token", sa.String(length=64), nullable=False),
        sa.Column("rule_id", sa.Integer(), nullable=False),
        sa.Column("flow_run_id", sa.String(length=64), nullable=True),
        sa.Column("started_at", sa.DateTime(), nullable=False),
        sa.Column("heartbeat_at", sa.DateTime(), nullable=False),
        sa.Column("ended_at", sa.DateTime(), nullable=True),
        sa.Column("ended_by", sa.String(length=20), nullable=True),
        sa.Column("message", sa.Text(), nullable=True),
        sa.Column("report", sa.JSON(), nullable=True),
        sa.ForeignKeyConstraint(["rule_id"], ["rules.id"], name=op.f("fk_chains_rule_id_rules")),
        sa.PrimaryKeyConstraint("token", name=op.f("pk_chains")),
    )
    with op.batch_alter_table("chains", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_chains_rule_id_started_at"), ["rule_id", "started_at"], unique=False)

    op.create_table(
        "ledger",
        sa.Column("id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), autoincrement=True, nullable=False),
        sa.Column("rule_id", sa.Integer(), nullable=False),
        sa.Column("record_id", sa.BigInteger(), nullable=False),
        sa.Column("status", sa.String(length=20), nullable=False),
        sa.Column("remote_id", sa.String(length=500), nullable=True),
        sa.Column("attempts", sa.Integer(), nullable=False),
        sa.Column("next_attempt_at", sa.DateTime(), nullable=True),
        sa.Column("last_error", sa.Text(), nullable=True),
        sa.Column("settled_changed_at", sa.DateTime(), nullable=True),
        sa.Column("fingerprint", sa.String(length=64), nullable=True),
        sa.Column("create_generation", sa.Integer(), nullable=False),
        sa.Column("created_at", sa.DateTime(), nullable=False),
        sa.Column("updated_at", sa.DateTime(), nullable=False),
        sa.ForeignKeyConstraint(["record_id"], ["mirror_records.id"], name=op.f("fk_ledger_record_id_mirror_records")),
        sa.ForeignKeyConstraint(["rule_id"], ["rules.id"], name=op.f("fk_ledger_rule_id_rules")),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_ledger")),
        sa.UniqueConstraint("rule_id", "record_id", name=op.f("uq_ledger_rule_id_record_id")),
    )
    with op.batch_alter_table("ledger", schema=None) as batch_op:
        batch_op.create_index(
            batch_op.f("ix_ledger_rule_id_status_next_attempt_at_id"),
            ["rule_id", "status", "next_attempt_at", "id"],
            unique=False,
        )


def downgrade() -> None:
    with op.batch_alter_table("ledger", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_ledger_rule_id_status_next_attempt_at_id"))

    op.drop_table("ledger")
    with op.batch_alter_table("chains", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_chains_rule_id_started_at"))

    op.drop_table("chains")
    op.drop_table("rules")
    with op.batch_alter_table("mirror_records", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_mirror_records_source_id_domain_changed_at_id"))

    op.drop_table("mirror_records")
    op.drop_table("breaker_states")
    op.drop_table("connections")
