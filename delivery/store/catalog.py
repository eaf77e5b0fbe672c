"""Connections and rules: reading them as domain values, and saving declared ones (`save_config`).
Whether a declaration may be saved is the caller's question (`delivery.apply`), asked first."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import sqlalchemy as sa

from delivery.clock import utcnow
from delivery.domain import (
    AuthSettings,
    BatchEndpoints,
    BatchShape,
    BreakerSettings,
    Connection,
    ConnectionSpec,
    ConnectionStatus,
    Cursor,
    DeletePolicy,
    Forbidden,
    Nulls,
    Policy,
    RateLimit,
    RequestShape,
    Rule,
    RuleSpec,
    SavedRule,
    SettleMode,
)
from delivery.errors import UnknownName
from delivery.store import chains
from delivery.store.tables import (
    connections_table,
    ledger_table,
    mirror_records_table,
    retired_ledger_rows_table,
    rules_table,
)


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
        token_secret=row.token_secret,
        settle=SettleMode(row.settle),
        forbidden=Forbidden(row.forbidden),
        rate_limit=None
        if row.rate_per_second is None and row.rate_per_day is None
        else RateLimit(row.rate_per_second, row.rate_per_day),
        max_pause_seconds=row.max_pause_seconds,
        batch=None
        if row.batch_create_path is None and row.batch_update_path is None and row.batch_delete_path is None
        else BatchEndpoints(
            row.batch_create_path,
            row.batch_update_path,
            row.batch_max_items or 100,
            _batch_shape((row.requests or {}).get("batch_create")),
            _batch_shape((row.requests or {}).get("batch_update")),
            row.batch_delete_path,
            _batch_shape((row.requests or {}).get("batch_delete")),
        ),
        headers=tuple(sorted((row.headers or {}).items())),
        requests=tuple(
            (verb, RequestShape(shape["method"], shape["path"], shape.get("body", "{{ fields }}"), shape.get("id_at")))
            for verb, shape in sorted((row.requests or {}).items())
            if verb in ("create", "update", "delete")
        ),
        auth=None
        if not row.auth
        else AuthSettings(row.auth["kind"], tuple(sorted((row.auth.get("keys") or {}).items()))),
    )


def _batch_shape(stored: dict[str, Any] | None) -> BatchShape | None:
    return None if not stored else BatchShape(**stored)


def _connections_by_id(conn: sa.Connection, ids: set[int]) -> dict[int, Connection]:
    rows = conn.execute(sa.select(connections_table).where(connections_table.c.id.in_(ids)))
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
        key_epoch=row.key_epoch,
        nulls=Nulls(row.nulls),
        deletes=DeletePolicy(row.deletes),
        max_deletes_per_chain=row.max_deletes_per_chain,
    )


def get_rule(conn: sa.Connection, name: str) -> Rule:
    row = conn.execute(sa.select(rules_table).where(rules_table.c.name == name)).one_or_none()
    if row is None:
        raise UnknownName(f"no rule named {name!r}")
    return _rule_from_row(row, _connections_by_id(conn, {row.source_id, row.target_id}))


def list_rules(conn: sa.Connection) -> list[Rule]:
    rows = conn.execute(sa.select(rules_table).order_by(rules_table.c.name)).all()
    by_id = _connections_by_id(conn, {r.source_id for r in rows} | {r.target_id for r in rows})
    return [_rule_from_row(row, by_id) for row in rows]


def list_connections(conn: sa.Connection) -> list[Connection]:
    return [
        connection_from_row(row)
        for row in conn.execute(sa.select(connections_table).order_by(connections_table.c.name))
    ]


def set_connection_status(
    conn: sa.Connection, name: str, status: ConnectionStatus, now: datetime | None = None
) -> None:
    result = conn.execute(
        connections_table.update()
        .where(connections_table.c.name == name)
        .values(status=status.value, updated_at=now or utcnow())
    )
    if result.rowcount == 0:
        raise UnknownName(f"no connection named {name!r}")


@dataclass(frozen=True)
class Retirement:
    """The ledger rows of one rule taken out of play because its route changed under them."""

    rule: str
    rows: int
    statuses: dict[str, int]
    reason: str

    def as_json(self) -> dict[str, Any]:
        return {"rule": self.rule, "rows": self.rows, "statuses": dict(self.statuses), "reason": self.reason}


@dataclass
class ApplyReport:
    created: list[str] = field(default_factory=list)
    updated: list[str] = field(default_factory=list)
    unchanged: list[str] = field(default_factory=list)
    retired: list[Retirement] = field(default_factory=list)

    def as_json(self) -> dict[str, Any]:
        return {
            "created": list(self.created),
            "updated": list(self.updated),
            "unchanged": list(self.unchanged),
            "retired": [retirement.as_json() for retirement in self.retired],
        }


def _upsert(
    conn: sa.Connection,
    table: sa.Table,
    kind: str,
    name: str,
    values: dict[str, Any],
    report: ApplyReport,
    now: datetime,
) -> tuple[int, dict[str, Any] | None]:
    """Insert, or update only what differs (so re-applying a file is a no-op). Returns the id and
    the previous row's values, if there was one."""
    # Locked as read: a concurrent apply compares against what this one writes, not what it read,
    # and (for a rule) no chain claims or settles between the comparison and the retirement.
    existing = conn.execute(sa.select(table).where(table.c.name == name).with_for_update(key_share=True)).one_or_none()
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


