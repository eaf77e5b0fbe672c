"""Connections and rules: reading them as domain values, and upserting them from a config."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import sqlalchemy as sa

from delivery.clock import utcnow
from delivery.config import DeliveryConfig, check_rules
from delivery.domain import BreakerSettings, Connection, ConnectionStatus, Cursor, Policy, Rule
from delivery.errors import UnknownName
from delivery.store.tables import connections, rules


def connection_from_row(row: Any) -> Connection:
    return Connection(
        id=row.id,
        name=row.name,
        driver=row.driver,
        status=ConnectionStatus(row.status),
        base_url=row.base_url,
        token_env=row.token_env,
        timeout_seconds=row.timeout_seconds,
        id_field=row.id_field,
        breaker=BreakerSettings(row.breaker_fail_max, row.breaker_reset_seconds),
    )


def _connections_by_id(conn: sa.Connection, ids: set[int]) -> dict[int, Connection]:
    rows = conn.execute(sa.select(connections).where(connections.c.id.in_(ids)))
    return {row.id: connection_from_row(row) for row in rows}


def _rule_from_row(row: Any, by_id: dict[int, Connection]) -> Rule:
    cursor = None
    if row.cursor_changed_at is not None:
        cursor = Cursor(row.cursor_changed_at, int(row.cursor_record_id))
    return Rule(
        id=row.id,
        name=row.name,
        source=by_id[row.source_id],
        domain=row.domain,
        target=by_id[row.target_id],
        collection=row.collection,
        policy=Policy(row.policy),
        batch_size=row.batch_size,
        overlap_seconds=row.overlap_seconds,
        max_attempts=row.max_attempts,
        retry_schedule_seconds=tuple(row.retry_schedule),
        fields=row.fields,
        enabled=row.enabled,
        cursor=cursor,
        concurrency=row.concurrency,
    )


def get_rule(conn: sa.Connection, name: str) -> Rule:
    row = conn.execute(sa.select(rules).where(rules.c.name == name)).one_or_none()
    if row is None:
        raise UnknownName(f"no rule named {name!r}")
    return _rule_from_row(row, _connections_by_id(conn, {row.source_id, row.target_id}))


def list_rules(conn: sa.Connection) -> list[Rule]:
    rows = conn.execute(sa.select(rules).order_by(rules.c.name)).all()
    by_id = _connections_by_id(conn, {r.source_id for r in rows} | {r.target_id for r in rows})
    return [_rule_from_row(row, by_id) for row in rows]


def list_connections(conn: sa.Connection) -> list[Connection]:
    return [connection_from_row(row) for row in conn.execute(sa.select(connections).order_by(connections.c.name))]


def set_connection_status(conn: sa.Connection, name: str, status: ConnectionStatus) -> None:
    result = conn.execute(
        connections.update().where(connections.c.name == name).values(status=status.value, updated_at=utcnow())
    )
    if result.rowcount == 0:
        raise UnknownName(f"no connection named {name!r}")


@dataclass
class ApplyReport:
    created: list[str] = field(default_factory=list)
    updated: list[str] = field(default_factory=list)
    unchanged: list[str] = field(default_factory=list)


def _upsert(
    conn: sa.Connection, table: sa.Table, kind: str, name: str, values: dict[str, Any], report: ApplyReport
) -> tuple[int, dict[str, Any] | None]:
    """Insert, or update only what differs (so re-applying a file is a no-op). Returns the id and
    the previous row's values, if there was one."""
    existing = conn.execute(sa.select(table).where(table.c.name == name)).one_or_none()
    now = utcnow()
    if existing is None:
        new_id = conn.execute(
            table.insert().values(name=name, created_at=now, updated_at=now, **values)
        ).inserted_primary_key
        report.created.append(f"{kind} {name}")
        assert new_id is not None
        return int(new_id[0]), None
    before = existing._asdict()
    changed = {key: value for key, value in values.items() if before[key] != value}
    if changed:
        conn.execute(table.update().where(table.c.id == existing.id).values(updated_at=now, **changed))
        report.updated.append(f"{kind} {name}")
    else:
        report.unchanged.append(f"{kind} {name}")
    return int(existing.id), before


def apply_config(conn: sa.Connection, config: DeliveryConfig) -> ApplyReport:
    """Upsert every connection and rule of `config` inside the caller's transaction, after the
    save-time checks; a refused config raises `ConfigError` before anything is written."""
    known = {row.name: row.driver for row in conn.execute(sa.select(connections.c.name, connections.c.driver))}
    known.update({c.name: c.driver for c in config.connections})
    check_rules(config, known)

    report = ApplyReport()
    ids: dict[str, int] = {}
    for c in config.connections:
        values: dict[str, Any] = {
            "driver": c.driver,
            "base_url": c.base_url,
            "token_env": c.token_env,
            "timeout_seconds": c.timeout_seconds,
            "id_field": c.id_field,
            "breaker_fail_max": c.breaker.fail_max,
            "breaker_reset_seconds": c.breaker.reset_seconds,
        }
        exists = conn.execute(sa.select(connections.c.id).where(connections.c.name == c.name)).scalar()
        if c.status is not None or exists is None:
            values["status"] = (c.status or ConnectionStatus.ACTIVE).value
        ids[c.name], _ = _upsert(conn, connections, "connection", c.name, values, report)
    missing = {r.source for r in config.rules} | {r.target for r in config.rules}
    for name, conn_id in conn.execute(
        sa.select(connections.c.name, connections.c.id).where(connections.c.name.in_(missing - ids.keys()))
    ):
        ids[name] = conn_id

    for r in config.rules:
        values = {
            "source_id": ids[r.source],
            "domain": r.domain,
            "target_id": ids[r.target],
            "collection": r.collection,
            "policy": r.policy.value,
            "batch_size": r.batch_size,
            "overlap_seconds": r.overlap_seconds,
            "max_attempts": r.max_attempts,
            "retry_schedule": list(r.retry_schedule_seconds),
            "fields": r.fields,
            "enabled": r.enabled,
            "concurrency": r.concurrency,
        }
        rule_id, before = _upsert(conn, rules, "rule", r.name, values, report)
        if before is not None and (before["source_id"], before["domain"]) != (values["source_id"], r.domain):
            # The cursor is a position in one source+domain's changes; elsewhere it means nothing.
            conn.execute(
                rules.update().where(rules.c.id == rule_id).values(cursor_changed_at=None, cursor_record_id=None)
            )
    return report
