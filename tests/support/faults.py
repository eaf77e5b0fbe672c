"""Faults of the rule as tests set them up behind the chain's back: a route closed, a breaker
left open by an earlier outage, and a writer settling a record between the scan and the chain."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import sqlalchemy as sa

from delivery.clock import utcnow
from delivery.domain import ConnectionStatus
from delivery.store import catalog
from delivery.store.tables import breaker_states_table, ledger_table
from tests.integration.world import RULE, World


def close_route(world: World) -> None:
    with world.engine.begin() as conn:
        catalog.set_connection_status(conn, "crm", ConnectionStatus.ERROR)


def open_breaker(world: World) -> None:
    """The rule's target breaker stored open since now, as a trip leaves it."""
    with world.engine.begin() as conn:
        target_id = catalog.get_rule(conn, RULE).target.id
        conn.execute(sa.delete(breaker_states_table).where(breaker_states_table.c.connection_id == target_id))
        conn.execute(
            breaker_states_table.insert().values(
                connection_id=target_id, state="open", fail_counter=50, success_counter=0, opened_at=utcnow()
            )
        )


def scan_then_race(real: Callable[..., Any]) -> Callable[..., Any]:
    """`ledger.scan_page` (`real`), after which another writer settles each record it returned."""

    def scan(conn: sa.Connection, rule: Any, after: Any, limit: int) -> Any:
        page = real(conn, rule, after, limit)
        for candidate in page:
            conn.execute(
                ledger_table.insert().values(
                    rule_id=rule.id,
                    record_id=candidate.record.id,
                    status="delivered",
                    attempts=0,
                    create_generation=0,
                    created_at=utcnow(),
                    updated_at=utcnow(),
                )
            )
        return page

    return scan
