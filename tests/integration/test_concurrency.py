"""Writes in parallel inside a batch (`concurrency` > 1): every record still settles on its own,
and the cursor never passes a record that was not attempted."""

from __future__ import annotations

import pytest
import sqlalchemy as sa

from tests.integration.world import World
from tests.target_server import Answer, TargetServer


@pytest.fixture
def world(prefect_api: None, engine: sa.Engine, target: TargetServer) -> World:
    # A generous client timeout: eight writes at once on a loaded 2-core CI machine must not time out.
    return World(engine, target).apply(rule={"concurrency": 8, "batch_size": 20}, target={"timeout_seconds": 10})


def test_parallel_writes_deliver_each_record_once_and_park_faults_per_record(world: World) -> None:
    ids = [f"r{n:03d}" for n in range(60)]
    world.load(*ids)
    world.target.latency_ms = 20
    world.target.program(world.key("r005"), Answer.status(422))
    world.target.program(world.key("r017"), Answer.no_id())
    result = world.run()
    assert result["scanned"] == {"delivered": 58, "suppressed": 0, "failed": 1, "exhausted": 1, "remote_gone": 0}
    posts = [r.key for r in world.target.requests if r.method == "POST"]
    assert sorted(posts) == sorted(world.key(i) for i in ids)
    assert world.cursor().record_id == world.record_id("r059")
    rows = world.ledger()
    assert rows["r005"]["status"] == "failed" and rows["r017"]["status"] == "exhausted"


def test_breaker_cut_parallel_batch_leaves_the_cursor_before_the_first_record_not_attempted(world: World) -> None:
    ids = [f"r{n:03d}" for n in range(40)]
    world.load(*ids)
    world.target.down = True
    result = world.run()
    assert result["ended_by"] == "breaker_open"
    rows = world.ledger()
    attempted = [i for i in ids if i in rows]
    first_gap = next(i for i in ids if i not in rows)
    cursor = world.cursor()
    if cursor is not None:
        assert cursor.record_id < world.record_id(first_gap)
    # Nothing past the cursor is lost: once the target is back, every record gets delivered.
    world.target.down = False
    with world.engine.begin() as conn:
        conn.execute(sa.text("UPDATE breaker_states SET state = 'closed', fail_counter = 0"))
    world.make_due()
    world.run()
    assert {r["status"] for r in world.ledger().values()} == {"delivered"} and len(world.ledger()) == 40
    assert attempted  # the breaker needed failures to open
