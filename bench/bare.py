"""The physical limit: the same requests the engine makes, by a bare httpx client, nothing else.

Same client stack as the engine's `rest` writer (one pooled `httpx.Client` shared by `concurrency`
threads, its pool sized to `concurrency` as the writer's is), same bodies, same `Idempotency-Key`
header, and the answer's id is read as the writer does. No database, no breaker, no Prefect.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Sequence
from typing import Any

import httpx

from delivery import decisions
from delivery.writers.pools import shard_sizes


def post_all(
    base_url: str, collection: str, records: Sequence[tuple[str, dict[str, Any]]], concurrency: int, key_scope: str
) -> float:
    """POST every record (`(external_id, body)`) with `concurrency` requests in flight; returns the
    elapsed seconds. Raises on the first answer that is not a create."""
    client = httpx.Client(
        base_url=base_url.rstrip("/") + "/",
        headers={"Accept": "application/json", "User-Agent": "delivery-bench"},
        timeout=httpx.Timeout(10.0),
        # Sized as the writer sizes its pool: every thread keeps its connection alive between calls.
        limits=httpx.Limits(max_connections=max(1, concurrency), max_keepalive_connections=max(1, concurrency)),
    )
    pending = iter(range(len(records)))
    take = threading.Lock()
    errors: list[BaseException] = []

    def worker() -> None:
        try:
            while not errors:
                with take:
                    index = next(pending, None)
                if index is None:
                    return
                external_id, body = records[index]
                key = decisions.idempotency_key(key_scope, external_id, 0)
                response = client.post(collection, json=body, headers={"Idempotency-Key": key})
                if response.status_code != 201 or not response.json().get("id"):
                    raise RuntimeError(f"bare POST {collection}: HTTP {response.status_code}: {response.text[:200]}")
        except BaseException as exc:
            errors.append(exc)

    try:
        threads = [threading.Thread(target=worker, daemon=True) for _ in range(max(1, concurrency))]
        started = time.perf_counter()
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        elapsed = time.perf_counter() - started
    finally:
        client.close()
    if errors:
        raise errors[0]
    return elapsed


def post_all_async(
    base_url: str,
    collection: str,
    records: Sequence[tuple[str, dict[str, Any]]],
    concurrency: int,
    key_scope: str,
    *,
    one_pool: bool = False,
) -> float:
    """`post_all` by an asyncio client: `httpx.AsyncClient`s with the same pools as the engine's
    async verbs (`concurrency` connections split as `shard_sizes` splits them; task i uses pool
    i mod n, so each pool has as many tasks as connections), `concurrency` tasks on one event loop
    each taking the next record (what the engine's async job does, with nothing else): the limit to
    compare the async path with. `one_pool`: a single client with every connection, the layout
    that costs httpcore a time quadratic in the pool's size (`delivery.writers.pools`)."""

    async def run() -> float:
        sizes = [max(1, concurrency)] if one_pool else shard_sizes(concurrency)
        clients = [
            httpx.AsyncClient(
                base_url=base_url.rstrip("/") + "/",
                headers={"Accept": "application/json", "User-Agent": "delivery-bench"},
                timeout=httpx.Timeout(10.0),
                limits=httpx.Limits(max_connections=size, max_keepalive_connections=size),
            )
            for size in sizes
        ]
        # Task i to pool i mod n: as many tasks per pool as it has connections.
        owners = [clients[i % len(clients)] for i in range(max(1, concurrency))]
        try:
            pending = iter(range(len(records)))

            async def worker(client: httpx.AsyncClient) -> None:
                while (index := next(pending, None)) is not None:
                    external_id, body = records[index]
                    key = decisions.idempotency_key(key_scope, external_id, 0)
                    response = await client.post(collection, json=body, headers={"Idempotency-Key": key})
                    if response.status_code != 201 or not response.json().get("id"):
                        raise RuntimeError(
                            f"bare POST {collection}: HTTP {response.status_code}: {response.text[:200]}"
                        )

            started = time.perf_counter()
            await asyncio.gather(*(worker(client) for client in owners))
            return time.perf_counter() - started
        finally:
            for client in clients:
                await client.aclose()

    return asyncio.run(run())
