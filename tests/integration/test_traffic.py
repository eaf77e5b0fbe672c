"""Traffic control per target (issue #18), driven without Prefect against the real local target on
both databases: a Retry-After pauses the target for every rule and spends no attempt; a rate
budget spaces requests; a daily budget stops the chain `rate_limited`; nothing counts for the
breaker. The multi-process budget test is in tests/acceptance/test_rate_budget.py."""

from __future__ import annotations

import itertools
from datetime import UTC, datetime, timedelta

import pytest
import sqlalchemy as sa
import yaml

from delivery.apply import apply_config
from delivery.chain import Chain
from delivery.clock import SYSTEM, FakeClock, utcnow
from delivery.config import parse_config
from delivery.domain import ChainEnd
from delivery.store.tables import breaker_states_table, target_traffic_table
from delivery.traffic import TargetTraffic, TrafficListener
from tests.integration.world import RULE, World
from tests.support.chains import drive
from tests.target_server import Answer, TargetServer


class Heard(TrafficListener):
    def __init__(self) -> None:
        self.told: list[tuple[str, str]] = []

    def paused(self, target: str, until: datetime, reason: str) -> None:
        self.told.append(("paused", reason))

    def resumed(self, target: str, paused_at: datetime | None, until: datetime | None) -> None:
        self.told.append(("resumed", target))


@pytest.fixture
def world(engine: sa.Engine, target: TargetServer) -> World:
    return World(engine, target).apply(rule={"concurrency": 1})


def traffic_row(world: World) -> sa.Row[tuple[object, ...]]:
    with world.engine.connect() as conn:
        return conn.execute(sa.select(target_traffic_table)).one()


def breaker_failures(world: World) -> int:
    with world.engine.connect() as conn:
        return int(conn.execute(sa.select(breaker_states_table.c.fail_counter)).scalar_one())


@pytest.mark.parametrize("code", [429, 503])
def test_a_short_pause_is_waited_out_and_the_same_request_sent_again(world: World, code: int) -> None:
    world.load("a", "b")
    world.target.program(world.key("a"), Answer.status(code, headers={"Retry-After": "1"}))
    heard = Heard()
    clock = FakeClock()
    began = clock.now()
    report = drive(world.engine, RULE, traffic_listeners=[heard], clock=clock)
    assert report.ended_by is ChainEnd.CAUGHT_UP and report.counts["delivered"] == 2
    row = world.full_ledger_row("a")
    assert row["status"] == "delivered" and row["attempts"] == 0
    # The pause was waited out on the chain's clock, by "a" and by "b" after it: a, a again, then b.
    assert [r.key for r in world.target.requests] == [world.key("a"), world.key("a"), world.key("b")]
    assert report.waited_seconds == pytest.approx(1.0) and clock.now() - began == timedelta(seconds=1)
    assert heard.told == [("paused", f"HTTP {code}, Retry-After 1 s"), ("resumed", "crm")]
    assert breaker_failures(world) == 0
    assert traffic_row(world).paused_until is None


