"""Connections to one target for calls in flight on one event loop: many small
`httpx.AsyncClient` pools instead of one large one.

httpcore's async pool (1.0.x) re-examines every connection it holds each time a request joins or
leaves it, and for each idle one asks the socket whether it is readable (through anyio): the cost
of one call grows with the square of the pool's size, and with the idle connections a pool holds
whenever the sender is slower than its target. Measured with 3,000 POSTs at 50 ms against the
sandbox: one pool of 64 connections spent 8.7 ms of CPU per call and sent 97 calls/s; eight pools
of 8 spent 1.0 ms and sent 621/s (threads over one `httpx.Client` of 64: 1.85 ms, 448/s). Pools of
2 against pools of 8, the engine at 2 ms and 8 in flight: 1.28 against 1.54 ms of CPU per record,
787 against 650 records/s (docs/performance.md). So the connections are split into pools of at
most `SHARD_CONNECTIONS`, and each call goes to the pool with the most free connections, which
keeps every call on a free connection whenever the total in flight is within the limit.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import AsyncIterator, Callable

import httpx

#: The most connections one pool holds: the pool's bookkeeping per call grows with it (2 and 1
#: measured alike; 2 keeps the pools fewer at 64 in flight).
SHARD_CONNECTIONS = 2


def shard_sizes(connections: int) -> list[int]:
    """How `connections` are split: as few pools as allow at most `SHARD_CONNECTIONS` each, as
    even as can be (64 -> 32 x 2, 7 -> 2 + 2 + 2 + 1, 1 -> 1)."""
    connections = max(1, connections)
    shards = math.ceil(connections / SHARD_CONNECTIONS)
    base, extra = divmod(connections, shards)
    return [base + 1 if i < extra else base for i in range(shards)]


class AsyncPools:
    """`httpx.AsyncClient`s to one target, one per entry of `sizes` (its connections, see
    `shard_sizes`); used from one event loop."""

    def __init__(self, sizes: list[int], make: Callable[[httpx.Limits], httpx.AsyncClient]) -> None:
        self.sizes = sizes
        self.clients = [make(httpx.Limits(max_connections=size, max_keepalive_connections=size)) for size in sizes]
        self._in_flight = [0] * len(self.clients)

    @contextlib.asynccontextmanager
    async def lend(self) -> AsyncIterator[httpx.AsyncClient]:
        """The client with the most free connections, counted busy until the block ends (only the
        loop's own tasks touch the counts, so no lock is needed)."""
        index = min(range(len(self.clients)), key=lambda i: self._in_flight[i] - self.sizes[i])
        self._in_flight[index] += 1
        try:
            yield self.clients[index]
        finally:
            self._in_flight[index] -= 1

    async def aclose(self) -> None:
        errors: list[BaseException] = []
        for client in self.clients:
            try:
                await client.aclose()
            except Exception as exc:  # every client is closed; the first failure is reported
                errors.append(exc)
        if errors:
            raise errors[0]
