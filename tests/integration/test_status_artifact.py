"""The `delivery-status` artifact (flows/status_artifact.py `publish_status`) on the Prefect test
harness, SQLite and PostgreSQL: how each rule's last chain ended and since when in its first
columns, every cell plain words or a number, the same words as `delivery status` prints, and the
status as the database has it when it is published (not as a tick saw it before its chains ran)."""

from __future__ import annotations

import asyncio
import json
import re
from typing import Any

import pytest
import sqlalchemy as sa
import yaml
from typer.testing import CliRunner

from delivery.apply import apply_config
from delivery.config import parse_config
from delivery.domain import ChainEnd
from delivery.status import RUN_STATE_NAMES, TABLE_MESSAGE_CHARS
from delivery.store.tables import connections_table
from flows.cli import app
from flows.status_artifact import STATUS_ARTIFACT_KEY, publish_status
from tests.integration.world import RULE, World
from tests.target_server import TargetServer

FAILING = "companies-to-erp"
PAUSED = "leads-to-crm"
FIRST_COLUMNS = ["rule", "last chain", "since"]
TIME = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d UTC$")


@pytest.fixture
def world(prefect_api: None, engine: sa.Engine, target: TargetServer) -> World:
    """contacts-to-crm delivers two records; companies-to-erp fails (its target's driver is gone);
    leads-to-crm is disabled and never ran."""
    world = World(engine, target)
    config = world.config()
    config["connections"].append({"name": "erp", "driver": "rest", "base_url": target.url})
    config["rules"] += [
        {"name": FAILING, "source": "shop", "domain": "company", "target": "erp", "collection": "companies"},
        {**config["rules"][0], "name": PAUSED, "domain": "lead", "enabled": False},
    ]
    with engine.begin() as conn:
        apply_config(conn, parse_config(yaml.safe_dump(config)))
    world.load("a", "b")
    world.load("acme", domain="company")
    return world


def _latest() -> Any:
    from prefect import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey
    from prefect.client.schemas.sorting import ArtifactSort

    async def read() -> Any:
        async with get_client() as client:
            (latest,) = await client.read_artifacts(
                artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=[STATUS_ARTIFACT_KEY])),
                sort=ArtifactSort.CREATED_DESC,
                limit=1,
            )
            return latest

    return asyncio.run(read())


def _publish(summary: str | None = None) -> None:
    """Publish as a tick or a chain does: from inside a flow run (Prefect deprecates artifacts
    made outside one)."""
    from prefect import flow

    @flow(name="status-publisher")
    async def publisher(summary: str | None) -> None:
        await publish_status(summary)

    asyncio.run(publisher(summary))


def _rows(artifact: Any) -> list[dict[str, Any]]:
    data = artifact.data
    rows = json.loads(data) if isinstance(data, str) else data
    assert isinstance(rows, list)
    return rows


def _chains_end(world: World) -> None:
    assert world.run()["ended_by"] == "caught_up"
    with world.engine.begin() as conn:
        conn.execute(connections_table.update().where(connections_table.c.name == "erp").values(driver="soap"))
    assert world.run(FAILING)["state"] == "FAILED"


