"""The schema comes from Alembic, matches the models, and the hot queries are index seeks."""

from __future__ import annotations

from datetime import timedelta

import sqlalchemy as sa
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext

from delivery import db
from delivery.clock import utcnow
from delivery.domain import Connection, ConnectionStatus, Cursor, Policy, Rule
from delivery.store import ledger
from delivery.store.tables import metadata


def test_migrations_produce_exactly_the_models_schema(engine: sa.Engine) -> None:
    with engine.connect() as conn:
        diff = compare_metadata(MigrationContext.configure(conn, opts={"compare_type": True}), metadata)
    assert diff == []
    assert db.current_revision(engine) == db.head_revision(engine) == db.SCHEMA_HEAD


def test_downgrade_to_base_and_upgrade_again(engine: sa.Engine) -> None:
    from alembic import command

    config = db.alembic_config(engine)
    command.downgrade(config, "base")
    assert set(sa.inspect(engine).get_table_names()) <= {"alembic_version"}
    db.ensure_schema(engine)
    assert {"connections", "mirror_records", "rules", "ledger", "chains", "breaker_states"} <= set(
        sa.inspect(engine).get_table_names()
    )


def _rule() -> Rule:
    conn = Connection(1, "c", "rest", ConnectionStatus.ACTIVE)
    return Rule(
        id=1, name="r", source=conn, domain="contact", target=conn, collection="x",
        policy=Policy.CREATE_AND_UPDATE, batch_size=100, overlap_seconds=300, max_attempts=5,
        retry_schedule_seconds=(60,), fields=None, enabled=True, cursor=None,
    )  # fmt: skip


def _plan(engine: sa.Engine, query: sa.Select) -> str:  # type: ignore[type-arg]
    compiled = query.compile(engine, compile_kwargs={"literal_binds": True})
    prefix = "EXPLAIN QUERY PLAN " if engine.dialect.name == "sqlite" else "EXPLAIN "
    with engine.connect() as conn:
        if engine.dialect.name == "postgresql":
            conn.exec_driver_sql("SET enable_seqscan = off")  # an empty table would be seq-scanned anyway
        return "\n".join(str(row) for row in conn.exec_driver_sql(prefix + str(compiled)))


def test_scan_and_drain_queries_seek_their_indexes(engine: sa.Engine, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    captured: list[sa.Select] = []  # type: ignore[type-arg]

    class Spy:
        def execute(self, query):  # type: ignore[no-untyped-def]
            captured.append(query)
            return []

    rule = _rule()
    ledger.scan_page(Spy(), rule, Cursor(utcnow() - timedelta(minutes=5), 7), 100)  # type: ignore[arg-type]
    ledger.drain_page(Spy(), rule, utcnow(), 100)  # type: ignore[arg-type]
    scan_plan, drain_plan = (_plan(engine, q) for q in captured)
    assert "ix_mirror_records_source_id_domain_changed_at_id" in scan_plan
    assert "ix_ledger_rule_id_status_next_attempt_at_id" in drain_plan
    # Neither table is ever read whole: each candidate's ledger row is found through an index too.
    for plan in (scan_plan, drain_plan):
        assert "Seq Scan" not in plan
        assert "SCAN mirror_records" not in plan and "SCAN ledger" not in plan
