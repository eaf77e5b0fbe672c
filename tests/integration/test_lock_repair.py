"""Freeing the rule lock of a holder that is gone never makes two holders: a slot taken with nobody
on record is not reset while its lease may be alive; a server with a repossessor is left to free
expired leases itself, even when a dead holder's release fails; and on the ephemeral API (no
repossessor: the harness's server is one) the slot is freed once any lease has surely expired.

Prefect refuses leases shorter than 60 s, so the expiry tests drive `LockRepair` with a fake clock."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any
from uuid import UUID, uuid4

import httpx
import pytest
import sqlalchemy as sa

import flows.lock
from delivery import liveness
from delivery.chain import Chain
from delivery.clock import FakeClock, utcnow
from delivery.liveness import LEASE_SECONDS, UNACCOUNTED_ON_A_SERVER_SECONDS, UNACCOUNTED_SECONDS
from delivery.store import chains, tables
from flows.lock import acquire_lease, release_lease, rule_lock
from tests.integration.locks import own_rule_lock
from tests.integration.world import RULE, World
from tests.target_server import TargetServer


@pytest.fixture
def world(prefect_api: None, engine: sa.Engine, target: TargetServer) -> World:
    return World(engine, target).apply()


@pytest.fixture
def name(monkeypatch: pytest.MonkeyPatch) -> str:
    """A limit of this test's own, so that no other test's slot can be in the way."""
    return own_rule_lock(monkeypatch, "delivery-rule-repair")


def _take(name: str, timeout: float = 30) -> str:
    """A lease on the rule's slot that nobody records: like a holder killed between acquiring and
    recording it, or one whose record was cleared while it still held the slot."""

    async def take() -> str:
        return str(await acquire_lease(name, timeout_seconds=timeout, lease_seconds=LEASE_SECONDS))

    return asyncio.run(take())


def _try_take(name: str, timeout: float) -> str | None:
    try:
        return _take(name, timeout)
    except TimeoutError:
        return None


def _release(lease_id: str) -> None:
    asyncio.run(release_lease(UUID(lease_id)))


def _active_slots(name: str) -> int:
    from prefect import get_client

    async def read() -> int:
        async with get_client() as client:
            return (await client.read_global_concurrency_limit_by_name(name)).active_slots

    return asyncio.run(read())


class Waiter:
    """A job of `chain` entering the rule lock in a thread of its own, holding it until told."""

    def __init__(self, chain: Chain) -> None:
        self.chain = chain
        self.acquired = threading.Event()
        self.leave = threading.Event()
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        async def hold() -> None:
            async with rule_lock(self.chain):
                self.acquired.set()
                while not self.leave.is_set():
                    await asyncio.sleep(0.05)

        try:
            asyncio.run(hold())
        except BaseException as exc:
            self.error = exc

    def __enter__(self) -> Waiter:
        self.thread.start()
        return self

    def __exit__(self, *_: Any) -> None:
        self.leave.set()
        self.thread.join(timeout=30)


class WaitSteps:
    """Counts the wait steps (`LockRepair.after_wait`) the waiters of this test have made, so a
    test waits for steps to have happened instead of sleeping as long as they might take."""

    def __init__(self) -> None:
        self.count = 0
        self._changed = threading.Condition()

    def made(self) -> None:
        with self._changed:
            self.count += 1
            self._changed.notify_all()

    def wait_for(self, n: int, timeout: float = 120) -> None:
        with self._changed:
            assert self._changed.wait_for(lambda: self.count >= n, timeout), f"{self.count} of {n} wait steps"


@pytest.fixture
def wait_steps(monkeypatch: pytest.MonkeyPatch) -> WaitSteps:
    steps = WaitSteps()
    after_wait = flows.lock.LockRepair.after_wait

    async def counted(self: flows.lock.LockRepair) -> None:
        await after_wait(self)
        steps.made()

    monkeypatch.setattr(flows.lock.LockRepair, "after_wait", counted)
    return steps


@pytest.fixture
def others(name: str) -> Iterator[list[str]]:
    """Leases taken by the test, released at the end whatever happened."""
    leases: list[str] = []
    yield leases
    for lease in leases:
        _release(lease)


def test_a_slot_with_nobody_on_record_is_not_reset_while_its_lease_may_be_alive(
    world: World, name: str, others: list[str], wait_steps: WaitSteps
) -> None:
    alive = _take(name)  # a holder still in its job, with nobody on record
    with Waiter(Chain(world.engine, RULE)) as waiter:
        wait_steps.wait_for(5)  # five wait steps of the waiter, each judging the slot
        _release(alive)  # the holder ends its job and gives back its slot, once
        assert waiter.acquired.wait(15), waiter.error
        # A third job must find the rule taken. Had the waiter reset the slot while the lease was
        # alive, that release would have freed the slot the waiter took: two holders.
        third = _try_take(name, timeout=3)
        if third is not None:
            others.append(third)
        assert third is None, "two jobs hold the rule lock"
        assert _active_slots(name) == 1


def _repair(world: World, name: str, *, repossessor: bool) -> tuple[flows.lock.LockRepair, FakeClock]:
    clock = FakeClock()
    return flows.lock.LockRepair(Chain(world.engine, RULE, clock=clock), name, repossessor=repossessor), clock


def _to(clock: FakeClock, seconds: float) -> None:
    """Move `clock` on to `seconds` after the repair began."""
    clock.advance(seconds - clock.monotonic())


def test_without_a_repossessor_an_unaccounted_slot_is_freed_once_any_lease_has_expired(world: World, name: str) -> None:
    _take(name)  # and never released: its holder was killed before it recorded itself
    repair, clock = _repair(world, name, repossessor=False)
    for seconds in (0, 1, LEASE_SECONDS / 2, LEASE_SECONDS, UNACCOUNTED_SECONDS - 1):
        _to(clock, seconds)
        asyncio.run(repair.after_wait())
        assert _active_slots(name) == 1, f"reset {seconds} s after it was first seen unaccounted"
    _to(clock, UNACCOUNTED_SECONDS + 1)
    asyncio.run(repair.after_wait())
    assert _active_slots(name) == 0


def test_a_holder_on_record_again_restarts_the_unaccounted_time(world: World, name: str, others: list[str]) -> None:
    others.append(_take(name))
    repair, clock = _repair(world, name, repossessor=False)
    asyncio.run(repair.after_wait())
    holder = Chain(world.engine, RULE, clock=clock)
    liveness.record_lock(world.engine, holder.token, others[0], clock.now())  # a live holder (this process)
    clock.advance(UNACCOUNTED_SECONDS / 2)
    asyncio.run(repair.after_wait())
    liveness.record_lock(world.engine, holder.token, None, clock.now())
    clock.advance(UNACCOUNTED_SECONDS / 2 + 1)
    asyncio.run(repair.after_wait())
    assert _active_slots(name) == 1  # unaccounted for only since the holder left the record


def test_with_a_repossessor_an_unaccounted_slot_is_left_to_the_repossessor_then_reset(world: World, name: str) -> None:
    """A server that repossesses expired leases frees a killed holder's slot by itself, but it keeps
    leases in memory: after a restart the slot is held by a lease it forgot, for good. So the slot
    is left alone while the repossessor could still free it, and reset after (issue 29, point 4;
    before, it was left alone forever and the rule stopped for good)."""
    _take(name)
    repair, clock = _repair(world, name, repossessor=True)
    for seconds in (0, UNACCOUNTED_SECONDS + 1, UNACCOUNTED_ON_A_SERVER_SECONDS - 1):
        _to(clock, seconds)
        asyncio.run(repair.after_wait())
        assert _active_slots(name) == 1, f"reset {seconds} s after it was first seen unaccounted"
    _to(clock, UNACCOUNTED_ON_A_SERVER_SECONDS + 1)
    asyncio.run(repair.after_wait())
    assert _active_slots(name) == 0


def _dead_holder(world: World, lease_id: str) -> str:
    finished = subprocess.Popen([sys.executable, "-c", "pass"])
    finished.wait()
    rule_id = world.rule_row()["id"]
    with world.engine.begin() as conn:
        token = chains.start_chain(conn, rule_id, None, utcnow())
        chains.record_lock(conn, token, lease_id, liveness.this_host(), finished.pid, utcnow())
    return token


def _failing_release(calls: list[str]) -> Any:
    async def release(lease_id: UUID) -> None:
        calls.append(str(lease_id))
        raise RuntimeError("the API did not answer")

    return release


def test_with_a_repossessor_a_dead_holder_whose_release_fails_is_not_reset(
    world: World, name: str, others: list[str], monkeypatch: pytest.MonkeyPatch, wait_steps: WaitSteps
) -> None:
    lease = _take(name)
    others.append(lease)
    token = _dead_holder(world, lease)
    calls: list[str] = []
    monkeypatch.setattr(flows.lock, "release_lease", _failing_release(calls))
    monkeypatch.setattr(flows.lock, "server_repossesses_leases", lambda: True, raising=False)
    with Waiter(Chain(world.engine, RULE)) as waiter:
        wait_steps.wait_for(3)  # steps enough to try the dead holder's lease, and again
        assert calls == [lease]  # it tried the lease, once
        assert not waiter.acquired.is_set() and _active_slots(name) == 1  # no blunt reset
        rule_id = world.rule_row()["id"]
        with world.engine.connect() as conn:
            assert chains.lock_holders(conn, rule_id) == []  # the dead holder is off the record
        monkeypatch.undo()  # ...so the test's own release below is the real one
        _release(others.pop())  # what the repossessor does once the lease expires
        assert waiter.acquired.wait(15), waiter.error
    with world.engine.connect() as conn:
        dead = conn.execute(sa.select(tables.chains_table).where(tables.chains_table.c.token == token)).one()
    assert dead.ended_by == "superseded" and "left to expire" in dead.message


def test_without_a_repossessor_a_dead_holder_whose_release_fails_is_reset(
    world: World, name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    lease = _take(name)  # lived in an ephemeral server that is gone: nothing will ever release it
    _dead_holder(world, lease)
    calls: list[str] = []
    monkeypatch.setattr(flows.lock, "release_lease", _failing_release(calls))
    monkeypatch.setattr(flows.lock, "server_repossesses_leases", lambda: False)
    with Waiter(Chain(world.engine, RULE)) as waiter:
        assert waiter.acquired.wait(15), waiter.error
        assert calls == [lease]
        assert _active_slots(name) == 1


def test_without_a_repossessor_a_dead_holders_lease_the_server_does_not_know_is_reset_at_once(
    world: World, name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The embedded API keeps leases in the memory of the server process that granted them: a holder
    killed with its own ephemeral server leaves the slot taken and a lease the next process's server
    never knew. Releasing such a lease answers like a success and frees nothing; before, the waiter
    took that for a freed slot and waited out the unaccounted-slot window (75 s) for a reset."""
    _take(name)  # the slot stays taken: its lease lives on, apart from what the record names
    token = _dead_holder(world, str(uuid4()))  # a lease this server never granted
    monkeypatch.setattr(flows.lock, "server_repossesses_leases", lambda: False)
    with Waiter(Chain(world.engine, RULE)) as waiter:
        assert waiter.acquired.wait(15), waiter.error
    with world.engine.connect() as conn:
        dead = conn.execute(sa.select(tables.chains_table).where(tables.chains_table.c.token == token)).one()
    assert dead.ended_by == "superseded" and "its slot was reset" in dead.message, dead.message


