"""The per-record path's shortcuts keep the semantics: the breaker row read with each settle stands in
for the breaker's own reads, a trip elsewhere is seen one record later, the heartbeat still moves
during a long batch, and on PostgreSQL settles share the fence while a supersede still waits.
(A target settled `per_record`; tests/integration/test_grouped_settles.py covers grouped settles.)"""

from __future__ import annotations

import dataclasses
import threading
import time
from datetime import datetime
from typing import Any

import pytest
import sqlalchemy as sa

from delivery import db, liveness
from delivery.breaker import TargetBreaker
from delivery.chain import Chain
from delivery.clock import utcnow
from delivery.domain import ChainEnd, Phase
from delivery.errors import TargetUnavailable
from delivery.store import chains
from delivery.store.breaker import DatabaseBreakerStorage
from tests.integration.engine_events import Commits, Statements
from tests.integration.locks import wait_for_a_lock_wait
from tests.integration.world import RULE, World
from tests.target_server import TargetServer


@pytest.fixture
def world(engine: sa.Engine, target: TargetServer) -> World:
    return World(engine, target).apply(target={"settle": "per_record"})


def _fail() -> None:
    raise TargetUnavailable("down")


def _observed(world: World, storage: DatabaseBreakerStorage) -> None:
    """What the engine does in each settle: read the row with the fence check, hand it over."""
    rule = Chain(world.engine, RULE).rule
    with world.engine.begin() as conn:
        _held, row = chains.holds_fence_for_settle(conn, rule.id, "any-token", rule.target.id)
        storage.observe(conn, row)


def _breaker(engine: sa.Engine, world: World, fail_max: int = 3) -> TargetBreaker:
    rule = Chain(world.engine, RULE).rule
    target = dataclasses.replace(rule.target, breaker=dataclasses.replace(rule.target.breaker, fail_max=fail_max))
    return TargetBreaker(engine, dataclasses.replace(rule, target=target))


def _storage(breaker: TargetBreaker) -> DatabaseBreakerStorage:
    return breaker.storage


def test_a_breaker_row_read_with_a_settle_stands_in_for_the_breakers_reads(world: World) -> None:
    breaker = TargetBreaker(world.engine, Chain(world.engine, RULE).rule)
    _observed(world, _storage(breaker))
    with Statements(world.engine) as seen:
        assert breaker.call(lambda: 42) == 42
    assert seen.count == 0  # the state read answered by the row, the reset put off: no round trip

    _observed(world, _storage(breaker))
    with Statements(world.engine) as seen, pytest.raises(TargetUnavailable):
        breaker.call(_fail)
    assert seen.count > 0  # a failure is written at once, for every other process to see
    with Statements(world.engine) as seen:
        assert breaker.fail_counter == 1
    assert seen.count >= 1  # ...and our write dropped the row: the next read is the database's


def test_a_success_clears_failures_made_elsewhere_since_its_row_was_read(world: World, db_url: str) -> None:
    """fail, success, fail is not two consecutive failures, whichever workers made them."""
    other_engine = db.create_engine(db_url)
    try:
        mine, theirs = _breaker(world.engine, world, fail_max=2), _breaker(other_engine, world, fail_max=2)
        _observed(world, _storage(mine))  # my row: no failures
        with pytest.raises(TargetUnavailable):
            theirs.call(_fail)  # a failure elsewhere, after my row was read
        assert mine.call(lambda: "ok") == "ok"  # my success; its reset waits for my settle...
        _observed(world, _storage(mine))  # ...which sees the failure and clears it
        assert theirs.fail_counter == 0
        with pytest.raises(TargetUnavailable):
            theirs.call(_fail)
        assert theirs.current_state == "closed" and mine.current_state == "closed"
    finally:
        other_engine.dispose()


def test_an_observed_row_goes_stale_after_a_second(world: World, monkeypatch: pytest.MonkeyPatch) -> None:
    import delivery.store.breaker as breaker_module

    storage = DatabaseBreakerStorage(world.engine, Chain(world.engine, RULE).rule.target.id)
    with world.engine.begin() as conn:
        storage.observe(conn, {"state": "open", "fail_counter": 3, "success_counter": 0, "opened_at": None})
    assert storage.state == "open"
    monkeypatch.setattr(breaker_module, "SNAPSHOT_SECONDS", 0.0)
    assert storage.state == "closed"  # what the database says


