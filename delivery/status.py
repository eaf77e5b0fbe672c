"""The per-rule overview an operator starts from (`delivery status`): assembled here from the
store's answers and the decisions made elsewhere (the route in `policy`, the breaker's reopening
in `breaker`), so the overview never disagrees with what a chain would do."""

from __future__ import annotations

from datetime import datetime
from typing import Any

import sqlalchemy as sa

from delivery.breaker import reopens_at
from delivery.domain import LedgerStatus, Rule
from delivery.policy import closed_connection, scan_start
from delivery.store import catalog, chains
from delivery.store import ledger as ledger_store
from delivery.store import status as status_store
from delivery.store.breaker import breaker_state


def _route(rule: Rule) -> tuple[bool, str]:
    closed = closed_connection(rule)
    if closed is None:
        return True, "open"
    role, connection = closed
    return False, f"{role} {connection.name} is {connection.status.value}"


def _breaker(conn: sa.Connection, rule: Rule, now: datetime) -> str:
    state = breaker_state(conn, rule.target.id)
    if state is None or state["state"] == "closed":
        return "closed" if state is None or not state["fail_counter"] else f"closed ({state['fail_counter']} failures)"
    until = reopens_at(state["opened_at"], rule.target.breaker.reset_seconds)
    if state["state"] == "open" and until is not None:
        if until > now:
            return f"open until {until.isoformat(timespec='seconds')}"
        return "open (a trial call is due)"
    return str(state["state"])


def _last_chain(conn: sa.Connection, rule: Rule) -> dict[str, Any] | None:
    last = chains.last_chain(conn, rule.id)
    if last is None:
        return None
    return {
        "started_at": last["started_at"].isoformat(),
        "ended_at": last["ended_at"].isoformat() if last["ended_at"] else None,
        "ended_by": last["ended_by"],
        "message": last["message"],
        "flow_run_id": last["flow_run_id"],
    }


def overview(conn: sa.Connection, now: datetime) -> list[dict[str, Any]]:
    result = []
    for rule in catalog.list_rules(conn):
        route_open, route_why = _route(rule)
        oldest = status_store.oldest_undelivered(conn, rule, scan_start(rule))
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
                "due_retries": status_store.due_retries(conn, rule.id, now),
                "last_chain": _last_chain(conn, rule),
            }
        )
    return result


def last_ending(last: dict[str, Any] | None) -> str:
    """How the rule's last chain ended, in a few words: `running`, `caught_up`, `rule_fault: ...`."""
    if last is None:
        return "-"
    if last["ended_at"] is None:
        return "running"
    return f"{last['ended_by']}: {last['message']}" if last["message"] else str(last["ended_by"])


def flat_rows(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The overview as one flat row per rule, every value a scalar: what the `delivery-status`
    table artifact shows (a table cell cannot hold the nested counts)."""
    flat = []
    for r in rows:
        counts = r["counts"]
        last = r["last_chain"]
        ended_by = None if last is None else ("running" if last["ended_at"] is None else last["ended_by"])
        flat.append(
            {
                "rule": r["rule"],
                "enabled": r["enabled"],
                "route": r["route"],
                "breaker": r["breaker"],
                "cursor_lag_seconds": r["cursor_lag_seconds"],
                **{status.value: counts.get(status.value, 0) for status in LedgerStatus},
                "due_retries": r["due_retries"],
                "last_ended_by": ended_by,
                "last_message": None if last is None else last["message"],
                "last_ended_at": None if last is None else last["ended_at"],
            }
        )
    return flat
