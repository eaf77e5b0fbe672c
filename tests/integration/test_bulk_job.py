"""Batch verbs in the engine (issue #18): a target whose connection names batch paths gets each
window's creates and updates in one call per verb, and every record still gets its own ledger
outcome. Driven without Prefect against the real local target's batch endpoints, both databases."""

from __future__ import annotations

from typing import Any

import pytest
import sqlalchemy as sa

from delivery.domain import ChainEnd
from delivery.errors import Unauthorized
from delivery.store.tables import breaker_states_table
from tests.integration.world import RULE, World, email
from tests.support.chains import drive
from tests.target_server import Answer, TargetServer, _Reply

BATCH = {"create_path": "contacts/batch", "update_path": "contacts/batch", "max_items": 10}


@pytest.fixture
def world(engine: sa.Engine, target: TargetServer) -> World:
    return World(engine, target).apply(target={"batch": BATCH}, rule={"batch_size": 100, "concurrency": 1})


def ids(n: int, prefix: str = "r") -> list[str]:
    return [f"{prefix}{i:02d}" for i in range(n)]


def test_creates_and_updates_go_in_calls_of_max_items_each_record_settled_on_its_own(world: World) -> None:
    world.load(*ids(25))
    report = drive(world.engine, RULE)
    assert report.ended_by is ChainEnd.CAUGHT_UP and report.counts["delivered"] == 25
    calls = world.target.batch_requests()
    assert [(c.method, len(c.items)) for c in calls] == [("POST", 10), ("POST", 10), ("POST", 5)]
    assert len(world.target.requests) == 3
    stored = world.target.records("contacts")
    assert len(stored) == 25
    rows = world.ledger()
    assert {row["remote_id"] for row in rows.values()} == set(stored)
    assert all(row["status"] == "delivered" and row["attempts"] == 0 for row in rows.values())
    # Each item carried the key the one-record create would have sent: a replay makes no copy.
    keys = [item["idempotency_key"] for call in calls for item in call.items]
    assert len(set(keys)) == 25

    for external_id in ids(25):
        world.load(external_id, name="changed")
    report = drive(world.engine, RULE)
    assert report.counts["delivered"] == 25
    updates = world.target.batch_requests()[3:]
    assert [(c.method, len(c.items)) for c in updates] == [("PATCH", 10), ("PATCH", 10), ("PATCH", 5)]
    assert {r["name"] for r in world.target.records("contacts").values()} == {"changed"}


def test_each_item_gets_its_own_fault(world: World) -> None:
    world.load("good", "gone")
    drive(world.engine, RULE)
    remote = world.ledger()["gone"]["remote_id"]
    world.load("good", name="changed")
    world.load("gone", name="changed")
    world.load("bad", "noid", "fine")
    world.target.program(world.key("bad"), Answer.status(422, {"error": "email is invalid"}))
    world.target.program(world.key("noid"), Answer.no_id())
    world.target.program_remote(remote, Answer.status(404))
    report = drive(world.engine, RULE)
    rows = world.ledger()
    assert {k: r["status"] for k, r in rows.items()} == {
        "good": "delivered",
        "gone": "remote_gone",
        "bad": "failed",
        "noid": "exhausted",
        "fine": "delivered",
    }
    assert rows["bad"]["attempts"] == 1 and "email is invalid" in rows["bad"]["last_error"]
    assert report.ended_by is ChainEnd.CAUGHT_UP
    # One call per verb: the updates together, the creates together.
    assert sorted((c.method, len(c.items)) for c in world.target.batch_requests()[1:]) == [("PATCH", 2), ("POST", 3)]


def test_a_call_failing_as_a_whole_fails_each_item_and_the_replay_makes_no_copy(world: World) -> None:
    world.load(*ids(4))
    world.target.program_batch(Answer.status(500))
    report = drive(world.engine, RULE)
    rows = world.ledger()
    assert report.counts["failed"] == 4
    assert all(r["status"] == "failed" and r["attempts"] == 1 and "HTTP 500" in r["last_error"] for r in rows.values())
    world.make_due()
    report = drive(world.engine, RULE)
    assert report.drained["delivered"] == 4
    assert len(world.target.records("contacts")) == 4
    first, second = world.target.batch_requests()
    assert [i["idempotency_key"] for i in first.items] == [i["idempotency_key"] for i in second.items]


