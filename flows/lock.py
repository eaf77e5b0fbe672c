"""The rule lock: a Prefect global concurrency limit per rule (limit 1), held for one job.

Held for the length of one job, not of a chain (ADR-0029): a job that finds the rule taken waits
and runs once it is free, and waiting is no attempt and writes nothing. `strict=True`, because a
missing limit would otherwise silently mean no lock at all.

Freeing a slot whose holder died: leases are short (60 s) and renewed while a job runs. A waiter
that finds a dead holder on record releases that holder's lease: a release frees exactly the slot
that lease took, and only once. Setting `active_slots=0` (the blunt reset) frees whatever holds
the slot, so it is used only when nothing else can: it would otherwise let a lease still alive
later give back a slot that by then belongs to the next holder, and two jobs would hold the rule.

- A `prefect server start` (PREFECT_API_URL) runs a repossessor that frees every lease nobody
  renewed. A slot taken with nobody on record, or a dead holder whose release failed, is first left
  to the lease's expiry; but such a server keeps leases in memory, and after a restart a slot stays
  taken by a lease it forgot, which nothing frees. So once the slot has stood taken with nobody on
  record for longer than the repossessor could take (`liveness.UNACCOUNTED_ON_A_SERVER_SECONDS`),
  a waiter resets it there too.
- Prefect's ephemeral API (no PREFECT_API_URL: a temporary server per process; the test harness
  too) runs no repossessor, keeps leases in memory and loses them when its process ends, so
  nothing but a waiter can free such a slot. It resets only after the slot has stood taken with
  nobody on record for longer than a lease lives unrenewed (`liveness.slot_lost`), or when a
  dead holder's release fails (its lease died with the server that held it).

Every length here (the lease, its renewal, the wait step) and every judgement of a holder (dead,
or a slot lost) is `delivery.liveness`'s: this module acts on what it decides.

What an operator should see goes to the chain's run log (the `logger` the flow passes in): each
wait step that found the rule taken (which chain holds it, its flow run, process and host, and how
long the wait has lasted), and every slot freed from a dead holder.

Prefect's `concurrency()` never hands out the lease id this needs, so the lease is taken with the
public client's increment call, one try at a time, the wait between tries being ours. Prefect's
own acquirer is not used for a second reason: its timeout cancels a request in flight, and a slot
the server granted to that request is then held by a lease nobody knows (the rule stays taken
until a repossessor frees it, or for good on an API that runs none; seen under load: a `delivery
run` waiting 300 s for a slot nobody held).
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
import threading
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any
from uuid import UUID

import httpx
from prefect import get_client
from prefect.client.orchestration import PrefectClient
from prefect.client.schemas.actions import GlobalConcurrencyLimitCreate, GlobalConcurrencyLimitUpdate
from prefect.client.schemas.responses import ConcurrencyLimitWithLeaseResponse
from prefect.exceptions import ObjectAlreadyExists, ObjectNotFound
from prefect.settings import PREFECT_API_URL

from delivery import liveness
from delivery.chain import Chain
from flows.prefect_private import ephemeral_api_urls

log = logging.getLogger(__name__)

#: A std logger, or the run logger (a LoggerAdapter) of the chain's flow run.
RunLogger = logging.Logger | logging.LoggerAdapter[Any]

#: Every rule's lock is the Prefect global concurrency limit named this prefix + the rule's name.
LOCK_PREFIX = "delivery-rule-"


def lock_name(rule: str) -> str:
    return LOCK_PREFIX + rule


async def ensure_lock(rule: str) -> str:
    """Create the rule's limit (limit 1) when missing; it then shows in the UI's concurrency page."""
    name = lock_name(rule)
    async with get_client() as client:
        try:
            await client.read_global_concurrency_limit_by_name(name)
        except ObjectNotFound:
            with contextlib.suppress(ObjectAlreadyExists):  # created by a racing job: just as good
                await client.create_global_concurrency_limit(GlobalConcurrencyLimitCreate(name=name, limit=1))
    return name


def server_repossesses_leases() -> bool:
    """True for a Prefect server that frees expired leases itself (`prefect server start`). False
    for Prefect's ephemeral API: the one it starts in this process when PREFECT_API_URL is unset,
    or the test harness's. Both run in ephemeral mode, which starts no repossessor."""
    url = PREFECT_API_URL.value()
    if not url:
        return False
    return url.rstrip("/") not in ephemeral_api_urls()


