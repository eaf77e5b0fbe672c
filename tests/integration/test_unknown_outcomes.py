"""A write whose answer never came leaves the target's body unknown, and the next offer of the record
is sent whatever its body; an outage never spends a record's last attempt; a target refusing the
credentials is a fault of the rule. The chain driven without Prefect against the real local
target, on SQLite and PostgreSQL, for both settle modes where the settle path matters.

The three stale paths these guard against, each of which left the target older than the mirror
while the ledger said delivered:
1. an update applied but answered after the timeout, then the record reverted to the body last
   confirmed: the revert was suppressed as identical;
2. the same with the process gone between the send and the settle;
3. a replayed create's follow-up update applied with no outcome recorded, then the record reverted
   to the create's first body: the next replay sent no follow-up.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest
import sqlalchemy as sa

from delivery import senders as senders_module
from delivery.clock import utcnow
from delivery.domain import ChainEnd
from delivery.errors import Unauthorized
from delivery.store import ledger
from delivery.store.tables import breaker_states_table, ledger_table
from tests.integration.world import RULE, SHORT_TIMEOUT_SECONDS, World, email
from tests.support.chains import drive
from tests.target_server import Answer, TargetServer

SETTLES = ["grouped", "grouped-threads", "per_record"]
#: Longer than the short timeout (`SHORT_TIMEOUT_SECONDS`, 0.5 s): the target applies the write
#: after the client gave up.
LATE = 1.5


class Abandoned(BaseException):
    """The in-process stand-in for kill -9: the chain stops dead, between a send and its settle."""


@contextlib.contextmanager
def settles_die(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Every settle dies before writing: what a kill after the target answered leaves behind."""

    def die(*_args: Any, **_kwargs: Any) -> bool:
        raise Abandoned

    with monkeypatch.context() as patched:
        patched.setattr(ledger, "settle", die)
        patched.setattr(ledger, "settle_many", die)
        yield


def world_for(engine: sa.Engine, target: TargetServer, settle: str, **rule: Any) -> World:
    """`settle` "grouped-threads": grouped, sent from threads (as a writer with only sync verbs
    is) instead of the `rest` writer's event loop. The target keeps World's generous timeout; a
    test whose subject is a late answer shortens it first (`World.set_timeout`): a loaded machine
    once timed out a test's first create at 0.5 s, the record was then a failed row the next
    chain's scan left alone, and nothing was settled."""
    return World(engine, target).apply(target={"settle": settle_mode(settle)}, rule=rule or None)


def settle_mode(settle: str) -> str:
    """The connection's `settle` of a `SETTLES` case, the path it asks for taken (see `world_for`)."""
    mode, _, path = settle.partition("-")
    if path == "threads":
        _threads.setattr(senders_module, "offers_async", lambda _writer: False)
    return mode


#: Undone after each test (`_undo_threads`).
_threads = pytest.MonkeyPatch()


@pytest.fixture(autouse=True)
def _undo_threads() -> Iterator[None]:
    yield
    _threads.undo()


def held(world: World, external_id: str) -> dict[str, Any]:
    """What the target holds for the record (one copy of it, checked)."""
    copies = [r for r in world.target.records("contacts").values() if r.get("email") == email(external_id)]
    assert len(copies) == 1, copies
    return copies[0]


def wait_applied(world: World, external_id: str, name: str) -> None:
    """The late write lands once the target's stall ends."""
    deadline = utcnow() + timedelta(seconds=30)
    while held(world, external_id).get("name") != name:
        assert utcnow() < deadline, f"the target never applied {name!r}"
        world.target._stopping.wait(0.05)


def abandoned_chain(world: World) -> None:
    with pytest.raises(Abandoned):
        drive(world.engine, RULE)


# -- 1. an update applied, its answer late ---------------------------------------------------------


