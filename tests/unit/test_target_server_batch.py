"""The local target server's batch endpoints, checked with a plain httpx client: the engine's batch
tests rely on each item being handled as its single endpoint would handle it, and on the scripts
(per item, per whole call) doing what they say."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.target_server import NOT_GZIP, Answer, TargetServer


@pytest.fixture
def server() -> Iterator[TargetServer]:
    with TargetServer() as srv:
        yield srv


@pytest.fixture
def client(server: TargetServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, timeout=2.0) as c:
        yield c


def create_items(*emails: str, key: bool = True) -> dict[str, Any]:
    return {
        "items": [
            {**({"idempotency_key": f"k-{email}"} if key else {}), "record": {"email": email}} for email in emails
        ]
    }


def test_batch_create_answers_one_result_per_item(client: httpx.Client, server: TargetServer) -> None:
    answer = client.post("/contacts/batch", json=create_items("a@x.io", "b@x.io"))
    assert answer.status_code == 200
    assert answer.json() == {
        "results": [
            {"status": 201, "id": "r-1", "record": {"id": "r-1", "email": "a@x.io"}},
            {"status": 201, "id": "r-2", "record": {"id": "r-2", "email": "b@x.io"}},
        ]
    }
    assert set(server.records("contacts")) == {"r-1", "r-2"}


def test_a_batch_call_is_one_recorded_request_with_its_items(client: httpx.Client, server: TargetServer) -> None:
    client.post("/contacts/batch", json=create_items("a@x.io", "b@x.io"))
    client.patch("/contacts/batch", json={"items": [{"id": "r-2", "record": {"n": 1}}, {"id": 7, "record": {}}]})
    client.post("/contacts", json={"email": "a@x.io"})
    create, update, single = server.requests
    assert (create.batch, create.path, create.item_keys) == (True, "/api/contacts/batch", ("a@x.io", "b@x.io"))
    assert create.items == create_items("a@x.io", "b@x.io")["items"]
    assert (update.method, update.item_keys) == ("PATCH", ("r-2", "7"))
    assert (single.batch, single.items, single.item_keys) == (False, [], ())
    assert server.count("a@x.io") == 2  # the batch call and the single create
    assert [r.method for r in server.requests_for("r-2")] == ["PATCH"]
    assert server.batch_requests() == [create, update]


def test_batch_update_merges_or_answers_404_per_item(client: httpx.Client, server: TargetServer) -> None:
    client.post("/contacts/batch", json=create_items("a@x.io"))
    items = [{"id": "r-1", "record": {"name": "A", "id": "hijack"}}, {"id": "r-9", "record": {"name": "?"}}]
    answer = client.patch("/contacts/batch", json={"items": items})
    assert answer.json() == {
        "results": [
            {"status": 200, "id": "r-1", "record": {"id": "r-1", "email": "a@x.io", "name": "A"}},
            {"status": 404, "error": "not found"},
        ]
    }


def test_per_item_idempotency_keys_are_the_single_creates(client: httpx.Client, server: TargetServer) -> None:
    first = client.post("/contacts/batch", json=create_items("a@x.io", "b@x.io")).json()["results"]
    again = client.post("/contacts/batch", json=create_items("b@x.io", "a@x.io")).json()["results"]
    assert [r["id"] for r in again] == [first[1]["id"], first[0]["id"]]
    single = client.post("/contacts", json={"email": "a@x.io"}, headers={"Idempotency-Key": "k-a@x.io"})
    assert single.json()["id"] == first[0]["id"]
    twice = client.post("/contacts/batch", json=create_items("c@x.io", "c@x.io")).json()["results"]
    assert twice[0]["id"] == twice[1]["id"]
    unkeyed = client.post("/contacts/batch", json=create_items("d@x.io", "d@x.io", key=False)).json()["results"]
    assert unkeyed[0]["id"] != unkeyed[1]["id"]
    assert len(server.records("contacts")) == 5


def test_malformed_items_are_refused_one_by_one(client: httpx.Client) -> None:
    items = [{"record": {"email": "a@x.io"}}, "nope", {"record": [1]}, {"idempotency_key": 5, "record": {}}]
    results = client.post("/contacts/batch", json={"items": items}).json()["results"]
    assert [r["status"] for r in results] == [201, 400, 400, 400]
    results = client.patch("/contacts/batch", json={"items": [{"record": {}}]}).json()["results"]
    assert results == [{"status": 400, "error": "item needs a string 'id'"}]


@pytest.mark.parametrize("body", [b"{not json", b"[]", b'{"items": {}}'])
def test_a_body_without_an_item_list_is_a_400_without_results(client: httpx.Client, body: bytes) -> None:
    answer = client.post("/contacts/batch", content=body, headers={"Content-Type": "application/json"})
    assert answer.status_code == 400
    assert "results" not in answer.json()


def test_per_item_scripts_apply_to_that_item_alone(client: httpx.Client, server: TargetServer) -> None:
    server.program("bad@x.io", Answer.status(422, {"error": "invalid email"}))
    server.program("slow@x.io", Answer.status(429, headers={"Retry-After": "5"}))
    server.program("noid@x.io", Answer.no_id())
    server.program("odd@x.io", Answer.not_json())
    server.program("raw@x.io", Answer.raw(201, b'{"status": 201, "id": 1.5}'))
    emails = ("bad@x.io", "slow@x.io", "noid@x.io", "odd@x.io", "raw@x.io", "ok@x.io")
    answer = client.post("/contacts/batch", json=create_items(*emails))
    assert answer.status_code == 200
    assert answer.json()["results"] == [
        {"error": "invalid email", "status": 422},
        {"error": "scripted 429", "retry_after": "5", "status": 429},
        {"status": 201},
        "ok",
        {"status": 201, "id": 1.5},
        {"status": 201, "id": "r-1", "record": {"id": "r-1", "email": "ok@x.io"}},
    ]
    assert list(server.records("contacts")) == ["r-1"]
    assert all(server.pending(email) == 0 for email in emails)


def test_an_item_script_for_an_update_keys_on_its_id(client: httpx.Client, server: TargetServer) -> None:
    client.post("/contacts/batch", json=create_items("a@x.io"))
    server.program_remote("r-1", Answer.status(410))
    results = client.patch("/contacts/batch", json={"items": [{"id": "r-1", "record": {"n": 1}}]}).json()["results"]
    assert results == [{"error": "scripted 410", "status": 410}]
    assert "n" not in server.records("contacts")["r-1"]


def test_an_item_timeout_stalls_the_whole_call_then_handles_it(server: TargetServer) -> None:
    server.program("slow@x.io", Answer.timeout(1.0))
    with httpx.Client(base_url=server.url, timeout=0.2) as impatient, pytest.raises(httpx.ReadTimeout):
        impatient.post("/contacts/batch", json=create_items("slow@x.io", "b@x.io"))
    deadline = time.monotonic() + 3
    while len(server.records("contacts")) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(server.records("contacts")) == 2


@pytest.mark.parametrize(
    ("whole", "code", "stored"),
    [
        (Answer.status(400, {"error": "malformed"}), 400, 0),
        (Answer.status(500), 500, 0),
        (Answer.status(429, headers={"Retry-After": "9"}), 429, 0),
        (Answer.no_id(), 200, 2),
        (Answer.not_json(), 200, 2),
        (Answer.echo_headers(400), 400, 0),
    ],
    ids=["400", "500", "429", "no-results", "not-json", "echo"],
)
def test_whole_call_scripts(client: httpx.Client, server: TargetServer, whole: Answer, code: int, stored: int) -> None:
    server.program_batch(whole)
    answer = client.post("/contacts/batch", json=create_items("a@x.io", "b@x.io"))
    assert answer.status_code == code
    assert len(server.records("contacts")) == stored
    if code == 429:
        assert answer.headers["Retry-After"] == "9"
    # Drained: the next call is handled item by item.
    assert client.post("/contacts/batch", json=create_items("c@x.io")).json()["results"][0]["status"] == 201


def test_a_whole_call_bad_gzip_handles_the_items_and_breaks_the_answer(server: TargetServer) -> None:
    server.program_batch(Answer.bad_gzip())
    with (
        httpx.Client(base_url=server.url) as client,
        client.stream("POST", "/contacts/batch", json=create_items("a@x.io")) as answer,
    ):
        assert answer.status_code == 200
        assert answer.headers["Content-Encoding"] == "gzip"
        assert b"".join(answer.iter_raw()) == NOT_GZIP
    assert len(server.records("contacts")) == 1


def test_a_whole_call_drop_hangs_up(client: httpx.Client, server: TargetServer) -> None:
    server.program_batch(Answer.drop())
    with pytest.raises(httpx.TransportError):
        client.post("/contacts/batch", json=create_items("a@x.io"))
    assert server.records("contacts") == {}


def test_a_whole_call_script_can_wait_for_its_method(client: httpx.Client, server: TargetServer) -> None:
    server.program_batch(Answer.status(503), method="PATCH")
    assert client.post("/contacts/batch", json=create_items("a@x.io")).status_code == 200
    assert client.patch("/contacts/batch", json={"items": []}).status_code == 503
    assert client.patch("/contacts/batch", json={"items": []}).json() == {"results": []}


def test_down_and_the_token_apply_to_batch_calls(server: TargetServer) -> None:
    server.down = True
    assert httpx.post(f"{server.url}/contacts/batch", json=create_items("a@x.io")).status_code == 503
    server.down = False
    server.token = "tok"
    try:
        assert httpx.post(f"{server.url}/contacts/batch", json=create_items("a@x.io")).status_code == 401
        assert len(server.requests) == 2  # refused calls are recorded too
    finally:
        server.token = None


def test_reset_forgets_batch_scripts(client: httpx.Client, server: TargetServer) -> None:
    server.program_batch(Answer.status(500))
    server.reset()
    assert client.post("/contacts/batch", json=create_items("a@x.io")).status_code == 200


def test_get_and_delete_of_the_batch_path_are_record_addresses(client: httpx.Client) -> None:
    assert client.get("/contacts/batch").status_code == 404
    assert client.delete("/contacts/batch").status_code == 404
