"""Saving a rule over a saved one (issue 9, points 1 and 5), on SQLite and PostgreSQL: a rule whose
source, domain or target changes retires its ledger rows and starts over on its new route, and a
file that changes a connection under a saved rule is checked against what the rule needs."""

from __future__ import annotations

import copy
import threading
from typing import Any

import pytest
import sqlalchemy as sa
import yaml

from delivery.apply import apply_config
from delivery.chain import Chain
from delivery.clock import utcnow
from delivery.config import parse_config
from delivery.domain import ChainEnd, MirrorInput, Phase
from delivery.errors import ConfigError
from delivery.store import catalog, chains
from delivery.store.mirror import load_records
from delivery.store.tables import (
    chains_table,
    connections_table,
    ledger_table,
    mirror_records_table,
    retired_ledger_rows_table,
    rules_table,
)
from tests.integration.locks import wait_for_a_lock_wait
from tests.integration.world import RULE, World, email
from tests.target_server import Answer, TargetServer

MOVED = "rule source/domain/target changed from shop/contact -> crm to shop2/contact -> crm"


def with_connection(config: dict[str, Any], connection: dict[str, Any]) -> dict[str, Any]:
    changed = copy.deepcopy(config)
    changed["connections"].append(connection)
    return changed


def apply(engine: sa.Engine, config: dict[str, Any]) -> catalog.ApplyReport:
    with engine.begin() as conn:
        return apply_config(conn, parse_config(yaml.safe_dump(config)))


def moved_to_shop2(world: World, **rule: Any) -> dict[str, Any]:
    return with_connection(world.config(rule={"source": "shop2", **rule}), {"name": "shop2"})


def load(engine: sa.Engine, source: str, *ids: str) -> None:
    items = [MirrorInput(i, {"email": email(i), "name": f"{source} {i}"}, False) for i in ids]
    with engine.begin() as conn:
        load_records(conn, source, "contact", items)


def rows(engine: sa.Engine, table: sa.Table) -> list[dict[str, Any]]:
    with engine.connect() as conn:
        return [row._asdict() for row in conn.execute(sa.select(table).order_by(table.c.id))]


def connection_id(engine: sa.Engine, name: str) -> int:
    with engine.connect() as conn:
        return int(conn.execute(sa.select(connections_table.c.id).where(connections_table.c.name == name)).scalar_one())


def ledger_sources(engine: sa.Engine) -> dict[str, int]:
    """external id -> source id of every ledger row's record."""
    with engine.connect() as conn:
        query = sa.select(mirror_records_table.c.external_id, mirror_records_table.c.source_id).join(
            ledger_table, ledger_table.c.record_id == mirror_records_table.c.id
        )
        return {row.external_id: row.source_id for row in conn.execute(query)}


def creates_keys(target: TargetServer, external_id: str) -> list[str]:
    return [r.headers["idempotency-key"] for r in target.requests_for(email(external_id)) if r.method == "POST"]


# -- point 1: a rule moved to another source, domain or target ----------------------------------


def test_a_rule_moved_to_a_new_source_retires_the_old_rows_and_delivers_the_new_source(world: World) -> None:
    world.target.program(email("c-1"), Answer.status(500))
    world.load("c-1", "c-2")
    first = world.run()
    assert first["counts"]["delivered"] == 1 and first["counts"]["failed"] == 1
    world.make_due()  # the old source's failed c-1 is what the drain would offer next

    report = apply(world.engine, moved_to_shop2(world))
    load(world.engine, "shop2", "c-1", "c-3")
    result = world.run()

    # Left in the ledger, the old failed row made every chain fail with UnexpectedCandidate.
    assert result["state"] == "COMPLETED" and result["ended_by"] == "caught_up", result["message"]
    assert result["scanned"]["delivered"] == 2 and result["drained"]["failed"] == 0
    shop, shop2 = connection_id(world.engine, "shop"), connection_id(world.engine, "shop2")
    assert ledger_sources(world.engine) == {"c-1": shop2, "c-3": shop2}
    assert [r.as_json() for r in report.retired] == [
        {"rule": RULE, "rows": 2, "statuses": {"delivered": 1, "failed": 1}, "reason": MOVED}
    ]
    retired = rows(world.engine, retired_ledger_rows_table)
    assert {(r["external_id"], r["source_id"], r["domain"], r["status"]) for r in retired} == {
        ("c-1", shop, "contact", "failed"),
        ("c-2", shop, "contact", "delivered"),
    }
    assert {r["key_epoch"] for r in retired} == {0} and {r["reason"] for r in retired} == {MOVED}
    assert all(r["remote_id"] for r in retired if r["status"] == "delivered")
    assert world.rule_row()["key_epoch"] == 1

    # Re-applying the same file is a no-op: nothing more is retired, the epoch stays.
    again = apply(world.engine, moved_to_shop2(world))
    assert again.retired == [] and again.updated == []
    assert len(rows(world.engine, retired_ledger_rows_table)) == 2
    assert set(ledger_sources(world.engine)) == {"c-1", "c-3"}
    assert world.rule_row()["key_epoch"] == 1


