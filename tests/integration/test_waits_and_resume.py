"""Waits said at once, and a pause ended by hand (issue 32, point 3), on SQLite and PostgreSQL: a
sender about to wait more than a second for a target's pause or budget tells the chain's listeners
(the run log's `waiting until ... UTC for target crm's pause (HTTP 429, Retry-After 600 s)`), once
per thing waited for; `delivery connection-status NAME --resume` ends a pause now and records it."""

from __future__ import annotations

import json
import threading
from datetime import datetime, timedelta

import pytest
import sqlalchemy as sa
from typer.testing import CliRunner

from delivery.clock import SYSTEM, utcnow
from delivery.errors import InputError, UnknownName
from delivery.store import catalog
from delivery.store import traffic as traffic_store
from delivery.store.tables import target_traffic_table
from delivery.traffic import JobBounds, TargetTraffic, TrafficListener
from flows.cli import app
from tests.integration.world import World
from tests.target_server import TargetServer


class Waits(TrafficListener):
    def __init__(self) -> None:
        self.told: list[tuple[str, datetime, str]] = []

    def waiting(self, target: str, until: datetime, what: str) -> None:
        self.told.append((target, until, what))


def pause(engine: sa.Engine, seconds: float) -> datetime:
    until = utcnow() + timedelta(seconds=seconds)
    with engine.connect() as conn:
        crm = catalog.get_rule(conn, "contacts-to-crm").target
    traffic_store.ensure_row(engine, crm.id)
    with engine.begin() as conn:
        conn.execute(
            target_traffic_table.update().values(
                paused_at=utcnow(), paused_until=until, pause_reason="HTTP 429, Retry-After 600 s"
            )
        )
    return until


def test_a_wait_for_a_pause_is_told_as_it_begins_once(engine: sa.Engine, target: TargetServer) -> None:
    World(engine, target).apply()
    with engine.connect() as conn:
        crm = catalog.get_rule(conn, "contacts-to-crm").target
    waits = Waits()
    traffic = TargetTraffic(engine, crm, SYSTEM, [waits])
    until = pause(engine, 600)
    stop = threading.Event()
    stop.set()  # the job is stopping: the wait ends at once, after it was told
    bounds = JobBounds(utcnow() + timedelta(hours=1), stop)
    assert traffic.admit(bounds) is False
    assert traffic.admit(bounds) is False
    assert waits.told == [("crm", until, "its pause (HTTP 429, Retry-After 600 s)")]


def test_a_short_wait_is_not_told(engine: sa.Engine, target: TargetServer) -> None:
    World(engine, target).apply()
    with engine.connect() as conn:
        crm = catalog.get_rule(conn, "contacts-to-crm").target
    waits = Waits()
    traffic = TargetTraffic(engine, crm, SYSTEM, [waits])
    pause(engine, 0.5)
    stop = threading.Event()
    stop.set()
    traffic.admit(JobBounds(utcnow() + timedelta(hours=1), stop))
    assert waits.told == []


def test_resume_ends_a_pause_by_hand_and_records_it(engine: sa.Engine, target: TargetServer) -> None:
    World(engine, target).apply()
    runner = CliRunner()
    idle = runner.invoke(app, ["connection-status", "crm", "--resume"])
    assert idle.exit_code == 0 and "connection crm is not paused: nothing to resume" in idle.output
    until = pause(engine, 600)
    done = runner.invoke(app, ["connection-status", "crm", "--resume"])
    assert done.exit_code == 0, done.output
    assert (
        f"its pause until {until.isoformat(timespec='seconds')} (HTTP 429, Retry-After 600 s) is ended" in done.output
    )
    with engine.connect() as conn:
        row = conn.execute(sa.select(target_traffic_table)).one()
    assert row.paused_until is None and row.resumed_at is not None and "--resume" in row.resumed_note
    shown = json.loads(runner.invoke(app, ["connection-status", "crm", "--json"]).stdout)
    assert shown["paused_until"] is None and shown["resumed_by_hand_at"] == row.resumed_at.isoformat()
    # Refused before anything is written (the console script makes it exit 2, naming it).
    both = runner.invoke(app, ["connection-status", "crm", "active", "--resume"])
    assert isinstance(both.exception, InputError) and "--resume: give it alone" in str(both.exception)


@pytest.mark.parametrize("unknown", ["nope"])
def test_resume_of_an_unknown_connection_is_refused(engine: sa.Engine, target: TargetServer, unknown: str) -> None:
    World(engine, target).apply()
    refused = CliRunner().invoke(app, ["connection-status", unknown, "--resume"])
    assert isinstance(refused.exception, UnknownName) and "no connection named 'nope'" in str(refused.exception)


def test_a_record_held_by_a_pause_is_said_to_have_spent_no_attempt(
    prefect_api: None, engine: sa.Engine, target: TargetServer
) -> None:
    from tests.integration.runs import run_logs
    from tests.target_server import Answer

    world = World(engine, target).apply()
    world.load("a")
    target.program(world.key("a"), Answer.status(429, headers={"Retry-After": "600"}))
    result = world.run()
    assert result["ended_by"] == "rate_limited"
    assert world.full_ledger_row("a")["attempts"] == 0
    logs = run_logs(result["flow_run_id"])
    held = [line for line in logs if "record a held by target crm (no attempt spent)" in line]
    assert held, logs
    assert not [line for line in logs if "record a failed" in line]