async def acquire_lease(name: str, timeout_seconds: float, lease_seconds: float) -> UUID:
    """Take the one slot of the limit `name` under a lease of `lease_seconds` and return the lease
    id. Tries until `timeout_seconds` have passed (then `TimeoutError`), sleeping the server's
    Retry-After between tries. A missing limit is an error, since it would otherwise silently mean
    no lock at all (`LockMissing`)."""
    deadline = time.monotonic() + timeout_seconds
    async with get_client() as client:
        while True:
            try:
                response = await _increment_once(client, name, lease_seconds)
            except httpx.HTTPStatusError as exc:
                if exc.response.status_code != 423:  # anything but "taken"
                    raise
                retry_after = _retry_after(exc.response)
            else:
                if not response.limits:
                    raise LockMissing(f"the rule lock {name} does not exist")
                return response.lease_id
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"the rule lock {name} stayed taken for {timeout_seconds:g} s")
            await asyncio.sleep(min(retry_after, remaining))


class LockMissing(RuntimeError):
    """The rule's concurrency limit is gone (deleted by hand between `ensure_lock` and the job)."""


async def _increment_once(client: PrefectClient, name: str, lease_seconds: float) -> ConcurrencyLimitWithLeaseResponse:
    """One increment request, never cut short: a caller cancelled while it is in flight waits for
    its answer and gives back a slot it was granted, then is cancelled."""
    request = asyncio.ensure_future(
        client.increment_concurrency_slots_with_lease(
            names=[name], slots=1, mode="concurrency", lease_duration=lease_seconds
        )
    )
    try:
        response = await asyncio.shield(request)
    except asyncio.CancelledError:
        with contextlib.suppress(Exception):
            granted = ConcurrencyLimitWithLeaseResponse.model_validate((await request).json())
            if granted.limits:
                await client.release_concurrency_slots_with_lease(lease_id=granted.lease_id)
        raise
    return ConcurrencyLimitWithLeaseResponse.model_validate(response.json())


def _retry_after(response: httpx.Response) -> float:
    try:
        return max(0.0, float(response.headers.get("Retry-After", "1")))
    except ValueError:
        return 1.0


async def _reset(name: str) -> None:
    async with get_client() as client:
        await client.update_global_concurrency_limit(name, GlobalConcurrencyLimitUpdate(active_slots=0))


#: A release answered 5xx is sent this many times in all. A Prefect server on SQLite (the embedded
#: API, a local `prefect server start`) answers 500 "database is locked" now and then under load,
#: and Prefect's client sends a 500 only once: a slot not given back stays taken until its lease
#: expires (60 s), and on the embedded API until a waiter judges it lost (75 s).
RELEASE_ATTEMPTS = 3


async def release_lease(lease_id: UUID) -> None:
    """Free the slot `lease_id` took; a lease already gone is no error (the API answers alike).
    Sending it again is safe: the server frees the slot and forgets the lease only once the
    transaction that frees it has committed, and a lease it forgot frees nothing more."""
    async with get_client() as client:
        for attempt in range(1, RELEASE_ATTEMPTS + 1):
            try:
                await client.release_concurrency_slots_with_lease(lease_id=lease_id)
                return
            except httpx.HTTPStatusError as exc:
                if exc.response.status_code < 500 or attempt == RELEASE_ATTEMPTS:
                    raise
                log.info("releasing lease %s answered %s; trying again", lease_id, exc.response.status_code)
            await asyncio.sleep(0.5 * attempt)


async def _release(lease_id: str) -> bool:
    """Release a dead holder's lease; True only when that freed its slot.

    The API answers the release of a lease it does not hold as it answers any other, freeing
    nothing: the embedded API keeps leases in the memory of the server process that granted them,
    so the lease of a holder killed with its own server is unknown to the next one, while its slot
    stays taken. A renewal comes first because it is answered 410 Gone for a lease the API does not
    hold; the holder is dead, so keeping its lease a moment longer takes nothing from anyone."""
    try:
        async with get_client() as client:
            await client.renew_concurrency_lease(lease_id=UUID(lease_id), lease_duration=liveness.LEASE_SECONDS)
        await release_lease(UUID(lease_id))
    except Exception as exc:  # a lease the API does not hold (410), or the API did not answer
        if not (isinstance(exc, httpx.HTTPStatusError) and exc.response.status_code in (404, 410)):
            log.warning("could not release lease %s: %s", lease_id, exc)
        return False
    return True


