"""`delivery sandbox` is a real target people deliver to, so it is proved over real HTTP: the `rest`
contract, idempotency, fault injection, persistence, and the engine's own RestWriter against it."""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from delivery.domain import Connection, ConnectionStatus
from delivery.errors import InputError, RemoteGone, TargetUnavailable
from delivery.writers.rest import RestWriter
from playground.sandbox import MAX_BODY_BYTES, SandboxServer, SandboxSettings, create_app, serve

DELIVERY = Path(sys.executable).parent / "delivery"


def settings(**overrides: Any) -> SandboxSettings:
    return SandboxSettings(**{"port": 0, **overrides})


@pytest.fixture
def server() -> Iterator[SandboxServer]:
    with SandboxServer(settings()) as srv:
        yield srv


@pytest.fixture
def client(server: SandboxServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url + "/", timeout=5.0) as c:
        yield c


def stats(client: httpx.Client, collection: str) -> dict[str, int]:
    answer: dict[str, int] = client.get("_stats").json()["collections"][collection]
    return answer


def test_healthz_and_url(server: SandboxServer, client: httpx.Client) -> None:
    assert server.url == f"http://127.0.0.1:{server.port}/api"
    answer = client.get(server.url.removesuffix("/api") + "/healthz")
    assert (answer.status_code, answer.json()) == (200, {"ok": True})


def test_create_answers_201_with_a_string_id(client: httpx.Client) -> None:
    first = client.post("contacts", json={"email": "a@x.io", "id": "ignored"})
    second = client.post("contacts", json={"email": "b@x.io"})
    assert first.status_code == 201
    assert first.json() == {"id": "c-1", "email": "a@x.io"}
    assert second.json()["id"] == "c-2"
    assert client.post("deals", json={}).json()["id"] == "d-1"


def test_a_repeated_idempotency_key_replays_the_record(client: httpx.Client) -> None:
    first = client.post("contacts", json={"email": "a"}, headers={"Idempotency-Key": "k-1"})
    again = client.post("contacts", json={"email": "a"}, headers={"Idempotency-Key": "k-1"})
    other = client.post("contacts", json={"email": "a"}, headers={"Idempotency-Key": "k-2"})
    elsewhere = client.post("deals", json={"email": "a"}, headers={"Idempotency-Key": "k-1"})
    assert again.status_code in (200, 201)
    assert again.json() == first.json()
    assert other.json()["id"] != first.json()["id"]
    assert elsewhere.json()["id"] == "d-1"  # keys are per collection
    assert len(client.get("contacts").json()) == 2
    assert stats(client, "contacts")["creates"] == 2
    assert stats(client, "contacts")["replays"] == 1


def test_concurrent_creates_with_one_key_make_one_record(server: SandboxServer) -> None:
    async def burst() -> set[str]:
        async with httpx.AsyncClient(base_url=server.url + "/") as c:
            answers = await asyncio.gather(
                *(c.post("contacts", json={"n": 1}, headers={"Idempotency-Key": "same"}) for _ in range(8))
            )
        return {a.json()["id"] for a in answers}

    assert asyncio.run(burst()) == {"c-1"}


def test_patch_merges_and_unknown_ids_are_404(client: httpx.Client) -> None:
    rid = client.post("contacts", json={"email": "a", "name": "A"}).json()["id"]
    patched = client.patch(f"contacts/{rid}", json={"name": "B", "id": "hijack"})
    assert patched.status_code == 200
    assert patched.json() == {"id": rid, "email": "a", "name": "B"}
    assert client.patch("contacts/c-999", json={"name": "B"}).status_code == 404
    assert client.patch("nothing-here/c-1", json={}).status_code == 404
    assert client.patch(f"contacts/{rid}", json=[1]).status_code == 400
    assert client.patch(f"contacts/{rid}", content=b"{nope").status_code == 400