def test_the_new_sources_record_does_not_send_the_old_records_idempotency_key(world: World) -> None:
    world.load("c-1")
    world.run()
    apply(world.engine, moved_to_shop2(world))
    load(world.engine, "shop2", "c-1")
    result = world.run()

    assert result["scanned"]["delivered"] == 1, result["message"]
    old_key, new_key = creates_keys(world.target, "c-1")
    assert new_key != old_key
    # Under the old key a key-honouring target would have answered with the old c-1's record,
    # and the new source's c-1 would have been "delivered" into it.
    stored = sorted(r["name"] for r in world.target.records("contacts").values())
    assert stored == ["Name c-1", "shop2 c-1"]
    assert world.ledger()["c-1"]["remote_id"] != rows(world.engine, retired_ledger_rows_table)[0]["remote_id"]


def test_a_rule_moved_to_another_target_creates_there_instead_of_patching_old_remote_ids(world: World) -> None:
    world.load("a")
    world.run()
    old_remote = world.ledger()["a"]["remote_id"]
    crm2 = {**world.config()["connections"][0], "name": "crm2"}
    report = apply(world.engine, with_connection(world.config(rule={"target": "crm2"}), crm2))
    assert [(r.rule, r.rows, r.statuses) for r in report.retired] == [(RULE, 1, {"delivered": 1})]
    assert (
        report.retired[0].reason == "rule source/domain/target changed from shop/contact -> crm to shop/contact -> crm2"
    )

    result = world.run()
    assert result["state"] == "COMPLETED" and result["scanned"]["delivered"] == 1
    assert [r.method for r in world.target.requests] == ["POST", "POST"]
    assert not any(r.path.endswith(f"/{old_remote}") for r in world.target.requests)
    assert world.ledger()["a"]["remote_id"] != old_remote


def test_a_domain_change_retires_every_status_and_resets_the_cursor(world: World) -> None:
    world.load("a", "b", "c")
    ids = {name: world.record_id(name) for name in "abc"}
    rule_id = world.rule_row()["id"]
    with world.engine.begin() as conn:
        now = utcnow()
        for name, status in (("a", "delivered"), ("b", "exhausted"), ("c", "remote_gone")):
            conn.execute(
                ledger_table.insert().values(
                    rule_id=rule_id,
                    record_id=ids[name],
                    status=status,
                    remote_id=f"r-{name}",
                    attempts=2,
                    last_error="boom" if status != "delivered" else None,
                    create_generation=3,
                    created_at=now,
                    updated_at=now,
                )
            )
        conn.execute(rules_table.update().values(cursor_changed_at=now, cursor_record_id=ids["c"], key_epoch=4))
    report = apply(world.engine, world.config(rule={"domain": "lead"}))
    (retirement,) = report.retired
    assert retirement.rows == 3 and retirement.statuses == {"delivered": 1, "exhausted": 1, "remote_gone": 1}
    assert retirement.reason == "rule source/domain/target changed from shop/contact -> crm to shop/lead -> crm"
    assert rows(world.engine, ledger_table) == []
    retired = rows(world.engine, retired_ledger_rows_table)
    assert {
        (r["external_id"], r["remote_id"], r["attempts"], r["create_generation"], r["key_epoch"]) for r in retired
    } == {
        ("a", "r-a", 2, 3, 4),
        ("b", "r-b", 2, 3, 4),
        ("c", "r-c", 2, 3, 4),
    }
    assert all(r["retired_at"] is not None and r["record_id"] == ids[r["external_id"]] for r in retired)
    rule = world.rule_row()
    assert rule["key_epoch"] == 5 and rule["cursor_changed_at"] is None and rule["cursor_record_id"] is None


