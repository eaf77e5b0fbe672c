"""What an operator sees, against a real `prefect server start` (started once for the module, with
its event persister, triggers and actions on): chains' state names, the records artifact, the
breaker trip in the run's log and its event stored once; `delivery alerts install` twice leaves one
automation per file, updated in place; and the breaker-opened automation really notifies."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from typer.testing import CliRunner

from flows.automations import AUTOMATIONS_DIR
from flows.breaker_events import OPENED
from flows.chain_reporting import records_artifact_key
from flows.cli import app
from flows.traffic_events import PAUSED, RESUMED
from tests.integration.runs import run_artifacts, run_logs, run_state
from tests.integration.world import RULE, World
from tests.prefect_server import prefect_server
from tests.support.alerts import Receiver
from tests.support.databases import unique
from tests.support.waiting import wait_for
from tests.target_server import Answer, TargetServer


def _fresh_workers() -> None:
    """Prefect's log and event workers keep the API they were started with: drain and drop them
    when the API changes, so the next ones are made for the current settings."""
    from prefect.events.worker import EventsWorker
    from prefect.logging.handlers import APILogWorker

    APILogWorker.drain_all(timeout=10)
    EventsWorker.drain_all(timeout=10)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    # The test session turns these off for the harness (tests/conftest.py); here they are the
    # point: events stored and readable, automations triggered and their actions run.
    services = {
        "PREFECT_SERVER_SERVICES_EVENT_PERSISTER_ENABLED": "true",
        "PREFECT_SERVER_SERVICES_EVENT_PERSISTER_FLUSH_INTERVAL": "0.5",
        "PREFECT_SERVER_SERVICES_TRIGGERS_ENABLED": "true",
        "PREFECT_SERVER_SERVICES_ACTIONS_ENABLED": "true",
    }
    with prefect_server(tmp_path_factory.mktemp("prefect-server"), services) as api:
        yield api


@pytest.fixture
def api(server: str) -> Iterator[str]:
    """This test's Prefect calls (flows run in process, the CLI, reads) go to the real server."""
    from prefect.settings import PREFECT_API_URL, temporary_settings

    _fresh_workers()
    with temporary_settings(updates={PREFECT_API_URL: server}):
        yield server
        _fresh_workers()


@pytest.fixture
def world(api: str, engine: sa.Engine, target: TargetServer) -> World:
    return World(engine, target).apply()


def _events(name: str, resource_id: str, since: datetime) -> list[Any]:
    from prefect import get_client
    from prefect.events.filters import EventFilter, EventNameFilter, EventOccurredFilter, EventResourceFilter

    async def read() -> list[Any]:
        async with get_client() as client:
            page = await client.read_events(
                filter=EventFilter(
                    occurred=EventOccurredFilter(since=since, until=datetime.now(UTC)),
                    event=EventNameFilter(name=[name]),
                    resource=EventResourceFilter(id=[resource_id]),
                ),
                limit=50,
            )
        return list(page.events)

    return asyncio.run(read())


def test_states_records_logs_and_one_breaker_event_on_a_real_server(world: World) -> None:
    started = datetime.now(UTC)
    world.load("a")
    caught_up = world.run()
    assert run_state(caught_up["flow_run_id"]) == ("COMPLETED", "CaughtUp")

    world.set_driver("soap")
    failed = world.run()
    assert failed["state"] == "FAILED" and run_state(failed["flow_run_id"]) == ("FAILED", "Failed")
    world.set_driver("rest")

    world.apply(rule={"concurrency": 3})
    world.load(*[f"r{n}" for n in range(9)])
    world.target.down = True
    tripped = world.run()
    assert run_state(tripped["flow_run_id"]) == ("COMPLETED", "BreakerOpen")
    logs = run_logs(tripped["flow_run_id"])
    assert [m for m in logs if "the breaker of target crm opened (closed -> open)" in m], logs
    records = run_artifacts(tripped["flow_run_id"])[records_artifact_key(RULE)].data
    assert "delivery requeue contacts-to-crm --status failed --since " in records
    assert world.run()["ended_by"] == "breaker_open"  # still open: nothing more emitted

    stored = wait_for(lambda: _events(OPENED, "delivery.connection.crm", started), 20, "the breaker event")
    time.sleep(1.5)  # a second event would have been flushed by now
    stored = _events(OPENED, "delivery.connection.crm", started)
    assert len(stored) == 1
    assert stored[0].payload["rule"] == RULE
    assert str(stored[0].related[0].id) == f"prefect.flow-run.{tripped['flow_run_id']}"


