"""Putting parked records back: selected ledger rows become due retries, and every requeue is
recorded (who, when, what, how many) so an operator can see it later."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

import sqlalchemy as sa

from delivery.domain import LedgerStatus, Rule
from delivery.store.tables import ledger, mirror_records, requeues, rules

#: Statuses requeued when none is named: the parked (terminal) ones.
DEFAULT_STATUSES = (LedgerStatus.EXHAUSTED, LedgerStatus.REMOTE_GONE)


@dataclass(frozen=True)
class Selection:
    statuses: tuple[LedgerStatus, ...] = DEFAULT_STATUSES
    external_ids: tuple[str, ...] = ()
    error_contains: str | None = None
    since: datetime | None = None

    def as_json(self) -> dict[str, Any]:
        return {
            "statuses": [s.value for s in self.statuses],
            "external_ids": list(self.external_ids),
            "error_contains": self.error_contains,
            "since": self.since.isoformat() if self.since else None,
        }


def _selected(rule: Rule, selection: Selection) -> sa.Select[Any]:
    query = (
        sa.select(
            ledger.c.id,
            mirror_records.c.external_id,
            ledger.c.status,
            ledger.c.remote_id,
            ledger.c.attempts,
            ledger.c.last_error,
            ledger.c.updated_at,
        )
        .join(mirror_records, mirror_records.c.id == ledger.c.record_id)
        .where(ledger.c.rule_id == rule.id, ledger.c.status.in_([s.value for s in selection.statuses]))
        .order_by(ledger.c.updated_at, ledger.c.id)
    )
    if selection.external_ids:
        query = query.where(mirror_records.c.external_id.in_(selection.external_ids))
    if selection.error_contains:
        # LIKE's wildcards in operator input are meant literally.
        escaped = selection.error_contains.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_")
        query = query.where(ledger.c.last_error.like(f"%{escaped}%", escape="\\"))
    if selection.since is not None:
        query = query.where(ledger.c.updated_at >= sa.literal(selection.since, ledger.c.updated_at.type))
    return query


def preview(conn: sa.Connection, rule: Rule, selection: Selection) -> list[dict[str, Any]]:
    return [row._asdict() for row in conn.execute(_selected(rule, selection))]


def requeue(conn: sa.Connection, rule: Rule, selection: Selection, by: str, now: datetime) -> list[dict[str, Any]]:
    """Turn the selected rows into retries due now (attempts reset). A `remote_gone` row also loses
    its remote id and takes a new create generation: the next chain creates the record again, with
    a new Idempotency-Key so the target does not answer with the old, deleted record."""
    rows = preview(conn, rule, selection)
    for row in rows:
        values: dict[str, Any] = {
            "status": LedgerStatus.FAILED.value,
            "attempts": 0,
            "next_attempt_at": now,
            "last_error": f"requeued by {by} (was {row['status']}: {row['last_error'] or '-'})"[:1000],
            "updated_at": now,
        }
        if row["status"] == LedgerStatus.REMOTE_GONE.value:
            values.update(remote_id=None, fingerprint=None, create_generation=ledger.c.create_generation + 1)
        conn.execute(ledger.update().where(ledger.c.id == row["id"]).values(**values))
    if rows:
        conn.execute(
            requeues.insert().values(
                rule_id=rule.id,
                requested_by=by,
                requested_at=now,
                criteria=selection.as_json(),
                count=len(rows),
                external_ids=[r["external_id"] for r in rows],
            )
        )
    return rows


def history(conn: sa.Connection, rule: str | None = None, limit: int = 50) -> list[dict[str, Any]]:
    query = (
        sa.select(
            rules.c.name.label("rule"),
            requeues.c.requested_by,
            requeues.c.requested_at,
            requeues.c.count,
            requeues.c.criteria,
        )
        .join(rules, rules.c.id == requeues.c.rule_id)
        .order_by(requeues.c.requested_at.desc())
        .limit(limit)
    )
    if rule is not None:
        query = query.where(rules.c.name == rule)
    return [row._asdict() for row in conn.execute(query)]
