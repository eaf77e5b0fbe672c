"""What the command line lists and sets in the catalog: connections, rules and ledger rows.

A service, as `delivery.requeue` and `delivery.apply` are: `delivery connections`, `rules`, `ledger`,
`connection-status` and `run` call these instead of the store, and an unknown name is refused in one
place (`UnknownName`, exit 2). Each function runs in the caller's connection or transaction."""

from __future__ import annotations

from datetime import datetime
from typing import Any

import sqlalchemy as sa

from delivery.domain import Connection, ConnectionStatus, LedgerStatus, Rule
from delivery.errors import InputError, UnknownName
from delivery.status import connection_overview
from delivery.store import attempts, catalog, ledger, traffic
from delivery.store.catalog import Retirement

__all__ = [
    "Retirement",
    "connection",
    "connections",
    "ledger_rows",
    "record_history",
    "resume_target",
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


def resume_target(conn: sa.Connection, name: str, now: datetime) -> dict[str, Any] | None:
    """End connection `name`'s pause by hand now (recorded on its traffic row): what it was
    (`paused_at`, `paused_until`, `reason`), or None when it was not paused. `UnknownName` if none."""
    found = [c for c in catalog.list_connections(conn) if c.name == name]
    if not found:
        raise UnknownName(f"no connection named {name!r}")
    row = traffic.end_pause_by_hand(
        conn, found[0].id, now, f"ended by hand with `delivery connection-status {name} --resume`"
    )
    if row is None:
        return None
    return {"paused_at": row.paused_at, "paused_until": row.paused_until, "reason": row.pause_reason}


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


#: At most this many requests `delivery attempts` lists unless told otherwise, and at most.
DEFAULT_ATTEMPTS = 50
MAX_ATTEMPTS = 10_000


def record_history(conn: sa.Connection, rule_name: str, external_id: str, limit: int) -> dict[str, Any]:
    """A record's ledger row under the rule (None: the rule never wrote one) and the requests
    its steps made, newest first, at most `limit`. `UnknownName` for a rule that does not exist,
    `InputError` for a record its source has not mirrored."""
    found = catalog.get_rule(conn, rule_name)
    record_id = attempts.record_id(conn, found.source.id, found.domain, external_id)
    if record_id is None:
        raise InputError(
            f"record {external_id!r}: source {found.source.name!r} has no such {found.domain!r} record in the mirror"
        )
    rows = ledger.ledger_rows(conn, found.name, external_id=external_id)
    return {
        "rule": found.name,
        "external_id": external_id,
        "ledger": rows[0] if rows else None,
        "attempts": attempts.of_record(conn, found.id, record_id, limit),
    }
