"""`delivery apply` over saved rules, as an operator runs it (issue 9, points 1 and 5): the retired
ledger rows of a moved rule are reported, in text and with --json, and a file that changes the driver
under a saved rule exits 2 and writes nothing."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from delivery.clock import utcnow
from delivery.domain import MirrorInput
from delivery.store.mirror import load_records
from delivery.store.tables import (
    connections_table,
    ledger_table,
    mirror_records_table,
    retired_ledger_rows_table,
    rules_table,
)
from tests.support.cli import (
    RULE,
    as_json,
    config,
    delivery,
    ok,
    refused,
    set_up,
    table_rows,
    write_yaml,
)


@pytest.fixture
def workdir(tmp_path: Path) -> Path:
    """Not where the SQLite database lives, so a CLI that ignored DELIVERY_DATABASE_URL would show."""
    path = tmp_path / "work"
    path.mkdir()
    return path


def with_shop2(data: dict[str, Any]) -> dict[str, Any]:
    return {**data, "connections": [*data["connections"], {"name": "shop2"}]}


def give_ledger_rows(engine: sa.Engine, source: str, statuses: dict[str, str]) -> None:
    """Ledger rows as chains would have left them, without running one."""
    with engine.begin() as conn:
        load_records(conn, source, "contact", [MirrorInput(i, {"email": f"{i}@example.com"}) for i in statuses])
    with engine.begin() as conn:
        rule_id = conn.execute(sa.select(rules_table.c.id).where(rules_table.c.name == RULE)).scalar_one()
        source_id = conn.execute(
            sa.select(connections_table.c.id).where(connections_table.c.name == source)
        ).scalar_one()
        for external_id, status in statuses.items():
            record_id = conn.execute(
                sa.select(mirror_records_table.c.id).where(
                    mirror_records_table.c.source_id == source_id, mirror_records_table.c.external_id == external_id
                )
            ).scalar_one()
            conn.execute(
                ledger_table.insert().values(
                    rule_id=rule_id,
                    record_id=record_id,
                    status=status,
                    attempts=1 if status == "failed" else 0,
                    create_generation=0,
                    created_at=utcnow(),
                    updated_at=utcnow(),
                )
            )


def test_apply_reports_the_retired_rows_of_a_moved_rule(db_url: str, engine: sa.Engine, workdir: Path) -> None:
    set_up(engine, with_shop2(config()))
    give_ledger_rows(engine, "shop", {"a": "delivered", "b": "failed", "c": "failed"})

    moved = write_yaml(workdir, "moved.yaml", with_shop2(config(rule={"source": "shop2"})))
    # At 80 columns (what Rich assumes of a pipe) the line stays one line, for a script to grep.
    text = ok(delivery("apply", moved, cwd=workdir, env={**os.environ, "COLUMNS": "80"}))
    assert (
        f"retired: rule {RULE}: 3 ledger rows (1 delivered, 2 failed); rule source/domain/target changed "
        "from shop/contact -> crm to shop2/contact -> crm"
    ) in text.stdout
    assert len(table_rows(engine, retired_ledger_rows_table)) == 3 and table_rows(engine, ledger_table) == []
    assert "retired" not in ok(delivery("apply", moved, cwd=workdir)).stdout

    give_ledger_rows(engine, "shop2", {"d": "exhausted"})
    back = write_yaml(workdir, "back.yaml", with_shop2(config()))
    report = as_json(delivery("apply", "--json", back, cwd=workdir))
    assert report == {
        "created": [],
        "updated": [f"rule {RULE}"],
        "unchanged": ["connection crm", "connection shop", "connection shop2"],
        "retired": [
            {
                "rule": RULE,
                "rows": 1,
                "statuses": {"exhausted": 1},
                "reason": "rule source/domain/target changed from shop2/contact -> crm to shop/contact -> crm",
            }
        ],
    }
    assert as_json(delivery("apply", "--json", back, cwd=workdir))["retired"] == []


def test_apply_refuses_a_driver_change_under_a_saved_rule(db_url: str, engine: sa.Engine, workdir: Path) -> None:
    set_up(engine, config())
    before = table_rows(engine, connections_table), table_rows(engine, rules_table)
    only_crm = {"connections": [{**config()["connections"][0], "driver": "rest-create-only"}]}
    refused(
        delivery("apply", write_yaml(workdir, "create-only.yaml", only_crm), cwd=workdir),
        f"error: connections[0].driver: rule {RULE!r} (saved) targets 'crm', whose driver 'rest-create-only' "
        "does not offer the 'update' verb its policy 'create_and_update' needs",
    )
    assert (table_rows(engine, connections_table), table_rows(engine, rules_table)) == before
