"""The breaker's state is shared through the database; chains show up in Prefect as operators
need them: named and tagged after rule and target, with a summary artifact."""

from __future__ import annotations

import asyncio

import pybreaker
import pytest
import sqlalchemy as sa
import yaml

from delivery import db
from delivery.apply import apply_config
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
    # Long enough that record b still finds the breaker open on a loaded machine (with 0.2 s the
    # gap between a's failure and b's call was once longer, and b became the trial call).
    world.apply(target={"breaker": {"fail_max": 1, "reset_seconds": 2}})
    world.load("a", "b")
    world.target.down = True
    assert world.run()["ended_by"] == "breaker_open"
    world.target.down = False
    import time

    time.sleep(2.1)
    world.make_due()
    result = world.run()
    assert result["ended_by"] == "caught_up" and result["counts"]["delivered"] == 2


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
