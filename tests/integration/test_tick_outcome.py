"""The tick without the `deliver-rule` deployment (local use): it runs each chain itself, as a run
created with its name and tags, says per rule what it did (`delivery tick --json`), and publishes
the `delivery-status` artifact, one row per rule, as of after its chains."""

from __future__ import annotations

import asyncio
import json
import re
from typing import Any
from uuid import UUID

import pytest
import sqlalchemy as sa
from typer.testing import CliRunner

from flows.cli import app
from tests.integration.world import RULE, World
from tests.target_server import TargetServer


@pytest.fixture
def world(prefect_api: None, engine: sa.Engine, target: TargetServer) -> World:
    return World(engine, target).apply()


async def _read(flow_run_id: str) -> tuple[Any, list[Any]]:
    from prefect import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId, ArtifactFilterKey

    async with get_client() as client:
        run = await client.read_flow_run(UUID(flow_run_id))
        artifacts = await client.read_artifacts(
            artifact_filter=ArtifactFilter(
                key=ArtifactFilterKey(any_=["delivery-status"]),
                flow_run_id=ArtifactFilterFlowRunId(any_=[UUID(flow_run_id)]),
            )
        )
    return run, list(artifacts)


def test_tick_json_says_what_it_ran_and_the_status_artifact_shows_the_result(world: World) -> None:
    world.load("a", "b")
    result = CliRunner().invoke(app, ["tick", "--json"])
    assert result.exit_code == 0, result.output
    tick = json.loads(result.stdout)
    assert tick["state"] == "COMPLETED" and tick["started"] == 1 and tick["failed"] == []
    [ran] = tick["rules"]
    assert ran["rule"] == RULE and ran["action"] == "started" and ran["chain_state"] == "COMPLETED"

    chain_run, _ = asyncio.run(_read(ran["flow_run_id"]))
    assert chain_run.name == f"{RULE} -> crm" and {f"rule:{RULE}", "target:crm"} <= set(chain_run.tags)

    tick_run, artifacts = asyncio.run(_read(tick["flow_run_id"]))
    # Named for its UTC minute, its summary beginning with the count started.
    assert re.fullmatch(r"tick \d\d:\d\d", tick_run.name), tick_run.name
    assert tick_run.state.message.startswith("1 started, 0 idle, 0 dead replaced")
    assert len(artifacts) == 1
    data = artifacts[0].data
    [row] = json.loads(data) if isinstance(data, str) else data
    assert row["rule"] == RULE and row["records"] == "2 delivered" and row["last chain"] == "CaughtUp"
    assert row["due retries"] == 0 and row["lag"] == "none"


def test_tick_json_lists_a_failing_chain_and_exits_1(world: World) -> None:
    world.load("a")
    world.set_driver("soap")
    result = CliRunner().invoke(app, ["tick", "--json"])
    assert result.exit_code == 1
    tick = json.loads(result.stdout)
    assert tick["state"] == "FAILED" and tick["failed"] == [RULE]
    assert tick["rules"][0]["chain_state"] == "FAILED"
    human = CliRunner().invoke(app, ["tick"])  # the text output stays: one line
    assert human.exit_code == 1 and human.stdout.startswith("tick FAILED: 1 started") and RULE in human.stdout