class RefusingTarget(TargetServer):
    """Refuses a whole batch call (400, no per-item results) that carries a record named "poison"."""

    def _dispatch_batch(self, method: str, path: str, headers: Any, body: Any, *rest: Any) -> _Reply:
        items = body.get("items") if isinstance(body, dict) else None
        if isinstance(items, list) and any((i.get("record") or {}).get("name") == "poison" for i in items):
            self.program_batch(Answer.status(400, {"error": "one item is malformed"}))  # this very call's
        return super()._dispatch_batch(method, path, headers, body, *rest)  # type: ignore[misc]


def test_a_call_refused_as_a_whole_is_split_until_the_bad_record_is_alone(
    engine: sa.Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CRM_TOKEN", "s3cr3t-token-value")
    with RefusingTarget(token="s3cr3t-token-value") as target:
        world = World(engine, target).apply(target={"batch": BATCH}, rule={"batch_size": 100, "concurrency": 1})
        world.load(*ids(8))
        world.load("r05", name="poison")
        report = drive(world.engine, RULE)
        rows = world.ledger()
        assert report.counts["delivered"] == 7 and report.counts["failed"] == 1
        assert rows["r05"]["status"] == "failed" and rows["r05"]["attempts"] == 1
        assert "HTTP 400" in rows["r05"]["last_error"]
        # The neighbours spent no attempt on the way.
        assert all(r["attempts"] == 0 for k, r in rows.items() if k != "r05")
        sizes = [len(c.items) for c in target.batch_requests()]
        # r05 changed last, so it comes last: [r00-r07] refused; [r00-r03] taken; [r04 r06 r07 r05]
        # refused; [r04 r06] taken; [r07 r05] refused; [r07] taken; [r05] refused alone.
        assert sizes == [8, 4, 4, 2, 2, 1, 1]
        assert len(target.records("contacts")) == 7


def test_a_429_on_the_whole_call_pauses_the_target_and_sends_the_same_call_again(world: World) -> None:
    world.load(*ids(3))
    world.target.program_batch(Answer.status(429, headers={"Retry-After": "1"}))
    report = drive(world.engine, RULE)
    assert report.counts["delivered"] == 3 and report.waited_seconds >= 0.9
    assert all(r["attempts"] == 0 for r in world.ledger().values())
    first, second = world.target.batch_requests()
    assert second.time - first.time >= 0.9
    with world.engine.connect() as conn:
        assert conn.execute(sa.select(breaker_states_table.c.fail_counter)).scalar_one() == 0


def test_a_refused_token_fails_the_chain_and_takes_every_intent_back(world: World) -> None:
    world.load(*ids(3))
    world.target.program_batch(Answer.status(401))
    with pytest.raises(Unauthorized):
        drive(world.engine, RULE)
    assert world.ledger() == {}  # the intents of the creates never applied were taken back


def test_an_open_breaker_cuts_the_batch_and_leaves_the_rest_unsent(world: World) -> None:
    world.apply(target={"batch": BATCH, "breaker": {"fail_max": 1, "reset_seconds": 60}}, rule={"batch_size": 100})
    world.load(*ids(15))
    world.target.program_batch(Answer.status(503))
    report = drive(world.engine, RULE)
    assert report.ended_by is ChainEnd.BREAKER_OPEN
    rows = world.ledger()
    assert len(rows) == 10 and all(r["status"] == "failed" for r in rows.values())
    assert len(world.target.batch_requests()) == 1


def test_per_record_settles_send_one_record_per_call(world: World) -> None:
    world.apply(target={"batch": BATCH, "settle": "per_record"}, rule={"batch_size": 100})
    world.load(*ids(3))
    report = drive(world.engine, RULE)
    assert report.counts["delivered"] == 3
    assert world.target.batch_requests() == [] and len(world.target.requests) == 3


def test_a_rate_budget_counts_a_batch_call_once(world: World) -> None:
    world.apply(target={"batch": BATCH, "rate_limit": {"per_day": 2}}, rule={"batch_size": 100})
    world.load(*ids(20))
    report = drive(world.engine, RULE)
    assert report.counts["delivered"] == 20 and len(world.target.requests) == 2
    assert email("r00") in {r["email"] for r in world.target.records("contacts").values()}