def test_the_artifact_starts_with_how_each_last_chain_ended_in_plain_words(world: World) -> None:
    _chains_end(world)
    _publish()
    artifact = _latest()
    rows = {row["rule"]: row for row in _rows(artifact)}
    assert list(rows) == [FAILING, RULE, f"{PAUSED} (disabled)"]
    for row in rows.values():
        assert list(row)[:3] == FIRST_COLUMNS
    contacts, failing, paused = rows[RULE], rows[FAILING], rows[f"{PAUSED} (disabled)"]

    assert contacts["last chain"] == "CaughtUp" and TIME.match(contacts["since"]), contacts
    assert contacts["message"] == "caught up: 2 delivered"
    assert (contacts["records"], contacts["due retries"]) == ("2 delivered", 0)
    assert (contacts["route"], contacts["breaker"], contacts["lag"]) == ("open", "closed", "none")

    assert failing["last chain"] == "Failed: MissingWriter" and TIME.match(failing["since"]), failing
    # Less what the row says already (the fault's name, the rule's); a longer one is cut to fit a
    # 1280-pixel screen (tests/unit/test_shortened.py), the whole of it on the run.
    assert failing["message"] == "no writer is registered for target driver 'soap'", failing
    assert len(failing["message"]) <= TABLE_MESSAGE_CHARS
    assert failing["lag"] != "none" and re.match(r"^(under a second|\d+ seconds?|\d+ minutes?)$", failing["lag"])

    assert (paused["last chain"], paused["since"], paused["message"]) == ("never ran", "-", "-")

    # Plain words: no Python reprs, no float seconds, no snake_case in what an operator reads.
    for row in rows.values():
        assert len(row["message"]) <= TABLE_MESSAGE_CHARS
        for column, value in row.items():
            assert "_" not in column, column
            assert isinstance(value, int) or not re.search(r"[{}\[\]]|\d\.\d+ ?s\b|\bNone\b", value), (column, value)
    description = artifact.description
    assert description.startswith("**Delivery status** at ") and " UTC, 3 rules: " in description
    assert "1 CaughtUp" in description and "1 Failed: MissingWriter" in description and "1 never ran" in description
    assert "This tick" not in description and "{" not in description


def test_the_status_command_says_the_same_as_the_artifact(world: World) -> None:
    _chains_end(world)
    _publish()
    table = {row["rule"]: row for row in _rows(_latest())}
    result = CliRunner().invoke(app, ["status", "--json"])
    assert result.exit_code == 0, result.output
    for row in json.loads(result.stdout):
        shown = table[row["rule"] + ("" if row["enabled"] else " (disabled)")]
        assert row["last_ending"] == shown["last chain"]
        if row["rule"] != FAILING:  # its lag grows between the two reads
            assert row["cursor_lag"] == shown["lag"] == "none"
        assert row["cursor_lag_seconds"] >= 0  # the fields it had stay
    by_rule = {row["rule"]: row for row in json.loads(result.stdout)}
    assert by_rule[FAILING]["last_chain"]["state_name"] == "Failed"
    assert by_rule[FAILING]["last_chain"]["fault"] == "MissingWriter"
    assert by_rule[FAILING]["last_chain"]["ended_by"] == "rule_fault"
    assert by_rule[RULE]["last_chain"]["state_name"] == "CaughtUp" and by_rule[RULE]["last_chain"]["fault"] is None
    assert by_rule[PAUSED]["last_chain"] is None and by_rule[PAUSED]["last_ending"] == "never ran"

    text = CliRunner().invoke(app, ["status"]).stdout
    # A table, or one block per rule on a narrow terminal: either way the ending comes first.
    assert text.index("last chain") < text.index("since") < text.index("route") < text.index("breaker")
    assert "Failed: MissingWriter" in text and "CaughtUp" in text and "never ran" in text
    assert "rule_fault" not in text and "caught_up" not in text


def test_published_inside_a_flow_run_it_is_the_status_as_of_then_and_says_what_the_tick_did(world: World) -> None:
    _publish("0 started")
    before = {row["rule"]: row for row in _rows(_latest())}
    assert before[RULE]["last chain"] == "never ran" and before[RULE]["lag"] != "none"
    assert "This tick: 0 started." in _latest().description

    # A chain ends: the next publication (as the chain's end will publish it) shows it at once.
    assert world.run()["ended_by"] == "caught_up"
    _publish()
    after = _latest()
    assert after.flow_run_id is not None
    row = {r["rule"]: r for r in _rows(after)}[RULE]
    assert (row["last chain"], row["lag"], row["records"]) == ("CaughtUp", "none", "2 delivered")
    assert "This tick" not in after.description


def test_the_state_names_are_those_the_runs_end_in() -> None:
    from flows.deliver_rule import STATE_NAMES

    assert set(RUN_STATE_NAMES) == set(ChainEnd)  # every ending named
    assert set(STATE_NAMES) == set(ChainEnd) - {ChainEnd.RULE_FAULT, ChainEnd.CANCELLED}
    assert (RUN_STATE_NAMES[ChainEnd.RULE_FAULT], RUN_STATE_NAMES[ChainEnd.CANCELLED]) == ("Failed", "Cancelled")