def test_the_harness_server_runs_no_repossessor_and_a_real_server_does(prefect_api: None) -> None:
    from prefect.settings import PREFECT_API_URL, temporary_settings

    assert flows.lock.server_repossesses_leases() is False  # the harness: an ephemeral-mode server
    with temporary_settings(updates={PREFECT_API_URL: "http://prefect.example:4200/api"}):
        assert flows.lock.server_repossesses_leases() is True


def test_a_release_answered_500_is_sent_again_and_frees_the_slot(
    world: World, name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A Prefect server on SQLite answers 500 "database is locked" now and then under load, and
    Prefect's client does not send a 500 again: before, the job's slot stayed taken with nobody on
    record, and the rule's next chain waited 75 s on the embedded API for a waiter to reset it."""
    from prefect.client.orchestration import PrefectClient

    release = PrefectClient.release_concurrency_slots_with_lease
    answers: list[int] = []

    async def locked_once(self: PrefectClient, *args: Any, **kwargs: Any) -> Any:
        if not answers:
            answers.append(500)
            request = httpx.Request("POST", "http://prefect.test/api/v2/concurrency_limits/decrement-with-lease")
            response = httpx.Response(500, request=request, text="database is locked")
            raise httpx.HTTPStatusError("500 Internal Server Error", request=request, response=response)
        answers.append(204)
        return await release(self, *args, **kwargs)

    monkeypatch.setattr(PrefectClient, "release_concurrency_slots_with_lease", locked_once)
    with Waiter(Chain(world.engine, RULE)) as waiter:
        assert waiter.acquired.wait(15), waiter.error
        assert _active_slots(name) == 1
    assert waiter.error is None, waiter.error
    assert answers == [500, 204]
    assert _active_slots(name) == 0


# -- acquiring never loses a granted slot ------------------------------------------------------------


@pytest.fixture
def late_grants(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """The API grants a slot at once but its answer reaches the caller 1.5 s later (a loaded
    server or network). Returns the times the grants were made."""
    from prefect.client.orchestration import PrefectClient

    granted: list[float] = []
    increment = PrefectClient.increment_concurrency_slots_with_lease

    async def late(self: PrefectClient, *args: Any, **kwargs: Any) -> Any:
        response = await increment(self, *args, **kwargs)
        if response.is_success:
            granted.append(time.monotonic())
            await asyncio.sleep(1.5)
        return response

    monkeypatch.setattr(PrefectClient, "increment_concurrency_slots_with_lease", late)
    return granted


def test_a_grant_answered_after_the_wait_step_is_taken_not_lost(
    prefect_api: None, name: str, late_grants: list[float]
) -> None:
    """A wait step that runs out while the granting request is in flight must not cut it short:
    the slot would then be held by a lease nobody knows, the rule taken until a repossessor frees
    it (for good on the harness's API). Prefect's own acquirer, with its timeout, lost it."""
    started = time.monotonic()
    lease = _take(name, timeout=0.5)
    assert late_grants and time.monotonic() - started > 1.5  # the step ran out mid-request
    assert _active_slots(name) == 1
    _release(lease)
    assert _active_slots(name) == 0


def test_a_waiter_cancelled_while_its_grant_is_in_flight_gives_the_slot_back(
    prefect_api: None, name: str, late_grants: list[float]
) -> None:
    async def cancelled_mid_request() -> None:
        taking = asyncio.ensure_future(acquire_lease(name, timeout_seconds=30, lease_seconds=LEASE_SECONDS))
        while not late_grants:
            await asyncio.sleep(0.01)
        taking.cancel()
        with pytest.raises(asyncio.CancelledError):
            await taking

    asyncio.run(cancelled_mid_request())
    assert late_grants  # granted, then cancelled before the answer came
    assert _active_slots(name) == 0


def test_a_taken_slot_times_out_after_the_wait_step(prefect_api: None, name: str) -> None:
    lease = _take(name)
    started = time.monotonic()
    assert _try_take(name, timeout=1.0) is None
    assert 1.0 <= time.monotonic() - started < 10
    assert _active_slots(name) == 1
    _release(lease)
