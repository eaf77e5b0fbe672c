"""The `rest` writer keeps as many connections alive as the rule lets calls be in flight (issue #12).

httpx keeps 20 connections alive by default: at a `concurrency` of 32 or 64 every round of calls
would close the connections beyond 20 when they come back and open new ones for the next round.
Against a real local HTTP server that notes the client port of every request, rounds of
`concurrency` updates at once must go over exactly `concurrency` connections, opened in the first
round and reused after it.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from delivery.domain import Connection, ConnectionStatus
from delivery.writers.rest import RestWriter

ROUNDS = 4
#: Each answer is this late, as a real target's would be.
LATENCY_SECONDS = 0.02
#: How long the server holds a request for the rest of its round before answering anyway: only a
#: writer that cannot put the whole round in flight at once waits this out.
GATE_TIMEOUT_SECONDS = 5.0


class _Gate:
    """Holds requests until `size` of them are in flight, then lets them all go, round after round.

    Without it a request answered before the last thread of its round had sent its own would free a
    connection for that thread, and the count of connections would depend on thread timing."""

    def __init__(self, size: int) -> None:
        self._size = size
        self._waiting = 0
        self._generation = 0
        self._ready = threading.Condition()

    def passage(self) -> None:
        with self._ready:
            generation = self._generation
            self._waiting += 1
            if self._waiting < self._size:
                self._ready.wait_for(lambda: self._generation != generation, GATE_TIMEOUT_SECONDS)
            if self._generation == generation:  # this request completes the round, or waited it out
                self._generation += 1
                self._waiting = 0
                self._ready.notify_all()


class _PortServer(ThreadingHTTPServer):
    """Answers every PATCH with 200 after the gate and the latency, noting the client's port."""

    daemon_threads = True
    allow_reuse_address = True
    # A round's connections all arrive at once: more than the default backlog of 5.
    request_queue_size = 128

    def __init__(self, gate_size: int) -> None:
        self.gate = _Gate(gate_size)
        self.ports: list[int] = []
        self.lock = threading.Lock()
        super().__init__(("127.0.0.1", 0), _Handler)

    def handle_error(self, request: Any, client_address: Any) -> None:
        """Quiet: a client closing its connections at the end is no error here."""


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, as a real target offers
    server: _PortServer

    def log_message(self, format: str, *args: Any) -> None:
        """No access log in the test output."""

    def do_PATCH(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        with self.server.lock:
            self.server.ports.append(int(self.client_address[1]))
        self.server.gate.passage()
        time.sleep(LATENCY_SECONDS)
        body = json.dumps({"ok": True}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


@pytest.fixture
def server(request: pytest.FixtureRequest) -> Iterator[_PortServer]:
    httpd = _PortServer(int(request.param))
    thread = threading.Thread(target=httpd.serve_forever, name="pool-test-target", daemon=True)
    thread.start()
    try:
        yield httpd
    finally:
        httpd.shutdown()
        httpd.server_close()
        thread.join(timeout=10)


def _writer(server: _PortServer, concurrency: int) -> RestWriter:
    host, port = server.server_address[:2]
    target = Connection(
        id=1,
        name="crm",
        driver="rest",
        status=ConnectionStatus.ACTIVE,
        base_url=f"http://{host!s}:{port}/api",
        token_env=None,
        # Long enough that a writer waiting for a pooled connection (or for the gate) never times out.
        timeout_seconds=30,
        id_field="id",
    )
    return RestWriter(target, "contacts", token="", concurrency=concurrency)


def _rounds(writer: RestWriter, concurrency: int) -> None:
    """`ROUNDS` rounds of `concurrency` updates at once, each from a thread of its own, as a chain's
    workers send them; the first failure is raised."""
    start = threading.Barrier(concurrency)
    errors: list[BaseException] = []

    def worker(thread: int) -> None:
        try:
            for round_ in range(ROUNDS):
                start.wait(timeout=30)
                writer.update(f"r{round_}-{thread}", {"round": round_, "thread": thread})
        except BaseException as exc:
            errors.append(exc)
            start.abort()

    threads = [threading.Thread(target=worker, args=(n,)) for n in range(concurrency)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    if errors:
        raise errors[0]


@pytest.mark.parametrize(("server", "concurrency"), [(32, 32), (64, 64)], indirect=["server"])
def test_each_call_in_flight_has_a_connection_kept_alive(server: _PortServer, concurrency: int) -> None:
    writer = _writer(server, concurrency)
    try:
        _rounds(writer, concurrency)
    finally:
        writer.close()
    assert len(server.ports) == ROUNDS * concurrency
    # One connection per call in flight, each reused for every round: none closed and reopened.
    assert len(set(server.ports)) == concurrency
