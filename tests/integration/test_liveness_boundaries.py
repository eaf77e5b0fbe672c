"""The liveness windows through the store, on both databases: a chain whose heartbeat is exactly as
old as the window is alive to the tick and to the handover, and dead a microsecond later (the unit
tests pin the predicates; these pin that the stored heartbeat and the store's cutoff agree with
them, to the microsecond)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
import sqlalchemy as sa

from delivery import liveness
from delivery.store import catalog, chains
from tests.integration.world import RULE, World
from tests.target_server import TargetServer

NOW = datetime(2026, 3, 1, 12, 0, 0, 500_000, tzinfo=UTC)
TICK = timedelta(microseconds=1)


@pytest.fixture
def world(engine: sa.Engine, target: TargetServer) -> World:
    return World(engine, target).apply()


def _chain(world: World, started_at: datetime, heartbeat_at: datetime) -> str:
    with world.engine.begin() as conn:
        rule_id = catalog.get_rule(conn, RULE).id
        token = chains.start_chain(conn, rule_id, None, started_at)
        chains.heartbeat(conn, token, heartbeat_at)  # the store stamps the moment it is given
    return token


def _rule_id(world: World) -> int:
    with world.engine.connect() as conn:
        return catalog.get_rule(conn, RULE).id


def test_the_tick_finds_a_chain_alive_at_its_window_and_dead_a_microsecond_past_it(world: World) -> None:
    window = liveness.dead_chain_after(15)
    alive = _chain(world, NOW - timedelta(hours=1), NOW - window)
    dead = _chain(world, NOW - timedelta(hours=2), NOW - window - TICK)
    with world.engine.connect() as conn:
        judged = {life.token: life for life in liveness.judge_chains(conn, _rule_id(world), NOW, window)}
    assert judged[alive].alive is True
    assert judged[alive].silent_for == window
    assert judged[dead].alive is False
    assert judged[dead].silent_for == window + TICK


@pytest.mark.parametrize(("age", "handed_over"), [(timedelta(0), True), (TICK, False)], ids=["at-window", "past-it"])
def test_the_handover_finds_a_waiter_alive_at_its_window_and_not_past_it(
    world: World, monkeypatch: pytest.MonkeyPatch, age: timedelta, handed_over: bool
) -> None:
    monkeypatch.setenv("DELIVERY_LOCK_WAIT_STEP_SECONDS", "15")
    window = liveness.handover_window()
    holder_started = NOW - timedelta(minutes=5)
    holder = _chain(world, holder_started, NOW)
    waiter = _chain(world, NOW - timedelta(minutes=1), NOW - window - age)
    with world.engine.connect() as conn:
        newer = liveness.newer_waiting(conn, _rule_id(world), holder, holder_started, NOW)
    assert (newer is not None and newer.token == waiter) is handed_over
