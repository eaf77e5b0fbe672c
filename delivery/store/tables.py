"""The schema as SQLAlchemy Core tables. Alembic migrations own the database; a test compares
`alembic upgrade head` with this metadata so the two cannot drift apart."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Dialect

metadata = sa.MetaData(
    naming_convention={
        "ix": "ix_%(table_name)s_%(column_0_N_name)s",
        "uq": "uq_%(table_name)s_%(column_0_N_name)s",
        "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
        "pk": "pk_%(table_name)s",
        "ck": "ck_%(table_name)s_%(constraint_name)s",
    }
)

# SQLite can only alias the rowid with INTEGER, so big ids are BIGINT on PostgreSQL alone.
BigId = sa.BigInteger().with_variant(sa.Integer(), "sqlite")


class UTCDateTime(sa.TypeDecorator[datetime]):
    """Naive UTC in the database (the same on SQLite and PostgreSQL), aware UTC in Python.
    SQLite stores it as fixed-width text, so comparisons and keyset order stay correct."""

    impl = sa.DateTime(timezone=False)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            raise ValueError("naive datetime given to a UTC column")
        return value.astimezone(UTC).replace(tzinfo=None)

    def process_result_value(self, value: Any, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        return value.replace(tzinfo=UTC)  # type: ignore[no-any-return]


connections_table = sa.Table(
    "connections",
    metadata,
    sa.Column("id", sa.Integer, primary_key=True),
    sa.Column("name", sa.String(200), nullable=False, unique=True),
    sa.Column("driver", sa.String(200)),
    sa.Column("status", sa.String(20), nullable=False),
    sa.Column("base_url", sa.String(2000)),
    sa.Column("token_env", sa.String(200)),
    sa.Column("timeout_seconds", sa.Float, nullable=False),
    sa.Column("id_field", sa.String(200), nullable=False),
    sa.Column("breaker_fail_max", sa.Integer, nullable=False),
    sa.Column("breaker_reset_seconds", sa.Float, nullable=False),
    sa.Column("created_at", UTCDateTime, nullable=False),
    sa.Column("updated_at", UTCDateTime, nullable=False),
    # The Prefect Secret block holding the token (the name only: the value is read per chain).
    sa.Column("token_secret", sa.String(200)),
    # How chains delivering to this connection commit their ledger writes: grouped or per_record.
    sa.Column("settle", sa.String(20), nullable=False, server_default="grouped"),
    # What an HTTP 403 from this target means: `token` (the token may not write: a fault of the
    # rule, like a 401) or `record` (this record is refused: a fault of the record).
    sa.Column("forbidden", sa.String(20), nullable=False, server_default="token"),
    # As a target: its request budget (null: none), the cap on a Retry-After pause, its batch endpoints.
    sa.Column("rate_per_second", sa.Float),
    sa.Column("rate_per_day", sa.Integer),
    sa.Column("max_pause_seconds", sa.Float, nullable=False, server_default="900"),
    sa.Column("batch_create_path", sa.String(500)),
    sa.Column("batch_update_path", sa.String(500)),
    sa.Column("batch_delete_path", sa.String(500)),
    sa.Column("batch_max_items", sa.Integer),
    # As a target described in configuration: headers for every request, each verb's request
    # (method, path and body templates), how it authenticates (kinds and secret sources, never a value).
    sa.Column("headers", sa.JSON),
    sa.Column("requests", sa.JSON),
    sa.Column("auth", sa.JSON),
)

mirror_records_table = sa.Table(
    "mirror_records",
    metadata,
    sa.Column("id", BigId, primary_key=True, autoincrement=True),
    sa.Column("source_id", sa.Integer, sa.ForeignKey("connections.id"), nullable=False),
    sa.Column("domain", sa.String(200), nullable=False),
    sa.Column("external_id", sa.String(500), nullable=False),
    sa.Column("payload", sa.JSON, nullable=False),
    # Digest of payload + deleted flag: tells a real change from a re-load without reading payloads.
    sa.Column("content_hash", sa.String(64), nullable=False),
    sa.Column("deleted", sa.Boolean, nullable=False),
    sa.Column("changed_at", UTCDateTime, nullable=False),
    sa.Column("created_at", UTCDateTime, nullable=False),
    sa.UniqueConstraint("source_id", "domain", "external_id"),
    # The scan: one rule's source+domain in (changed_at, id) order, an index seek from the cursor.
    sa.Index(None, "source_id", "domain", "changed_at", "id"),
)

rules_table = sa.Table(
    "rules",
    metadata,
    sa.Column("id", sa.Integer, primary_key=True),
    sa.Column("name", sa.String(200), nullable=False, unique=True),
    sa.Column("source_id", sa.Integer, sa.ForeignKey("connections.id"), nullable=False),
    sa.Column("domain", sa.String(200), nullable=False),
    sa.Column("target_id", sa.Integer, sa.ForeignKey("connections.id"), nullable=False),
    sa.Column("collection", sa.String(500), nullable=False),
    sa.Column("policy", sa.String(40), nullable=False),
    sa.Column("batch_size", sa.Integer, nullable=False),
    sa.Column("overlap_seconds", sa.Integer, nullable=False),
    sa.Column("max_attempts", sa.Integer, nullable=False),
    sa.Column("retry_schedule", sa.JSON, nullable=False),
    sa.Column("fields", sa.JSON),
    sa.Column("enabled", sa.Boolean, nullable=False),
    # Writes in flight at once within a batch (each record still settles on its own).
    sa.Column("concurrency", sa.Integer, nullable=False, server_default="1"),
    sa.Column("cursor_changed_at", UTCDateTime),
    sa.Column("cursor_record_id", sa.BigInteger),
    # The fence: only the chain holding this token may write for the rule.
    sa.Column("chain_token", sa.String(64)),
    # Part of every Idempotency-Key: moved on each change of the rule's source or domain, so a
    # record of the new source never sends a key the old source's record of that id once sent.
    sa.Column("key_epoch", sa.Integer, nullable=False, server_default="0"),
    # A mapped field whose value is null: `send` it (clearing the target's value) or `skip` it.
    sa.Column("nulls", sa.String(10), nullable=False, server_default="send"),
    # What a record deleted in the source does (`ignore`, `propagate`), and the chain's guard.
    sa.Column("deletes", sa.String(20), nullable=False, server_default="ignore"),
    sa.Column("max_deletes_per_chain", sa.Integer, nullable=False, server_default="100"),
    sa.Column("created_at", UTCDateTime, nullable=False),
    sa.Column("updated_at", UTCDateTime, nullable=False),
)

ledger_table = sa.Table(
    "ledger",
    metadata,
    sa.Column("id", BigId, primary_key=True, autoincrement=True),
    sa.Column("rule_id", sa.Integer, sa.ForeignKey("rules.id"), nullable=False),
    sa.Column("record_id", sa.BigInteger, sa.ForeignKey("mirror_records.id"), nullable=False),
    sa.Column("status", sa.String(20), nullable=False),
    sa.Column("remote_id", sa.String(500)),
    sa.Column("attempts", sa.Integer, nullable=False),
    sa.Column("next_attempt_at", UTCDateTime),
    sa.Column("last_error", sa.Text),
    sa.Column("settled_changed_at", UTCDateTime),
    sa.Column("fingerprint", sa.String(64)),
    sa.Column("create_generation", sa.Integer, nullable=False),
    # Moves with every write of the row: a settle or a requeue writes only the version it read,
    # so neither overwrites the other unseen.
    sa.Column("version", sa.Integer, nullable=False, server_default="0"),
    # The digest of the first body sent under the row's current Idempotency-Key (written before
    # the create goes out). A key-honouring target keeps that first body, so a later create under
    # the same key with another body is followed by an update.
    sa.Column("create_fingerprint", sa.String(64)),
    # A write to the record may have reached the target without its answer being recorded (a
    # timeout, a dropped connection, a cut or a crash between send and settle): what the target
    # holds is unknown, so the next offer is sent whatever its body. Set before the write goes out.
    sa.Column("in_doubt", sa.Boolean, nullable=False, server_default=sa.false()),
    # A delete of remote_id went out, its answer not recorded (see LedgerRow.deleting).
    sa.Column("deleting", sa.Boolean, nullable=False, server_default=sa.false()),
    sa.Column("created_at", UTCDateTime, nullable=False),
    sa.Column("updated_at", UTCDateTime, nullable=False),
    sa.UniqueConstraint("rule_id", "record_id"),
    # The drain (failed rows due, oldest first) and the per-status counts.
    sa.Index(None, "rule_id", "status", "next_attempt_at", "id"),
    # A rule's parked set, latest change first (the `parked-RULE` artifact), and rows of a status
    # changed since a time (a chain's records artifact, `delivery requeue --since`).
    sa.Index(None, "rule_id", "status", "updated_at", "id"),
)

attempts_table = sa.Table(
    # Every request a record's step made, written with the settle it belongs to (`delivery
    # attempts RULE RECORD`), kept DELIVERY_ATTEMPTS_KEEP_DAYS days (the tick prunes older ones).
    "delivery_attempts",
    metadata,
    sa.Column("id", BigId, primary_key=True, autoincrement=True),
    sa.Column("rule_id", sa.Integer, nullable=False),
    sa.Column("record_id", sa.BigInteger, nullable=False),
    sa.Column("at", UTCDateTime, nullable=False),
    sa.Column("chain_run_id", sa.String(64)),
    sa.Column("verb", sa.String(20), nullable=False),
    sa.Column("method", sa.String(10), nullable=False),
    sa.Column("path", sa.String(2000), nullable=False),
    sa.Column("status_code", sa.Integer),
    sa.Column("error", sa.Text),
    sa.Column("duration_ms", sa.Integer, nullable=False),
    sa.Column("answer_excerpt", sa.Text),
    sa.Column("outcome", sa.String(20), nullable=False),
    # One record's history, newest first; and the pruning, oldest first.
    sa.Index(None, "rule_id", "record_id", "at", "id"),
    sa.Index(None, "at", "id"),
)

chains_table = sa.Table(
    "chains",
    metadata,
    sa.Column("token", sa.String(64), primary_key=True),
    sa.Column("rule_id", sa.Integer, sa.ForeignKey("rules.id"), nullable=False),
    sa.Column("flow_run_id", sa.String(64)),
    sa.Column("started_at", UTCDateTime, nullable=False),
    sa.Column("heartbeat_at", UTCDateTime, nullable=False),
    sa.Column("ended_at", UTCDateTime),
    sa.Column("ended_by", sa.String(20)),
    sa.Column("message", sa.Text),
    sa.Column("report", sa.JSON),
    # The holder of the rule lock while one of this chain's jobs runs: the Prefect lease, and the
    # process, so a waiter can tell a holder killed mid-job from one that is merely slow.
    sa.Column("lease_id", sa.String(64)),
    sa.Column("holder_host", sa.String(255)),
    sa.Column("holder_pid", sa.Integer),
    # When the chain's run began to run: at once for a run started by hand; for a run the tick
    # launched, when a worker started it (None while it waits for one).
    sa.Column("running_at", UTCDateTime),
    sa.Index(None, "rule_id", "started_at"),
)

retired_ledger_rows_table = sa.Table(
    # Ledger rows of a rule whose source or domain changed: kept as history, out of the drain's
    # and the scan's way (they address records of a source the rule no longer delivers from).
    "retired_ledger_rows",
    metadata,
    sa.Column("id", BigId, primary_key=True, autoincrement=True),
    sa.Column("rule_id", sa.Integer, sa.ForeignKey("rules.id"), nullable=False),
    sa.Column("record_id", sa.BigInteger, nullable=False),
    sa.Column("source_id", sa.Integer, nullable=False),
    sa.Column("domain", sa.String(200), nullable=False),
    sa.Column("external_id", sa.String(500), nullable=False),
    sa.Column("status", sa.String(20), nullable=False),
    sa.Column("remote_id", sa.String(500)),
    sa.Column("attempts", sa.Integer, nullable=False),
    sa.Column("last_error", sa.Text),
    sa.Column("key_epoch", sa.Integer, nullable=False),
    sa.Column("create_generation", sa.Integer, nullable=False),
    sa.Column("retired_at", UTCDateTime, nullable=False),
    sa.Column("reason", sa.Text, nullable=False),
    sa.Index(None, "rule_id", "retired_at"),
)

requeues_table = sa.Table(
    "requeues",
    metadata,
    sa.Column("id", sa.Integer, primary_key=True),
    sa.Column("rule_id", sa.Integer, sa.ForeignKey("rules.id"), nullable=False),
    sa.Column("requested_by", sa.String(200), nullable=False),
    sa.Column("requested_at", UTCDateTime, nullable=False),
    sa.Column("criteria", sa.JSON, nullable=False),
    sa.Column("count", sa.Integer, nullable=False),
    sa.Column("external_ids", sa.JSON, nullable=False),
    # The `delivery-requeue` flow run that made it; null for a requeue from the command line.
    sa.Column("flow_run_id", sa.String(64)),
    sa.Index(None, "rule_id", "requested_at"),
)

#: A target's traffic, shared by every rule and worker sending to it: the next moment its rate budget
#: lets a request out (requests are spaced evenly), the UTC day and its count for a daily budget,
#: and a pause a Retry-After asked for. One row per target connection, made when first needed.
target_traffic_table = sa.Table(
    "target_traffic",
    metadata,
    sa.Column("connection_id", sa.Integer, sa.ForeignKey("connections.id"), primary_key=True),
    sa.Column("next_send_at", UTCDateTime),
    sa.Column("day", sa.String(10)),
    sa.Column("day_count", sa.Integer, nullable=False, server_default="0"),
    sa.Column("paused_at", UTCDateTime),
    sa.Column("paused_until", UTCDateTime),
    sa.Column("pause_reason", sa.String(1000)),
    # The last pause an operator ended by hand (`delivery connection-status NAME --resume`).
    sa.Column("resumed_at", UTCDateTime),
    sa.Column("resumed_note", sa.String(1000)),
)

breaker_states_table = sa.Table(
    "breaker_states",
    metadata,
    sa.Column("connection_id", sa.Integer, sa.ForeignKey("connections.id"), primary_key=True),
    sa.Column("state", sa.String(20), nullable=False),
    sa.Column("fail_counter", sa.Integer, nullable=False),
    sa.Column("success_counter", sa.Integer, nullable=False),
    sa.Column("opened_at", UTCDateTime),
)

# The refresh token an OAuth2 token endpoint rotated in, per connection: the next process starts
# from it. The configured secret is never copied here; no command shows this table.
oauth_refresh_tokens_table = sa.Table(
    "oauth_refresh_tokens",
    metadata,
    sa.Column("connection_id", sa.Integer, sa.ForeignKey("connections.id"), primary_key=True),
    sa.Column("refresh_token", sa.Text, nullable=False),
    sa.Column("updated_at", UTCDateTime, nullable=False),
)
