"""The baseline a user would build first: a Prefect flow with one task per record.

Each task POSTs one record (same body and Idempotency-Key as the engine) and returns the new id;
the flow maps the task over the records on a thread pool of `concurrency` workers. It keeps no
ledger, no cursor, no breaker and writes nothing to a database, so it is an upper bound for that
design: what is left is Prefect's per-task cost.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import httpx
from prefect import flow, task, unmapped
from prefect.task_runners import ThreadPoolTaskRunner

from delivery import decisions

_clients: dict[str, httpx.Client] = {}


def _client(base_url: str) -> httpx.Client:
    # One pooled client for the flow (kind to the baseline: a first design often opens one per task).
    if base_url not in _clients:
        _clients[base_url] = httpx.Client(base_url=base_url.rstrip("/") + "/", timeout=httpx.Timeout(10.0))
    return _clients[base_url]


@task(name="deliver-record")
def deliver_record(base_url: str, collection: str, key_scope: str, external_id: str, body: dict[str, Any]) -> str:
    key = decisions.idempotency_key(key_scope, external_id, 0)
    response = _client(base_url).post(collection, json=body, headers={"Idempotency-Key": key})
    response.raise_for_status()
    return str(response.json()["id"])


@flow(name="naive-delivery")
def naive_delivery(
    base_url: str, collection: str, key_scope: str, external_ids: list[str], bodies: list[dict[str, Any]]
) -> int:
    futures = deliver_record.map(unmapped(base_url), unmapped(collection), unmapped(key_scope), external_ids, bodies)
    return len([future.result() for future in futures])


def run(
    base_url: str, collection: str, records: Sequence[tuple[str, dict[str, Any]]], concurrency: int, key_scope: str
) -> float:
    """Run the naive flow over `records`; returns the elapsed seconds (flow run included)."""
    runner: ThreadPoolTaskRunner[Any] = ThreadPoolTaskRunner(max_workers=max(1, concurrency))
    flow_with_pool = naive_delivery.with_options(task_runner=runner)  # type: ignore[arg-type]
    started = time.perf_counter()
    done = flow_with_pool(
        base_url=base_url,
        collection=collection,
        key_scope=key_scope,
        external_ids=[external_id for external_id, _ in records],
        bodies=[body for _, body in records],
    )
    elapsed = time.perf_counter() - started
    for client in _clients.values():
        client.close()
    _clients.clear()
    if done != len(records):
        raise RuntimeError(f"naive flow delivered {done} of {len(records)} records")
    return elapsed