def test_a_target_pause_shows_as_events_logs_and_a_rate_limited_run_on_a_real_server(world: World) -> None:
    started = datetime.now(UTC)
    world.apply(target={"max_pause_seconds": 3600})
    world.load("a")
    world.target.program(world.key("a"), Answer.status(429, headers={"Retry-After": "1"}))
    waited = world.run()
    assert run_state(waited["flow_run_id"]) == ("COMPLETED", "CaughtUp") and waited["counts"]["delivered"] == 1
    logs = run_logs(waited["flow_run_id"])
    assert [m for m in logs if "target crm asked for a pause (HTTP 429, Retry-After 1 s)" in m], logs
    assert [m for m in logs if "waited" in m and "for target crm's traffic" in m], logs
    for name in (PAUSED, RESUMED):

        def stored(name: str = name) -> list[Any]:
            return _events(name, "delivery.connection.crm", started)

        assert wait_for(stored, 20, name)[0].payload["rule"] == RULE

    world.load("b")
    world.target.program(world.key("b"), Answer.status(503, headers={"Retry-After": "3000"}))
    held = world.run()
    assert run_state(held["flow_run_id"]) == ("COMPLETED", "RateLimited")
    assert held["message"].startswith("target 'crm' is paused until ")


# -- alerts ---------------------------------------------------------------------------------------


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    made = Receiver()
    yield made
    made.httpd.shutdown()


def _automations() -> dict[str, list[Any]]:
    from prefect import get_client

    async def read() -> dict[str, list[Any]]:
        async with get_client() as client:
            found: dict[str, list[Any]] = {}
            for automation in await client.read_automations():
                found.setdefault(automation.name, []).append(automation)
            return found

    return asyncio.run(read())


def _install(*args: str) -> list[dict[str, Any]]:
    result = CliRunner().invoke(app, ["alerts", "install", *args, "--json"])
    assert result.exit_code == 0, result.output
    installed: list[dict[str, Any]] = json.loads(result.stdout)
    return installed


def test_alerts_install_twice_leaves_one_automation_per_file_and_the_breaker_alert_notifies(
    api: str, receiver: Receiver, engine: sa.Engine, target: TargetServer
) -> None:
    from prefect.blocks.notifications import CustomWebhookNotificationBlock

    name = unique("ops")
    block_id = CustomWebhookNotificationBlock(
        name="delivery alerts", url=receiver.url, json_data={"subject": "{{subject}}", "body": "{{body}}"}
    ).save(name)
    block = f"custom-webhook/{name}"
    files = sorted(path.name for path in Path(AUTOMATIONS_DIR).glob("*.yaml"))
    assert len(files) == 6

    from prefect import get_client
    from prefect.events.schemas.automations import AutomationCore

    async def forget() -> None:  # a clean slate (this test runs once per database)
        async with get_client() as client:
            for automation in await client.read_automations():
                if automation.name.startswith("delivery: "):
                    await client.delete_automation(automation.id)

    asyncio.run(forget())
    first = _install("--block", block, "--disabled")
    assert sorted(i["file"] for i in first) == files and {i["action"] for i in first} == {"created"}

    # A duplicate made by hand (or by an older install) goes at the next install.
    async def duplicate() -> None:
        async with get_client() as client:
            (kept,) = await client.read_automations_by_name("delivery: breaker opened")
            await client.create_automation(AutomationCore(**kept.model_dump(exclude={"id", "created", "updated"})))

    asyncio.run(duplicate())
    second = _install("--block", block)
    assert {i["action"] for i in second} == {"updated"}
    assert {i["id"] for i in second} == {i["id"] for i in first}  # the same automations, in place
    installed = _automations()
    for made in second:
        (automation,) = installed[made["name"]]  # one per file
        assert automation.enabled is True
        assert [a.block_document_id for a in automation.actions] == [block_id]

    # The breaker-opened automation, live: a chain trips the breaker, the webhook hears of it.
    world = World(engine, target).apply()
    world.load("a", "b", "c", "d")
    target.down = True
    time.sleep(2)  # the triggers service picks up the automations it was told of
    assert world.run()["ended_by"] == "breaker_open"
    posts = wait_for(
        lambda: [p for p in receiver.posts if "breaker opened: target crm" in p.get("subject", "")],
        45,
        "the breaker-opened notification",
    )
    assert RULE in posts[0]["body"]
