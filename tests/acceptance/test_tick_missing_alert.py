"""The "no tick completed" alert (automations/tick-missing.yaml) on a real `prefect server start`
with its triggers and actions services on, installed by `delivery alerts install`'s function with a
20-second window instead of 15 minutes (Prefect's shortest for a proactive trigger is 10 s).

The alert must fire one window after the last delivery-tick run that Completed: the first version of
the file (no `after`) fired two to three windows later, because Prefect drops a window that saw a
tick and starts the next one only a whole window later (30 to 45 minutes on the 15-minute window: a
tick deployment paused for 24 minutes raised nothing). Here:

1. installed while no tick runs, it fires one window after the install;
2. while ticks keep completing (real `delivery-tick` runs, in process, against the server) for
   longer than a window, it stays quiet: each completed tick restarts the window;
3. once they stop, it fires one window after the last one, not two, and says which run that was.

Times come from the server: the Completed state of the tick runs and the automation's
`prefect.automation.triggered` events. The notification is a custom webhook this test listens on.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, cast
from uuid import UUID, uuid4

import pytest
import sqlalchemy as sa

from flows.automations import FORMER_NAMES, TICK_MISSING_FILE, automations, install
from tests.prefect_server import api_call, prefect_server, stop_group
from tests.support.databases import unique

WINDOW = timedelta(seconds=20)
#: The window of the test with scheduled ticks: each tick run `delivery serve` starts is a process.
SCHEDULED_WINDOW = timedelta(seconds=60)
#: How late a firing may come: Prefect evaluates proactive triggers every 5 s, then the actions
#: service sends the notification. Less than a window, so a firing a window late fails the test.
LATE = timedelta(seconds=10)


def _wait_for(predicate: Callable[[], Any], timeout: float, what: str, poll: float = 0.5) -> Any:
    deadline = time.monotonic() + timeout
    while not (value := predicate()):
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(poll)
    return value


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    # The test session turns these off for the harness (tests/conftest.py); here they are the point.
    services = {
        "PREFECT_SERVER_SERVICES_EVENT_PERSISTER_ENABLED": "true",
        "PREFECT_SERVER_SERVICES_EVENT_PERSISTER_FLUSH_INTERVAL": "0.5",
        "PREFECT_SERVER_SERVICES_TRIGGERS_ENABLED": "true",
        "PREFECT_SERVER_SERVICES_ACTIONS_ENABLED": "true",
        # Scheduled ticks (the last test) are made within seconds of a schedule's change.
        "PREFECT_SERVER_SERVICES_SCHEDULER_LOOP_SECONDS": "2",
    }
    with prefect_server(tmp_path_factory.mktemp("prefect-server"), services) as api:
        yield api


@pytest.fixture
def api(server: str) -> Iterator[str]:
    from prefect.events.worker import EventsWorker
    from prefect.logging.handlers import APILogWorker
    from prefect.settings import PREFECT_API_URL, temporary_settings

    # Prefect's log and event workers keep the API they were started with: fresh ones for this one.
    APILogWorker.drain_all(timeout=10)
    EventsWorker.drain_all(timeout=10)
    with temporary_settings(updates={PREFECT_API_URL: server}):
        yield server
        APILogWorker.drain_all(timeout=10)
        EventsWorker.drain_all(timeout=10)


class _Receiver:
    """A webhook that records what Prefect's notification action posts to it, and when."""

    def __init__(self) -> None:
        self.posts: list[dict[str, Any]] = []
        received = self.posts

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                received.append(json.loads(body or b"{}"))
                self.send_response(200)
                self.end_headers()

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/hook"


@pytest.fixture
def receiver() -> Iterator[_Receiver]:
    made = _Receiver()
    yield made
    made.httpd.shutdown()


def _firings(automation_id: str, since: datetime) -> list[datetime]:
    """When the automation fired (its `prefect.automation.triggered` events), oldest first."""
    from prefect import get_client
    from prefect.events.filters import EventFilter, EventNameFilter, EventOccurredFilter, EventResourceFilter

    async def read() -> list[datetime]:
        async with get_client() as client:
            page = await client.read_events(
                filter=EventFilter(
                    occurred=EventOccurredFilter(since=since, until=datetime.now(UTC) + timedelta(minutes=1)),
                    event=EventNameFilter(name=["prefect.automation.triggered"]),
                    resource=EventResourceFilter(id=[f"prefect.automation.{automation_id}"]),
                ),
                limit=50,
            )
        return sorted(event.occurred for event in page.events)

    return asyncio.run(read())


