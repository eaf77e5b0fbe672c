"""The rule lock: a Prefect global concurrency limit per rule (limit 1), held for one job.

Held for the length of one job, not of a chain (ADR-0029): a job that finds the rule taken waits
and runs once it is free, and waiting is no attempt and writes nothing. `strict=True`, because a
missing limit would otherwise silently mean no lock at all. Leases are short and renewed, so a
Prefect server frees the slot of a killed holder by itself; the embedded API does not (no
repossessor, leases in memory), so a waiter judges the recorded holder and frees the slot itself.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import os
import threading
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from datetime import timedelta
from uuid import UUID

from prefect import get_client
from prefect.client.schemas.actions import GlobalConcurrencyLimitCreate, GlobalConcurrencyLimitUpdate
from prefect.concurrency._asyncio import (
    aacquire_concurrency_slots_with_lease,
    arelease_concurrency_slots_with_lease,
)
from prefect.exceptions import ObjectAlreadyExists, ObjectNotFound

from delivery import liveness
from delivery.clock import utcnow
from delivery.engine import Chain

log = logging.getLogger(__name__)

LEASE_SECONDS = 60.0  # Prefect's minimum: a killed holder's slot is repossessed soonest
WAIT_STEP_ENV = "DELIVERY_LOCK_WAIT_STEP_SECONDS"


def lock_name(rule: str) -> str:
    return f"delivery-rule-{rule}"


def _wait_step() -> float:
    return float(os.environ.get(WAIT_STEP_ENV) or 15)


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


async def _free_if_holder_dead(chain: Chain, name: str, unknown_waits: int) -> None:
    """Free the slot of a holder that died mid-job. Returns without doing anything when the
    holder is alive (the job simply waits on) or when nobody is recorded yet."""
    now = utcnow()
    stale = timedelta(seconds=liveness.STALE_HOLDER_SECONDS + 2 * chain.rule.target.timeout_seconds)
    holders = [h for h in liveness.lock_holders(chain.engine, chain.rule.id) if h.token != chain.token]
    dead = [h for h in holders if liveness.holder_is_dead(h, now, stale, liveness.this_host())]
    if not dead and not (not holders and unknown_waits >= 2):
        return
    async with get_client() as client:
        for holder in dead:
            released = False
            if holder.lease_id:
                try:
                    await arelease_concurrency_slots_with_lease(UUID(holder.lease_id))
                    released = True
                except Exception:  # the lease lived in a server that is gone
                    released = False
            if not released:
                await client.update_global_concurrency_limit(name, GlobalConcurrencyLimitUpdate(active_slots=0))
            liveness.supersede(
                chain.engine,
                chain.rule.id,
                holder.token,
                f"lock holder (pid {holder.pid} on {holder.host}) died mid-job; its slot was freed",
            )
            log.warning("rule %s: freed the lock of dead chain %s", chain.rule.name, holder.token)
        if not holders:
            # A slot taken and nobody on record for two wait steps: taken by a process killed
            # between acquiring and recording it, or by a server restart that lost its leases.
            await client.update_global_concurrency_limit(name, GlobalConcurrencyLimitUpdate(active_slots=0))
            log.warning("rule %s: freed a lock slot that no live chain holds", chain.rule.name)


def _renew(lease_id: UUID, stop: threading.Event) -> None:
    """Renew at 75 % of the lease. Unlike Prefect's own helper this does not renew at once, so a
    short job (most are) makes no renewal call that could race its release."""
    with get_client(sync_client=True) as client:
        while not stop.wait(LEASE_SECONDS * 0.75):
            try:
                client.renew_concurrency_lease(lease_id=lease_id, lease_duration=LEASE_SECONDS)
            except Exception as exc:  # keep working: the DB fence still guards every write
                log.warning("could not renew the rule lock lease %s: %s", lease_id, exc)


@asynccontextmanager
async def rule_lock(chain: Chain) -> AsyncIterator[None]:
    name = await ensure_lock(chain.rule.name)
    unknown_waits = 0
    while True:
        try:
            response = await aacquire_concurrency_slots_with_lease(
                [name], 1, timeout_seconds=_wait_step(), lease_duration=LEASE_SECONDS, strict=True
            )
            break
        except TimeoutError:
            unknown_waits = unknown_waits + 1 if not liveness.lock_holders(chain.engine, chain.rule.id) else 0
            await _free_if_holder_dead(chain, name, unknown_waits)
    lease_id = response.lease_id
    liveness.record_lock(chain.engine, chain.token, str(lease_id))
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
        liveness.record_lock(chain.engine, chain.token, None)
        try:
            await arelease_concurrency_slots_with_lease(lease_id)
        except Exception:  # a slot already freed by a waiter that judged us dead
            log.warning("rule %s: the lock lease was already gone at release", chain.rule.name)
