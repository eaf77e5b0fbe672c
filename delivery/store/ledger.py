"""The ledger: the drain and scan pages (each an index seek), settling outcomes, and reading rows."""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any

import sqlalchemy as sa
from sqlalchemy.exc import IntegrityError

from delivery.domain import Candidate, Cursor, LedgerRow, LedgerStatus, MirrorRecord, Outcome, Rule
from delivery.errors import LedgerRowConflict
from delivery.store.tables import ledger, mirror_records, rules

_L = [c.label(f"l_{c.name}") for c in ledger.c]
_M = [c.label(f"m_{c.name}") for c in mirror_records.c]
#: Rows the scan offers again once their record's change signal moves.
_REOFFERED = (LedgerStatus.DELIVERED.value, LedgerStatus.SUPPRESSED.value)


def _candidate(row: Any) -> Candidate:
    record = MirrorRecord(
        id=row.m_id,
        source_id=row.m_source_id,
        domain=row.m_domain,
        external_id=row.m_external_id,
        payload=row.m_payload,
        deleted=row.m_deleted,
        changed_at=row.m_changed_at,
    )
    row_ledger = None
    if row.l_id is not None:
        row_ledger = LedgerRow(
            id=row.l_id,
            rule_id=row.l_rule_id,
            record_id=row.l_record_id,
            status=LedgerStatus(row.l_status),
            remote_id=row.l_remote_id,
            attempts=row.l_attempts,
            next_attempt_at=row.l_next_attempt_at,
            last_error=row.l_last_error,
            settled_changed_at=row.l_settled_changed_at,
            fingerprint=row.l_fingerprint,
            create_generation=row.l_create_generation,
        )
    return Candidate(record, row_ledger)


def scan_page(conn: sa.Connection, rule: Rule, after: Cursor | None, limit: int) -> list[Candidate]:
    """The rule's changes after `after` in (changed_at, id) order, skipping what the ledger already
    settled at this change signal, terminal rows and failed rows (the drain owns those)."""
    m, lg = mirror_records, ledger
    query = (
        sa.select(*_M, *_L)
        .select_from(m.outerjoin(lg, sa.and_(lg.c.rule_id == rule.id, lg.c.record_id == m.c.id)))
        .where(
            m.c.source_id == rule.source.id,
            m.c.domain == rule.domain,
            m.c.deleted.is_(False),
            sa.or_(
                lg.c.id.is_(None),
                sa.and_(
                    lg.c.status.in_(_REOFFERED),
                    sa.or_(lg.c.settled_changed_at.is_(None), lg.c.settled_changed_at != m.c.changed_at),
                ),
            ),
        )
        .order_by(m.c.changed_at, m.c.id)
        .limit(limit)
    )
    if after is not None:
        query = query.where(
            sa.tuple_(m.c.changed_at, m.c.id)
            > sa.tuple_(sa.literal(after.changed_at, mirror_records.c.changed_at.type), sa.literal(after.record_id))
        )
    return [_candidate(row) for row in conn.execute(query)]


def scan_start(rule: Rule) -> Cursor | None:
    """Where a chain's scan begins: the cursor less the overlap window, which catches changes that
    committed late with a change signal just behind the cursor."""
    if rule.cursor is None:
        return None
    return Cursor(rule.cursor.changed_at - timedelta(seconds=rule.overlap_seconds), -1)


def drain_page(conn: sa.Connection, rule: Rule, due_by: datetime, limit: int) -> list[Candidate]:
    """Failed rows due by the chain's start, oldest due first. Every row a batch attempts lands, or
    is given a time after `due_by`, or turns terminal, so repeating this query ends."""
    m, lg = mirror_records, ledger
    query = (
        sa.select(*_M, *_L)
        .select_from(lg.join(m, m.c.id == lg.c.record_id))
        .where(
            lg.c.rule_id == rule.id,
            lg.c.status == LedgerStatus.FAILED.value,
            lg.c.next_attempt_at <= sa.literal(due_by, ledger.c.next_attempt_at.type),
        )
        .order_by(lg.c.next_attempt_at, lg.c.id)
        .limit(limit)
    )
    return [_candidate(row) for row in conn.execute(query)]


#: Built once: the settle runs once per record, and building a statement costs more Python than
#: the database spends running it.
_INSERT = ledger.insert()
_UPDATE = ledger.update().where(ledger.c.id == sa.bindparam("row_id"))


def settle(conn: sa.Connection, rule: Rule, candidate: Candidate, outcome: Outcome, now: datetime) -> None:
    """Write one record's outcome. The change signal it settles is the one the candidate carried.
    Run in the transaction of the fence check that guards it."""
    values = {
        "status": outcome.status.value,
        "remote_id": outcome.remote_id,
        "attempts": outcome.attempts,
        "next_attempt_at": outcome.next_attempt_at,
        "last_error": outcome.last_error,
        "settled_changed_at": candidate.record.changed_at,
        "fingerprint": outcome.fingerprint,
        "create_generation": outcome.create_generation,
        "updated_at": now,
    }
    if candidate.ledger is None:
        try:
            conn.execute(_INSERT, {"rule_id": rule.id, "record_id": candidate.record.id, "created_at": now, **values})
        except IntegrityError as exc:
            # The scan said there was no row: one that exists all the same is an invariant broken,
            # not a row to overwrite. The whole transaction goes with it (nothing else is in it).
            raise LedgerRowConflict(rule.name, candidate.record.external_id) from exc
    else:
        conn.execute(_UPDATE, {"row_id": candidate.ledger.id, **values})


def settled_since(conn: sa.Connection, rule_id: int, since: datetime) -> int:
    """Rows the rule's chains wrote since `since` (a progress figure, not a hot path)."""
    return int(
        conn.execute(
            sa.select(sa.func.count()).where(
                ledger.c.rule_id == rule_id, ledger.c.updated_at >= sa.literal(since, ledger.c.updated_at.type)
            )
        ).scalar_one()
    )


def counts_by_status(conn: sa.Connection, rule_id: int) -> dict[str, int]:
    rows = conn.execute(
        sa.select(ledger.c.status, sa.func.count()).where(ledger.c.rule_id == rule_id).group_by(ledger.c.status)
    )
    counts = {status.value: 0 for status in LedgerStatus}
    counts.update({status: n for status, n in rows})
    return counts


def ledger_rows(
    conn: sa.Connection, rule: str | None = None, status: LedgerStatus | None = None, limit: int | None = None
) -> list[dict[str, Any]]:
    query = (
        sa.select(
            rules.c.name.label("rule"),
            mirror_records.c.external_id,
            ledger.c.status,
            ledger.c.remote_id,
            ledger.c.attempts,
            ledger.c.next_attempt_at,
            ledger.c.last_error,
            ledger.c.updated_at,
        )
        .select_from(
            ledger.join(rules, rules.c.id == ledger.c.rule_id).join(
                mirror_records, mirror_records.c.id == ledger.c.record_id
            )
        )
        .order_by(rules.c.name, ledger.c.updated_at, ledger.c.id)
    )
    if rule is not None:
        query = query.where(rules.c.name == rule)
    if status is not None:
        query = query.where(ledger.c.status == status.value)
    if limit is not None:
        query = query.limit(limit)
    return [row._asdict() for row in conn.execute(query)]
