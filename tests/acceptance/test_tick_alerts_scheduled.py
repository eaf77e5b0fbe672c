"""The tick alerts (automations/tick-missing.yaml, tick-failed.yaml) on ticks that Prefect's
scheduler makes, as in production: `delivery serve` against a real `prefect server start`, the
delivery-tick deployment on an interval schedule.

Prefect's scheduler writes a run's Scheduled state without an event, and Prefect's automations hold
each later state event of that run back, waiting for the event it follows, for up to 15 minutes. The
alerts watched those state events and fired falsely (issue 32, point 4); they watch the tick's own
events now (flows/tick_events.py). The in-process ticks of tests/acceptance/test_tick_missing_alert.py
never had that problem: a run created through the API gets its Scheduled event.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import subprocess
import sys
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any
from uuid import uuid4

import pytest
import sqlalchemy as sa

from flows.automations import TICK_MISSING_FILE, automations, install
from tests.prefect_server import api_call, stop_group
from tests.support.alerts import Receiver, firings
from tests.support.databases import unique
from tests.support.waiting import wait_for

#: A tick run `delivery serve` starts is a process of its own: 10 to 15 s apart on a loaded machine.
SCHEDULED_WINDOW = timedelta(seconds=60)
#: How late a firing may come: Prefect evaluates proactive triggers every 5 s, then the actions
#: service sends the notification.
LATE = timedelta(seconds=10)


@pytest.fixture
def serving(alerting_api: str, tmp_path: Path) -> Iterator[str]:
    """`delivery serve` against the module's server (its deployments: delivery-tick among them);
    yields the delivery-tick deployment's id, its schedules removed."""
    env = {
        **os.environ,
        "PREFECT_API_URL": alerting_api,
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
                "POST", f"{alerting_api}/deployments/filter", {"deployments": {"name": {"any_": ["delivery-tick"]}}}
            )
            return found[0] if found else None

        tick = wait_for(deployment, 120, "delivery serve's delivery-tick deployment")
        for schedule in tick["schedules"]:
            api_call("DELETE", f"{alerting_api}/deployments/{tick['id']}/schedules/{schedule['id']}")
        yield str(tick["id"])
    finally:
        stop_group(process)


def _schedule(alerting_api: str, deployment_id: str, every: timedelta, parameters: dict[str, Any] | None = None) -> str:
    """An interval schedule on the deployment, its first run in a few seconds (the scheduler
    makes none in the past); its id."""
    first = datetime.now(UTC) + timedelta(seconds=5)
    schedule = {"interval": every.total_seconds(), "anchor_date": first.isoformat()}
    (made,) = api_call(
        "POST",
        f"{alerting_api}/deployments/{deployment_id}/schedules",
        [{"schedule": schedule, "active": True, "parameters": parameters or {}}],
    )
    return str(made["id"])


def _tick_runs(alerting_api: str, deployment_id: str) -> list[dict[str, Any]]:
    runs: list[dict[str, Any]] = api_call(
        "POST", f"{alerting_api}/flow_runs/filter", {"flow_runs": {"deployment_id": {"any_": [deployment_id]}}}
    )
    return runs


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
def test_ticks_made_by_the_scheduler_keep_the_alert_quiet_and_a_failed_one_is_told_at_once(
    alerting_api: str, receiver: Receiver, engine: sa.Engine, serving: str
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
    schedule = _schedule(alerting_api, serving, every)

    def completed() -> list[tuple[datetime, str]]:
        return sorted(
            (datetime.fromisoformat(run["state"]["timestamp"]), run["name"])
            for run in _tick_runs(alerting_api, serving)
            if run["state_type"] == "COMPLETED"
        )

    wait_for(completed, 60, "the first scheduled tick to complete")
    installed_at = datetime.now(UTC)
    done = asyncio.run(install(f"custom-webhook/{block}", True, tick_missing_within=SCHEDULED_WINDOW))
    (automation_id,) = [i.id for i in done if i.name == name]
    wait_for(lambda: datetime.now(UTC) - installed_at > SCHEDULED_WINDOW * 2.5, 300, "two and a half windows", poll=1)
    ticks = [at for at, _ in completed() if at > installed_at]
    gaps = [(b - a).total_seconds() for a, b in itertools.pairwise([installed_at, *ticks])]
    assert len(ticks) >= 4 and max(gaps) < (SCHEDULED_WINDOW - LATE).total_seconds(), f"ticks too far apart: {gaps}"
    quiet = firings(automation_id, installed_at)
    assert quiet == [], f"fired while scheduled ticks completed every {every.total_seconds():.1f} s: {quiet}"

    # The schedule paused: one alert, one window after the last tick that completed.
    api_call("PATCH", f"{alerting_api}/deployments/{serving}/schedules/{schedule}", {"active": False})
    wait_for(
        lambda: not [r for r in _tick_runs(alerting_api, serving) if r["state_type"] in ("PENDING", "RUNNING")],
        60,
        "the last tick to end",
    )
    stopped_at = datetime.now(UTC)
    last_completed, last_name = completed()[-1]
    (fired,) = wait_for(
        lambda: firings(automation_id, stopped_at - SCHEDULED_WINDOW),
        (3 * SCHEDULED_WINDOW + LATE).total_seconds(),
        "the firing",
    )
    late = fired - last_completed
    assert SCHEDULED_WINDOW - timedelta(seconds=1) <= late <= SCHEDULED_WINDOW + LATE, late
    (alert,) = wait_for(lambda: [p for p in receiver.posts if "no delivery-tick completed" in p["subject"]], 15, "it")
    assert f"The last one that did was {last_name}, at " in alert["body"]

    # A scheduled tick that fails: told within seconds of its end.
    _schedule(alerting_api, serving, timedelta(hours=1), {"dead_after_minutes": -1})

    def failed() -> list[dict[str, Any]]:
        return [r for r in _tick_runs(alerting_api, serving) if r["state_type"] == "FAILED"]

    (run,) = wait_for(failed, 60, "the failing tick to end")
    ended = datetime.fromisoformat(run["state"]["timestamp"])
    (told,) = wait_for(
        lambda: [p for p in receiver.posts if p["subject"].startswith("[delivery] delivery-tick Failed")],
        60,
        "the tick-failed alert",
    )
    assert told["subject"] == f"[delivery] delivery-tick Failed: {run['name']}"
    assert "dead_after_minutes" in told["body"] and datetime.now(UTC) - ended < timedelta(seconds=45)
