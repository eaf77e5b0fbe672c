"""Locks the tests take or watch: a Prefect rule lock of a test's own, and PostgreSQL row locks
that prove two transactions overlapped."""

from __future__ import annotations

import asyncio
import time

import pytest
import sqlalchemy as sa

import flows.lock
from flows.lock import ensure_lock
from tests.integration.world import RULE
from tests.support.databases import unique


def own_rule_lock(monkeypatch: pytest.MonkeyPatch, prefix: str) -> str:
    """A rule-lock limit of the calling test's own (so no other test's slot is in the way), waited
    for in 1-second steps; returns its name."""
    name = unique(prefix)
    monkeypatch.setattr(flows.lock, "lock_name", lambda rule: name)
    monkeypatch.setenv("DELIVERY_LOCK_WAIT_STEP_SECONDS", "1")
    asyncio.run(ensure_lock(RULE))
    return name


def wait_for_a_lock_wait(engine: sa.Engine, what: str) -> None:
    """Proof two transactions overlapped: one of them is waiting on the other's row lock.
    `what` names the wait expected, for the failure message."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        with engine.connect() as conn:
            waiting = conn.exec_driver_sql(
                "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND datname = current_database()"
            ).scalar_one()
        if waiting:
            return
        time.sleep(0.05)
    raise AssertionError(f"{what} never waited on the other transaction")
