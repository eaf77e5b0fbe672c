"""The retry schedule on the chain's clock: a failed record is offered again when its step of the
rule's `retry_schedule_seconds` has passed on the clock that stamped its failure, and not a
microsecond before; nothing is backdated and nothing sleeps."""

from __future__ import annotations

from datetime import timedelta

import pytest
import sqlalchemy as sa

from delivery.clock import FakeClock
from tests.integration.world import World
from tests.target_server import Answer, TargetServer


@pytest.fixture
def world(engine: sa.Engine, target: TargetServer) -> World:
    return World(engine, target, through_prefect=False, clock=FakeClock()).apply(
        target={"breaker": {"fail_max": 10, "reset_seconds": 60}}, rule={"retry_schedule_seconds": [60, 600]}
    )


def test_a_failed_record_is_tried_again_on_its_schedule(world: World) -> None:
    assert isinstance(world.clock, FakeClock)
    world.load("a")
    world.target.program(world.key("a"), Answer.status(500), Answer.status(500))
    failed_at = world.clock.now()
    assert world.run()["counts"]["failed"] == 1
    assert world.ledger()["a"]["next_attempt_at"] == failed_at + timedelta(seconds=60)

    world.clock.set(failed_at + timedelta(seconds=60) - timedelta(microseconds=1))
    world.run()
    assert world.target.count(world.key("a")) == 1  # not due yet

    world.clock.advance(1e-6)  # its first step has passed: due
    world.run()
    assert world.target.count(world.key("a")) == 2
    second_failure = world.clock.now()
    assert world.ledger()["a"]["next_attempt_at"] == second_failure + timedelta(seconds=600)  # the next step

    world.clock.advance(600)
    assert world.run()["counts"]["delivered"] == 1 and world.target.count(world.key("a")) == 3
