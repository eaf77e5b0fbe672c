"""What the command line lists and sets in the catalog: connections, rules and ledger rows.

A service, as `delivery.requeue` and `delivery.apply` are: `delivery connections`, `rules`, `ledger`,
`connection-status` and `run` call these instead of the store, and an unknown name is refused in one
place (`UnknownName`, exit 2). Each function runs in the caller's connection or transaction."""

from __future__ import annotations

from datetime import datetime
from typing import Any

import sqlalchemy as sa

from delivery.domain import Connection, ConnectionStatus, LedgerStatus, Rule
from delivery.errors import UnknownName
from delivery.status import connection_overview
from delivery.store import catalog, ledger
from delivery.store.catalog import Retirement

__all__ = [
    "Retirement",
    "connection",
    "connections",
    "ledger_rows",
    "rule",
    "rules_with_counts",
    "set_connection_status",
]


def connections(conn: sa.Connection) -> list[Connection]:
    return catalog.list_connections(conn)


def connection(conn: sa.Connection, name: str, now: datetime) -> dict[str, Any]:
    """One connection's status, and as a target its breaker and traffic; UnknownName if none."""
    for overview in connection_overview(conn, now):
        if overview["name"] == name:
            return overview
    raise UnknownName(f"no connection named {name!r}")


def set_connection_status(conn: sa.Connection, name: str, status: ConnectionStatus) -> None:
    catalog.set_connection_status(conn, name, status)


def rule(conn: sa.Connection, name: str) -> Rule:
    return catalog.get_rule(conn, name)


def rules_with_counts(conn: sa.Connection) -> list[tuple[Rule, dict[str, int]]]:
    """Every rule with its ledger rows counted per status."""
    return [(r, ledger.counts_by_status(conn, r.id)) for r in catalog.list_rules(conn)]


def ledger_rows(
    conn: sa.Connection, rule_name: str | None, status: LedgerStatus | None, limit: int | None
) -> list[dict[str, Any]]:
    """Ledger rows, of one rule or all, of one status or all; an unknown rule is refused rather
    than answered with no rows."""
    if rule_name is not None:
        catalog.get_rule(conn, rule_name)
    return ledger.ledger_rows(conn, rule_name, status, limit)