def test_a_pause_beyond_the_job_parks_nothing_and_ends_the_chain_rate_limited(world: World) -> None:
    world.apply(target={"max_pause_seconds": 3600}, rule={"concurrency": 1})
    world.load("a", "b", "c")
    world.target.program(world.key("a"), Answer.status(429, headers={"Retry-After": "3000"}))
    heard = Heard()
    clock = FakeClock()
    report = drive(world.engine, RULE, traffic_listeners=[heard], clock=clock)
    assert report.ended_by is ChainEnd.RATE_LIMITED
    assert "paused until" in report.message and "'crm'" in report.message
    row = world.full_ledger_row("a")
    assert row["status"] == "failed" and row["attempts"] == 0
    assert row["next_attempt_at"] == clock.now() + timedelta(seconds=3000)
    # Nothing after it was sent or settled: b and c wait for the next chain.
    assert world.target.count(world.key("b")) == world.target.count(world.key("c")) == 0
    assert set(world.ledger()) == {"a"}
    assert breaker_failures(world) == 0
    assert [what for what, _ in heard.told] == ["paused"]

    # Another rule's chain on the same target stops at its start: the pause is the target's.
    config = world.config(target={"max_pause_seconds": 3600}, rule={"concurrency": 1})
    config["rules"].append({**config["rules"][0], "name": "leads-to-crm", "domain": "lead"})
    with world.engine.begin() as conn:
        apply_config(conn, parse_config(yaml.safe_dump(config)))
    world.load("l1", domain="lead")
    before = len(world.target.requests)
    other = drive(world.engine, "leads-to-crm", clock=clock)
    assert other.ended_by is ChainEnd.RATE_LIMITED and len(world.target.requests) == before

    # The pause over (and the record that met it due again, then), it goes first, and then the rest.
    clock.advance(3000)
    report = drive(world.engine, RULE, traffic_listeners=[heard], clock=clock)
    assert report.ended_by is ChainEnd.CAUGHT_UP
    assert report.drained["delivered"] == 1 and report.scanned["delivered"] == 2
    assert heard.told[-1] == ("resumed", "crm")
    assert world.target.requests[before].key == world.key("a")


def test_a_target_pausing_every_try_gets_a_few_tries_a_second_apart_then_the_record_waits(world: World) -> None:
    world.load("a")
    world.target.program(world.key("a"), *[Answer.status(429, headers={"Retry-After": "0"})] * 10)
    clock = FakeClock()
    began = clock.now()
    report = drive(world.engine, RULE, clock=clock)
    sent = world.target.requests_for(world.key("a"))
    # The first try and three more, each after a pause of a second (Retry-After: 0 counts as 1).
    assert len(sent) == 4
    assert report.waited_seconds == pytest.approx(3.0) and clock.now() - began == timedelta(seconds=3)
    row = world.full_ledger_row("a")
    assert row["status"] == "failed" and row["attempts"] == 0
    assert report.counts["failed"] == 1


def test_a_retry_after_without_429_or_503_is_an_ordinary_failure(world: World) -> None:
    world.load("a")
    world.target.program(world.key("a"), Answer.status(500, headers={"Retry-After": "1"}))
    report = drive(world.engine, RULE)
    assert report.ended_by is ChainEnd.CAUGHT_UP
    row = world.full_ledger_row("a")
    assert row["status"] == "failed" and row["attempts"] == 1
    assert breaker_failures(world) == 1
    assert traffic_row(world).paused_until is None


def test_a_daily_budget_spent_ends_the_chain_rate_limited(world: World) -> None:
    # At noon: the day's reset is further off than the job's deadline, whatever the hour the test
    # runs (at 23:55 the chain would rightly wait five minutes for it).
    clock = FakeClock(datetime.combine(utcnow().date(), datetime.min.time(), UTC) + timedelta(hours=12))
    world.apply(target={"rate_limit": {"per_day": 2}}, rule={"concurrency": 1})
    world.load("a", "b", "c", at=clock.now())
    report = drive(world.engine, RULE, clock=clock)
    assert report.ended_by is ChainEnd.RATE_LIMITED and "rate budget" in report.message
    assert report.counts["delivered"] == 2 and len(world.target.requests) == 2
    assert len(world.ledger()) == 2
    row = traffic_row(world)
    assert row.day == clock.now().date().isoformat() and row.day_count == 2
    # The day's budget is the target's, whichever chain asks.
    again = drive(world.engine, RULE, clock=clock)
    assert again.ended_by is ChainEnd.RATE_LIMITED and len(world.target.requests) == 2


