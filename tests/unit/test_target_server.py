"""Proves the local target server behaves as the delivery tests rely on.

If the server itself misbehaved, engine tests built on it would pass or fail
for the wrong reason, so each scripted answer is checked against a real httpx
client here.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import httpx
import pytest

from tests.support.waiting import wait_for
from tests.target_server import Answer, TargetServer


@pytest.fixture
def server() -> Iterator[TargetServer]:
    with TargetServer() as srv:
        yield srv


@pytest.fixture
def client(server: TargetServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, timeout=2.0) as c:
        yield c


def test_url_points_at_api_prefix_on_loopback(server: TargetServer) -> None:
    assert server.url == f"http://127.0.0.1:{server.port}/api"


def test_create_assigns_counter_ids(client: httpx.Client, server: TargetServer) -> None:
    first = client.post("/contacts", json={"email": "a@x.io", "name": "A"})
    second = client.post("/contacts", json={"email": "b@x.io"})
    assert first.status_code == 201
    assert first.json() == {"id": "r-1", "email": "a@x.io", "name": "A"}
    assert second.json()["id"] == "r-2"
    assert set(server.records("contacts")) == {"r-1", "r-2"}


def test_idempotency_key_replays_the_first_record(client: httpx.Client, server: TargetServer) -> None:
    headers = {"Idempotency-Key": "k-1"}
    first = client.post("/contacts", json={"email": "a@x.io"}, headers=headers)
    again = client.post("/contacts", json={"email": "a@x.io"}, headers=headers)
    other = client.post("/contacts", json={"email": "a@x.io"}, headers={"Idempotency-Key": "k-2"})
    assert again.status_code == 201
    assert again.json() == first.json()
    assert other.json()["id"] != first.json()["id"]
    assert len(server.records("contacts")) == 2


def test_concurrent_retries_with_one_idempotency_key_create_one_record(server: TargetServer) -> None:
    ids: list[str] = []

    def post() -> None:
        r = httpx.post(f"{server.url}/contacts", json={"n": 1}, headers={"Idempotency-Key": "same"})
        ids.append(r.json()["id"])

    threads = [threading.Thread(target=post) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(set(ids)) == 1
    assert len(server.records("contacts")) == 1


def test_patch_get_list_and_delete(client: httpx.Client, server: TargetServer) -> None:
    rid = client.post("/contacts", json={"email": "a@x.io", "name": "A"}).json()["id"]
    patched = client.patch(f"/contacts/{rid}", json={"name": "B", "id": "hijack"})
    assert patched.status_code == 200
    assert patched.json() == {"id": rid, "email": "a@x.io", "name": "B"}
    assert client.get(f"/contacts/{rid}").json()["name"] == "B"
    assert client.get("/contacts").json() == [patched.json()]
    assert client.delete(f"/contacts/{rid}").status_code == 204
    assert client.get(f"/contacts/{rid}").status_code == 404
    assert server.records("contacts") == {}


def test_patch_unknown_id_is_404(client: httpx.Client) -> None:
    r = client.patch("/contacts/r-99", json={"name": "x"})
    assert r.status_code == 404
    assert r.json() == {"error": "not found"}


def test_scripted_500_then_default_success(client: httpx.Client, server: TargetServer) -> None:
    server.program("a@x.io", Answer.status(500))
    failed = client.post("/contacts", json={"email": "a@x.io"})
    assert failed.status_code == 500
    assert failed.json() == {"error": "scripted 500"}
    assert server.records("contacts") == {}
    ok = client.post("/contacts", json={"email": "a@x.io"})
    assert ok.status_code == 201
    assert server.count("a@x.io") == 2
    assert server.pending("a@x.io") == 0


def test_script_only_affects_its_own_key(client: httpx.Client, server: TargetServer) -> None:
    server.program("a@x.io", Answer.status(422))
    assert client.post("/contacts", json={"email": "b@x.io"}).status_code == 201
    assert client.post("/contacts", json={"email": "a@x.io"}).status_code == 422


def test_record_key_header_wins_and_program_remote_scripts_patch(client: httpx.Client, server: TargetServer) -> None:
    rid = client.post("/contacts", json={"email": "a@x.io"}).json()["id"]
    server.program_remote(rid, Answer.status(410))
    assert client.patch(f"/contacts/{rid}", json={"n": 1}).status_code == 410
    assert client.patch(f"/contacts/{rid}", json={"n": 1}).status_code == 200
    server.program("ext-7", Answer.status(404))
    r = client.post("/contacts", json={"email": "a@x.io"}, headers={"X-Record-Key": "ext-7"})
    assert r.status_code == 404
    assert server.count(rid) == 2
    assert server.count("ext-7") == 1


def test_429_carries_retry_after(client: httpx.Client, server: TargetServer) -> None:
    server.program("a@x.io", Answer.status(429, headers={"Retry-After": "120"}))
    r = client.post("/contacts", json={"email": "a@x.io"})
    assert r.status_code == 429
    assert r.headers["Retry-After"] == "120"


def test_timeout_answer_exceeds_client_timeout(server: TargetServer) -> None:
    server.program("a@x.io", Answer.timeout(1.0))
    started = time.monotonic()
    with pytest.raises(httpx.TimeoutException):
        httpx.post(f"{server.url}/contacts", json={"email": "a@x.io"}, timeout=0.2)
    assert time.monotonic() - started < 0.9


def test_drop_is_a_transport_error(client: httpx.Client, server: TargetServer) -> None:
    server.program("a@x.io", Answer.drop())
    with pytest.raises(httpx.TransportError):
        client.post("/contacts", json={"email": "a@x.io"})
    assert server.records("contacts") == {}
    # The pooled client recovers on a fresh connection.
    assert client.post("/contacts", json={"email": "a@x.io"}).status_code == 201


def test_no_id_answer_stores_nothing(client: httpx.Client, server: TargetServer) -> None:
    server.program("a@x.io", Answer.no_id())
    r = client.post("/contacts", json={"email": "a@x.io"})
    assert r.status_code == 201
    assert "id" not in r.json()
    assert server.records("contacts") == {}


def test_not_json_answer(client: httpx.Client, server: TargetServer) -> None:
    server.program("a@x.io", Answer.not_json())
    r = client.post("/contacts", json={"email": "a@x.io"})
    assert r.status_code == 201
    assert r.text == "ok"
    assert r.headers["content-type"].startswith("text/plain")


def test_down_flag_answers_503_for_everyone(client: httpx.Client, server: TargetServer) -> None:
    server.down = True
    assert client.post("/contacts", json={"email": "a@x.io"}).status_code == 503
    assert client.get("/contacts").status_code == 503
    server.down = False
    assert client.post("/contacts", json={"email": "a@x.io"}).status_code == 201


def test_token_is_required_when_configured() -> None:
    with TargetServer(token="s3cret") as srv:
        assert httpx.get(f"{srv.url}/contacts").status_code == 401
        wrong = {"Authorization": "Bearer nope"}
        assert httpx.get(f"{srv.url}/contacts", headers=wrong).status_code == 401
        right = {"Authorization": "Bearer s3cret"}
        assert httpx.get(f"{srv.url}/contacts", headers=right).status_code == 200


def test_echo_headers_reflects_request_headers(client: httpx.Client, server: TargetServer) -> None:
    server.program("a@x.io", Answer.echo_headers(400))
    r = client.post("/contacts", json={"email": "a@x.io"}, headers={"Authorization": "Bearer leak-me"})
    assert r.status_code == 400
    assert r.json()["headers"]["authorization"] == "Bearer leak-me"


def test_requests_are_recorded_and_reset_clears_everything(client: httpx.Client, server: TargetServer) -> None:
    server.latency_ms = 20
    client.post("/contacts", json={"email": "a@x.io"}, headers={"X-Trace": "t1"})
    client.get("/contacts")
    assert [(r.method, r.path) for r in server.requests] == [
        ("POST", "/api/contacts"),
        ("GET", "/api/contacts"),
    ]
    first = server.requests[0]
    assert first.json == {"email": "a@x.io"}
    assert first.key == "a@x.io"
    assert first.headers["x-trace"] == "t1"
    assert server.requests[1].json is None
    assert server.requests[1].time >= first.time + 0.02

    server.program("a@x.io", Answer.status(500))
    server.down = True
    server.reset()
    assert server.requests == []
    assert server.records("contacts") == {}
    assert server.pending("a@x.io") == 0
    assert not server.down
    assert client.post("/contacts", json={"email": "a@x.io"}).json()["id"] == "r-1"


def test_a_held_request_is_recorded_and_answered_only_when_released(server: TargetServer) -> None:
    server.hold()
    answers: list[httpx.Response] = []

    def post() -> None:
        with httpx.Client(base_url=server.url, timeout=30.0) as c:
            answers.append(c.post("/contacts", json={"email": "a@x.io"}))

    sender = threading.Thread(target=post)
    sender.start()
    wait_for(lambda: bool(server.requests), 10, "the request to arrive", poll=0.01)
    sender.join(timeout=0.3)
    assert sender.is_alive() and not answers  # arrived, recorded, not answered
    server.release()
    sender.join(timeout=10)
    assert [r.status_code for r in answers] == [201]


def test_a_given_up_answer_comes_only_after_the_client_gave_up_and_is_applied(server: TargetServer) -> None:
    """However late the client's timeout strikes, it never sees the answer: the target waits for
    the client to hang up, not for a guessed length, and then makes the record all the same."""
    server.program("a@x.io", Answer.given_up())
    with pytest.raises(httpx.TimeoutException):
        httpx.post(f"{server.url}/contacts", json={"email": "a@x.io"}, timeout=1.5)
    # Applied once the client hung up, not at the end of the answer's 30-second bound.
    wait_for(
        lambda: bool(server.records("contacts")), 10, "the request to be applied after the client gave up", poll=0.01
    )
    assert [r["email"] for r in server.records("contacts").values()] == ["a@x.io"]


def test_a_request_stalled_across_a_reset_is_dropped_not_applied(server: TargetServer) -> None:
    """A stall outliving its test (the target is shared, reset between tests) makes nothing in
    the next test's target."""
    server.program("late@x.io", Answer.timeout(60))  # the reset ends it at once
    answers: list[BaseException | int] = []

    def post() -> None:
        try:
            answers.append(httpx.post(f"{server.url}/contacts", json={"email": "late@x.io"}, timeout=30).status_code)
        except httpx.HTTPError as exc:
            answers.append(exc)

    sender = threading.Thread(target=post)
    sender.start()
    wait_for(lambda: server.stalled == 1, 10, "the request to be stalled", poll=0.01)
    server.reset()  # the next test begins while the request is stalled
    sender.join(timeout=30)
    assert not sender.is_alive(), "the reset did not end the stall"
    assert server.records("contacts") == {}
    assert len(answers) == 1 and isinstance(answers[0], httpx.HTTPError)  # dropped: no answer either