def test_a_success_without_a_fresh_row_writes_only_a_reset_there_is_to_write(
    world: World, db_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Records slower than a row stays fresh (a slow target, a loaded machine) must not cost a write
    transaction per success: a read decides, and failures made elsewhere are still cleared."""
    import delivery.store.breaker as breaker_module

    monkeypatch.setattr(breaker_module, "SNAPSHOT_SECONDS", 0.0)
    other_engine = db.create_engine(db_url)
    try:
        mine, theirs = _breaker(world.engine, world, fail_max=2), _breaker(other_engine, world, fail_max=2)
        with Commits(world.engine) as commits:
            for _ in range(5):
                assert mine.call(lambda: "ok") == "ok"
        assert commits.count == 0
        with pytest.raises(TargetUnavailable):
            theirs.call(_fail)
        assert mine.call(lambda: "ok") == "ok"
        assert theirs.fail_counter == 0
    finally:
        other_engine.dispose()


def test_a_breaker_tripped_by_another_process_is_seen_before_the_next_create(world: World, db_url: str) -> None:
    world.load(*[f"r{n}" for n in range(6)])
    other_engine = db.create_engine(db_url)  # another worker process delivering to the same target
    try:
        theirs = _breaker(other_engine, world, fail_max=1)
        chain = Chain(world.engine, RULE)
        assert chain.open() is None
        real_check = chain.step.check
        checked = 0

        def check(candidate: Any, phase: Phase) -> None:
            nonlocal checked
            checked += 1
            if checked == 2:  # after record 1's settle, before record 2's call
                with pytest.raises(TargetUnavailable):
                    theirs.call(_fail)  # the other process's failure trips the shared breaker
            real_check(candidate, phase)

        chain.step.check = check  # type: ignore[method-assign]
        report = chain.run_batch(Phase.SCAN)
        chain.finish()
    finally:
        other_engine.dispose()
    # A create's intent is written under the fence, which reads the breaker row: the row read
    # before record 2's create shows the trip, so record 2 is not sent and leaves no intent.
    assert report.ended_by is ChainEnd.BREAKER_OPEN and report.attempted == 1
    assert len([r for r in world.target.requests if r.method == "POST"]) == 1
    assert len(world.ledger()) == 1


@pytest.fixture
def beats(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """When each chain heartbeat was written (monotonic clock)."""
    written: list[float] = []
    real_heartbeat = chains.heartbeat

    def heartbeat(conn: sa.Connection, token: str, now: datetime) -> None:
        written.append(time.monotonic())
        real_heartbeat(conn, token, now)

    monkeypatch.setattr(chains, "heartbeat", heartbeat)
    return written


def test_the_heartbeat_moves_during_a_long_batch_but_not_per_record(world: World, beats: list[float]) -> None:
    world.apply(
        target={"timeout_seconds": 10, "settle": "per_record"}
    )  # slow answers, not timeouts, on a loaded machine
    world.load(*[f"r{n}" for n in range(8)])
    world.target.latency_ms = 300  # eight records: a batch of about 2.4 s
    chain = Chain(world.engine, RULE)
    assert chain.open() is None
    started = time.monotonic()
    report = chain.run_batch(Phase.SCAN)
    ended = time.monotonic()
    chain.finish()
    assert report.attempted == 8
    during = [t for t in beats if started < t < ended]
    # One as the job starts, one as the cursor moves, and one with a settle each second between.
    assert len(during) >= 4
    assert len(during) <= 2 + int(ended - started) + 1


def test_a_fast_batch_writes_the_heartbeat_as_the_job_starts_and_as_the_cursor_moves(
    world: World, beats: list[float], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(liveness, "HEARTBEAT_SECONDS", 3600.0)
    world.load(*[f"r{n}" for n in range(10)])
    chain = Chain(world.engine, RULE)
    assert chain.open() is None
    assert chain.run_batch(Phase.SCAN).attempted == 10
    chain.finish()
    assert len(beats) == 2  # not one per record


def _claimed_chain_on_postgresql(world: World, db_url: str) -> Chain:
    if not db_url.startswith("postgresql"):
        pytest.skip("row locks are PostgreSQL's: on SQLite the write transaction (BEGIN IMMEDIATE) is the fence")
    world.load("a")
    chain = Chain(world.engine, RULE)
    assert chain.open() is None
    assert chain.run_batch(Phase.SCAN).attempted == 1  # the chain has claimed the rule
    return chain


@pytest.mark.postgres
def test_on_postgresql_settles_share_the_fence_and_a_supersede_waits_for_them(world: World, db_url: str) -> None:
    chain = _claimed_chain_on_postgresql(world, db_url)
    rule = chain.rule
    with world.engine.connect() as first:
        first.begin()
        assert chains.holds_fence_for_settle(first, rule.id, chain.token, rule.target.id)[0]
        with world.engine.connect() as second:
            second.begin()
            second.exec_driver_sql("SET LOCAL lock_timeout = '500ms'")
            # Another worker's settle is not kept waiting...
            assert chains.holds_fence_for_settle(second, rule.id, chain.token, rule.target.id)[0]
            second.rollback()
        superseded = threading.Event()

        def supersede() -> None:
            with world.engine.begin() as conn:
                chains.supersede(conn, rule.id, chain.token, utcnow(), "judged dead")
            superseded.set()

        thread = threading.Thread(target=supersede)
        thread.start()
        # ...but a supersede is, until the settle in flight commits.
        assert not superseded.wait(1.0)
        first.commit()
        assert superseded.wait(10.0)
        thread.join()
    assert chain.run_batch(Phase.SCAN).ended_by is ChainEnd.SUPERSEDED
    chain.finish()


@pytest.mark.postgres
def test_on_postgresql_a_supersede_during_a_settle_waits_and_never_deadlocks(world: World, db_url: str) -> None:
    chain = _claimed_chain_on_postgresql(world, db_url)
    rule = chain.rule
    errors: list[BaseException] = []
    done = threading.Event()

    def supersede() -> None:
        try:
            with world.engine.begin() as conn:
                conn.exec_driver_sql("SET LOCAL deadlock_timeout = '100ms'")
                chains.supersede(conn, rule.id, chain.token, utcnow(), "judged dead")
        except BaseException as exc:
            errors.append(exc)
        finally:
            done.set()

    with world.engine.connect() as settle:
        settle.begin()
        assert chains.holds_fence_for_settle(settle, rule.id, chain.token, rule.target.id)[0]
        thread = threading.Thread(target=supersede)
        thread.start()
        wait_for_a_lock_wait(world.engine, "the supersede")  # the supersede waits on the rule row...
        chains.heartbeat(settle, chain.token, utcnow())  # ...while the settle takes the chain row
        settle.commit()
        assert done.wait(10)
        thread.join()
    assert errors == []  # taken in the same order, the two wait for each other but never deadlock
    assert chain.run_batch(Phase.SCAN).ended_by is ChainEnd.SUPERSEDED
    chain.finish()


def test_a_failure_after_a_success_whose_reset_was_put_off_counts_from_one(world: World) -> None:
    """Consecutive failures: a success between two failures clears the first, even when its reset
    waited for the next observed row and a failure came first. Before, the failure after it added
    to the old count, and a target answering most records tripped its breaker on scattered
    failures (and never counted as seen healthy, so a bad record was never parked)."""
    storage = DatabaseBreakerStorage(world.engine, Chain(world.engine, RULE).rule.target.id)
    storage.increment_counter()
    storage.increment_counter()
    with world.engine.begin() as conn:
        storage.observe(conn, {"state": "closed", "fail_counter": 2, "success_counter": 0, "opened_at": None})
    storage.reset_counter()  # a success, its reset put off to the next observed row
    assert storage.fresh_counter() == 0
    storage.increment_counter()
    assert storage.fresh_counter() == 1