def test_a_rate_budget_spaces_the_requests_of_concurrent_workers(world: World) -> None:
    world.apply(target={"rate_limit": {"per_second": 10}}, rule={"concurrency": 4, "batch_size": 25})
    ids = [f"r{i:02d}" for i in range(16)]
    world.load(*ids)
    report = drive(world.engine, RULE)
    assert report.ended_by is ChainEnd.CAUGHT_UP and report.counts["delivered"] == 16
    times = sorted(r.time for r in world.target.requests)
    assert len(times) == 16
    for i, start in enumerate(times):
        assert sum(1 for t in times[i:] if t < start + 1.0) <= 10, "more than 10 requests in one second"
    # How close to the budget they come is measured by tests/acceptance/test_rate_budget.py.
    assert report.waited_seconds > 0


def test_a_wait_that_would_outlast_the_job_ends_it_rate_limited(world: World, monkeypatch: pytest.MonkeyPatch) -> None:
    # The job's deadline: 30 s of batch timeout less the request timeout (5 s) less 5 s of margin.
    monkeypatch.setenv("DELIVERY_BATCH_TIMEOUT_SECONDS", "30")
    world.apply(target={"rate_limit": {"per_second": 0.02}}, rule={"concurrency": 1})
    world.load("a", "b")
    report = drive(world.engine, RULE)
    assert report.ended_by is ChainEnd.RATE_LIMITED
    assert len(world.target.requests) == 1 and set(world.ledger()) == {"a"}
    # "b" was not sent, and its intent was taken back: the next chain sends it as new.
    assert world.ledger()["a"]["status"] == "delivered"


@pytest.mark.parametrize(
    ("per_second", "late_ms", "sent"), [(2, 40, False), (2, 20, True), (20, 10, True), (20, 15, False)]
)
def test_a_sender_that_wakes_too_late_for_its_slot_takes_a_new_one(
    world: World, per_second: float, late_ms: int, sent: bool
) -> None:
    """At 2/s a quarter interval (131 ms) is more than the 50 ms the spacing leaves between
    3 requests and a second: the allowance is half of that room, whatever the rate."""
    world.apply(target={"rate_limit": {"per_second": per_second}})
    slot = utcnow()
    traffic = TargetTraffic(
        world.engine, Chain(world.engine, RULE).rule.target, clock=FakeClock(slot + timedelta(milliseconds=late_ms))
    )
    assert traffic._too_late(slot) is not sent


@pytest.mark.parametrize("asynchronous", [False, True], ids=["thread", "event-loop"])
def test_a_slot_handed_out_before_a_pause_does_not_cross_it(world: World, asynchronous: bool) -> None:
    """Two processes share a budget: B takes the next slot, then A's request is answered 429 with
    Retry-After while B waits for that slot. B must not send when it wakes: the pause holds it,
    and a pause beyond its job's deadline ends the job `rate_limited` (issue 29, point 2; before,
    B was admitted in the middle of the pause)."""
    import asyncio

    from delivery.errors import TargetUnavailable, TrafficHeld
    from delivery.traffic import JobBounds

    world.apply(target={"rate_limit": {"per_second": 10}})
    target = Chain(world.engine, RULE).rule.target
    a = TargetTraffic(world.engine, target, clock=SYSTEM)
    b = TargetTraffic(world.engine, target, clock=SYSTEM)
    bounds = JobBounds(deadline=utcnow() + timedelta(seconds=30))
    assert a.admit(bounds)  # A's slot: now; B's will be the next, about 0.1 s later
    slot_at: list[datetime] = []
    real_take = b._take

    def take_then_pause(now: datetime, latest: datetime) -> object:
        got = real_take(now, latest)
        if not slot_at:
            slot_at.append(getattr(got, "at", now))
            # A's answer arrives while B waits for its slot: a pause of 60 s.
            a.pause(TargetUnavailable("HTTP 429", 60.0, status_code=429))
        return got

    b._take = take_then_pause  # type: ignore[method-assign]
    short = JobBounds(deadline=utcnow() + timedelta(seconds=5))

    async def off_loop(call: object, *args: object) -> object:
        return call(*args)  # type: ignore[operator]

    with pytest.raises(TrafficHeld) as held:
        if asynchronous:
            asyncio.run(b.admit_async(short, off_loop))
        else:
            b.admit(short)
    assert slot_at and slot_at[0] > utcnow() - timedelta(seconds=5)
    assert held.value.until > utcnow() + timedelta(seconds=50)  # held by the pause, not the budget