def _completed_at(flow_run_id: str) -> tuple[str, datetime]:
    """A tick run's name and when it Completed, as the server has it."""
    from prefect import get_client

    async def read() -> tuple[str, datetime]:
        async with get_client() as client:
            run = await client.read_flow_run(UUID(flow_run_id))
        assert run.state is not None and run.state.is_completed(), run.state
        return run.name, run.state.timestamp

    return asyncio.run(read())


def _tick() -> tuple[str, datetime]:
    from flows.tick import run_tick

    result = run_tick()
    assert result["state"] == "COMPLETED", result
    return _completed_at(result["flow_run_id"])


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)  # the alert watches Prefect, not the database
def test_the_no_tick_alert_fires_one_window_after_the_install_and_after_the_last_completed_tick(
    api: str, receiver: _Receiver, engine: sa.Engine
) -> None:
    from prefect.blocks.notifications import CustomWebhookNotificationBlock

    block = unique("ops")
    CustomWebhookNotificationBlock(
        name="delivery alerts", url=receiver.url, json_data={"subject": "{{subject}}", "body": "{{body}}"}
    ).save(block)
    (name,) = [a.name for path, a in automations(uuid4(), True) if path.name == TICK_MISSING_FILE]

    def alerts() -> list[dict[str, Any]]:
        return [p for p in receiver.posts if "no delivery-tick completed" in p.get("subject", "")]

    # 1. Installed while no tick runs: it fires one window after the install.
    installed_at = datetime.now(UTC)
    done = asyncio.run(install(f"custom-webhook/{block}", True, tick_missing_within=WINDOW))
    (automation_id,) = [i.id for i in done if i.name == name]
    (first,) = _wait_for(
        lambda: _firings(automation_id, installed_at), (WINDOW + LATE).total_seconds() + 15, "the first firing"
    )
    assert WINDOW - timedelta(seconds=1) <= first - installed_at <= WINDOW + LATE, first - installed_at
    (alert,) = _wait_for(alerts, 15, "the first notification")

    # 2. Ticks that keep completing, for longer than a window: each restarts it, nothing fires.
    ticking_since = datetime.now(UTC)
    ticks = [_tick()]
    while ticks[-1][1] - ticks[0][1] < WINDOW * 1.5:
        ticks.append(_tick())
    gaps = [b[1] - a[1] for a, b in itertools.pairwise(ticks)]
    assert max(gaps) < WINDOW - LATE, f"ticks too far apart to keep the window open: {gaps}"
    last_name, last_completed = ticks[-1]
    quiet = _firings(automation_id, ticking_since)
    assert quiet == [], f"fired while ticks completed {[str(t[1]) for t in ticks]}: {quiet}"

    # 3. No more ticks: it fires one window after the last Completed, not two.
    (fired,) = _wait_for(
        lambda: _firings(automation_id, ticking_since), (3 * WINDOW + LATE).total_seconds(), "the firing"
    )
    late = fired - last_completed
    assert WINDOW - timedelta(seconds=1) <= late <= WINDOW + LATE, (
        f"fired {late.total_seconds():.1f} s after the last completed tick, for a {WINDOW.total_seconds():.0f} s window"
    )
    # What they say: the window installed, and the last tick that completed once there was one.
    assert alert["subject"] == "[delivery] no delivery-tick completed for 20 seconds"
    assert "has Completed in the last 20 seconds" in alert["body"] and "The last one that did" not in alert["body"]
    after_ticks = _wait_for(lambda: alerts()[1:], 15, "the notification after the ticks")
    assert after_ticks[0]["subject"] == alert["subject"]
    assert f"The last one that did was {last_name}, at " in after_ticks[0]["body"]
    assert "This alert repeats every 40 seconds until a tick completes." in after_ticks[0]["body"]


