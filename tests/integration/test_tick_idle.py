"""The tick starts a chain only for a rule with something to do (issue #12): a rule with nothing
due and nothing to scan is idle, gets no chain and no flow run, and says so in `delivery tick
--json`; a due retry, a fresh change, or a misconfigured target (ADR-0029: it fails on every tick)
each get one. On SQLite and PostgreSQL, through the real `delivery-tick` flow on the test harness
(no `deliver-rule` deployment: the tick runs the chains it starts itself)."""

from __future__ import annotations

import asyncio
import json
from datetime import timedelta
from typing import Any

import pytest
import sqlalchemy as sa
from typer.testing import CliRunner

from delivery.clock import utcnow
from delivery.store.tables import chains_table, rules_table
from delivery.tick import plan_tick, record_launch
from flows.cli import app
from tests.integration.world import RULE, World
from tests.target_server import Answer, TargetServer


@pytest.fixture
def world(prefect_api: None, engine: sa.Engine, target: TargetServer) -> World:
    return World(engine, target).apply()


def _tick() -> dict[str, Any]:
    result = CliRunner().invoke(app, ["tick", "--json"])
    assert result.exit_code in (0, 1), result.output
    tick: dict[str, Any] = json.loads(result.stdout)
    return tick


def _chain_count(world: World) -> int:
    with world.engine.connect() as conn:
        return int(conn.execute(sa.select(sa.func.count()).select_from(chains_table)).scalar_one())


def _deliver_rule_runs() -> int:
    async def count() -> int:
        from prefect import get_client
        from prefect.client.schemas.filters import FlowFilter, FlowFilterName, FlowRunFilter, FlowRunFilterTags

        # Counted by the server: a read returns at most 200 runs, and the session's server holds more.
        async with get_client() as client:
            return await client.count_flow_runs(
                flow_filter=FlowFilter(name=FlowFilterName(any_=["deliver-rule"])),
                flow_run_filter=FlowRunFilter(tags=FlowRunFilterTags(all_=[f"rule:{RULE}"])),
            )

    return asyncio.run(count())


def _action(tick: dict[str, Any]) -> str:
    [row] = [r for r in tick["rules"] if r["rule"] == RULE]
    return str(row["action"])


def _caught_up(world: World) -> None:
    """Deliver what the rule has, so the next tick finds nothing."""
    world.load("a", "b")
    first = _tick()
    assert first["state"] == "COMPLETED" and _action(first) == "started"
    assert {row["status"] for row in world.ledger().values()} == {"delivered"}


def test_an_idle_rule_gets_no_chain_and_no_flow_run(world: World) -> None:
    # Never a record: nothing to drain, nothing to scan.
    chains_before, runs_before = _chain_count(world), _deliver_rule_runs()
    tick = _tick()
    assert tick["state"] == "COMPLETED"
    assert (tick["started"], tick["alive"], tick["idle"], tick["dead_replaced"], tick["failed"]) == (0, 0, 1, 0, [])
    assert tick["rules"] == [{"rule": RULE, "action": "idle", "replaced": []}]
    assert "0 started" in tick["message"] and "1 idle" in tick["message"]
    assert _chain_count(world) == chains_before and _deliver_rule_runs() == runs_before

    human = CliRunner().invoke(app, ["tick"])
    assert human.exit_code == 0 and "1 idle" in human.stdout


def test_a_rule_whose_changes_all_settled_within_the_overlap_window_is_idle(world: World) -> None:
    _caught_up(world)
    # The records' change signals sit inside the overlap window behind the cursor (the scan starts
    # there), but each ledger row settled that very signal: nothing to offer again.
    cursor = world.cursor()
    assert cursor is not None and utcnow() - cursor.changed_at < timedelta(seconds=300)
    chains_before, runs_before = _chain_count(world), _deliver_rule_runs()
    tick = _tick()
    assert _action(tick) == "idle" and tick["started"] == 0 and tick["idle"] == 1
    assert _chain_count(world) == chains_before and _deliver_rule_runs() == runs_before


def test_a_fresh_change_gets_a_chain(world: World) -> None:
    _caught_up(world)
    world.load("a", changed="yes")  # a new change signal for a record already delivered
    runs_before = _deliver_rule_runs()
    tick = _tick()
    assert _action(tick) == "started" and tick["idle"] == 0
    assert _deliver_rule_runs() == runs_before + 1
    assert world.ledger()["a"]["status"] == "delivered" and world.target.records("contacts")


def test_a_due_retry_gets_a_chain_and_one_not_yet_due_does_not(world: World) -> None:
    world.target.program(world.key("a"), Answer.status(503))
    world.load("a")
    first = _tick()
    assert _action(first) == "started" and world.ledger()["a"]["status"] == "failed"

    # Failed, due in a minute: the scan leaves failed rows to the drain, the drain waits.
    assert _action(_tick()) == "idle"

    world.make_due()
    runs_before = _deliver_rule_runs()
    tick = _tick()
    assert _action(tick) == "started" and _deliver_rule_runs() == runs_before + 1
    assert world.ledger()["a"]["status"] == "delivered"


def test_a_rule_without_a_writer_gets_a_chain_on_every_tick_even_with_nothing_to_do(world: World) -> None:
    world.set_driver("soap")  # nothing registered under it: the chain fails MissingWriter
    for _ in range(2):
        tick = _tick()
        assert tick["state"] == "FAILED" and tick["failed"] == [RULE] and tick["idle"] == 0
        [row] = tick["rules"]
        assert row["action"] == "started" and row["chain_state"] == "FAILED"


def test_a_rule_whose_writer_lacks_a_verb_its_policy_needs_gets_a_chain(world: World) -> None:
    # Saved valid, then the connection's driver changed under it: create-only for an update policy.
    world.apply(rule={"policy": "update_only"})
    world.set_driver("rest-create-only")
    with world.engine.connect() as conn:
        plan = plan_tick(conn, utcnow(), timedelta(minutes=15))
    assert [launch.rule for launch in plan.start] == [RULE] and plan.idle == []


def test_a_disabled_rule_is_never_idle_and_an_alive_chain_is_left_alone(world: World) -> None:
    with world.engine.begin() as conn:
        record_launch(conn, RULE, utcnow())  # a launched chain waiting for a worker: alive
    with world.engine.connect() as conn:
        plan = plan_tick(conn, utcnow(), timedelta(minutes=15))
    assert plan.alive == [RULE] and plan.idle == [] and plan.start == []

    with world.engine.begin() as conn:
        conn.execute(rules_table.update().where(rules_table.c.name == RULE).values(enabled=False))
    with world.engine.connect() as conn:
        plan = plan_tick(conn, utcnow(), timedelta(minutes=15))
    assert plan.disabled == [RULE] and plan.idle == [] and plan.start == []


def test_a_dead_chain_of_an_idle_rule_is_replaced_by_no_chain(world: World) -> None:
    with world.engine.begin() as conn:
        token = record_launch(conn, RULE, utcnow() - timedelta(minutes=20))
    tick = _tick()
    assert tick["state"] == "COMPLETED" and tick["dead_replaced"] == 1 and tick["started"] == 0
    [row] = tick["rules"]
    assert row["action"] == "idle" and [dead["chain_token"] for dead in row["replaced"]] == [token]
    with world.engine.connect() as conn:
        ended = conn.execute(sa.select(chains_table.c.ended_by).where(chains_table.c.token == token)).scalar_one()
    assert ended == "superseded" and _chain_count(world) == 1
