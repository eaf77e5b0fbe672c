"""The ledger's writes for many records in one statement (`record_create_intents`, `settle_many`),
on SQLite and PostgreSQL: what they write is what the one-by-one writes would have written, a row a
requeue moved meanwhile is left to the requeue (and only that one), and a row made where the scan
saw none is the conflict of the record it belongs to, with nothing of the window written."""

from __future__ import annotations

import pytest
import sqlalchemy as sa

from delivery import decisions
from delivery.clock import utcnow
from delivery.domain import Rule
from delivery.errors import LedgerRowConflict
from delivery.store import catalog, ledger
from delivery.store.tables import ledger_table
from tests.integration.world import RULE, World
from tests.support.chains import drive
from tests.target_server import TargetServer


def _rule(engine: sa.Engine) -> Rule:
    with engine.connect() as conn:
        return catalog.get_rule(conn, RULE)


def test_a_groups_outcomes_in_one_statement_leave_a_row_a_requeue_moved_to_the_requeue(
    engine: sa.Engine, target: TargetServer
) -> None:
    world = World(engine, target).apply()
    ids = ["a", "b", "c", "d"]
    world.load(*ids)
    drive(engine, RULE)
    world.load(*ids, name="changed")
    rule = _rule(engine)
    with engine.connect() as conn:
        candidates = ledger.scan_page(conn, rule, None, 10)
    assert [c.record.external_id for c in candidates] == ids
    moved = candidates[1].ledger
    assert moved is not None
    with engine.begin() as conn:  # a requeue's write: the row's version moves
        conn.execute(
            ledger_table.update().where(ledger_table.c.id == moved.id).values(version=ledger_table.c.version + 1)
        )
    outcomes = [
        decisions.delivered(c.ledger, c.ledger.remote_id if c.ledger else None, f"digest-{i}")
        for i, c in enumerate(candidates)
    ]
    with engine.begin() as conn:
        written = ledger.settle_many(conn, rule, list(zip(candidates, outcomes, strict=True)), utcnow())
    assert written == [True, False, True, True]
    with engine.connect() as conn:
        rows = {row.id: row for row in conn.execute(sa.select(ledger_table))}
    fingerprints = {c.record.external_id: rows[c.ledger.id].fingerprint for c in candidates if c.ledger}
    assert fingerprints["a"] == "digest-0" and fingerprints["c"] == "digest-2" and fingerprints["d"] == "digest-3"
    assert fingerprints["b"] != "digest-1"  # the requeue's row, untouched


@pytest.mark.parametrize("conflict", [0, 2])
def test_a_windows_create_intents_in_one_statement_name_the_conflicting_record(
    engine: sa.Engine, target: TargetServer, conflict: int
) -> None:
    world = World(engine, target).apply()
    ids = ["n0", "n1", "n2"]
    world.load(*ids)
    rule = _rule(engine)
    with engine.connect() as conn:
        candidates = ledger.scan_page(conn, rule, None, 10)
    now = utcnow()
    with engine.begin() as conn:  # a row the scan did not see
        ledger.record_create_intent(conn, rule, candidates[conflict], "elsewhere", now)
    creates = [(c, f"digest-{i}", False) for i, c in enumerate(candidates)]
    with pytest.raises(LedgerRowConflict, match=repr(ids[conflict])), engine.begin() as conn:
        ledger.record_create_intents(conn, rule, creates, now)
    assert set(world.ledger()) == {ids[conflict]}  # nothing of the window was written

    with engine.begin() as conn:
        conn.execute(ledger_table.delete())
    with engine.begin() as conn:
        made = ledger.record_create_intents(conn, rule, creates, now)
    assert [row.create_digest if row else None for row in made] == ["digest-0", "digest-1", "digest-2"]
    with engine.connect() as conn:
        stored = {row.id: row.create_fingerprint for row in conn.execute(sa.select(ledger_table))}
    assert {row.id: row.create_digest for row in made if row} == stored