def test_an_install_renames_the_automation_installed_under_the_former_name_in_place(api: str) -> None:
    """The first version was named "delivery: no tick completed for 15 minutes": installing again
    takes that automation over (same id and history), never leaving the old one to fire beside it."""
    from prefect import get_client
    from prefect.blocks.notifications import CustomWebhookNotificationBlock
    from prefect.events.schemas.automations import AutomationCore

    block = unique("ops")
    block_id = CustomWebhookNotificationBlock(name="delivery alerts", url="http://127.0.0.1:9/hook").save(block)
    (automation,) = [a for path, a in automations(cast(UUID, block_id), False) if path.name == TICK_MISSING_FILE]
    (former,) = FORMER_NAMES[automation.name]

    async def scenario() -> tuple[Any, list[Any]]:
        async with get_client() as client:
            for made in await client.read_automations():
                if made.name in {automation.name, former}:
                    await client.delete_automation(made.id)
            old_id = await client.create_automation(AutomationCore(**{**automation.model_dump(), "name": former}))
            done = await install(f"custom-webhook/{block}", False)
            now = [a for a in await client.read_automations() if a.name in {automation.name, former}]
            return old_id, [i for i in done if i.file == TICK_MISSING_FILE] + now

    old_id, (installed, kept) = asyncio.run(scenario())
    assert (installed.action, installed.id, installed.name) == ("updated", str(old_id), automation.name)
    assert (kept.id, kept.name, kept.enabled) == (old_id, automation.name, False)


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
def test_ticks_a_third_of_a_window_apart_from_the_install_on_never_fire_it_and_one_stop_fires_it_once(
    api: str, receiver: _Receiver, engine: sa.Engine
) -> None:
    """Issue 32, point 4, at a ninth of the scale: ticks every minute under a three-minute window
    for ten minutes (here every 6.7 s under 20 s, for 70 s), from the install on: no alert; then the
    ticks stop (a paused schedule): one alert, one window after the last completed tick."""
    from prefect.blocks.notifications import CustomWebhookNotificationBlock

    block = unique("ops")
    CustomWebhookNotificationBlock(
        name="delivery alerts", url=receiver.url, json_data={"subject": "{{subject}}", "body": "{{body}}"}
    ).save(block)
    (name,) = [a.name for path, a in automations(uuid4(), True) if path.name == TICK_MISSING_FILE]
    installed_at = datetime.now(UTC)
    done = asyncio.run(install(f"custom-webhook/{block}", True, tick_missing_within=WINDOW))
    (automation_id,) = [i.id for i in done if i.name == name]
    every = WINDOW / 3
    ticks = [_tick()]
    while datetime.now(UTC) - installed_at < WINDOW * 3.5:
        next_at = ticks[-1][1] + every
        time.sleep(max((next_at - datetime.now(UTC)).total_seconds(), 0))  # a schedule's pace, not a wait for a state
        ticks.append(_tick())
    quiet = _firings(automation_id, installed_at)
    assert quiet == [], f"fired while ticks completed every {every.total_seconds():.1f} s: {quiet}"
    last_completed = ticks[-1][1]
    (fired,) = _wait_for(
        lambda: _firings(automation_id, installed_at), (3 * WINDOW + LATE).total_seconds(), "the firing"
    )
    late = fired - last_completed
    assert WINDOW - timedelta(seconds=1) <= late <= WINDOW + LATE, late