def test_get_list_limit_and_delete(client: httpx.Client) -> None:
    ids = [client.post("contacts", json={"n": n}).json()["id"] for n in range(3)]
    assert [r["id"] for r in client.get("contacts").json()] == ids
    assert [r["id"] for r in client.get("contacts", params={"limit": 2}).json()] == ids[:2]
    assert client.get("contacts", params={"limit": "x"}).status_code == 400
    assert client.get("empty").json() == []
    assert client.get(f"contacts/{ids[1]}").json() == {"id": ids[1], "n": 1}
    assert client.delete(f"contacts/{ids[1]}").status_code == 204
    assert client.get(f"contacts/{ids[1]}").status_code == 404
    assert client.delete(f"contacts/{ids[1]}").status_code == 404
    assert client.patch(f"contacts/{ids[1]}", json={}).status_code == 404
    # A deleted id is never handed out again: the engine's ledger still points at it.
    assert client.post("contacts", json={}).json()["id"] == "c-4"
    assert client.put("contacts", json={}).status_code == 405
    assert client.get("_nope").status_code == 404


@pytest.mark.parametrize(
    ("method", "path", "status", "allow"),
    [
        ("POST", "/healthz", 405, "GET"),
        ("HEAD", "/api/contacts", 405, "GET, POST"),
        ("PUT", "/api/contacts", 405, "GET, POST"),
        ("POST", "/api/contacts/c-1", 405, "GET, PATCH, DELETE"),
        ("POST", "/api/_stats", 405, "GET"),  # its own endpoint, not a collection named `_stats`
        ("DELETE", "/api/_faults", 405, "GET, PUT"),
        ("POST", "/api/_nope", 404, None),
        ("GET", "/api/contacts/c-1/x", 404, None),
        ("GET", "/api//c-1", 404, None),
        ("GET", "/api", 404, None),
        ("GET", "/nope", 404, None),
    ],
)
def test_unrouted_requests_answer_a_json_error(
    server: SandboxServer, method: str, path: str, status: int, allow: str | None
) -> None:
    root = server.url.removesuffix("/api")
    answer = httpx.request(method, root + path, timeout=5.0)
    assert (answer.status_code, answer.headers.get("allow")) == (status, allow)
    if method != "HEAD":
        assert answer.json() == {"error": "method not allowed" if status == 405 else "not found"}


def test_a_trailing_slash_is_the_same_address(client: httpx.Client) -> None:
    assert client.post("contacts/", json={"n": 1}).status_code == 201
    assert [r["id"] for r in client.get("contacts/").json()] == ["c-1"]
    assert client.get("contacts/c-1/").json() == {"id": "c-1", "n": 1}
    assert client.get("_stats/").status_code == 200


def test_a_body_over_the_limit_is_413_and_nothing_is_stored(client: httpx.Client) -> None:
    answer = client.post("contacts", content=b"x" * (MAX_BODY_BYTES + 1))
    assert answer.status_code == 413
    assert str(MAX_BODY_BYTES) in answer.json()["error"]
    assert client.get("contacts").json() == []


def test_a_token_guards_unknown_paths_under_the_api_too() -> None:
    with SandboxServer(settings(token="s3cret")) as server, httpx.Client() as c:
        for path in ("/api", "/api/_nope", "/api/contacts/c-1/x"):
            answer = c.get(server.url.removesuffix("/api") + path)
            assert (answer.status_code, answer.headers["www-authenticate"]) == (401, "Bearer"), path
        assert c.get(server.url.removesuffix("/api") + "/nope").status_code == 404


def test_a_token_guards_the_api_but_not_healthz() -> None:
    with SandboxServer(settings(token="s3cret")) as server, httpx.Client() as c:
        base = server.url
        assert c.post(f"{base}/contacts", json={}).status_code == 401
        wrong = {"Authorization": "Bearer nope"}
        assert c.get(f"{base}/contacts", headers=wrong).status_code == 401
        assert c.put(f"{base}/_faults", json={"fail_rate": 1}, headers=wrong).status_code == 401
        assert c.get(f"{base}/_stats").status_code == 401
        good = {"Authorization": "Bearer s3cret"}
        assert c.post(f"{base}/contacts", json={}, headers=good).status_code == 201
        assert c.get(f"{base}/_stats", headers=good).json()["unauthorized"] == 4
        assert c.get(base.removesuffix("/api") + "/healthz").status_code == 200


def test_fail_rate_one_answers_503_and_changes_nothing() -> None:
    with SandboxServer(settings(fail_rate=1.0)) as server, httpx.Client(base_url=server.url + "/") as client:
        assert client.post("contacts", json={}).status_code == 503
        assert client.patch("contacts/c-1", json={}).status_code == 503
        assert client.get("contacts").json() == []  # reads are never faulted
        counts = stats(client, "contacts")
        assert (counts["faults"], counts["creates"], counts["requests"]) == (2, 0, 3)


