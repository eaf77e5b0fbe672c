"""The fault table of ADR-0029, row by row, against the chain with the real store (SQLite and
PostgreSQL) and the real local HTTP target, without Prefect: every record fault lands in that
record's ledger row and the job carries on; every rule fault ends the chain and writes nothing for
itself. (The Prefect wiring of the same endings is tested in test_chain.py and test_operator_runs.py.)"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest
import sqlalchemy as sa

from delivery import senders as senders_module
from delivery.clock import utcnow
from delivery.domain import Candidate, ChainEnd, ConnectionStatus
from delivery.errors import LedgerRowConflict, MissingWriter, RuleFault, UnexpectedCandidate, UnsupportedDeliveryVerb
from delivery.store import catalog, ledger
from tests.integration.world import RULE, World
from tests.support.chains import drive
from tests.support.faults import close_route, open_breaker, scan_then_race
from tests.target_server import Answer, TargetServer


@pytest.fixture(params=["grouped", "grouped-threads", "per_record"])
def world(
    engine: sa.Engine, target: TargetServer, request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> World:
    # One write at a time, in order: each row of the table is one record between two healthy ones.
    # Both ways of settling a job, each of which routes the faults itself; grouped, both ways of
    # sending (from one event loop, the `rest` writer's default, and a thread per call, what a
    # writer with only sync verbs gets).
    settle, _, path = request.param.partition("-")
    if path == "threads":
        monkeypatch.setattr(senders_module, "offers_async", lambda _writer: False)
    return World(engine, target).apply(target={"settle": settle}, rule={"concurrency": 1})


# -- record faults: the record's row, and the job carries on ----------------------------------------

#: (what the target does to a create, the row it leaves: status, attempts, whether a retry is due)
CREATE_FAULTS: dict[str, tuple[Answer, str, int, bool]] = {
    "timeout": (Answer.timeout(2), "failed", 1, True),
    "connection dropped": (Answer.drop(), "failed", 1, True),
    "5xx": (Answer.status(500), "failed", 1, True),
    "429 without Retry-After": (Answer.status(429), "failed", 1, True),
    "rejected field (422)": (Answer.status(422, {"error": "email is invalid"}), "failed", 1, True),
    "2xx without a usable id": (Answer.no_id(), "exhausted", 1, False),
}


@pytest.mark.parametrize("case", list(CREATE_FAULTS))
def test_a_record_fault_on_a_create_lands_in_its_row_and_the_job_carries_on(world: World, case: str) -> None:
    answer, status, attempts, due = CREATE_FAULTS[case]
    world.load("before", "hit", "after")
    world.target.program(world.key("hit"), answer)
    if answer.kind == "timeout":
        world.set_timeout()
    report = drive(world.engine, RULE)
    assert report.ended_by is ChainEnd.CAUGHT_UP
    rows = world.ledger()
    assert rows["before"]["status"] == rows["after"]["status"] == "delivered"
    hit = world.full_ledger_row("hit")
    assert (hit["status"], hit["attempts"]) == (status, attempts)
    assert (hit["next_attempt_at"] is not None) is due and hit["last_error"]
    assert world.cursor() is not None  # the cursor moved past it


@pytest.mark.parametrize("code", [404, 410])
def test_an_update_answered_gone_parks_remote_gone(world: World, code: int) -> None:
    world.load("a")
    drive(world.engine, RULE)
    world.target.program_remote(world.ledger()["a"]["remote_id"], Answer.status(code))
    world.load("a", name="changed")
    drive(world.engine, RULE)
    row = world.full_ledger_row("a")
    assert row["status"] == "remote_gone" and row["next_attempt_at"] is None and f"HTTP {code}" in row["last_error"]


def test_the_failure_that_reaches_max_attempts_parks_exhausted(world: World) -> None:
    world.load("a")
    world.target.program(world.key("a"), *[Answer.status(422)] * 3)  # not the target's fault: no breaker
    for _ in range(3):  # max_attempts 3
        drive(world.engine, RULE)
        world.make_due()
    row = world.full_ledger_row("a")
    assert row["status"] == "exhausted" and row["attempts"] == 3 and row["last_error"].startswith("gave up after 3")


# -- rule faults: the chain ends and nothing is written for them ----------------------------------


def _leaky_scan(real: Callable[..., Any]) -> Callable[..., Any]:
    def scan(conn: sa.Connection, rule: Any, after: Any, limit: int) -> Any:
        page = real(conn, rule, after, limit)
        return [Candidate(dataclasses.replace(page[0].record, domain="company"), None)] if page else page

    return scan


#: Results: how the chain ends (Completed), with nothing sent and nothing written.
RESULTS: dict[str, tuple[Callable[[World], None], ChainEnd]] = {
    "route closed": (close_route, ChainEnd.ROUTE_CLOSED),
    "breaker open": (open_breaker, ChainEnd.BREAKER_OPEN),
}


@pytest.mark.parametrize("case", list(RESULTS))
def test_a_closed_route_or_an_open_breaker_ends_the_chain_as_a_result(world: World, case: str) -> None:
    make, ending = RESULTS[case]
    world.load("a")
    make(world)
    report = drive(world.engine, RULE)
    assert report.ended_by is ending
    assert world.target.requests == [] and world.ledger() == {} and world.cursor() is None
    with world.engine.connect() as conn:
        assert catalog.get_rule(conn, RULE).target.status is (
            ConnectionStatus.ERROR if case == "route closed" else ConnectionStatus.ACTIVE
        )  # an open breaker never touches the connection's status


#: Exceptions: the chain fails, nothing is written for the fault, the cursor stays.
EXCEPTIONS: dict[str, tuple[Callable[[World, pytest.MonkeyPatch], None], type[RuleFault]]] = {
    "no writer for the driver": (lambda world, _: world.set_driver("soap"), MissingWriter),
    "the writer lacks the verb": (lambda world, _: world.set_driver("rest-create-only"), UnsupportedDeliveryVerb),
    "a ledger row where the scan said none": (
        lambda _, mp: mp.setattr(ledger, "scan_page", scan_then_race(ledger.scan_page)),
        LedgerRowConflict,
    ),
    "a candidate the scan should never return": (
        lambda _, mp: mp.setattr(ledger, "scan_page", _leaky_scan(ledger.scan_page)),
        UnexpectedCandidate,
    ),
}


@pytest.mark.parametrize("case", list(EXCEPTIONS))
def test_a_rule_fault_fails_the_chain_and_writes_nothing_for_it(
    world: World, monkeypatch: pytest.MonkeyPatch, case: str
) -> None:
    make, fault = EXCEPTIONS[case]
    world.load("a")
    if case == "the writer lacks the verb":  # an update is what the create-only writer lacks
        drive(world.engine, RULE)
        world.load("a", name="changed")
    before = world.ledger()
    cursor = world.cursor()
    sent = len(world.target.requests)
    make(world, monkeypatch)
    with pytest.raises(fault):
        drive(world.engine, RULE)
    after = world.ledger()
    if case == "a ledger row where the scan said none":
        # The racing writer's row stands; the chain wrote none of its own.
        assert {k: r["status"] for k, r in after.items()} == {"a": "delivered"} and after["a"]["remote_id"] is None
    else:
        assert after == before  # not even an update's intent (the row marked in doubt) stays
    assert world.cursor() == cursor and len(world.target.requests) == sent


def test_a_later_chain_resumes_where_the_route_closed(world: World) -> None:
    world.load("a")
    close_route(world)
    drive(world.engine, RULE)
    with world.engine.begin() as conn:
        catalog.set_connection_status(conn, "crm", ConnectionStatus.ACTIVE)
    report = drive(world.engine, RULE)
    assert report.ended_by is ChainEnd.CAUGHT_UP and report.counts["delivered"] == 1
    assert world.full_ledger_row("a")["updated_at"] <= utcnow() + timedelta(seconds=1)