@dataclass
class LockRepair:
    """What a waiter does after each wait step that found the rule taken. It lives as long as the
    wait, because a slot is judged unaccounted for by how long it has stood so."""

    chain: Chain
    name: str
    repossessor: bool
    unaccounted_since: float | None = None
    warned: bool = False
    logger: RunLogger = log
    #: When the wait began, on the chain's clock (`Clock.monotonic`); by default, as this is made.
    waiting_since: float | None = None

    def __post_init__(self) -> None:
        if self.waiting_since is None:
            self.waiting_since = self.chain.clock.monotonic()

    async def after_wait(self) -> None:
        chain = self.chain
        liveness.beat(chain.engine, chain.token, chain.clock.now())
        holders = [h for h in liveness.lock_holders(chain.engine, chain.rule.id) if h.token != chain.token]
        self._tell_wait(holders)
        if holders:
            self.unaccounted_since = None
            await self._free_dead(holders)
        else:
            await self._free_unaccounted()

    def _tell_wait(self, holders: list[liveness.Holder]) -> None:
        """One line per wait step: who the chain waits for, so a run that seems stuck says why."""
        clock = self.chain.clock
        waited = clock.monotonic() - (self.waiting_since or 0.0)
        now = clock.now()
        if not holders:
            who = "by no chain on record (a slot being handed over, or one left by a dead process)"
        else:
            who = "; ".join(
                f"by chain {h.token} (flow run {h.flow_run_id or '-'}, pid {h.pid} on {h.host}, "
                f"last heartbeat {(now - h.heartbeat_at).total_seconds():.0f} s ago)"
                for h in holders
            )
        self.logger.info(
            "rule %s: waiting for the rule lock %s, for %.0f s so far; it is held %s",
            self.chain.rule.name, self.name, waited, who,
        )  # fmt: skip

    async def _free_dead(self, holders: list[liveness.Holder]) -> None:
        """Free the slot of a holder that died mid-job; a live holder (however slow) is waited for."""
        chain = self.chain
        stale = liveness.holder_stale_after(chain.rule.target.timeout_seconds)
        now = chain.clock.now()
        for holder in holders:
            if not liveness.holder_is_dead(holder, now, stale, liveness.this_host()):
                continue
            released = holder.lease_id is not None and await _release(holder.lease_id)
            if not released and not self.repossessor:
                await _reset(self.name)  # its lease died with the ephemeral server that held it
            how = "its lease was released" if released else (
                "its lease is left to expire" if self.repossessor else "its slot was reset"
            )  # fmt: skip
            # Off the record too: superseding an ended chain (one that died in its last release)
            # would leave it there, judged dead again at every wait.
            liveness.record_lock(chain.engine, holder.token, None, chain.clock.now())
            liveness.supersede(
                chain.engine, chain.rule.id, holder.token,
                f"lock holder (pid {holder.pid} on {holder.host}) died mid-job; {how}", chain.clock.now(),
            )  # fmt: skip
            self.logger.warning(
                "rule %s: freed the lock of dead chain %s (flow run %s, pid %s on %s, last heartbeat at %s): %s",
                chain.rule.name, holder.token, holder.flow_run_id or "-", holder.pid, holder.host,
                holder.heartbeat_at.isoformat(timespec="seconds"), how,
            )  # fmt: skip

    async def _free_unaccounted(self) -> None:
        """A slot taken and nobody on record: taken by a process killed between acquiring and
        recording it, held by a chain superseded while still in its job, or left by a server that
        lost its leases (the ephemeral API when its process ended; a `prefect server start`
        restarted, since it keeps leases in memory). Its lease, if it has one, may be alive: never
        reset it before that lease has surely expired, and on a server with a repossessor not
        before the repossessor would surely have freed it (`liveness.slot_lost`). The delivery
        database decides who works the rule: nobody on record that long means nobody."""
        now = self.chain.clock.monotonic()
        if self.unaccounted_since is None:
            self.unaccounted_since = now
            return
        waited = now - self.unaccounted_since
        if self.repossessor and liveness.slot_lost(waited) and not self.warned:
            self.warned = True
            self.logger.warning(
                "rule %s: the lock has been taken for %.0f s with no chain on record; waiting up to "
                "%.0f s in all for the server to repossess its lease, then resetting the slot",
                self.chain.rule.name, waited, liveness.UNACCOUNTED_ON_A_SERVER_SECONDS,
            )  # fmt: skip
        if not liveness.slot_lost(waited, self.repossessor):
            return
        await _reset(self.name)
        self.unaccounted_since = None
        why = " (the server holds no lease for it: it restarted, or lost it)" if self.repossessor else ""
        self.logger.warning("rule %s: freed a lock slot that no live chain holds%s", self.chain.rule.name, why)