def test_a_change_that_keeps_the_route_retires_nothing(world: World) -> None:
    world.load("a")
    rule_id, record_id = world.rule_row()["id"], world.record_id("a")
    with world.engine.begin() as conn:
        conn.execute(
            ledger_table.insert().values(
                rule_id=rule_id,
                record_id=record_id,
                status="delivered",
                remote_id="r-a",
                attempts=0,
                create_generation=0,
                created_at=utcnow(),
                updated_at=utcnow(),
            )
        )
    report = apply(world.engine, world.config(rule={"collection": "people", "batch_size": 7}))
    assert report.updated == [f"rule {RULE}"] and report.retired == []
    assert len(rows(world.engine, ledger_table)) == 1 and rows(world.engine, retired_ledger_rows_table) == []
    assert world.rule_row()["key_epoch"] == 0


def test_a_chain_claimed_before_the_move_cannot_write_after_it(world: World) -> None:
    world.apply(rule={"batch_size": 1})
    world.load("a", "b")
    chain = Chain(world.engine, RULE)
    assert chain.open() is None
    first = chain.run_batch(Phase.SCAN)
    assert first.attempted == 1 and world.rule_row()["chain_token"] == chain.token
    sent = len(world.target.requests)

    apply(world.engine, world.config(rule={"batch_size": 1, "domain": "lead"}))
    rule = world.rule_row()
    assert rule["chain_token"] is None
    with world.engine.connect() as conn:
        ended = conn.execute(sa.select(chains_table).where(chains_table.c.token == chain.token)).one()
    assert ended.ended_by == "superseded" and "shop/lead -> crm" in ended.message

    second = chain.run_batch(Phase.SCAN)
    assert second.ended_by is ChainEnd.SUPERSEDED and second.attempted == 0
    assert len(world.target.requests) == sent
    assert rows(world.engine, ledger_table) == []
    assert world.rule_row()["cursor_changed_at"] is None
    # The chain says why it stopped: the move, not "another chain took over" (there is none).
    assert second.message.startswith("chain superseded: rule source/domain/target changed from"), second.message
    chain.finish()
    with world.engine.connect() as conn:
        ended = conn.execute(sa.select(chains_table).where(chains_table.c.token == chain.token)).one()
    assert "shop/lead -> crm" in ended.message and "took over" not in ended.message, ended.message


def test_a_chain_started_before_the_move_but_not_yet_claimed_cannot_claim_after_it(world: World) -> None:
    world.load("a")
    waiting = Chain(world.engine, RULE)  # read the old rule; its first job waits for the lock
    assert waiting.open() is None

    apply(world.engine, world.config(rule={"domain": "lead"}))
    batch = waiting.run_batch(Phase.SCAN)

    assert batch.ended_by is ChainEnd.SUPERSEDED and batch.attempted == 0
    assert world.target.requests == [] and rows(world.engine, ledger_table) == []
    assert world.rule_row()["chain_token"] is None
    with world.engine.connect() as conn:
        ended = conn.execute(sa.select(chains_table).where(chains_table.c.token == waiting.token)).one()
    assert ended.ended_by == "superseded" and "shop/lead -> crm" in ended.message


# -- point 5: a connection changed under a saved rule --------------------------------------------


def test_a_file_that_takes_the_update_verb_from_a_saved_rules_target_is_refused(world: World) -> None:
    before = rows(world.engine, connections_table), rows(world.engine, rules_table)
    changed = {"connections": [{**world.config()["connections"][0], "driver": "rest-create-only"}]}
    with pytest.raises(ConfigError) as caught:
        apply(world.engine, changed)
    assert caught.value.problems == [
        f"connections[0].driver: rule {RULE!r} (saved) targets 'crm', whose driver 'rest-create-only' does not "
        "offer the 'update' verb its policy 'create_and_update' needs"
    ]
    assert (rows(world.engine, connections_table), rows(world.engine, rules_table)) == before


def test_a_file_that_redeclares_a_saved_rules_target_without_a_driver_is_refused(world: World) -> None:
    before = rows(world.engine, connections_table), rows(world.engine, rules_table)
    with pytest.raises(ConfigError) as caught:
        apply(world.engine, {"connections": [{"name": "crm"}]})
    (problem,) = caught.value.problems
    assert problem.startswith(f"connections[0].driver: rule {RULE!r} (saved) targets 'crm'")
    assert "without a driver" in problem and "'create' and 'update' verbs" in problem
    assert "'create_and_update'" in problem
    assert (rows(world.engine, connections_table), rows(world.engine, rules_table)) == before


