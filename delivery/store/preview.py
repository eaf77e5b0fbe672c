"""What `delivery.preview` reads: one read-only snapshot of the database, and the scan's first
changes including those the scan passes over. Nothing here writes."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime

import sqlalchemy as sa

from delivery.domain import Candidate, Cursor, LedgerStatus, Rule
from delivery.store.ledger import _candidate, changes_query
from delivery.store.tables import ledger_table, mirror_records_table


@contextmanager
def read_only_snapshot(engine: sa.Engine) -> Iterator[sa.Connection]:
    """One read-only transaction that sees one state of the database throughout, as the other read
    paths open it (`readonly`: on SQLite a deferred BEGIN, never queueing behind a chain's writes).
    The database refuses any write in it: on PostgreSQL the transaction is REPEATABLE READ, READ
    ONLY; on SQLite the connection is `query_only` until the transaction ends."""
    with engine.connect().execution_options(readonly=True) as conn:
        if conn.dialect.name == "postgresql":
            conn.exec_driver_sql("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ, READ ONLY")
            yield conn
            return
        if conn.dialect.name != "sqlite":  # pragma: no cover - the engine runs on these two
            yield conn
            return
        conn.exec_driver_sql("PRAGMA query_only = ON")
        try:
            yield conn
        finally:
            # The connection goes back to the pool: it must write again for its next user, or go.
            try:
                conn.rollback()
                conn.exec_driver_sql("PRAGMA query_only = OFF")
                conn.commit()
            except sa.exc.DBAPIError:
                conn.invalidate()


def scan_changes(
    conn: sa.Connection, rule: Rule, after: Cursor | None, due_by: datetime, limit: int
) -> list[Candidate]:
    """The changes a scan of `rule` from `after` meets, in its (changed_at, id) order: the records
    `ledger.scan_page` offers, and those it passes over, which are deleted records, records whose
    row is terminal and failed rows not due by `due_by`, each only while its ledger row has not
    settled this change signal (as `scan_page` asks of the rows it offers). Failed rows due by
    `due_by` are the drain's (`ledger.drain_page`) and are not here."""
    m, lg = mirror_records_table, ledger_table
    query = changes_query(
        rule,
        after,
        limit,
        sa.or_(
            lg.c.id.is_(None),
            sa.and_(
                sa.or_(lg.c.settled_changed_at.is_(None), lg.c.settled_changed_at != m.c.changed_at),
                sa.or_(
                    lg.c.status != LedgerStatus.FAILED.value,
                    lg.c.next_attempt_at.is_(None),
                    lg.c.next_attempt_at > sa.literal(due_by, ledger_table.c.next_attempt_at.type),
                ),
            ),
        ),
    )
    return [_candidate(row) for row in conn.execute(query)]