@pytest.mark.parametrize("settle", SETTLES)
def test_an_update_answered_late_then_reverted_is_sent_again(
    engine: sa.Engine, target: TargetServer, settle: str
) -> None:
    world = world_for(engine, target, settle, fields={"email": "email", "name": "name"})
    world.load("a", name="A")
    drive(engine, RULE)
    remote_id = world.ledger()["a"]["remote_id"]

    world.load("a", name="B")
    world.set_timeout(SHORT_TIMEOUT_SECONDS)
    target.program_remote(remote_id, Answer.timeout(LATE))
    drive(engine, RULE)
    row = world.ledger()["a"]
    assert row["status"] == "failed" and "timed out" in row["last_error"] and row["in_doubt"], row
    wait_applied(world, "a", "B")

    world.load("a", name="A")  # back to the body the target last confirmed
    world.make_due()
    drive(engine, RULE)
    assert held(world, "a")["name"] == "A"
    row = world.ledger()["a"]
    assert row["status"] == "delivered" and not row["in_doubt"], row

    # Confirmed again: a change that maps to the same body is suppressed, as ever.
    sent = len(target.requests)
    world.load("a", name="A", note="not mapped")
    drive(engine, RULE)
    assert len(target.requests) == sent
    assert world.ledger()["a"]["status"] == "suppressed"


@pytest.mark.parametrize("settle", SETTLES)
def test_a_refusal_the_target_answered_keeps_suppression(engine: sa.Engine, target: TargetServer, settle: str) -> None:
    """A 422 is an answer: the write was not applied, so what the target holds is still known."""
    world = world_for(engine, target, settle, fields={"email": "email", "name": "name"})
    world.load("a", name="A")
    drive(engine, RULE)
    remote_id = world.ledger()["a"]["remote_id"]
    world.load("a", name="B")
    target.program_remote(remote_id, Answer.status(422))
    drive(engine, RULE)
    assert not world.ledger()["a"]["in_doubt"]
    world.load("a", name="A")
    world.make_due()
    sent = len(target.requests)
    drive(engine, RULE)
    assert len(target.requests) == sent
    assert world.ledger()["a"]["status"] == "suppressed"


# -- 2. an update cut between send and settle ------------------------------------------------------


