"""The "no tick completed" automation as the installer loads it, and its texts as Prefect renders
them (its own sandboxed Jinja). That it fires on time is tests/acceptance/test_tick_missing_alert.py,
on a real server."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from types import SimpleNamespace
from typing import Any
from uuid import uuid4

import pytest
from typer.testing import CliRunner

from delivery.errors import InputError
from flows.automations import FORMER_NAMES, TICK_MISSING_FILE, automations, tick_missing_window
from flows.cli import app


def _tick_missing(within: timedelta | None = None) -> Any:
    (automation,) = [
        a for path, a in automations(uuid4(), True, tick_missing_within=within) if path.name == TICK_MISSING_FILE
    ]
    return automation


def test_every_completed_tick_restarts_the_window() -> None:
    automation = _tick_missing()
    trigger = automation.trigger
    assert trigger.posture == "Proactive"
    # `after` equal to `expect`: a completed tick starts a window, and the next one restarts it.
    # The tick's own event, not Prefect's state events (held back up to 15 minutes for a run its
    # scheduler made: flows/tick_events.py).
    assert trigger.after == trigger.expect == {"delivery.tick.completed"}
    assert trigger.match.root == {"prefect.resource.id": "delivery.tick.*"}
    assert not trigger.for_each  # one window for the deployment, opened by Prefect at install
    assert (trigger.threshold, trigger.within) == (1, timedelta(minutes=15))


def test_the_window_can_be_set_at_install_and_the_other_automations_keep_theirs() -> None:
    assert _tick_missing(timedelta(seconds=20)).trigger.within == timedelta(seconds=20)
    others = [
        a
        for path, a in automations(uuid4(), True, tick_missing_within=timedelta(minutes=3))
        if path.name != TICK_MISSING_FILE
    ]
    assert others and all(a.trigger.within == timedelta(0) for a in others)  # type: ignore[union-attr]


def test_the_renamed_automation_is_found_under_its_former_name() -> None:
    assert FORMER_NAMES[_tick_missing().name] == ("delivery: no tick completed for 15 minutes",)


@pytest.mark.parametrize(("minutes", "seconds"), [(15, 900), (0.5, 30), (10 / 60, 10), (10080, 7 * 24 * 3600)])
def test_tick_missing_minutes_taken(minutes: float, seconds: float) -> None:
    assert tick_missing_window(minutes) == timedelta(seconds=seconds)


@pytest.mark.parametrize("minutes", [0, 0.1, -5, 10081, float("nan"), float("inf"), 1e300])
def test_tick_missing_minutes_refused(minutes: float) -> None:
    with pytest.raises(InputError, match=r"^--tick-missing-minutes: .* give 0\.17 \(10 seconds\) to 10080 \(a week\)$"):
        tick_missing_window(minutes)


def test_the_cli_refuses_a_window_prefect_cannot_watch_before_asking_prefect() -> None:
    result = CliRunner().invoke(
        app, ["alerts", "install", "--block", "custom-webhook/ops", "--tick-missing-minutes", "0.1"]
    )
    assert result.exit_code != 0 and isinstance(result.exception, InputError), result.output
    assert "--tick-missing-minutes: 0.1 is not a window Prefect can watch" in str(result.exception)


def _render(within: timedelta, event: Any = None) -> tuple[str, str]:
    from prefect.server.utilities.user_templates import render_user_template_sync

    (action,) = _tick_missing(within).actions
    context = {"automation": SimpleNamespace(trigger=SimpleNamespace(within=within)), "event": event}
    return render_user_template_sync(action.subject, context), render_user_template_sync(action.body, context)


@pytest.mark.parametrize(
    ("within", "said", "repeat"),
    [
        (timedelta(minutes=15), "15 minutes", "30 minutes"),
        (timedelta(minutes=1), "1 minute", "2 minutes"),
        (timedelta(seconds=20), "20 seconds", "40 seconds"),
        (timedelta(seconds=90), "90 seconds", "3 minutes"),
    ],
)
def test_the_texts_say_the_window_installed(within: timedelta, said: str, repeat: str) -> None:
    subject, body = _render(within)
    assert subject == f"[delivery] no delivery-tick completed for {said}"
    assert body == (
        f"No run of the delivery-tick flow has Completed in the last {said}: no new chains are started.\n"
        "Check that a worker polls the delivery work pool and that the delivery-tick deployment and its "
        "schedule are active.\n"
        f"This alert repeats every {repeat} until a tick completes."
    )


def test_the_body_names_the_last_tick_that_completed_when_there_was_one() -> None:
    event = SimpleNamespace(
        resource=SimpleNamespace(name="wine-rat"), occurred=datetime(2026, 12, 5, 12, 8, 21, 345, tzinfo=UTC)
    )
    _, body = _render(timedelta(minutes=15), event)
    assert "no new chains are started.\nThe last one that did was wine-rat, at 2026-12-05 12:08:21 UTC.\nCheck" in body


def _tick_failed_texts(resource: dict[str, str]) -> tuple[str, str]:
    from prefect.events.schemas.events import Resource
    from prefect.server.utilities.user_templates import render_user_template_sync

    (action,) = next(a for path, a in automations(uuid4(), True) if path.name == "tick-failed.yaml").actions
    context = {"event": SimpleNamespace(resource=Resource(resource))}
    return render_user_template_sync(action.subject, context), render_user_template_sync(action.body, context)


def test_the_tick_failed_alert_says_the_ticks_own_event_and_prefects_crashed_one_alike() -> None:
    """`delivery.tick.failed` (the tick says it, at once) and Prefect's `Crashed` state event (a tick
    whose process died) carry the state's name and message under different labels."""
    ours = _tick_failed_texts(
        {
            "prefect.resource.id": "delivery.tick.0193",
            "prefect.resource.name": "tick 07:05",
            "delivery.state-name": "Failed",
            "delivery.state-message": "dead_after_minutes: -1 is not a number of minutes",
        }
    )
    crashed = _tick_failed_texts(
        {
            "prefect.resource.id": "prefect.flow-run.0193",
            "prefect.resource.name": "tick 07:05",
            "prefect.state-name": "Crashed",
            "prefect.state-message": "Flow run process exited with code -9",
        }
    )
    assert ours[0] == "[delivery] delivery-tick Failed: tick 07:05"
    assert ours[1].startswith("The delivery-tick run tick 07:05 ended Failed: dead_after_minutes: -1 is not")
    assert crashed[0] == "[delivery] delivery-tick Crashed: tick 07:05"
    assert crashed[1].startswith("The delivery-tick run tick 07:05 ended Crashed: Flow run process exited")
