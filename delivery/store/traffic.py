"""A target's traffic in the database: its rate budget and a pause its Retry-After asked for, shared
by every rule, worker and process sending to it (see `delivery.traffic`).

The budget is a schedule of send slots (`delivery.budget`): a sender takes the next slot in one
short transaction that holds the row (FOR UPDATE on PostgreSQL; on SQLite the write transaction's
BEGIN IMMEDIATE) and waits for it outside. So at most one request starts per interval, whoever
sends it, without a list of past sends.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import datetime

import sqlalchemy as sa
from sqlalchemy.exc import IntegrityError

from delivery import budget
from delivery.budget import Held, Slot
from delivery.domain import RateLimit
from delivery.store.tables import target_traffic_table


@dataclass(frozen=True)
class TrafficRow:
    connection_id: int
    next_send_at: datetime | None
    day: str | None
    day_count: int
    paused_at: datetime | None
    paused_until: datetime | None
    pause_reason: str | None
    resumed_at: datetime | None = None
    resumed_note: str | None = None


def ensure_row(engine: sa.Engine, connection_id: int) -> None:
    with engine.begin() as conn:
        found = conn.execute(
            sa.select(target_traffic_table.c.connection_id).where(target_traffic_table.c.connection_id == connection_id)
        ).first()
        if found is None:
            try:
                with conn.begin_nested():
                    conn.execute(target_traffic_table.insert().values(connection_id=connection_id, day_count=0))
            except IntegrityError:
                pass  # another process made it first: one row serves both


def _locked(conn: sa.Connection, connection_id: int) -> TrafficRow:
    query = sa.select(target_traffic_table).where(target_traffic_table.c.connection_id == connection_id)
    if conn.dialect.name == "postgresql":
        query = query.with_for_update()
    return TrafficRow(**conn.execute(query).one()._asdict())


def take_slot(
    conn: sa.Connection, connection_id: int, limit: RateLimit | None, clock: Callable[[], datetime], latest: datetime
) -> Slot | Held:
    """Count one send against the target's budget, at the first moment it allows
    (`delivery.budget.next_slot`), unless that is after `latest` or the target is paused (then
    nothing is counted). Call inside a transaction. The moment is read from `clock` once the row is
    held: a sender that waited for the row (another sender held it) must not be handed a slot for
    a moment that has passed."""
    row = _locked(conn, connection_id)
    ledger = budget.Ledger(row.next_send_at, row.day, row.day_count, row.paused_until, row.pause_reason)
    got, changes = budget.next_slot(ledger, limit, clock(), latest)
    if changes:
        conn.execute(
            target_traffic_table.update().where(target_traffic_table.c.connection_id == connection_id).values(**changes)
        )
    return got


def pause(conn: sa.Connection, connection_id: int, until: datetime, reason: str, now: datetime) -> bool:
    """Pause every send to the target until `until` (a later pause already there stands). Returns
    whether the target was running until now: the pause is news."""
    row = _locked(conn, connection_id)
    running = row.paused_until is None or row.paused_until <= now
    if running:
        values = {"paused_at": now, "paused_until": until, "pause_reason": reason}
    elif row.paused_until is not None and until > row.paused_until:
        values = {"paused_until": until, "pause_reason": reason}
    else:
        return False
    conn.execute(
        target_traffic_table.update().where(target_traffic_table.c.connection_id == connection_id).values(**values)
    )
    return running


def end_pause(conn: sa.Connection, connection_id: int, now: datetime) -> TrafficRow | None:
    """Clear a pause that is over. Returns the row as it was when this call cleared it (whoever
    clears it says the target resumed), None when there was none to clear."""
    row = conn.execute(
        sa.select(target_traffic_table).where(
            target_traffic_table.c.connection_id == connection_id,
            target_traffic_table.c.paused_until.is_not(None),
            target_traffic_table.c.paused_until <= now,
        )
    ).first()
    if row is None:
        return None
    cleared = conn.execute(
        target_traffic_table.update()
        .where(
            target_traffic_table.c.connection_id == connection_id,
            target_traffic_table.c.paused_until == row.paused_until,
        )
        .values(paused_until=None, paused_at=None, pause_reason=None)
    )
    return TrafficRow(**row._asdict()) if cleared.rowcount == 1 else None


def end_pause_by_hand(conn: sa.Connection, connection_id: int, now: datetime, note: str) -> TrafficRow | None:
    """End the target's pause now, whether it is over or not, recording when and `note`. Returns
    the row as it was, or None when the target was not paused."""
    row = conn.execute(
        sa.select(target_traffic_table).where(
            target_traffic_table.c.connection_id == connection_id,
            target_traffic_table.c.paused_until.is_not(None),
            target_traffic_table.c.paused_until > now,
        )
    ).first()
    if row is None:
        return None
    conn.execute(
        target_traffic_table.update()
        .where(target_traffic_table.c.connection_id == connection_id)
        .values(paused_until=None, paused_at=None, pause_reason=None, resumed_at=now, resumed_note=note[:1000])
    )
    return TrafficRow(**row._asdict())


def paused_until(conn: sa.Connection, connection_id: int, now: datetime) -> TrafficRow | None:
    """The target's row while it is paused now, else None."""
    row = conn.execute(
        sa.select(target_traffic_table).where(
            target_traffic_table.c.connection_id == connection_id, target_traffic_table.c.paused_until > now
        )
    ).first()
    return None if row is None else TrafficRow(**row._asdict())


def traffic_of(conn: sa.Connection, connection_ids: Iterable[int]) -> dict[int, TrafficRow]:
    """The traffic rows of these connections (a target never sent to has none)."""
    ids = list(connection_ids)
    if not ids:
        return {}
    rows = conn.execute(sa.select(target_traffic_table).where(target_traffic_table.c.connection_id.in_(ids)))
    return {row.connection_id: TrafficRow(**row._asdict()) for row in rows}