@pytest.mark.parametrize("settle", SETTLES)
def test_an_update_whose_settle_never_came_is_sent_again_after_a_revert(
    engine: sa.Engine, target: TargetServer, settle: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    world = world_for(engine, target, settle)
    world.load("a", name="A")
    drive(engine, RULE)

    world.load("a", name="B")
    with settles_die(monkeypatch):
        abandoned_chain(world)
    assert held(world, "a")["name"] == "B"  # applied; nothing recorded
    row = world.ledger()["a"]
    assert row["status"] == "delivered" and row["in_doubt"], row

    world.load("a", name="A")
    drive(engine, RULE)
    assert held(world, "a")["name"] == "A"
    row = world.ledger()["a"]
    assert row["status"] == "delivered" and not row["in_doubt"], row


# -- 3. a replayed create's follow-up cut between send and settle ----------------------------------


@pytest.mark.parametrize("settle", SETTLES)
def test_a_replays_follow_up_cut_before_its_settle_is_followed_up_again(
    engine: sa.Engine, target: TargetServer, settle: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    world = world_for(engine, target, settle)
    world.load("a", name="A")
    with settles_die(monkeypatch):
        abandoned_chain(world)  # the create applied, its outcome never recorded
        assert held(world, "a")["name"] == "A"

        world.load("a", name="B")
        abandoned_chain(world)  # a replay (same key, the first body kept) and a follow-up PATCH with B
        assert held(world, "a")["name"] == "B"
        assert len([r for r in target.requests if r.method == "PATCH"]) == 1
    assert world.ledger()["a"]["in_doubt"]

    world.load("a", name="A")  # back to the create's first body
    drive(engine, RULE)
    assert held(world, "a")["name"] == "A"
    row = world.ledger()["a"]
    assert row["status"] == "delivered" and not row["in_doubt"], row
    keys = {r.headers["idempotency-key"] for r in target.requests if r.method == "POST"}
    assert len(keys) == 1


# -- an outage never spends a last attempt --------------------------------------------------------


@pytest.mark.parametrize("settle", SETTLES)
def test_the_trial_call_after_a_cooldown_never_parks_a_record(
    engine: sa.Engine, target: TargetServer, settle: str
) -> None:
    world = World(engine, target).apply(
        target={"settle": settle_mode(settle), "breaker": {"fail_max": 1, "reset_seconds": 60}},
        rule={"max_attempts": 2, "retry_schedule_seconds": [1]},
    )
    world.load("a")
    target.program(email("a"), Answer.status(503), Answer.status(503))
    first = drive(engine, RULE)
    assert first.counts["failed"] == 1
    row = world.ledger()["a"]
    # It tripped the breaker: an outage, due after the cooldown, not after the schedule's 1 s.
    assert row["status"] == "failed" and row["attempts"] == 1
    assert row["next_attempt_at"] >= utcnow() + timedelta(seconds=50)

    _cool_down(engine)
    world.make_due()
    second = drive(engine, RULE)  # the trial call fails: the breaker opens again
    assert second.counts["failed"] == 1 and second.counts["exhausted"] == 0
    row = world.ledger()["a"]
    assert row["status"] == "failed" and row["attempts"] == 1 and "503" in row["last_error"], row
    assert row["next_attempt_at"] >= utcnow() + timedelta(seconds=50)

    _cool_down(engine)
    world.make_due()
    assert drive(engine, RULE).counts["delivered"] == 1  # the target is back: delivered


def test_a_refusal_on_the_last_attempt_still_exhausts(engine: sa.Engine, target: TargetServer) -> None:
    """Only the target's own failures while it is down are spared: a refused record is parked."""
    world = World(engine, target).apply(
        target={"breaker": {"fail_max": 1, "reset_seconds": 60}}, rule={"max_attempts": 1}
    )
    world.load("a")
    target.program(email("a"), Answer.status(422))
    drive(engine, RULE)
    assert world.ledger()["a"]["status"] == "exhausted"


def _cool_down(engine: sa.Engine) -> None:
    """Time travel: the breaker opened long enough ago for its trial call."""
    with engine.begin() as conn:
        conn.execute(breaker_states_table.update().values(opened_at=utcnow() - timedelta(minutes=5)))


# -- credentials refused: a fault of the rule -----------------------------------------------------


def _rows(engine: sa.Engine) -> list[dict[str, Any]]:
    """The ledger as an operator reads it: `version` only counts writes (an intent taken back
    moves it on, so that a requeue that read the intent cannot write over the row unseen)."""
    with engine.connect() as conn:
        rows = conn.execute(sa.select(ledger_table).order_by(ledger_table.c.id))
        return [{k: v for k, v in row._asdict().items() if k != "version"} for row in rows]


@pytest.mark.parametrize("settle", SETTLES)
@pytest.mark.parametrize("status", [401, 403])
def test_credentials_refused_end_the_chain_and_write_nothing(
    engine: sa.Engine, target: TargetServer, settle: str, status: int
) -> None:
    world = world_for(engine, target, settle)
    world.load("a", "b")
    drive(engine, RULE)
    world.load("a", name="changed")
    world.load("c")  # a create
    before = _rows(engine)
    remote_a = world.ledger()["a"]["remote_id"]
    target.program_remote(remote_a, Answer.status(status))
    target.program(email("c"), Answer.status(status))
    with pytest.raises(Unauthorized) as caught:
        drive(engine, RULE)
    message = str(caught.value)
    assert message.startswith(f"rule {RULE!r}: target 'crm' refused the credentials") and "$CRM_TOKEN" in message
    assert "s3cr3t" not in message
    assert _rows(engine) == before  # no row written, no attempt spent, no intent left
    with engine.connect() as conn:
        assert conn.execute(sa.select(breaker_states_table.c.fail_counter)).scalar_one() == 0


def test_a_403_is_a_record_refusal_where_the_connection_says_so(engine: sa.Engine, target: TargetServer) -> None:
    world = World(engine, target).apply(target={"forbidden": "record"})
    world.load("a", "b")
    target.program(email("a"), Answer.status(403))
    report = drive(engine, RULE)
    assert report.ended_by is ChainEnd.CAUGHT_UP
    rows = world.ledger()
    assert rows["a"]["status"] == "failed" and "HTTP 403" in rows["a"]["last_error"]
    assert rows["b"]["status"] == "delivered"


# -- a rule saved mid-chain counts from the chain's next job --------------------------------------


def _save_after_first_job(world: World, **changes: Any) -> Any:
    """A `between_jobs` hook that saves the rule once, after the chain's first job."""
    saved: list[int] = []

    def hook(_chain: Any, _report: Any) -> None:
        if not saved:
            saved.append(len(world.target.requests))
            world.apply(**changes)

    hook.saved = saved  # type: ignore[attr-defined]
    return hook


@pytest.mark.parametrize("settle", SETTLES)
def test_update_only_saved_mid_chain_stops_creates_from_the_next_job(
    engine: sa.Engine, target: TargetServer, settle: str
) -> None:
    world = world_for(engine, target, settle, batch_size=5)
    ids = [f"m{n:02d}" for n in range(20)]
    world.load(*ids)
    hook = _save_after_first_job(
        world, target={"settle": settle_mode(settle)}, rule={"batch_size": 5, "policy": "update_only"}
    )
    drive(engine, RULE, between_jobs=hook)
    assert hook.saved == [5]
    assert [r.method for r in target.requests] == ["POST"] * 5  # none after the save
    rows = world.ledger()
    assert sorted(i for i in ids if rows[i]["status"] == "delivered") == ids[:5]
    assert {rows[i]["last_error"] for i in ids[5:]} == {"policy update_only excludes create"}


def test_collection_fields_token_and_batch_size_saved_mid_chain_count_from_the_next_job(
    engine: sa.Engine, target: TargetServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("OTHER_TOKEN", "another-token-value")
    world = world_for(engine, target, "grouped", batch_size=4)
    world.load(*[f"m{n:02d}" for n in range(12)])
    sizes: list[int] = []
    hook = _save_after_first_job(
        world,
        target={"token_env": "OTHER_TOKEN"},
        rule={"batch_size": 2, "collection": "people", "fields": {"email": "email"}},
    )

    def between(chain: Any, report: Any) -> None:
        sizes.append(report.attempted)
        hook(chain, report)
        monkeypatch.setattr(target, "token", "another-token-value")  # the token rotated with it

    drive(engine, RULE, between_jobs=between)
    first, later = target.requests[:4], target.requests[4:]
    assert {r.path for r in first} == {"/api/contacts"} and len(later) == 8
    assert {r.path for r in later} == {"/api/people"}  # no request to the collection left behind
    assert all(set(r.json) == {"email"} for r in later)  # the saved fields
    assert {r.headers["authorization"] for r in later} == {"Bearer another-token-value"}
    assert sizes == [4, 2, 2, 2, 2]  # the saved batch size, from the job after the save


# -- a batch answer that says nothing about its items ---------------------------------------------


@pytest.mark.parametrize("answer", [Answer.no_id(), Answer.not_json()], ids=["no-results", "not-json"])
def test_a_batch_update_answered_without_results_then_reverted_reaches_the_target(
    engine: sa.Engine, target: TargetServer, answer: Answer
) -> None:
    """The target applies the batch PATCH but answers 200 without a usable result list; the mirror
    then reverts. Before, each item was refused, and the revert was suppressed as identical to
    what was last delivered while the target held the other body (issue 29, point 3)."""
    batch = {"create_path": "contacts/batch", "update_path": "contacts/batch", "max_items": 10}
    world = World(engine, target).apply(target={"batch": batch}, rule={"retry_schedule_seconds": [1]})
    ids = [f"b-{n}" for n in range(5)]
    world.load(*ids, name="A")
    drive(engine, RULE)
    world.load(*ids, name="B")
    target.program_batch(answer, method="PATCH")
    drive(engine, RULE)
    assert {held(world, i)["name"] for i in ids} == {"B"}  # applied, but the answer said nothing
    assert all(world.ledger()[i]["in_doubt"] for i in ids), world.ledger()

    world.load(*ids, name="A")  # back to the body last confirmed
    world.make_due()
    drive(engine, RULE)
    assert {held(world, i)["name"] for i in ids} == {"A"}
    assert {world.ledger()[i]["status"] for i in ids} == {"delivered"}
