"""The async verbs' connections split into small pools (`delivery.writers.pools`)."""

from __future__ import annotations

import asyncio

import httpx
from hypothesis import given
from hypothesis import strategies as st

from delivery.writers.pools import SHARD_CONNECTIONS, AsyncPools, shard_sizes


@given(st.integers(min_value=1, max_value=500))
def test_the_pools_hold_every_connection_none_too_many_and_differ_by_one_at_most(connections: int) -> None:
    sizes = shard_sizes(connections)
    assert sum(sizes) == connections
    assert max(sizes) <= SHARD_CONNECTIONS and min(sizes) >= 1
    assert max(sizes) - min(sizes) <= 1
    assert len(sizes) == -(-connections // SHARD_CONNECTIONS)  # as few pools as the cap allows


def test_calls_in_flight_within_the_limit_each_find_a_free_connection() -> None:
    """Lent to the pool with the most free connections: with 20 calls in flight over 7 + 7 + 6,
    no pool is ever asked for more than it holds, however the calls end and start."""
    made: list[httpx.Limits] = []

    def make(limits: httpx.Limits) -> httpx.AsyncClient:
        made.append(limits)
        return httpx.AsyncClient(transport=httpx.MockTransport(lambda request: httpx.Response(200)))

    async def scenario() -> list[int]:
        pools = AsyncPools(shard_sizes(20), make)
        most = [0] * len(pools.clients)
        busy = [0] * len(pools.clients)
        release = [asyncio.Event() for _ in range(200)]

        async def call(n: int) -> None:
            async with pools.lend() as client:
                index = pools.clients.index(client)
                busy[index] += 1
                most[index] = max(most[index], busy[index])
                await release[n].wait()
                busy[index] -= 1

        live = {n: asyncio.create_task(call(n)) for n in range(20)}
        await asyncio.sleep(0)
        for n in range(20, 200):  # one ends (in a scrambled order), the next starts
            ending = sorted(live)[(n * 7) % len(live)]
            release[ending].set()
            await live.pop(ending)
            live[n] = asyncio.create_task(call(n))
            await asyncio.sleep(0)
            assert sum(busy) == 20
        for event in release:
            event.set()
        await asyncio.gather(*live.values())
        await pools.aclose()
        return most

    most = asyncio.run(scenario())
    assert [limits.max_connections for limits in made] == shard_sizes(20)
    assert most == shard_sizes(20)  # every pool filled, none past what it holds