def _renew(lease_id: UUID, stop: threading.Event) -> None:
    """Renew every `liveness.LEASE_RENEW_SECONDS`. Unlike Prefect's own helper this does not renew
    at once, so a short job (most are) makes no renewal call that could race its release."""
    with get_client(sync_client=True) as client:
        while not stop.wait(liveness.LEASE_RENEW_SECONDS):
            try:
                client.renew_concurrency_lease(lease_id=lease_id, lease_duration=liveness.LEASE_SECONDS)
            except Exception as exc:  # keep working: the DB fence still guards every write
                log.warning("could not renew the rule lock lease %s: %s", lease_id, exc)


#: How long a job first tries for the rule lock before it says it waits (a free lock is taken at once).
FIRST_TRY_SECONDS = 0.5


@asynccontextmanager
async def rule_lock(chain: Chain, logger: RunLogger | None = None) -> AsyncIterator[None]:
    """Hold the rule lock for one job. `logger`: the chain's run logger, where waits and repairs
    are told (default: this module's logger)."""
    name = await ensure_lock(chain.rule.name)
    repair: LockRepair | None = None
    started = chain.clock.monotonic()
    step = FIRST_TRY_SECONDS
    while True:
        try:
            lease_id = await acquire_lease(name, timeout_seconds=step, lease_seconds=liveness.LEASE_SECONDS)
            break
        except TimeoutError:
            if step == FIRST_TRY_SECONDS:
                # Said as the wait begins: a run that seems stuck says why at once.
                step = liveness.lock_wait_step_seconds()
                holders = [h for h in liveness.lock_holders(chain.engine, chain.rule.id) if h.token != chain.token]
                held = f"held by chain {holders[0].token} (flow run {holders[0].flow_run_id or '-'})" if holders else (
                    "held by no chain on record"
                )  # fmt: skip
                (logger or log).info("waiting for the rule lock %s, %s", name, held)
                continue
            repair = repair or LockRepair(
                chain, name, repossessor=server_repossesses_leases(), logger=logger or log, waiting_since=started
            )
            await repair.after_wait()
    if repair is not None:
        (logger or log).info(
            "rule %s: took the rule lock after waiting %.0f s", chain.rule.name, chain.clock.monotonic() - started
        )
    liveness.record_lock(chain.engine, chain.token, str(lease_id), chain.clock.now())
    stop = threading.Event()
    # A thread, not an asyncio task: the batch task runs synchronously on this event loop.
    context = contextvars.copy_context()
    renewer = threading.Thread(
        target=context.run, args=(_renew, lease_id, stop), daemon=True, name=f"delivery-lease-{chain.rule.name}"
    )
    renewer.start()
    try:
        yield
    finally:
        stop.set()
        renewer.join(timeout=5)
        # Release, then clear the record: the other order leaves a moment where the slot is taken
        # by a live lease with nobody on record, which a waiter could take for a lost slot.
        cancelled = await _release_even_if_cancelled(lease_id, chain.rule.name, logger or log)
        liveness.record_lock(chain.engine, chain.token, None, chain.clock.now())
        if cancelled:
            raise asyncio.CancelledError


async def _release_even_if_cancelled(lease_id: UUID, rule: str, logger: RunLogger) -> bool:
    """Release the lease to the end; True if the chain was cancelled meanwhile.

    A chain cancelled in a long-lived process (Cancel in the UI on `delivery worker`) is cancelled
    at its next await, and while a batch runs that is this release: cut short, it would leave the
    slot taken until its lease expires, and the rule's next chain would wait that long."""
    release = asyncio.ensure_future(release_lease(lease_id))
    cancelled = False
    while not release.done():
        try:
            await asyncio.shield(release)
        except asyncio.CancelledError:
            cancelled = True
    if release.cancelled() or release.exception() is not None:  # a slot a waiter freed, judging us dead
        logger.warning("rule %s: the lock lease was already gone at release", rule)
    return cancelled
