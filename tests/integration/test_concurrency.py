"""Writes in parallel inside a batch (`concurrency` > 1): every record still settles on its own,
and the cursor never passes a record that was not attempted."""

from __future__ import annotations

import pytest
import sqlalchemy as sa

from tests.integration.world import World
from tests.target_server import Answer


@pytest.fixture
def world(world: World) -> World:
    # A generous client timeout: eight writes at once on a loaded 2-core CI machine must not time out.
    return world.apply(rule={"concurrency": 8, "batch_size": 20}, target={"timeout_seconds": 10})


def test_parallel_writes_deliver_each_record_once_and_park_faults_per_record(world: World) -> None:
    ids = [f"r{n:03d}" for n in range(60)]
    world.load(*ids)
    world.target.latency_ms = 20
    world.target.program(world.key("r005"), Answer.status(422))
    world.target.program(world.key("r017"), Answer.no_id())
    result = world.run()
    assert result["scanned"] == {
        "delivered": 58,
        "suppressed": 0,
        "failed": 1,
        "exhausted": 1,
        "remote_gone": 0,
        "deleted": 0,
    }
    posts = [r.key or "" for r in world.target.requests if r.method == "POST"]
    assert sorted(posts) == sorted(world.key(i) for i in ids)
    cursor = world.cursor()
    assert cursor is not None and cursor.record_id == world.record_id("r059")
    rows = world.ledger()
    assert rows["r005"]["status"] == "failed" and rows["r017"]["status"] == "exhausted"


def _cut_by_the_breaker(world: World) -> tuple[list[str], list[str]]:
    """Forty records, the target down, writes eight at a time: the breaker (fail_max 3) cuts the
    first batch. Every 503 takes 300 ms, so the first eight writes are all in flight before any
    failure comes back: r000, the first record taken, is always sent, and some records never are.
    Returns (ids, the ids the target received a request for)."""
    ids = [f"r{n:03d}" for n in range(40)]
    world.load(*ids)
    world.target.down = True
    world.target.latency_ms = 300
    result = world.run()
    assert result["ended_by"] == "breaker_open"
    sent = [i for i in ids if world.target.count(world.key(i))]
    assert "r000" in sent and len(sent) < len(ids), sent
    return ids, sent


def test_breaker_cut_parallel_batch_leaves_the_cursor_before_the_first_record_not_attempted(world: World) -> None:
    ids, sent = _cut_by_the_breaker(world)
    first_gap = next(i for i in ids if i not in sent)
    cursor = world.cursor()
    # Exactly past the records attempted up to the first one that was not: r000 was attempted,
    # so the cursor has moved.
    assert cursor is not None
    assert cursor.record_id == world.record_id(ids[ids.index(first_gap) - 1]) < world.record_id(first_gap)
    # Nothing past the cursor is lost: once the target is back, every record gets delivered.
    world.target.down = False
    world.target.latency_ms = 0
    with world.engine.begin() as conn:
        conn.execute(sa.text("UPDATE breaker_states SET state = 'closed', fail_counter = 0"))
    world.make_due()
    world.run()
    assert {r["status"] for r in world.ledger().values()} == {"delivered"} and len(world.ledger()) == 40
    assert sorted(r.key for r in world.target.requests if r.method == "POST" and r.key) == sorted(
        [world.key(i) for i in ids] + [world.key(i) for i in sent]
    )  # each record sent once more at most: the ones that failed, once each


def test_writes_in_flight_when_the_breaker_opens_still_settle_their_answer(world: World) -> None:
    """Each worker finishes the call it has started: the 503 it gets back counts an attempt and
    lands in the record's row like any other, and records never sent get no row."""
    _ids, sent = _cut_by_the_breaker(world)
    rows = world.ledger()
    unsettled = {
        i: (rows[i]["status"], rows[i]["attempts"], rows[i]["last_error"])
        for i in sent
        if rows.get(i, {}).get("attempts") != 1 or "HTTP 503" not in (rows[i]["last_error"] or "")
    }
    assert unsettled == {}
    assert {rows[i]["status"] for i in sent} == {"failed"}
    assert set(rows) == set(sent)
