"""A bad DELIVERY_* value reaching a `deliver-rule` run (a worker started without the CLI's check)
fails the run before its chain exists: it is no fault of the rule, so no chain is recorded as ended
by one, nothing is sent and nothing is written."""

from __future__ import annotations

import asyncio

import pytest
import sqlalchemy as sa

from delivery.store.tables import chains_table
from flows.deliver_rule import deliver_rule
from tests.integration.world import RULE, World
from tests.target_server import TargetServer


@pytest.fixture
def world(prefect_api: None, engine: sa.Engine, target: TargetServer) -> World:
    return World(engine, target).apply()


@pytest.mark.parametrize("variable", ["DELIVERY_BATCH_TIMEOUT_SECONDS", "DELIVERY_LOCK_WAIT_STEP_SECONDS"])
def test_a_bad_setting_fails_the_run_before_its_chain_exists(
    world: World, monkeypatch: pytest.MonkeyPatch, variable: str
) -> None:
    world.load("a")
    monkeypatch.setenv(variable, "abc")
    # The flow itself, not `run_now`: reading the summary back would meet the bad value again.
    state = asyncio.run(deliver_rule(rule=RULE, return_state=True))
    assert state.is_failed() and variable in (state.message or "")
    with world.engine.connect() as conn:
        assert conn.execute(sa.select(chains_table)).all() == []
    assert world.ledger() == {} and world.cursor() is None
    monkeypatch.delenv(variable)
    assert world.run()["state"] == "COMPLETED"  # the rule itself was fine all along
    assert world.ledger()["a"]["status"] == "delivered"