def test_the_same_seed_gives_the_same_fault_sequence() -> None:
    def statuses(seed: int) -> list[int]:
        with SandboxServer(settings(fail_rate=0.5, seed=seed)) as server, httpx.Client() as c:
            return [c.post(f"{server.url}/contacts", json={}).status_code for _ in range(24)]

    first = statuses(7)
    assert first == statuses(7)
    assert {201, 503} == set(first)


def test_latency_is_added_without_serializing_requests() -> None:
    async def timed(url: str, n: int) -> float:
        async with httpx.AsyncClient() as c:
            started = time.monotonic()
            await asyncio.gather(*(c.get(f"{url}/contacts") for _ in range(n)))
            return time.monotonic() - started

    with SandboxServer(settings(latency_ms=200)) as server:
        assert asyncio.run(timed(server.url, 1)) >= 0.2
        assert asyncio.run(timed(server.url, 5)) < 0.6  # five in parallel, not 1 s in a row


def test_a_hang_makes_the_client_time_out_and_stop_still_is_quick() -> None:
    server = SandboxServer(settings(fail_rate=1, timeout_share=1, hang_seconds=30)).start()
    try:
        with httpx.Client(base_url=server.url + "/") as c:
            with pytest.raises(httpx.ReadTimeout):
                c.post("contacts", json={}, timeout=0.2)
            assert c.get("_stats").json()["total"]["hangs"] == 1
            # The hung request is still sleeping on the server while it stops.
            with pytest.raises(httpx.ReadTimeout):
                c.post("contacts", json={}, timeout=0.05)
    finally:
        started = time.monotonic()
        server.stop()
    assert time.monotonic() - started < 3
    server.stop()  # twice is fine


def test_put_faults_switches_faults_at_run_time(client: httpx.Client) -> None:
    assert client.post("contacts", json={}).status_code == 201
    on = client.put("_faults", json={"fail_rate": 1, "latency_ms": 0})
    assert on.status_code == 200
    assert on.json()["fail_rate"] == 1.0
    assert client.post("contacts", json={}).status_code == 503
    assert client.get("_faults").json()["fail_rate"] == 1.0
    assert client.put("_faults", json={"fail_rate": 0}).status_code == 200
    assert client.post("contacts", json={}).status_code == 201
    refused = client.put("_faults", json={"fail_rate": 2})
    assert refused.status_code == 400
    assert "fail_rate" in refused.json()["error"]
    assert "failrate" in client.put("_faults", json={"failrate": 1}).json()["error"]
    assert client.get("_faults").json()["fail_rate"] == 0.0


def test_a_sqlite_file_survives_a_restart(tmp_path: Path) -> None:
    path = str(tmp_path / "sandbox.db")
    with SandboxServer(settings(db_path=path)) as server, httpx.Client(base_url=server.url + "/") as c:
        rid = c.post("contacts", json={"email": "a"}, headers={"Idempotency-Key": "k"}).json()["id"]
        c.patch(f"contacts/{rid}", json={"name": "A"})
        gone = c.post("contacts", json={}).json()["id"]
        c.delete(f"contacts/{gone}")
    with SandboxServer(settings(db_path=path)) as server, httpx.Client(base_url=server.url + "/") as c:
        assert c.get(f"contacts/{rid}").json() == {"id": rid, "email": "a", "name": "A"}
        assert c.post("contacts", json={"email": "a"}, headers={"Idempotency-Key": "k"}).json()["id"] == rid
        assert c.post("contacts", json={}).json()["id"] == "c-3"
        assert c.get("_stats").json()["collections"]["contacts"]["records"] == 2


def test_a_foreign_sqlite_file_is_refused(tmp_path: Path) -> None:
    import sqlite3

    path = tmp_path / "other.db"
    with sqlite3.connect(path) as db:
        db.execute("CREATE TABLE ledger (id INTEGER)")
    db.close()
    with pytest.raises(ValueError, match="db_path"):
        create_app(settings(db_path=str(path)))