def connection_drivers(conn: sa.Connection) -> dict[str, str | None]:
    """Every saved connection's driver by name, for the save-time checks."""
    return {
        row.name: row.driver for row in conn.execute(sa.select(connections_table.c.name, connections_table.c.driver))
    }


def saved_rules(conn: sa.Connection) -> list[SavedRule]:
    """Every saved rule, as much of it as the save-time checks read."""
    target = connections_table.alias("target")
    rows = conn.execute(
        sa.select(rules_table.c.name, target.c.name.label("target"), rules_table.c.policy, rules_table.c.deletes).join(
            target, target.c.id == rules_table.c.target_id
        )
    )
    return [SavedRule(row.name, row.target, Policy(row.policy), DeletePolicy(row.deletes)) for row in rows]


def _route_text(names: dict[int, str], source_id: int, domain: str, target_id: int) -> str:
    return f"{names[source_id]}/{domain} -> {names[target_id]}"


def retire_ledger(conn: sa.Connection, rule_id: int, key_epoch: int, now: datetime, reason: str) -> dict[str, int]:
    """Move every ledger row of the rule into `retired_ledger_rows`, set-wise (a rule can have
    millions of rows), and return how many there were per status. The caller holds the rule row."""
    statuses = {
        str(status): int(count)
        for status, count in conn.execute(
            sa.select(ledger_table.c.status, sa.func.count())
            .where(ledger_table.c.rule_id == rule_id)
            .group_by(ledger_table.c.status)
        )
    }
    if not statuses:
        return {}
    moved = (
        sa.select(
            ledger_table.c.rule_id,
            ledger_table.c.record_id,
            mirror_records_table.c.source_id,
            mirror_records_table.c.domain,
            mirror_records_table.c.external_id,
            ledger_table.c.status,
            ledger_table.c.remote_id,
            ledger_table.c.attempts,
            ledger_table.c.last_error,
            sa.literal(key_epoch, sa.Integer()),
            ledger_table.c.create_generation,
            sa.literal(now, retired_ledger_rows_table.c.retired_at.type),
            sa.literal(reason, sa.Text()),
        )
        .join(mirror_records_table, mirror_records_table.c.id == ledger_table.c.record_id)
        .where(ledger_table.c.rule_id == rule_id)
    )
    conn.execute(
        retired_ledger_rows_table.insert().from_select(
            [
                "rule_id",
                "record_id",
                "source_id",
                "domain",
                "external_id",
                "status",
                "remote_id",
                "attempts",
                "last_error",
                "key_epoch",
                "create_generation",
                "retired_at",
                "reason",
            ],
            moved,
        )
    )
    conn.execute(ledger_table.delete().where(ledger_table.c.rule_id == rule_id))
    return statuses


