"""Chains and the fence: the rule row holds the token of the one chain allowed to write for it."""

from __future__ import annotations

import uuid
from datetime import datetime
from typing import Any

import sqlalchemy as sa

from delivery.domain import ChainReport, Cursor
from delivery.store.tables import chains, rules


def start_chain(conn: sa.Connection, rule_id: int, flow_run_id: str | None, now: datetime) -> str:
    """Open a chain and make it the rule's current one; any chain before it is superseded and its
    next write finds the fence closed."""
    token = uuid.uuid4().hex
    conn.execute(
        chains.insert().values(token=token, rule_id=rule_id, flow_run_id=flow_run_id, started_at=now, heartbeat_at=now)
    )
    conn.execute(rules.update().where(rules.c.id == rule_id).values(chain_token=token))
    return token


def holds_fence(conn: sa.Connection, rule_id: int, token: str) -> bool:
    """True while `token` is the rule's current chain. On PostgreSQL the rule row stays locked until
    the caller's transaction ends, so a supersede cannot slip between this check and the writes it
    guards; on SQLite the write transaction (BEGIN IMMEDIATE) already excludes every other writer."""
    current = conn.execute(sa.select(rules.c.chain_token).where(rules.c.id == rule_id).with_for_update()).scalar()
    return current == token


def heartbeat(conn: sa.Connection, token: str, now: datetime) -> None:
    conn.execute(chains.update().where(chains.c.token == token).values(heartbeat_at=now))


def move_cursor(conn: sa.Connection, rule_id: int, to: Cursor) -> Cursor:
    """Move the cursor forward to `to`; never backwards. Returns where it stands."""
    row = conn.execute(
        sa.select(rules.c.cursor_changed_at, rules.c.cursor_record_id).where(rules.c.id == rule_id)
    ).one()
    if row.cursor_changed_at is not None:
        current = Cursor(row.cursor_changed_at, int(row.cursor_record_id))
        if current >= to:
            return current
    conn.execute(
        rules.update()
        .where(rules.c.id == rule_id)
        .values(cursor_changed_at=to.changed_at, cursor_record_id=to.record_id)
    )
    return to


def end_chain(conn: sa.Connection, report: ChainReport, now: datetime) -> None:
    conn.execute(
        chains.update()
        .where(chains.c.token == report.token)
        .values(
            ended_at=now,
            heartbeat_at=now,
            ended_by=report.ended_by.value,
            message=report.message,
            report=report.as_json(),
        )
    )


def chain_by_flow_run(conn: sa.Connection, flow_run_id: str) -> dict[str, Any] | None:
    row = conn.execute(sa.select(chains).where(chains.c.flow_run_id == flow_run_id)).one_or_none()
    return None if row is None else row._asdict()


def last_chain(conn: sa.Connection, rule_id: int) -> dict[str, Any] | None:
    row = conn.execute(
        sa.select(chains).where(chains.c.rule_id == rule_id).order_by(chains.c.started_at.desc()).limit(1)
    ).one_or_none()
    return None if row is None else row._asdict()
