"""The two Prefect internals the engine cannot do without, kept in this one module.

Everything else the engine asks of Prefect goes through its public API. These two have no public
equivalent in Prefect 3.9:

- The rule lock must know its lease id: it is recorded so that a waiter can release the lease of a
  holder that died mid-job (flows/lock.py). The public `prefect.concurrency.asyncio.concurrency()`
  takes `lease_duration`, `strict` and a `holder` but never hands the lease id out, and no public
  API finds a lease by its holder. A bare `PrefectClient.increment_concurrency_slots_with_lease`
  call would give the id but lose what Prefect's own acquirer adds: it waits out the server's
  Retry-After while the slot is taken, and releases a lease granted to a caller that was cancelled
  while waiting (which would otherwise hold the rule until the lease expires).
- Telling Prefect's ephemeral API (which repossesses no expired lease) from a real server needs the
  ephemeral servers this process started, which Prefect keeps only in a private class attribute.

tests/unit/test_prefect_private.py imports each of these names and checks its shape, so the day a
Prefect upgrade moves or changes one, that test fails instead of the lock at run time.
"""

from __future__ import annotations

import sys
from uuid import UUID

from prefect.concurrency._asyncio import aacquire_concurrency_slots_with_lease

#: Where Prefect keeps its ephemeral servers; looked up, not imported (importing it costs seconds).
EPHEMERAL_SERVER_MODULE = "prefect.server.api.server"


async def acquire_lease(name: str, timeout_seconds: float, lease_seconds: float) -> UUID:
    """Take the one slot of the limit `name` under a lease of `lease_seconds` and return the lease
    id. Waits at most `timeout_seconds` (then `TimeoutError`); a missing limit is an error
    (`strict`), since it would otherwise silently mean no lock at all."""
    response = await aacquire_concurrency_slots_with_lease(
        [name], 1, timeout_seconds=timeout_seconds, lease_duration=lease_seconds, strict=True
    )
    return response.lease_id


def ephemeral_api_urls() -> set[str]:
    """The API URLs of the ephemeral Prefect servers this process started (none if it started none)."""
    server = sys.modules.get(EPHEMERAL_SERVER_MODULE)
    if server is None:
        return set()
    instances = server.SubprocessASGIServer._instances
    return {str(s.api_url).rstrip("/") for s in instances.values() if s.port is not None}