@pytest.fixture
def serving(api: str, tmp_path: Path) -> Iterator[str]:
    """`delivery serve` against the module's server (its deployments: delivery-tick among them);
    yields the delivery-tick deployment's id, its schedules removed."""
    env = {
        **os.environ,
        "PREFECT_API_URL": api,
        "DELIVERY_DATABASE_URL": f"sqlite:///{tmp_path / 'delivery.db'}",
        "PREFECT_RUNNER_POLL_FREQUENCY": "1",
    }
    with (tmp_path / "serve.log").open("wb") as log:
        process = subprocess.Popen(
            [str(Path(sys.executable).with_name("delivery")), "serve"],
            cwd=tmp_path, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
    try:

        def deployment() -> dict[str, Any] | None:
            assert process.poll() is None, (tmp_path / "serve.log").read_text()
            found = api_call(
                "POST", f"{api}/deployments/filter", {"deployments": {"name": {"any_": ["delivery-tick"]}}}
            )
            return found[0] if found else None

        tick = _wait_for(deployment, 120, "delivery serve's delivery-tick deployment")
        for schedule in tick["schedules"]:
            api_call("DELETE", f"{api}/deployments/{tick['id']}/schedules/{schedule['id']}")
        yield str(tick["id"])
    finally:
        stop_group(process)


def _schedule(api: str, deployment_id: str, every: timedelta, parameters: dict[str, Any] | None = None) -> str:
    """An interval schedule on the deployment, its first run in a few seconds (the scheduler
    makes none in the past); its id."""
    first = datetime.now(UTC) + timedelta(seconds=5)
    schedule = {"interval": every.total_seconds(), "anchor_date": first.isoformat()}
    (made,) = api_call(
        "POST",
        f"{api}/deployments/{deployment_id}/schedules",
        [{"schedule": schedule, "active": True, "parameters": parameters or {}}],
    )
    return str(made["id"])


def _tick_runs(api: str, deployment_id: str) -> list[dict[str, Any]]:
    runs: list[dict[str, Any]] = api_call(
        "POST", f"{api}/flow_runs/filter", {"flow_runs": {"deployment_id": {"any_": [deployment_id]}}}
    )
    return runs


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
def test_ticks_made_by_the_scheduler_keep_the_alert_quiet_and_a_failed_one_is_told_at_once(
    api: str, receiver: _Receiver, engine: sa.Engine, serving: str
) -> None:
    """Issue 32, point 4, as it was seen: ticks run by `delivery serve` from the deployment's
    schedule. Prefect's scheduler makes those runs without a Scheduled event, so Prefect holds
    their state events back from the automations for up to 15 minutes (each waits for the event it
    follows): watching them, the alert fired one window after the install while ticks completed
    a third of a window apart. Here ticks every 15 s under a one-minute window for two and a half
    windows (a tick run served is a process of its own: 10-15 s apart on a loaded machine): no alert; the
    schedule paused: one alert, one window after the last completed tick; then a scheduled tick
    that fails (a refused parameter): its alert comes within seconds, not 15 minutes."""
    from prefect.blocks.notifications import CustomWebhookNotificationBlock

    block = unique("ops")
    CustomWebhookNotificationBlock(
        name="delivery alerts", url=receiver.url, json_data={"subject": "{{subject}}", "body": "{{body}}"}
    ).save(block)
    (name,) = [a.name for path, a in automations(uuid4(), True) if path.name == TICK_MISSING_FILE]
    every = SCHEDULED_WINDOW / 4
    schedule = _schedule(api, serving, every)

    def completed() -> list[tuple[datetime, str]]:
        return sorted(
            (datetime.fromisoformat(run["state"]["timestamp"]), run["name"])
            for run in _tick_runs(api, serving)
            if run["state_type"] == "COMPLETED"
        )

    _wait_for(completed, 60, "the first scheduled tick to complete")
    installed_at = datetime.now(UTC)
    done = asyncio.run(install(f"custom-webhook/{block}", True, tick_missing_within=SCHEDULED_WINDOW))
    (automation_id,) = [i.id for i in done if i.name == name]
    _wait_for(lambda: datetime.now(UTC) - installed_at > SCHEDULED_WINDOW * 2.5, 300, "two and a half windows", poll=1)
    ticks = [at for at, _ in completed() if at > installed_at]
    gaps = [(b - a).total_seconds() for a, b in itertools.pairwise([installed_at, *ticks])]
    assert len(ticks) >= 4 and max(gaps) < (SCHEDULED_WINDOW - LATE).total_seconds(), f"ticks too far apart: {gaps}"
    quiet = _firings(automation_id, installed_at)
    assert quiet == [], f"fired while scheduled ticks completed every {every.total_seconds():.1f} s: {quiet}"

    # The schedule paused: one alert, one window after the last tick that completed.
    api_call("PATCH", f"{api}/deployments/{serving}/schedules/{schedule}", {"active": False})
    _wait_for(
        lambda: not [r for r in _tick_runs(api, serving) if r["state_type"] in ("PENDING", "RUNNING")],
        60,
        "the last tick to end",
    )
    stopped_at = datetime.now(UTC)
    last_completed, last_name = completed()[-1]
    (fired,) = _wait_for(
        lambda: _firings(automation_id, stopped_at - SCHEDULED_WINDOW),
        (3 * SCHEDULED_WINDOW + LATE).total_seconds(),
        "the firing",
    )
    late = fired - last_completed
    assert SCHEDULED_WINDOW - timedelta(seconds=1) <= late <= SCHEDULED_WINDOW + LATE, late
    (alert,) = _wait_for(lambda: [p for p in receiver.posts if "no delivery-tick completed" in p["subject"]], 15, "it")
    assert f"The last one that did was {last_name}, at " in alert["body"]

    # A scheduled tick that fails: told within seconds of its end.
    _schedule(api, serving, timedelta(hours=1), {"dead_after_minutes": -1})

    def failed() -> list[dict[str, Any]]:
        return [r for r in _tick_runs(api, serving) if r["state_type"] == "FAILED"]

    (run,) = _wait_for(failed, 60, "the failing tick to end")
    ended = datetime.fromisoformat(run["state"]["timestamp"])
    (told,) = _wait_for(
        lambda: [p for p in receiver.posts if p["subject"].startswith("[delivery] delivery-tick Failed")],
        60,
        "the tick-failed alert",
    )
    assert told["subject"] == f"[delivery] delivery-tick Failed: {run['name']}"
    assert "dead_after_minutes" in told["body"] and datetime.now(UTC) - ended < timedelta(seconds=45)
