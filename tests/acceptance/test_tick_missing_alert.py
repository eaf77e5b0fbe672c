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
import time
from datetime import UTC, datetime, timedelta
from typing import Any, cast
from uuid import UUID, uuid4

import pytest
import sqlalchemy as sa

from flows.automations import FORMER_NAMES, TICK_MISSING_FILE, automations, install
from tests.support.alerts import Receiver, firings
from tests.support.databases import unique
from tests.support.waiting import wait_for

WINDOW = timedelta(seconds=20)
#: How late a firing may come: Prefect evaluates proactive triggers every 5 s, then the actions
#: service sends the notification. Less than a window, so a firing a window late fails the test.
LATE = timedelta(seconds=10)


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
    alerting_api: str, receiver: Receiver, engine: sa.Engine
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
    (first,) = wait_for(
        lambda: firings(automation_id, installed_at), (WINDOW + LATE).total_seconds() + 15, "the first firing"
    )
    assert WINDOW - timedelta(seconds=1) <= first - installed_at <= WINDOW + LATE, first - installed_at
    (alert,) = wait_for(alerts, 15, "the first notification")

    # 2. Ticks that keep completing, for longer than a window: each restarts it, nothing fires.
    ticking_since = datetime.now(UTC)
    ticks = [_tick()]
    while ticks[-1][1] - ticks[0][1] < WINDOW * 1.5:
        ticks.append(_tick())
    gaps = [b[1] - a[1] for a, b in itertools.pairwise(ticks)]
    assert max(gaps) < WINDOW - LATE, f"ticks too far apart to keep the window open: {gaps}"
    last_name, last_completed = ticks[-1]
    quiet = firings(automation_id, ticking_since)
    assert quiet == [], f"fired while ticks completed {[str(t[1]) for t in ticks]}: {quiet}"

    # 3. No more ticks: it fires one window after the last Completed, not two.
    (fired,) = wait_for(
        lambda: firings(automation_id, ticking_since), (3 * WINDOW + LATE).total_seconds(), "the firing"
    )
    late = fired - last_completed
    assert WINDOW - timedelta(seconds=1) <= late <= WINDOW + LATE, (
        f"fired {late.total_seconds():.1f} s after the last completed tick, for a {WINDOW.total_seconds():.0f} s window"
    )
    # What they say: the window installed, and the last tick that completed once there was one.
    assert alert["subject"] == "[delivery] no delivery-tick completed for 20 seconds"
    assert "has Completed in the last 20 seconds" in alert["body"] and "The last one that did" not in alert["body"]
    after_ticks = wait_for(lambda: alerts()[1:], 15, "the notification after the ticks")
    assert after_ticks[0]["subject"] == alert["subject"]
    assert f"The last one that did was {last_name}, at " in after_ticks[0]["body"]
    assert "This alert repeats every 40 seconds until a tick completes." in after_ticks[0]["body"]


def test_an_install_renames_the_automation_installed_under_the_former_name_in_place(alerting_api: str) -> None:
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
    alerting_api: str, receiver: Receiver, engine: sa.Engine
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
    quiet = firings(automation_id, installed_at)
    assert quiet == [], f"fired while ticks completed every {every.total_seconds():.1f} s: {quiet}"
    last_completed = ticks[-1][1]
    (fired,) = wait_for(lambda: firings(automation_id, installed_at), (3 * WINDOW + LATE).total_seconds(), "the firing")
    late = fired - last_completed
    assert WINDOW - timedelta(seconds=1) <= late <= WINDOW + LATE, late
