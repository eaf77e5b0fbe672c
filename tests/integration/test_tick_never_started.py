"""A chain the tick launched whose run never began (issue 32, point 1), on SQLite and PostgreSQL:
alive while it waits for a worker up to `NEVER_STARTED_SECONDS`, then judged dead at the next
tick (its run cancelled, a new chain started) instead of holding the rule for the whole dead-chain
threshold; a run that began is judged by its heartbeat alone."""

from __future__ import annotations

from datetime import timedelta

import sqlalchemy as sa

from delivery import liveness
from delivery.clock import utcnow
from delivery.store import chains
from delivery.tick import plan_tick, record_launch
from tests.integration.world import RULE, World
from tests.target_server import TargetServer

THRESHOLD = timedelta(minutes=15)


def test_a_launch_never_started_is_dead_after_the_bound_and_a_started_one_is_not(
    engine: sa.Engine, target: TargetServer
) -> None:
    world = World(engine, target, through_prefect=False).apply()
    world.load("a")
    now = utcnow()
    waited = timedelta(seconds=liveness.NEVER_STARTED_SECONDS)
    with engine.begin() as conn:
        record_launch(conn, RULE, now - waited + timedelta(seconds=30))
    with engine.connect() as conn:
        plan = plan_tick(conn, now, THRESHOLD)
    assert plan.alive == [RULE] and plan.dead == []  # still within the bound: waiting for a worker

    later = now + timedelta(seconds=60)
    with engine.connect() as conn:
        plan = plan_tick(conn, later, THRESHOLD)
    (dead,) = plan.dead
    assert dead.never_started and dead.rule == RULE and plan.alive == []
    assert dead.why.startswith("judged dead by the tick: launched ") and dead.why.endswith("never began to run")
    assert [launch.rule for launch in plan.start] == [RULE]  # a new chain in its place

    # Its run began (a worker started it): judged by its heartbeat alone from then on.
    rule_id = world.rule_row()["id"]
    with engine.begin() as conn:
        chains.adopt_chain(conn, dead.token, rule_id, "run-1", later)
    with engine.connect() as conn:
        plan = plan_tick(conn, later + timedelta(minutes=5), THRESHOLD)
    assert plan.alive == [RULE] and plan.dead == []
