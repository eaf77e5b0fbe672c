"""The queries behind the status overview (`delivery.status`): how far behind a rule is, and how
many of its retries are due. Each is one index seek or one count."""

from __future__ import annotations

from datetime import datetime

import sqlalchemy as sa

from delivery.domain import Cursor, LedgerStatus, Rule
from delivery.store.ledger import scan_page
from delivery.store.tables import ledger_table


def oldest_undelivered(conn: sa.Connection, rule: Rule, scan_from: Cursor | None) -> datetime | None:
    """The oldest change not yet delivered: the first change the scan would deliver from
    `scan_from` (changes settled beyond a cursor that never moved, as a killed chain leaves them,
    are not behind), or the oldest failed row's change, whichever is older. The scan's first page
    of one row and one aggregate over the rule's failed rows."""
    candidates = []
    first = scan_page(conn, rule, scan_from, 1)
    if first:
        candidates.append(first[0].record.changed_at)
    failed = conn.execute(
        sa.select(sa.func.min(ledger_table.c.settled_changed_at)).where(
            ledger_table.c.rule_id == rule.id, ledger_table.c.status == LedgerStatus.FAILED.value
        )
    ).scalar()
    if failed is not None:
        candidates.append(failed)
    return min(candidates) if candidates else None


def due_retries(conn: sa.Connection, rule_id: int, now: datetime) -> int:
    """How many failed rows of the rule the next drain would take."""
    return int(
        conn.execute(
            sa.select(sa.func.count()).where(
                ledger_table.c.rule_id == rule_id,
                ledger_table.c.status == LedgerStatus.FAILED.value,
                ledger_table.c.next_attempt_at <= sa.literal(now, ledger_table.c.next_attempt_at.type),
            )
        ).scalar_one()
    )
