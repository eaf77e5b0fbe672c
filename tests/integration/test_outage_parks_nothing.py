"""An outage never parks a record (issue 29, point 1): a failure that may be the target's (a 5xx,
a refused connection, a timeout) spends a record's last attempt but parks it only when it comes
again after the target was seen answering others. Before, the failures a target gave before its
breaker tripped were spent as ordinary attempts, and the first records of an outage were parked
`exhausted`.

The whole target down, for every `max_attempts` (1, 2, 3), settle or send path (grouped on an event
loop, per record, batch calls), kind of failure and concurrency (1 and 8): nothing is parked, chain
after chain, and everything is delivered once the target is back. A record the target alone fails
while it answers the others is still parked. The chains run in this process, on SQLite and
PostgreSQL.
"""

from __future__ import annotations

import itertools
import time
from datetime import timedelta
from typing import Any

import pytest
import sqlalchemy as sa

from delivery.clock import utcnow
from delivery.store.tables import breaker_states_table
from tests.integration.world import RULE, World, email
from tests.support.chains import drive
from tests.target_server import Answer, TargetServer

#: A port nothing listens on: every connection is refused.
CLOSED_PORT_URL = "http://127.0.0.1:9/api"
RECORDS = [f"o-{n:02d}" for n in range(12)]

PATHS = ["grouped", "per_record", "batch"]
FAILURES = ["503", "refused", "timeout"]
CASES = list(itertools.product([1, 2, 3], PATHS, FAILURES, [1, 8]))


def _case_id(case: tuple[int, str, str, int]) -> str:
    attempts, path, failure, concurrency = case
    return f"max{attempts}-{path}-{failure}-c{concurrency}"


def _world(engine: sa.Engine, target: TargetServer, path: str, max_attempts: int, concurrency: int) -> World:
    connection: dict[str, Any] = {
        "settle": "per_record" if path == "per_record" else "grouped",
        "breaker": {"fail_max": 5, "reset_seconds": 60},
    }
    if path == "batch":
        connection["batch"] = {"create_path": "contacts/batch", "update_path": "contacts/batch", "max_items": 10}
    rule = {"max_attempts": max_attempts, "retry_schedule_seconds": [1], "concurrency": concurrency}
    return World(engine, target).apply(target=connection, rule=rule)


def _down(world: World, target: TargetServer, failure: str) -> None:
    if failure == "503":
        target.down = True
    elif failure == "refused":
        world._update_target(base_url=CLOSED_PORT_URL)
    else:
        world.set_timeout(0.2)
        target.latency_ms = 600


def _up(world: World, target: TargetServer) -> None:
    target.down = False
    target.latency_ms = 0
    world._update_target(base_url=target.url, timeout_seconds=5.0)
    # Requests the client gave up on are still sleeping in the target: let them end here, or they
    # would take the next test's scripted answers for their records.
    deadline = time.monotonic() + 30
    while target.in_flight:
        assert time.monotonic() < deadline, "the target's late requests never ended"
        time.sleep(0.05)


def _cool_down(engine: sa.Engine) -> None:
    """Time travel: the breaker opened long enough ago for its trial call."""
    with engine.begin() as conn:
        conn.execute(breaker_states_table.update().values(opened_at=utcnow() - timedelta(minutes=5)))


def _parked(world: World) -> dict[str, str]:
    return {k: row["last_error"] for k, row in world.ledger().items() if row["status"] == "exhausted"}


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_an_outage_parks_no_record(engine: sa.Engine, target: TargetServer, case: tuple[int, str, str, int]) -> None:
    max_attempts, path, failure, concurrency = case
    world = _world(engine, target, path, max_attempts, concurrency)
    world.load(*RECORDS[:4])
    drive(engine, RULE)  # delivered while the target is up: the later changes are updates
    world.load(*RECORDS[:4], name="changed")
    world.load(*RECORDS[4:])  # creates
    _down(world, target, failure)
    # Every record is offered more times than it has attempts while the target stays down: each
    # chain runs into the open breaker, then its trial call after the cooldown fails again.
    for _ in range(max_attempts + 2):
        drive(engine, RULE)
        assert _parked(world) == {}
        _cool_down(engine)
        world.make_due()
    assert "failed" in {row["status"] for row in world.ledger().values()} <= {"failed", "delivered"}

    _up(world, target)
    for _ in range(3):  # the trial call closes the breaker; the rest follow
        drive(engine, RULE)
        _cool_down(engine)
        world.make_due()
    ledger = world.ledger()
    assert {k: row["status"] for k, row in ledger.items()} == dict.fromkeys(RECORDS, "delivered")
    assert target.records("contacts") and all(
        stored["name"] == ("changed" if stored["email"] in {email(i) for i in RECORDS[:4]} else stored["name"])
        for stored in target.records("contacts").values()
    )


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("max_attempts", [1, 3])
def test_a_record_the_target_alone_fails_is_still_parked(
    engine: sa.Engine, target: TargetServer, path: str, max_attempts: int
) -> None:
    """A 503 for one record while the others are answered: proof it is the record, not the target.
    It takes one attempt more than `max_attempts` at least: the failure that spends the last one
    must come again after the target was seen answering someone."""
    world = _world(engine, target, path, max_attempts, concurrency=1)
    bad = email("bad-1")  # a key no other test of this module sends
    statuses = []
    for round_ in range(max_attempts + 3):
        # Fresh records each chain, so there is always someone the target answers.
        world.load(*[f"ok-{round_}-{n}" for n in range(3)], "bad-1")
        target.program(bad, Answer.status(503))
        drive(engine, RULE)
        world.make_due()
        statuses.append(world.ledger()["bad-1"]["status"])
        if statuses[-1] == "exhausted":
            break
    assert statuses[:max_attempts] == ["failed"] * max_attempts
    row = world.ledger()["bad-1"]
    assert row["status"] == "exhausted", statuses
    assert row["last_error"].startswith(f"gave up after {row['attempts']} attempts: "), row
    assert row["attempts"] > max_attempts
    assert all(r["status"] == "delivered" for k, r in world.ledger().items() if k != "bad-1")


def test_a_whole_batch_call_failing_proves_nothing_about_its_items(engine: sa.Engine, target: TargetServer) -> None:
    """A record awaiting proof (its last attempt spent by a 503 of its own while the others were
    answered) whose next batch call fails as a whole: one failure for the breaker, but it is the
    call's, not the record's. Before, the breaker's count of 1 read as "healthy" and it was parked."""
    world = _world(engine, target, "batch", max_attempts=1, concurrency=1)
    world.load("a", "b", "c")
    drive(engine, RULE)
    world.load("a", "b", "c", name="changed")
    target.program_remote(world.ledger()["a"]["remote_id"], Answer.status(503))  # a alone fails; b, c answered
    drive(engine, RULE)
    assert world.ledger()["a"]["status"] == "failed" and world.ledger()["a"]["attempts"] == 1
    world.make_due()
    target.program_batch(Answer.status(503))  # the whole call fails: the target, not the record
    drive(engine, RULE)
    assert world.ledger()["a"]["status"] == "failed", world.ledger()["a"]
