"""The sandbox's batch endpoints over real HTTP: the `rest` driver's batch wire format, each item
handled as its single endpoint would, faults met once per call, and the engine's batch verbs
against it."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from delivery.domain import BatchEndpoints, Connection, ConnectionStatus
from delivery.errors import RemoteGone, TargetUnavailable
from delivery.writers import CreateItem, UpdateItem
from delivery.writers.registry import writer_for
from playground.sandbox import SandboxServer, SandboxSettings


@pytest.fixture
def server() -> Iterator[SandboxServer]:
    with SandboxServer(SandboxSettings(port=0)) as srv:
        yield srv


@pytest.fixture
def client(server: SandboxServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url + "/", timeout=5.0) as c:
        yield c


def stats(client: httpx.Client, collection: str) -> dict[str, int]:
    answer: dict[str, int] = client.get("_stats").json()["collections"][collection]
    return answer


def test_batch_create_replays_keys_per_item(client: httpx.Client) -> None:
    items = [{"idempotency_key": "k-1", "record": {"email": "a"}}, {"record": {"email": "b", "id": "ignored"}}]
    first = client.post("contacts/batch", json={"items": items})
    assert first.status_code == 200
    assert first.json() == {
        "results": [
            {"status": 201, "id": "c-1", "record": {"id": "c-1", "email": "a"}},
            {"status": 201, "id": "c-2", "record": {"id": "c-2", "email": "b"}},
        ]
    }
    again = client.post("contacts/batch", json={"items": [items[0]]}).json()["results"]
    assert again == [{"status": 200, "id": "c-1", "record": {"id": "c-1", "email": "a"}}]
    single = client.post("contacts", json={"email": "a"}, headers={"Idempotency-Key": "k-1"})
    assert single.json()["id"] == "c-1"  # one store of keys for both endpoints
    counted = stats(client, "contacts")
    assert (counted["batches"], counted["creates"], counted["replays"]) == (2, 2, 2)
    assert counted["requests"] == 3 and counted["records"] == 2


def test_batch_update_merges_or_answers_404_per_item(client: httpx.Client) -> None:
    client.post("contacts/batch/", json={"items": [{"record": {"email": "a"}}]})  # the trailing slash too
    items = [{"id": "c-1", "record": {"name": "A"}}, {"id": "c-9", "record": {}}, {"record": {}}]
    results = client.patch("contacts/batch", json={"items": items}).json()["results"]
    assert results[0] == {"status": 200, "id": "c-1", "record": {"id": "c-1", "email": "a", "name": "A"}}
    assert results[1] == {"status": 404, "error": "no record 'c-9' in 'contacts'"}
    assert results[2]["status"] == 400
    assert client.get("contacts/c-1").json()["name"] == "A"
    assert stats(client, "contacts")["not_found"] == 1


@pytest.mark.parametrize("body", [[], {"items": "x"}, {"record": {}}])
def test_a_body_without_an_item_list_is_refused_whole(client: httpx.Client, body: Any) -> None:
    answer = client.post("contacts/batch", json=body)
    assert answer.status_code == 400
    assert "results" not in answer.json()


def test_get_of_the_batch_path_is_a_record_address(client: httpx.Client) -> None:
    assert client.get("contacts/batch").status_code == 404
    assert client.put("contacts/batch", json={}).status_code == 405


def test_an_injected_fault_fails_the_whole_call(client: httpx.Client) -> None:
    client.put("_faults", json={"fail_rate": 1})
    answer = client.post("contacts/batch", json={"items": [{"record": {"email": "a"}}]})
    assert answer.status_code == 503
    assert client.get("contacts").json() == []
    assert stats(client, "contacts")["faults"] == 1


def test_the_engines_batch_verbs_work_against_it(server: SandboxServer, client: httpx.Client) -> None:
    connection = Connection(
        id=1,
        name="sb",
        driver="rest",
        status=ConnectionStatus.ACTIVE,
        base_url=server.url,
        timeout_seconds=5,
        batch=BatchEndpoints(create_path="contacts/batch", update_path="contacts/batch"),
    )
    writer_type = writer_for(connection)
    assert writer_type is not None
    with writer_type(connection, "contacts") as writer:
        items = [CreateItem({"email": f"{n}@x.io"}, f"key-{n}") for n in range(3)]
        ids = writer.create_many(items)
        assert ids == ["c-1", "c-2", "c-3"]
        assert writer.create_many(items[1:]) == ids[1:]  # a retried call
        client.delete("contacts/c-2")
        updated = writer.update_many([UpdateItem("c-1", {"name": "A"}), UpdateItem("c-2", {"name": "B"})])
        assert updated[0] is None
        assert isinstance(updated[1], RemoteGone)
        assert client.get("contacts/c-1").json() == {"id": "c-1", "email": "0@x.io", "name": "A"}
        client.put("_faults", json={"fail_rate": 1})
        with pytest.raises(TargetUnavailable):
            writer.create_many([CreateItem({"email": "x"}, "key-x")])
    assert stats(client, "contacts")["batches"] == 4