def test_a_file_that_fixes_the_connection_and_the_rule_together_is_accepted(world: World) -> None:
    fixed = world.config(target={"driver": "rest-create-only"}, rule={"policy": "create_only"})
    report = apply(world.engine, fixed)
    assert report.updated == ["connection crm", f"rule {RULE}"]
    with world.engine.connect() as conn:
        rule = catalog.get_rule(conn, RULE)
    assert rule.target.driver == "rest-create-only" and rule.policy.value == "create_only"


# -- on PostgreSQL, with a settle or another apply in flight ------------------------------------


def _postgresql_only(db_url: str) -> None:
    if not db_url.startswith("postgresql"):
        pytest.skip("row locks are PostgreSQL's: on SQLite BEGIN IMMEDIATE serialises whole transactions")


def _apply_in_thread(engine: sa.Engine, config: dict[str, Any]) -> tuple[threading.Thread, list[Any]]:
    results: list[Any] = []

    def run() -> None:
        try:
            results.append(apply(engine, config))
        except BaseException as exc:  # handed to the test thread
            results.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    return thread, results


@pytest.mark.postgres
def test_on_postgresql_a_move_waits_for_a_settle_in_flight_and_retires_its_row(world: World, db_url: str) -> None:
    _postgresql_only(db_url)
    world.load("b")
    chain = Chain(world.engine, RULE)
    assert chain.open() is None
    rule = chain.rule
    chain.run_batch(Phase.DRAIN)  # claims the rule; nothing is due
    b = world.record_id("b")
    with world.engine.connect() as settle:
        settle.begin()
        # A settle of the claimed chain, between its fence check and its commit.
        assert chains.holds_fence_for_settle(settle, rule.id, chain.token, rule.target.id)[0]
        settle.execute(
            ledger_table.insert().values(
                rule_id=rule.id,
                record_id=b,
                status="delivered",
                remote_id="r-b",
                attempts=0,
                create_generation=0,
                created_at=utcnow(),
                updated_at=utcnow(),
            )
        )
        thread, results = _apply_in_thread(world.engine, world.config(rule={"domain": "lead"}))
        wait_for_a_lock_wait(world.engine, "the apply")
        assert not results  # the move waits for the settle in flight...
        settle.commit()
    thread.join(10)
    (report,) = results
    assert isinstance(report, catalog.ApplyReport), report
    # ...and then retires the row that settle wrote: nothing of the old route stays in play.
    assert [(r.rows, r.statuses) for r in report.retired] == [(1, {"delivered": 1})]
    assert rows(world.engine, ledger_table) == []
    assert world.rule_row()["chain_token"] is None
    assert chain.run_batch(Phase.SCAN).ended_by is ChainEnd.SUPERSEDED


@pytest.mark.postgres
def test_on_postgresql_two_applies_of_one_move_retire_and_bump_the_epoch_once(world: World, db_url: str) -> None:
    _postgresql_only(db_url)
    world.load("a")
    rule_id, record_id = world.rule_row()["id"], world.record_id("a")
    with world.engine.begin() as conn:
        conn.execute(
            ledger_table.insert().values(
                rule_id=rule_id,
                record_id=record_id,
                status="failed",
                attempts=1,
                create_generation=0,
                created_at=utcnow(),
                updated_at=utcnow(),
            )
        )
    moved = world.config(rule={"domain": "lead"})
    with world.engine.connect() as first:
        first.begin()
        first_report = apply_config(first, parse_config(yaml.safe_dump(moved)))
        thread, results = _apply_in_thread(world.engine, moved)
        wait_for_a_lock_wait(world.engine, "the apply")
        assert not results
        first.commit()
    thread.join(10)
    (second_report,) = results
    assert isinstance(second_report, catalog.ApplyReport), second_report
    assert [r.rows for r in first_report.retired] == [1]
    # The second apply compared against what the first wrote, not what it read before waiting.
    assert second_report.retired == [] and second_report.updated == []
    assert world.rule_row()["key_epoch"] == 1
    assert len(rows(world.engine, retired_ledger_rows_table)) == 1
