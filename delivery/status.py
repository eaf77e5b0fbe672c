"""The per-rule overview an operator starts from (`delivery status`)."""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any

import sqlalchemy as sa

from delivery.domain import ConnectionStatus, LedgerStatus, Rule
from delivery.store import catalog, chains
from delivery.store import ledger as ledger_store
from delivery.store.breaker import breaker_state
from delivery.store.tables import ledger, mirror_records


def _route(rule: Rule) -> tuple[bool, str]:
    for role, connection in (("source", rule.source), ("target", rule.target)):
        if connection.status is not ConnectionStatus.ACTIVE:
            return False, f"{role} {connection.name} is {connection.status.value}"
    return True, "open"


def _breaker(conn: sa.Connection, rule: Rule, now: datetime) -> str:
    state = breaker_state(conn, rule.target.id)
    if state is None or state["state"] == "closed":
        return "closed" if state is None or not state["fail_counter"] else f"closed ({state['fail_counter']} failures)"
    if state["state"] == "open" and state["opened_at"] is not None:
        until = state["opened_at"] + timedelta(seconds=rule.target.breaker.reset_seconds)
        if until > now:
            return f"open until {until.isoformat(timespec='seconds')}"
        return "open (a trial call is due)"
    return str(state["state"])


def _oldest_undelivered(conn: sa.Connection, rule: Rule) -> datetime | None:
    """The oldest change not yet delivered: the first change past the cursor, or the oldest
    failed row's change, whichever is older. Both are index seeks (LIMIT 1)."""
    candidates = []
    beyond = sa.select(mirror_records.c.changed_at).where(
        mirror_records.c.source_id == rule.source.id,
        mirror_records.c.domain == rule.domain,
        mirror_records.c.deleted.is_(False),
    )
    if rule.cursor is not None:
        beyond = beyond.where(
            sa.tuple_(mirror_records.c.changed_at, mirror_records.c.id)
            > sa.tuple_(
                sa.literal(rule.cursor.changed_at, mirror_records.c.changed_at.type), sa.literal(rule.cursor.record_id)
            )
        )
    first = conn.execute(beyond.order_by(mirror_records.c.changed_at, mirror_records.c.id).limit(1)).scalar()
    if first is not None:
        candidates.append(first)
    failed = conn.execute(
        sa.select(sa.func.min(ledger.c.settled_changed_at)).where(
            ledger.c.rule_id == rule.id, ledger.c.status == LedgerStatus.FAILED.value
        )
    ).scalar()
    if failed is not None:
        candidates.append(failed)
    return min(candidates) if candidates else None


def overview(conn: sa.Connection, now: datetime) -> list[dict[str, Any]]:
    result = []
    for rule in catalog.list_rules(conn):
        route_open, route_why = _route(rule)
        oldest = _oldest_undelivered(conn, rule)
        due = conn.execute(
            sa.select(sa.func.count()).where(
                ledger.c.rule_id == rule.id,
                ledger.c.status == LedgerStatus.FAILED.value,
                ledger.c.next_attempt_at <= sa.literal(now, ledger.c.next_attempt_at.type),
            )
        ).scalar_one()
        last = chains.last_chain(conn, rule.id)
        result.append(
            {
                "rule": rule.name,
                "enabled": rule.enabled,
                "route_open": route_open,
                "route": route_why,
                "breaker": _breaker(conn, rule, now),
                "cursor": rule.cursor.as_json() if rule.cursor else None,
                "cursor_lag_seconds": round((now - oldest).total_seconds(), 1) if oldest else 0.0,
                "counts": ledger_store.counts_by_status(conn, rule.id),
                "due_retries": due,
                "last_chain": None
                if last is None
                else {
                    "started_at": last["started_at"].isoformat(),
                    "ended_at": last["ended_at"].isoformat() if last["ended_at"] else None,
                    "ended_by": last["ended_by"],
                    "message": last["message"],
                    "flow_run_id": last["flow_run_id"],
                },
            }
        )
    return result
