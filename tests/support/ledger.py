"""The delivery database as tests set it up and compare it: a ledger row as a chain would have left
it, and the rows of the ledger or of every table, to check that something changed nothing."""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any

import sqlalchemy as sa

from delivery.store.tables import ledger_table, metadata
from tests.integration.world import World


def park(world: World, external_id: str, status: str, *, last_error: str = "HTTP 500", updated_at: datetime) -> None:
    """A ledger row as a chain would have left it, for tests about selecting rows (no flow)."""
    rule_id, record_id = world.rule_row()["id"], world.record_id(external_id)
    terminal = status in ("exhausted", "remote_gone")
    with world.engine.begin() as conn:
        conn.execute(
            ledger_table.insert().values(
                rule_id=rule_id,
                record_id=record_id,
                status=status,
                remote_id="r-9" if status == "remote_gone" else None,
                attempts=3 if terminal else 1,
                next_attempt_at=None if terminal else updated_at + timedelta(hours=1),
                last_error=last_error,
                settled_changed_at=updated_at,
                fingerprint=None,
                create_generation=0,
                created_at=updated_at,
                updated_at=updated_at,
            )
        )


def snapshot(engine: sa.Engine) -> list[dict[str, Any]]:
    with engine.connect() as conn:
        return [r._asdict() for r in conn.execute(sa.select(ledger_table).order_by(ledger_table.c.id))]


def dump(engine: sa.Engine) -> dict[str, list[tuple[Any, ...]]]:
    with engine.connect() as conn:
        return {
            table.name: [tuple(row) for row in conn.execute(sa.select(table).order_by(*table.primary_key.columns))]
            for table in metadata.sorted_tables
        }