def _move_route(
    conn: sa.Connection, rule_name: str, rule_id: int, before: dict[str, Any], values: dict[str, Any], now: datetime
) -> Retirement:
    """A rule whose source, domain or target changed starts over on its new route. Its ledger
    rows address records of the old source (the drain would offer them and fail the chain) and
    remote ids in the old target (patching them on another system writes into the wrong records):
    they are retired. The key epoch moves so the new source's `c-1` never sends the key the old
    `c-1` used; the cursor, a position in the old source's changes, is reset; the rule's chains
    are superseded, so a chain still running with the old rule writes nothing more."""
    ids = {before["source_id"], before["target_id"], values["source_id"], values["target_id"]}
    names: dict[int, str] = {
        row.id: row.name
        for row in conn.execute(
            sa.select(connections_table.c.id, connections_table.c.name).where(connections_table.c.id.in_(ids))
        )
    }
    old = _route_text(names, before["source_id"], before["domain"], before["target_id"])
    new = _route_text(names, values["source_id"], values["domain"], values["target_id"])
    reason = f"rule source/domain/target changed from {old} to {new}"
    # Re-read under the lock `_upsert` took: a chain may have claimed the rule since `before`.
    current = conn.execute(
        sa.select(rules_table.c.chain_token, rules_table.c.key_epoch).where(rules_table.c.id == rule_id)
    ).one()
    statuses = retire_ledger(conn, rule_id, current.key_epoch, now, reason)
    conn.execute(
        rules_table.update()
        .where(rules_table.c.id == rule_id)
        .values(cursor_changed_at=None, cursor_record_id=None, key_epoch=current.key_epoch + 1)
    )
    # Every chain not ended yet, not only the one holding the fence: a chain that has read the
    # old rule but not yet claimed it (its first job waiting for the lock) must not claim it now.
    tokens = {chain.token for chain in chains.open_chains(conn, rule_id)}
    if current.chain_token is not None:
        tokens.add(current.chain_token)
    for token in sorted(tokens):
        chains.supersede(conn, rule_id, token, now, f"superseded: {reason}")
    return Retirement(rule_name, sum(statuses.values()), statuses, reason)


def _route_of(values: dict[str, Any]) -> tuple[Any, Any, Any]:
    return values["source_id"], values["domain"], values["target_id"]


def save_config(
    conn: sa.Connection,
    declared_connections: Sequence[ConnectionSpec],
    declared_rules: Sequence[RuleSpec],
    now: datetime | None = None,
) -> ApplyReport:
    """Upsert every declared connection, then every declared rule, inside the caller's transaction,
    stamped `now` (the system's time if not given). Nothing here checks that they may be saved: the
    caller does, in the same transaction, first."""
    now = now or utcnow()
    report = ApplyReport()
    ids: dict[str, int] = {}
    for c in declared_connections:
        values: dict[str, Any] = {
            "driver": c.driver,
            "base_url": c.base_url,
            "token_env": c.token_env,
            "token_secret": c.token_secret,
            "settle": c.settle.value,
            "forbidden": c.forbidden.value,
            "timeout_seconds": c.timeout_seconds,
            "id_field": c.id_field,
            "breaker_fail_max": c.breaker.fail_max,
            "breaker_reset_seconds": c.breaker.reset_seconds,
            "rate_per_second": c.rate_limit.per_second if c.rate_limit else None,
            "rate_per_day": c.rate_limit.per_day if c.rate_limit else None,
            "max_pause_seconds": c.max_pause_seconds,
            "batch_create_path": c.batch.create_path if c.batch else None,
            "batch_update_path": c.batch.update_path if c.batch else None,
            "batch_delete_path": c.batch.delete_path if c.batch else None,
            "batch_max_items": c.batch.max_items if c.batch else None,
            "headers": dict(c.headers) or None,
            "requests": {
                **{
                    verb: {"method": shape.method, "path": shape.path, "body": shape.body, "id_at": shape.id_at}
                    for verb, shape in c.requests
                },
                **{
                    f"batch_{verb}": dataclasses.asdict(shape)
                    for verb, shape in (
                        ("create", c.batch.create_shape if c.batch else None),
                        ("update", c.batch.update_shape if c.batch else None),
                        ("delete", c.batch.delete_shape if c.batch else None),
                    )
                    if shape is not None
                },
            }
            or None,
            "auth": None if c.auth is None else {"kind": c.auth.kind, "keys": dict(c.auth.keys)},
        }
        exists = conn.execute(sa.select(connections_table.c.id).where(connections_table.c.name == c.name)).scalar()
        if c.status is not None or exists is None:
            values["status"] = (c.status or ConnectionStatus.ACTIVE).value
        ids[c.name], _ = _upsert(conn, connections_table, "connection", c.name, values, report, now)
    missing = {r.source for r in declared_rules} | {r.target for r in declared_rules}
    for name, conn_id in conn.execute(
        sa.select(connections_table.c.name, connections_table.c.id).where(
            connections_table.c.name.in_(missing - ids.keys())
        )
    ):
        ids[name] = conn_id

    for r in declared_rules:
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
            "nulls": r.nulls.value,
            "deletes": r.deletes.value,
            "max_deletes_per_chain": r.max_deletes_per_chain,
        }
        rule_id, before = _upsert(conn, rules_table, "rule", r.name, values, report, now)
        if before is not None and _route_of(before) != _route_of(values):
            report.retired.append(_move_route(conn, r.name, rule_id, before, values, now))
    return report
