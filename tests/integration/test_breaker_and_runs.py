"""The breaker's state is shared through the database; chains show up in Prefect as operators
need them: named and tagged after rule and target, with a summary artifact."""

from __future__ import annotations

import asyncio
from datetime import timedelta

import pybreaker
import pytest
import sqlalchemy as sa
import yaml

from delivery import db
from delivery.apply import apply_config
from delivery.breaker import Refused, TargetBreaker
from delivery.clock import FakeClock
from delivery.config import parse_config
from delivery.errors import TargetUnavailable
from delivery.store import catalog
from delivery.store.breaker import DatabaseBreakerStorage
from tests.integration.world import RULE, World


def _breaker(engine: sa.Engine, connection_id: int) -> pybreaker.CircuitBreaker:
    return pybreaker.CircuitBreaker(
        fail_max=2, reset_timeout=60, state_storage=DatabaseBreakerStorage(engine, connection_id),
        throw_new_error_on_trip=False,
    )  # fmt: skip


def _fail() -> None:
    raise TargetUnavailable("down")


def test_breaker_state_is_shared_by_two_engine_instances(engine: sa.Engine, db_url: str) -> None:
    with engine.begin() as conn:
        apply_config(conn, parse_config("connections: [{name: crm}]"))
        crm = catalog.list_connections(conn)[0].id
    other_engine = db.create_engine(db_url)  # what a second worker process has
    try:
        mine, theirs = _breaker(engine, crm), _breaker(other_engine, crm)
        with pytest.raises(TargetUnavailable):
            mine.call(_fail)
        assert theirs.fail_counter == 1
        with pytest.raises(TargetUnavailable):
            theirs.call(_fail)  # the second failure, seen from the other process, trips it
        assert mine.current_state == "open"
        with pytest.raises(pybreaker.CircuitBreakerError):
            mine.call(lambda: None)
        theirs.close()
        assert mine.current_state == "closed" and mine.call(lambda: 42) == 42
    finally:
        other_engine.dispose()


def test_a_breaker_tripped_by_one_rule_stops_another_rule_on_the_same_target(world: World) -> None:
    config = world.config()
    config["rules"].append({**config["rules"][0], "name": "leads-to-crm", "domain": "lead"})
    with world.engine.begin() as conn:
        apply_config(conn, parse_config(yaml.safe_dump(config)))
    world.load("a", "b", "c", "d")
    world.load("l1", domain="lead")
    world.target.down = True
    assert world.run()["ended_by"] == "breaker_open"
    db.dispose_engines()  # the other rule's chain gets engines of its own, as another worker would
    sent = len(world.target.requests)
    other = world.run("leads-to-crm")
    assert other["ended_by"] == "breaker_open" and len(world.target.requests) == sent


def test_breaker_lets_a_trial_through_after_reset_and_closes_on_success(world: World) -> None:
    """On a fake clock: nothing waits, and the cooldown ends when the clock says, not when a loaded
    machine gets round to it (this test once slept 2.1 s for a 2 s cooldown, and with 0.2 s record
    b sometimes became the trial call)."""
    clock = world.clock = FakeClock()
    world.apply(target={"breaker": {"fail_max": 1, "reset_seconds": 60}})  # the retry schedule's first step too
    world.load("a", "b")
    world.target.down = True
    assert world.run()["ended_by"] == "breaker_open"
    world.target.down = False
    sent = len(world.target.requests)
    clock.advance(59)
    assert world.run()["ended_by"] == "breaker_open" and len(world.target.requests) == sent  # still cooling
    clock.advance(1)  # the cooldown is over, and a's retry is due: no row is backdated
    result = world.run()
    assert result["ended_by"] == "caught_up" and result["counts"]["delivered"] == 2


def test_the_breakers_own_cooldown_runs_on_the_engines_clock(world: World) -> None:
    """pybreaker's open state compares the system's time with its storage's `opened_at`: the
    storage reports it shifted by the clock's skew, so a trial call is let through when the engine's
    clock (here a fake one, an hour ahead in the end) says the cooldown is over, and not before."""
    clock = FakeClock()
    world.apply(target={"breaker": {"fail_max": 1, "reset_seconds": 3600}})
    with world.engine.connect() as conn:
        rule = catalog.get_rule(conn, RULE)
    breaker = TargetBreaker(world.engine, rule, clock=clock)
    with pytest.raises(TargetUnavailable):
        breaker.call(_fail)  # trips it
    assert breaker.current_state == "open" and breaker.open_until(clock.now()) == clock.now() + timedelta(hours=1)
    clock.advance(3599)
    with pytest.raises(Refused):
        breaker.call(lambda: 42)
    clock.advance(1)
    assert breaker.call(lambda: 42) == 42  # the trial call, let through by pybreaker itself
    assert breaker.current_state == "closed"


async def _flow_run(flow_run_id: str) -> tuple[str, list[str], list[dict]]:  # type: ignore[type-arg]
    from uuid import UUID

    from prefect import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId

    async with get_client() as client:
        run = await client.read_flow_run(UUID(flow_run_id))
        artifacts = await client.read_artifacts(
            artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[UUID(flow_run_id)]))
        )
    return run.name, list(run.tags), [{"key": a.key, "data": a.data, "description": a.description} for a in artifacts]


@pytest.mark.through_prefect
def test_flow_run_is_named_and_tagged_and_publishes_a_summary_artifact(world: World) -> None:
    world.load("a", "b")
    result = world.run()
    name, tags, artifacts = asyncio.run(_flow_run(result["flow_run_id"]))
    assert name == f"{RULE} -> crm"
    assert {f"rule:{RULE}", "target:crm"} <= set(tags)
    (artifact,) = [a for a in artifacts if a["key"] == f"chain-{RULE}"]
    assert "ended **CaughtUp**" in artifact["description"] and "cursor after" in artifact["description"]
    rows = artifact["data"] if isinstance(artifact["data"], list) else yaml.safe_load(artifact["data"])
    delivered = next(r for r in rows if r["outcome"] == "delivered")
    assert delivered == {"outcome": "delivered", "drained": 0, "scanned": 2, "total": 2}


@pytest.mark.through_prefect
def test_failed_chain_still_publishes_its_artifact_and_state_message(world: World) -> None:
    world.load("a")
    world.set_driver("soap")
    result = world.run()
    assert result["state"] == "FAILED"
    _, _, artifacts = asyncio.run(_flow_run(result["flow_run_id"]))
    (summary,) = [a for a in artifacts if a["key"] == f"chain-{RULE}"]
    assert "ended **Failed**" in summary["description"] and "MissingWriter" in summary["description"]
