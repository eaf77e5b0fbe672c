"""Grouped settles (the default): every record keeps its own ledger write and outcome, the writes
are committed in groups of at most 50 records, a cut batch leaves no intent of a create it never
sent, and `settle: per_record` still commits each outcome (and each create's intent) on its own."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import sqlalchemy as sa

from delivery import db
from delivery.breaker import TargetBreaker
from delivery.chain import Chain
from delivery.domain import ChainEnd, ChainReport, Phase
from delivery.errors import TargetUnavailable
from delivery.settle import GROUP_RECORDS
from delivery.store import chains
from tests.integration.engine_events import Commits, Statements
from tests.integration.world import RULE, World, email
from tests.support.chains import drive
from tests.target_server import Answer, TargetServer


def _chain(world: World) -> ChainReport:
    return drive(world.engine, RULE)


def _ids(n: int) -> list[str]:
    return [f"g-{i:03d}" for i in range(n)]


@pytest.mark.parametrize("concurrency", [1, 4])
def test_grouped_settles_commit_in_groups_and_each_record_gets_its_own_outcome(
    engine: sa.Engine, target: TargetServer, concurrency: int, job_path: str
) -> None:
    world = World(engine, target).apply(rule={"batch_size": 200, "concurrency": concurrency})
    ids = _ids(120)
    world.load(*ids)
    with Commits(engine) as commits:
        _chain(world)
    ledger = world.ledger()
    assert {i: ledger[i]["status"] for i in ids} == dict.fromkeys(ids, "delivered")
    assert all(target.count(email(i)) == 1 for i in ids)
    # Per record it would be 240 (an intent and a settle per create). Grouped: per window of 50 one
    # intent commit, and a settle commit per group (50 records or 200 ms), plus the chain's own.
    assert commits.count < len(ids) // 2, commits.count

    # A second round of changes: updates, grouped the same way, each row its own new outcome.
    world.load(*ids, name="changed")
    with Commits(engine) as commits:
        _chain(world)
    assert commits.count < len(ids) // 2, commits.count
    stored = target.records("contacts")
    assert sorted(body["email"] for body in stored.values()) == sorted(email(i) for i in ids)
    assert {body["name"] for body in stored.values()} == {"changed"}


def test_per_record_settles_commit_each_outcome_and_each_intent(engine: sa.Engine, target: TargetServer) -> None:
    world = World(engine, target).apply(target={"settle": "per_record"}, rule={"batch_size": 200})
    ids = _ids(60)
    world.load(*ids)
    with Commits(engine) as commits:
        _chain(world)
    assert {row["status"] for row in world.ledger().values()} == {"delivered"}
    assert commits.count >= 2 * len(ids)


@pytest.mark.parametrize("concurrency", [1, 4])
def test_a_batch_cut_by_the_breaker_keeps_no_intent_of_a_create_it_never_sent(
    engine: sa.Engine, target: TargetServer, concurrency: int
) -> None:
    """The window's intents are committed before its first request; the breaker trips on the
    third failure and the records never sent must not be left as 'create sent'."""
    world = World(engine, target).apply(rule={"batch_size": 200, "concurrency": concurrency})
    ids = _ids(80)
    world.load(*ids)
    for i in ids[5:]:
        target.program(email(i), Answer.status(503))
    assert _chain(world).ended_by is ChainEnd.BREAKER_OPEN
    ledger = world.ledger()
    sent = {i for i in ids if target.count(email(i)) > 0}
    # Every record that reached the target has its outcome; none that did not has a row at all.
    assert set(ledger) == sent
    assert {ledger[i]["status"] for i in ids[:5] if i in sent} <= {"delivered"}
    assert all(ledger[i]["status"] == "failed" and "503" in ledger[i]["last_error"] for i in sent - set(ids[:5]))
    assert len(sent) < len(ids)


def test_a_breaker_tripped_by_another_process_is_seen_within_one_group(
    engine: sa.Engine, target: TargetServer, db_url: str, job_path: str
) -> None:
    """Grouped, the breaker row is read with each window's intents and each group's commit (not
    with every record): a trip made elsewhere stops the batch within one group of records."""
    world = World(engine, target).apply(rule={"batch_size": 200})
    ids = _ids(150)
    world.load(*ids)
    other_engine = db.create_engine(db_url)  # another worker process delivering to the same target
    try:
        theirs = _breaker(other_engine, world)
        chain = Chain(world.engine, RULE)
        assert chain.open() is None
        real_send = chain.step.send
        sent = 0

        def send(*args: Any) -> Any:
            nonlocal sent
            sent += 1
            if sent == 3:
                with pytest.raises(TargetUnavailable):
                    theirs.call(_fail)  # the other process's failure trips the shared breaker
            return real_send(*args)

        real_send_async = chain.step.send_async

        async def send_async(*args: Any) -> Any:
            nonlocal sent
            sent += 1
            if sent == 3:
                with pytest.raises(TargetUnavailable):
                    theirs.call(_fail)
            return await real_send_async(*args)

        chain.step.send = send  # type: ignore[method-assign]
        chain.step.send_async = send_async  # type: ignore[method-assign]
        report = chain.run_batch(Phase.SCAN)
        chain.finish()
    finally:
        other_engine.dispose()
    assert report.ended_by is ChainEnd.BREAKER_OPEN
    posts = len([r for r in target.requests if r.method == "POST"])
    assert 3 <= posts <= GROUP_RECORDS
    # What was sent is settled; what was not has no row (its intent taken back).
    assert len(world.ledger()) == posts


def _fail() -> None:
    raise TargetUnavailable("down")


def _breaker(engine: sa.Engine, world: World) -> TargetBreaker:
    rule = Chain(world.engine, RULE).rule
    target = dataclasses.replace(rule.target, breaker=dataclasses.replace(rule.target.breaker, fail_max=1))
    return TargetBreaker(engine, dataclasses.replace(rule, target=target))


@pytest.mark.parametrize("settle", ["grouped", "per_record"])
@pytest.mark.parametrize("concurrency", [1, 4])
def test_a_writer_bug_mid_batch_fails_the_chain_and_keeps_every_outcome_gathered_before_it(
    engine: sa.Engine, target: TargetServer, settle: str, concurrency: int, job_path: str
) -> None:
    """Nothing is rolled back: the records delivered before the bug stay delivered, whether their
    outcomes were still being gathered for a group or not; the record that met the bug has no
    outcome (its create's intent, if any, stays: it may have gone out)."""
    world = World(engine, target).apply(target={"settle": settle}, rule={"batch_size": 200, "concurrency": concurrency})
    ids = _ids(40)
    world.load(*ids)
    chain = Chain(world.engine, RULE)
    assert chain.open() is None
    writer = chain._writer
    assert writer is not None
    real_create = writer.create  # type: ignore[attr-defined]

    def create(body: dict[str, Any], key: str, *record: Any) -> str:
        if body["email"] == email(ids[20]):
            raise RuntimeError("a bug in the writer")
        return real_create(body, key, *record)  # type: ignore[no-any-return]

    real_acreate = writer.acreate  # type: ignore[attr-defined]

    async def acreate(body: dict[str, Any], key: str, *record: Any) -> str:
        if body["email"] == email(ids[20]):
            raise RuntimeError("a bug in the writer")
        return await real_acreate(body, key, *record)  # type: ignore[no-any-return]

    writer.create = create  # type: ignore[attr-defined]
    writer.acreate = acreate  # type: ignore[attr-defined]
    with pytest.raises(RuntimeError, match="a bug in the writer"):
        chain.run_batch(Phase.SCAN)
    chain.finish(RuntimeError("a bug in the writer"))
    ledger = world.ledger()
    posted = {i for i in ids if target.count(email(i)) > 0}
    delivered = {i for i, row in ledger.items() if row["status"] == "delivered"}
    # Every record the target took has its outcome; with one worker, exactly the 20 before the bug.
    assert delivered == posted
    if concurrency == 1:
        assert delivered == set(ids[:20])
    assert ids[20] not in delivered
    assert world.cursor() is None  # the batch did not conclude


def test_a_breaker_row_read_before_a_workers_own_write_does_not_stand_in_for_it(
    engine: sa.Engine, target: TargetServer
) -> None:
    """Grouped settles hand the row they read to the workers' breakers from another thread: a row
    read before a worker's own failure was written must not hide that failure."""
    World(engine, target).apply()
    breaker = TargetBreaker(engine, Chain(engine, RULE).rule)
    storage = breaker.storage
    rule = Chain(engine, RULE).rule
    mark = storage.write_mark
    with engine.begin() as conn:
        _held, before = chains.holds_fence_for_settle(conn, rule.id, "any-token", rule.target.id)
    storage.increment_counter()  # the worker's failure, written after the row was read
    with engine.begin() as conn:
        breaker.observe(conn, before, mark)
    assert storage.counter == 1  # read from the database, not from the older row
    mark = storage.write_mark
    with engine.begin() as conn:
        _held, after = chains.holds_fence_for_settle(conn, rule.id, "any-token", rule.target.id)
        breaker.observe(conn, after, mark)
    with Statements(engine) as seen:
        assert storage.counter == 1
    assert seen.count == 0  # a row read after the write stands in for the read