@pytest.mark.parametrize("path", ["grouped", "grouped-threads", "per_record", "batch"])
def test_whatever_leaves_the_admission_takes_the_intent_back(
    world: World, monkeypatch: pytest.MonkeyPatch, path: str
) -> None:
    """Before: an OverflowError from the budget (`per_second: 1e-300`, refused at apply since) failed
    the chain and left each create's intent as a due failure that was never sent (issue 29, 6)."""
    from delivery import senders as senders_module
    from delivery.errors import TrafficControlFailed

    settle, _, threads = path.partition("-")
    connection: dict[str, object] = {"rate_limit": {"per_second": 10}}
    if settle == "batch":
        connection["batch"] = {"create_path": "contacts/batch", "max_items": 10}
    else:
        connection["settle"] = settle
    if threads:
        monkeypatch.setattr(senders_module, "offers_async", lambda _writer: False)
    world.apply(target=connection)
    world.load("a", "b")

    def overflow(*_args: object) -> object:
        raise OverflowError("date value out of range")

    monkeypatch.setattr(TargetTraffic, "_take", overflow)
    with pytest.raises(TrafficControlFailed) as caught:
        drive(world.engine, RULE)
    assert "OverflowError: date value out of range" in str(caught.value)
    assert world.ledger() == {}  # no intent left behind, no attempt spent
    assert world.target.requests == []


def test_a_wait_for_a_pause_on_a_fake_clock_passes_no_real_time(world: World) -> None:
    """`TargetTraffic.admit` waits for a ten-minute pause on the chain's clock: the wait advances
    the fake clock, the pause is ended and told of as over, and the sender is let through."""
    import time

    from delivery.store import traffic as store
    from delivery.traffic import JobBounds

    clock = FakeClock()
    target = Chain(world.engine, RULE, clock=clock).rule.target
    until = clock.now() + timedelta(minutes=10)
    store.ensure_row(world.engine, target.id)
    with world.engine.begin() as conn:
        store.pause(conn, target.id, until, "HTTP 429, Retry-After 600 s", clock.now())
    heard = Heard()
    traffic = TargetTraffic(world.engine, target, clock, [heard])
    started = time.monotonic()
    assert traffic.admit(JobBounds(clock.now() + timedelta(hours=1))) is True
    assert time.monotonic() - started < 60  # not the ten minutes: only database round trips
    assert clock.now() == until and traffic.waited_seconds == 600
    assert heard.told == [("resumed", "crm")] and traffic_row(world).paused_until is None


@pytest.mark.parametrize("per_second", [0.5, 2, 7.5])
def test_a_rate_budget_on_a_fake_clock_never_lets_more_than_the_budget_into_a_second(
    world: World, per_second: float
) -> None:
    """The budget through the store (`take_slot` around `budget.next_slot`), each sender waiting for
    its slot on the chain's clock: the moments the senders are let out, none crowded."""
    import math

    from delivery.traffic import JobBounds

    world.apply(target={"rate_limit": {"per_second": per_second}}, rule={"concurrency": 1})
    clock = FakeClock()
    target = Chain(world.engine, RULE, clock=clock).rule.target
    senders = [TargetTraffic(world.engine, target, clock) for _ in range(3)]
    bounds = JobBounds(clock.now() + timedelta(hours=1))
    let_out: list[datetime] = []
    for sender in itertools.islice(itertools.cycle(senders), 12):
        assert sender.admit(bounds)
        let_out.append(clock.now())
    budget = math.ceil(per_second)
    for first, beyond in zip(let_out, let_out[budget:], strict=False):
        assert beyond - first >= timedelta(seconds=1), (first, beyond)
    assert let_out[-1] - let_out[0] < timedelta(seconds=12 * 1.1 / per_second)  # and not held back for nothing