def test_the_engines_rest_writer_works_against_it(server: SandboxServer, client: httpx.Client) -> None:
    conn = Connection(
        id=1,
        name="sb",
        driver="rest",
        status=ConnectionStatus.ACTIVE,
        base_url=server.url,
        token_env=None,
        timeout_seconds=5,
    )
    writer = RestWriter(conn, "contacts")
    try:
        remote_id = writer.create({"email": "a"}, "key-1")
        assert writer.create({"email": "a"}, "key-1") == remote_id  # a retried create
        writer.update(remote_id, {"name": "A"})
        assert client.get(f"contacts/{remote_id}").json() == {"id": remote_id, "email": "a", "name": "A"}
        with pytest.raises(RemoteGone):
            writer.update("c-404", {"name": "B"})
        client.delete(f"contacts/{remote_id}")
        with pytest.raises(RemoteGone):
            writer.update(remote_id, {"name": "B"})
        client.put("_faults", json={"fail_rate": 1})
        with pytest.raises(TargetUnavailable):
            writer.create({"email": "b"}, "key-2")
    finally:
        writer.close()


def test_the_rest_writer_sends_the_token(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SANDBOX_TOKEN", "s3cret")
    with SandboxServer(settings(token="s3cret")) as server:
        conn = Connection(1, "sb", "rest", ConnectionStatus.ACTIVE, base_url=server.url, token_env="SANDBOX_TOKEN")
        writer = RestWriter(conn, "contacts")
        try:
            assert writer.create({"email": "a"}, "key-1") == "c-1"
        finally:
            writer.close()


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("fail_rate", 1.5),
        ("fail_rate", -0.1),
        ("fail_rate", float("nan")),
        ("timeout_share", 2),
        ("latency_ms", -1),
        ("latency_ms", 10**20),  # before: taken, and every request then failed in the sleep
        ("latency_ms", 1.5),
        ("hang_seconds", -1),
        ("port", 70000),
        ("port", True),
        ("host", ""),
        ("token", ""),
        ("db_path", ""),
        ("seed", "x"),
    ],
)
def test_bad_settings_name_the_field(field: str, value: Any) -> None:
    with pytest.raises(ValueError, match=field):
        SandboxSettings(**{field: value})


def test_a_taken_port_raises_oserror(server: SandboxServer) -> None:
    with pytest.raises(OSError, match="cannot listen"):
        SandboxServer(settings(port=server.port)).start()


@pytest.fixture
def taken_port() -> Iterator[int]:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield int(sock.getsockname()[1])


def sandbox_cli(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(DELIVERY), "sandbox", *args], cwd=cwd, env=dict(os.environ), capture_output=True, text=True, timeout=60
    )


def test_serve_refuses_a_taken_port_as_bad_input_naming_the_flag(taken_port: int) -> None:
    with pytest.raises(InputError) as caught:
        serve(settings(port=taken_port))
    assert str(caught.value) == f"--port {taken_port}: cannot listen on 127.0.0.1:{taken_port}: Address already in use"


@pytest.mark.parametrize("where", ["missing-dir", "a-directory"])
def test_serve_refuses_an_unusable_db_as_bad_input_naming_the_flag(tmp_path: Path, where: str) -> None:
    path = tmp_path / "missing" / "x.db" if where == "missing-dir" else tmp_path
    with pytest.raises(InputError) as caught:
        serve(settings(db_path=str(path)))
    expected = (
        f"--db {path}: its directory {path.parent} does not exist"
        if where == "missing-dir"
        else f"--db {path}: cannot be used as the sandbox database: unable to open database file"
    )
    assert str(caught.value) == expected
    assert not (tmp_path / "missing").exists()


def test_the_cli_exits_2_with_one_line_for_a_taken_port_or_an_unusable_db(tmp_path: Path, taken_port: int) -> None:
    taken = sandbox_cli("--port", str(taken_port), cwd=tmp_path)
    assert (taken.returncode, taken.stderr) == (
        2,
        f"error: --port {taken_port}: cannot listen on 127.0.0.1:{taken_port}: Address already in use\n",
    )
    missing = tmp_path / "nonexistent" / "x.db"
    unusable = sandbox_cli("--port", "0", "--db", str(missing), cwd=tmp_path)
    assert (unusable.returncode, unusable.stderr) == (
        2,
        f"error: --db {missing}: its directory {missing.parent} does not exist\n",
    )
    assert taken.stdout == unusable.stdout == ""
