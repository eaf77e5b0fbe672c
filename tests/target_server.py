"""A real, threaded HTTP target that imitates a REST JSON API, for delivery tests.

Why a real socket server instead of a mocked transport: the engine's failure
handling (timeouts, dropped connections, keep-alive pooling, retry-after) only
means something against real TCP behaviour.  Mocks at the httpx layer would let
bugs in connection handling slip through.

Why per-record scripting: delivery tests need to say "this one record fails
twice then succeeds" while the rest of the batch behaves normally, so answers
are queued per *record key* rather than globally.

Batch endpoints (the `rest` driver's wire format, see delivery/writers/rest.py):
``POST /{collection}/batch`` takes ``{"items": [{"idempotency_key": K, "record": BODY}]}`` and
``PATCH /{collection}/batch`` takes ``{"items": [{"id": ID, "record": BODY}]}``; both answer 200
with ``{"results": [...]}``, one result per item in order, each item handled exactly as the
single endpoint would handle it (its idempotency key honoured like the ``Idempotency-Key``
header, answers programmed for its record key applied to it alone). A batch call is recorded
as one request, with the record keys of its items in ``item_keys``; :meth:`TargetServer.program_batch`
scripts the whole call (a 400 without results, a 500, a 429 with Retry-After, a timeout...).

Only the standard library is used so the server can never drift with a
third-party dependency upgrade.
"""

from __future__ import annotations

import contextlib
import copy
import json
import select
import socket
import threading
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import TracebackType
from typing import Any, Literal
from urllib.parse import urlsplit

__all__ = ["Answer", "AnswerKind", "RecordedRequest", "TargetServer"]

API_PREFIX = "/api"
#: The last path segment of the batch endpoints: ``/api/{collection}/batch``.
BATCH_SEGMENT = "batch"
#: `POST /api/{collection}/batch-delete` deletes its items (`{"items": [{"id": ...}]}`); its batch
#: calls are recorded, and scripted (`program_batch(method="DELETE")`), as method DELETE.
BATCH_DELETE_SEGMENT = "batch-delete"

AnswerKind = Literal["status", "timeout", "given_up", "no_id", "not_json", "drop", "echo_headers", "bad_gzip", "raw"]

#: What a ``bad_gzip`` answer sends under ``Content-Encoding: gzip``: not gzip at all.
NOT_GZIP = b"this body claims to be gzip but is not"


@dataclass(frozen=True)
class Answer:
    """One scripted reply; built through the class-method helpers.

    Kept as plain data (not callables) so a failing test can print the queue
    and a reader sees at a glance what the target was told to do.
    """

    kind: AnswerKind
    code: int | None = None
    body: Any = None
    headers: dict[str, str] | None = None
    seconds: float = 0.0

    @classmethod
    def status(cls, code: int, body: Any = None, headers: dict[str, str] | None = None) -> Answer:
        """Reply with ``code`` and a JSON body, storing nothing.

        A default body is provided so error-path tests can assert the engine
        captured *something* from the target without spelling it out.
        """
        if body is None:
            body = {"error": f"scripted {code}"}
        return cls(kind="status", code=code, body=body, headers=dict(headers) if headers else None)

    @classmethod
    def timeout(cls, seconds: float) -> Answer:
        """Stall, then process the request normally.

        The request still takes effect after the delay on purpose: that is the
        ambiguous outcome a real slow target produces (the client gave up, the
        server committed), which idempotency handling must survive.
        """
        return cls(kind="timeout", seconds=seconds)

    @classmethod
    def given_up(cls, bound_seconds: float = 30.0) -> Answer:
        """Stall until the client gives up (closes its connection: its timeout struck), then
        process the request normally, as a target that commits after the client's timeout.

        Unlike `timeout`, the client's own timeout decides when the stall ends, never a guessed
        length: a client whose loop or thread was starved past its deadline on a loaded machine
        still never receives the answer. `bound_seconds` ends a stall the client never gives up.
        """
        return cls(kind="given_up", seconds=bound_seconds)

    @classmethod
    def raw(cls, code: int, body: bytes, content_type: str = "application/json") -> Answer:
        """Reply ``code`` with exactly these bytes, storing nothing: answers no JSON encoder
        would write (a raw NUL, NaN, an id of a type no API should send)."""
        return cls(kind="raw", code=code, body=body, headers={"Content-Type": content_type})

    @classmethod
    def no_id(cls) -> Answer:
        """Answer 201 without an ``id`` so the engine cannot learn a remote id."""
        return cls(kind="no_id")

    @classmethod
    def not_json(cls) -> Answer:
        """Answer 2xx with a ``text/plain`` body; nothing is stored.

        Exercises the engine's handling of success responses it cannot parse.
        """
        return cls(kind="not_json")

    @classmethod
    def drop(cls) -> Answer:
        """Close the connection without a response, i.e. a transport error for the client."""
        return cls(kind="drop")

    @classmethod
    def echo_headers(cls, code: int) -> Answer:
        """Reply ``code`` with every request header in the body.

        Lets tests prove the engine redacts secrets that a target reflects back
        into error bodies before it logs or stores them.
        """
        return cls(kind="echo_headers", code=code)

    @classmethod
    def bad_gzip(cls, code: int | None = None) -> Answer:
        """Reply with ``Content-Encoding: gzip`` and a body that is not gzip.

        Without ``code`` the request is processed as usual (a create is stored, an
        update applied) and only its answer arrives broken: the target did the
        work, the client cannot read the reply.  With ``code`` nothing is stored
        and that status is sent, so a refusal's body is unreadable too.
        """
        return cls(kind="bad_gzip", code=code)


@dataclass(frozen=True)
class RecordedRequest:
    """What arrived, captured before any answer logic so failed requests count too.

    ``headers`` keys are lower-cased so assertions do not depend on the client's
    casing; ``time`` is ``time.monotonic()`` so tests can measure backoff gaps.
    A batch call is one request: ``batch`` is set, ``item_keys`` holds the record
    key of each of its items (None for an item without one) and ``items`` the items.
    """

    method: str
    path: str
    headers: dict[str, str]
    json: Any | None
    key: str | None
    time: float
    batch: bool = False
    item_keys: tuple[str | None, ...] = ()

    @property
    def items(self) -> list[Any]:
        """A batch call's items as they arrived (empty for a single-record request)."""
        if not self.batch or not isinstance(self.json, dict) or not isinstance(self.json.get("items"), list):
            return []
        return list(self.json["items"])

    def concerns(self, key: str) -> bool:
        return self.key == key or key in self.item_keys


@dataclass
class _Reply:
    """Internal: a fully decided response, written in one place so Content-Length is always right."""

    code: int
    body: bytes = b""
    content_type: str | None = "application/json"
    headers: dict[str, str] = field(default_factory=dict)

    @classmethod
    def of_json(cls, code: int, payload: Any, headers: dict[str, str] | None = None) -> _Reply:
        return cls(code=code, body=json.dumps(payload).encode("utf-8"), headers=dict(headers or {}))


class _Drop(Exception):
    """Internal signal: abandon the connection without writing anything."""


class _HTTPServer(ThreadingHTTPServer):
    """Carries a back-reference to the :class:`TargetServer` that owns the state."""

    daemon_threads = True
    # Connections a burst of calls may open at once (socketserver's default is 5: at a concurrency
    # of 32 the rest would wait for a SYN retransmit, a second later).
    request_queue_size = 128
    # Without this a restarted test server can fail to bind a port still in TIME_WAIT.
    allow_reuse_address = True

    def __init__(self, target: TargetServer) -> None:
        self.target = target
        super().__init__(("127.0.0.1", 0), _Handler)

    def handle_error(self, request: Any, client_address: Any) -> None:
        """Stay quiet: clients hanging up mid-answer is expected in these tests, not a failure."""


#: The socket of the request the current handler thread is answering (`Answer.given_up` watches it).
_answering_socket = threading.local()


class _Handler(BaseHTTPRequestHandler):
    """Routes every method through one function so the cross-cutting rules apply uniformly."""

    # HTTP/1.1 keep-alive so an httpx pooled client reuses connections as in production.
    protocol_version = "HTTP/1.1"
    server: _HTTPServer

    def log_message(self, format: str, *args: Any) -> None:
        """Silence per-request stderr noise that would drown pytest output."""

    def do_GET(self) -> None:
        self._handle()

    def do_POST(self) -> None:
        self._handle()

    def do_PATCH(self) -> None:
        self._handle()

    def do_DELETE(self) -> None:
        self._handle()

    def do_PUT(self) -> None:
        self._handle()

    def _read_body(self) -> bytes:
        length = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(length) if length > 0 else b""

    def _handle(self) -> None:
        try:
            # The body is always consumed first so the keep-alive stream stays
            # in sync no matter which answer (401, 503, scripted) follows.
            raw = self._read_body()
            _answering_socket.value = self.connection
            with self.server.target.handling():
                reply = self.server.target._dispatch(self.command, self.path, self.headers, raw)
        except _Drop:
            self._drop()
            return
        except (ConnectionError, TimeoutError, ValueError):
            self.close_connection = True
            return
        self._write(reply)

    def _drop(self) -> None:
        self.close_connection = True
        with contextlib.suppress(OSError):
            self.connection.shutdown(socket.SHUT_RDWR)

    def _write(self, reply: _Reply) -> None:
        try:
            self.send_response(reply.code)
            for name, value in reply.headers.items():
                self.send_header(name, value)
            if reply.content_type is not None and reply.body:
                self.send_header("Content-Type", reply.content_type)
            self.send_header("Content-Length", str(len(reply.body)))
            self.end_headers()
            if reply.body:
                self.wfile.write(reply.body)
            self.wfile.flush()
        except (ConnectionError, OSError):
            # The client already gave up (e.g. its timeout fired); nothing to tell it.
            self.close_connection = True


class TargetServer:
    """A programmable local REST target: ``/api/{collection}[/{id}]`` over real HTTP.

    All mutable state sits behind one lock because the server answers each
    connection on its own thread and tests read counters concurrently.
    """

    def __init__(self, token: str | None = None) -> None:
        self.token = token
        self.down: bool = False
        self.latency_ms: int = 0
        self.requests: list[RecordedRequest] = []
        #: Requests held by a `timeout` or `given_up` answer now.
        self.stalled = 0
        #: Requests being handled now, and the most seen at once since the last `reset`.
        self.in_flight = 0
        self.max_in_flight = 0
        self._lock = threading.Lock()
        self._collections: dict[str, dict[str, dict[str, Any]]] = {}
        self._scripts: dict[str, deque[Answer]] = {}
        # Whole-call answers for batch calls, each for one method or (None) either.
        self._batch_scripts: deque[tuple[str | None, Answer]] = deque()
        self._idempotency: dict[tuple[str, str], dict[str, Any]] = {}
        self._next_id = 1
        #: Set by the next `reset` (or `stop`), then replaced: it wakes the requests stalled
        #: before it, which are dropped, their test being over.
        self._reset_woken = threading.Event()
        self._httpd: _HTTPServer | None = None
        self._thread: threading.Thread | None = None
        # Set on stop so handlers sleeping for latency/timeout answers abandon
        # their request instead of keeping a daemon thread busy after the test.
        self._stopping = threading.Event()
        # Cleared while the test holds every answer back (`hold`).
        self._answering = threading.Event()
        self._answering.set()

    # ----------------------------------------------------------------- lifecycle

    def start(self) -> TargetServer:
        """Bind to an ephemeral port so parallel test runs never collide."""
        if self._httpd is not None:
            return self
        self._stopping.clear()
        if self._reset_woken.is_set():  # stopped before: the stalls of then are gone
            self._reset_woken = threading.Event()
        self._httpd = _HTTPServer(self)
        self._thread = threading.Thread(
            target=self._httpd.serve_forever,
            kwargs={"poll_interval": 0.05},
            name=f"target-server-{self.port}",
            daemon=True,
        )
        self._thread.start()
        return self

    def stop(self) -> None:
        """Shut down and release the socket; safe to call twice."""
        httpd, thread = self._httpd, self._thread
        if httpd is None:
            return
        self._stopping.set()
        self._reset_woken.set()
        httpd.shutdown()
        httpd.server_close()
        if thread is not None:
            thread.join(timeout=5)
        self._httpd = None
        self._thread = None

    def __enter__(self) -> TargetServer:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    @property
    def port(self) -> int:
        if self._httpd is None:
            raise RuntimeError("TargetServer is not started")
        return int(self._httpd.server_address[1])

    @property
    def url(self) -> str:
        """Base URL including ``/api`` so tests configure targets exactly as users would."""
        return f"http://127.0.0.1:{self.port}{API_PREFIX}"

    # --------------------------------------------------------------- programming

    def program(self, key: str, *answers: Answer) -> None:
        """Queue answers for requests about ``key``; once drained, default behaviour resumes.

        Appending (rather than replacing) lets a test build up a script in steps.
        """
        for answer in answers:
            if not isinstance(answer, Answer):
                raise TypeError(f"expected Answer, got {type(answer).__name__}")
        with self._lock:
            self._scripts.setdefault(str(key), deque()).extend(answers)

    def program_batch(self, *answers: Answer, method: str | None = None) -> None:
        """Queue answers for the next batch calls as a whole (``method``: only POST or only PATCH
        ones); once drained, each item is handled on its own again.

        ``status`` answers exactly that and stores nothing (a 400 without results, a 500, a 429
        with ``Retry-After``, or a 200 with a results list of the test's making); ``raw`` sends
        its bytes; ``drop`` hangs up; ``timeout`` stalls, then handles the call; ``echo_headers``
        answers its code with the request headers; ``no_id``, ``not_json`` and ``bad_gzip`` (no
        code) handle every item, then answer without results, with text, or with a broken gzip.
        """
        for answer in answers:
            if not isinstance(answer, Answer):
                raise TypeError(f"expected Answer, got {type(answer).__name__}")
        with self._lock:
            self._batch_scripts.extend((method, answer) for answer in answers)

    def program_remote(self, remote_id: str, *answers: Answer) -> None:
        """Script PATCHes by remote id; same queue as :meth:`program` since PATCH keys on its id."""
        self.program(remote_id, *answers)

    def hold(self) -> None:
        """Answer nothing until :meth:`release`: a request arriving meanwhile is recorded, then
        waits. Unlike a latency, a hold lasts as long as the test needs, not a guessed length."""
        self._answering.clear()

    def release(self) -> None:
        """Answer the held requests, and every later one, as the target otherwise would."""
        self._answering.set()

    def reset(self) -> None:
        """Return to a pristine target so one server can be shared across tests."""
        self._answering.set()
        with self._lock:
            self._reset_woken.set()
            self._reset_woken = threading.Event()
            self._collections.clear()
            self._scripts.clear()
            self._batch_scripts.clear()
            self._idempotency.clear()
            self.requests.clear()
            self._next_id = 1
            self.down = False
            self.latency_ms = 0
            self.max_in_flight = self.in_flight

    # ------------------------------------------------------------------ counters

    @contextlib.contextmanager
    def handling(self) -> Iterator[None]:
        """Count one request in flight while its answer is decided (latency included)."""
        with self._lock:
            self.in_flight += 1
            self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            yield
        finally:
            with self._lock:
                self.in_flight -= 1

    def count(self, key: str) -> int:
        """How many requests (whatever their answer) concerned ``key``: a batch call carrying an
        item of that key counts once."""
        with self._lock:
            return sum(1 for r in self.requests if r.concerns(key))

    def requests_for(self, key: str) -> list[RecordedRequest]:
        """The requests about ``key`` in arrival order, for timing/header assertions."""
        with self._lock:
            return [r for r in self.requests if r.concerns(key)]

    def batch_requests(self) -> list[RecordedRequest]:
        """The batch calls in arrival order."""
        with self._lock:
            return [r for r in self.requests if r.batch]

    def records(self, collection: str) -> dict[str, dict[str, Any]]:
        """A deep copy of what is stored, so test assertions cannot race with handlers."""
        with self._lock:
            return copy.deepcopy(self._collections.get(collection, {}))

    def pending(self, key: str) -> int:
        """Scripted answers not yet consumed; lets a test assert its script was fully used."""
        with self._lock:
            return len(self._scripts.get(key, ()))

    # ------------------------------------------------------------------ dispatch

    def _dispatch(self, method: str, raw_path: str, headers: Any, raw: bytes) -> _Reply:
        """Decide the reply; raises :class:`_Drop` to hang up. Runs on a handler thread."""
        path = urlsplit(raw_path).path
        collection, remote_id = _parse_path(path)

        body: Any | None = None
        body_error = False
        if raw:
            try:
                body = json.loads(raw)
            except ValueError:
                body_error = True

        if collection is not None and remote_id == BATCH_SEGMENT and method in ("POST", "PATCH"):
            return self._dispatch_batch(method, path, headers, body, body_error, collection)
        if collection is not None and remote_id == BATCH_DELETE_SEGMENT and method == "POST":
            return self._dispatch_batch("DELETE", path, headers, body, body_error, collection)

        key = self._record_key(method, headers, body, remote_id)
        header_dict = {name.lower(): value for name, value in headers.items()}
        with self._lock:
            self.requests.append(RecordedRequest(method, path, header_dict, body, key, time.monotonic()))
            latency = self.latency_ms
        if latency > 0:
            self._sleep(latency / 1000)
        self._wait_until_answering()

        if self.down:
            return _Reply.of_json(503, {"error": "target down"})
        if self.token is not None and headers.get("Authorization") != f"Bearer {self.token}":
            return _Reply.of_json(401, {"error": "unauthorized"})

        answer = self._pop_answer(key)
        if answer is not None:
            scripted = self._scripted(answer, method, header_dict)
            if scripted is not None:
                return scripted

        if collection is None:
            reply = _Reply.of_json(404, {"error": "not found"})
        elif body_error:
            reply = _Reply.of_json(400, {"error": "invalid json"})
        else:
            reply = self._default(method, collection, remote_id, body, headers.get("Idempotency-Key"))
        if answer is not None and answer.kind == "bad_gzip":
            return _not_gzip(reply.code)
        return reply

    def _dispatch_batch(
        self, method: str, path: str, headers: Any, body: Any, body_error: bool, collection: str
    ) -> _Reply:
        """A batch call: the checks every request meets, then the whole-call script, then each
        item as its single endpoint would handle it."""
        items = body.get("items") if isinstance(body, dict) else None
        item_keys = tuple(_item_key(method, item) for item in items) if isinstance(items, list) else ()
        header_dict = {name.lower(): value for name, value in headers.items()}
        explicit = headers.get("X-Record-Key")
        recorded = RecordedRequest(
            method, path, header_dict, body, str(explicit) if explicit else None, time.monotonic(), True, item_keys
        )
        with self._lock:
            self.requests.append(recorded)
            latency = self.latency_ms
        if latency > 0:
            self._sleep(latency / 1000)
        self._wait_until_answering()
        if self.down:
            return _Reply.of_json(503, {"error": "target down"})
        if self.token is not None and headers.get("Authorization") != f"Bearer {self.token}":
            return _Reply.of_json(401, {"error": "unauthorized"})

        whole = self._pop_batch_answer(method)
        if whole is not None:
            if whole.kind in ("status", "raw", "drop", "echo_headers") or (
                whole.kind == "bad_gzip" and whole.code is not None
            ):
                scripted = self._scripted(whole, method, header_dict)
                assert scripted is not None
                return scripted
            if whole.kind in ("timeout", "given_up"):
                self._stall(whole)
        if body_error:
            return _Reply.of_json(400, {"error": "invalid json"})
        if not isinstance(items, list):
            return _Reply.of_json(400, {"error": 'body must be {"items": [...]}'})
        results = [
            self._batch_item(method, collection, item, key, header_dict)
            for item, key in zip(items, item_keys, strict=True)
        ]
        if whole is not None and whole.kind == "no_id":
            return _Reply.of_json(200, {"status": "done"})
        if whole is not None and whole.kind == "not_json":
            return _Reply(code=200, body=b"ok", content_type="text/plain")
        if whole is not None and whole.kind == "bad_gzip":
            return _not_gzip(200)
        return _Reply(code=200, body=b'{"results": [' + b", ".join(results) + b"]}")

    def _pop_batch_answer(self, method: str) -> Answer | None:
        with self._lock:
            for index, (wanted, answer) in enumerate(self._batch_scripts):
                if wanted is None or wanted == method:
                    del self._batch_scripts[index]
                    return answer
        return None

    def _batch_item(self, method: str, collection: str, item: Any, key: str | None, headers: dict[str, str]) -> bytes:
        """One item's result, as JSON bytes (a ``raw`` answer's bytes go in as they are)."""
        answer = self._pop_answer(key)
        success = 201 if method == "POST" else 200
        if answer is not None:
            if answer.kind == "status":
                assert answer.code is not None
                payload = dict(answer.body) if isinstance(answer.body, dict) else {"error": answer.body}
                retry_after = (answer.headers or {}).get("Retry-After")
                if retry_after is not None:
                    payload["retry_after"] = retry_after
                return json.dumps({**payload, "status": answer.code}).encode("utf-8")
            if answer.kind in ("timeout", "given_up"):
                self._stall(answer)  # the whole call stalls, then the item is handled
            elif answer.kind == "no_id":
                return json.dumps({"status": success}).encode("utf-8")
            elif answer.kind == "not_json":
                return b'"ok"'  # a result that is not an object
            elif answer.kind == "drop":
                raise _Drop
            elif answer.kind == "raw":
                assert isinstance(answer.body, bytes)
                return answer.body
            elif answer.kind == "echo_headers":
                assert answer.code is not None
                echoed = {"status": answer.code, "error": f"scripted {answer.code}", "headers": headers}
                return json.dumps(echoed).encode("utf-8")
            # bad_gzip breaks a single answer's encoding; an item has none of its own: handled as usual.
        code, payload = self._batch_default(method, collection, item)
        return json.dumps({**payload, "status": code}).encode("utf-8")

    def _batch_default(self, method: str, collection: str, item: Any) -> tuple[int, dict[str, Any]]:
        """What the single endpoint would answer for this item: its status and body."""
        if method == "DELETE":
            remote_id = item.get("id") if isinstance(item, dict) else None
            if not isinstance(remote_id, str):
                return 400, {"error": "item needs a string 'id'"}
            with self._lock:
                gone = self._collections.setdefault(collection, {}).pop(remote_id, None)
            return (404, {"error": "not found"}) if gone is None else (200, {"id": remote_id})
        record = item.get("record") if isinstance(item, dict) else None
        if not isinstance(record, dict):
            return 400, {"error": "item must be an object with a 'record' object"}
        with self._lock:
            store = self._collections.setdefault(collection, {})
            if method == "POST":
                key = item.get("idempotency_key")
                if key is not None and not isinstance(key, str):
                    return 400, {"error": "idempotency_key must be a string"}
                code, created = self._create_record(store, collection, record, key)
                return code, {"id": created["id"], "record": created}
            remote_id = item.get("id")
            if not isinstance(remote_id, str):
                return 400, {"error": "item needs a string 'id'"}
            stored = store.get(remote_id)
            if stored is None:
                return 404, {"error": "not found"}
            stored.update({k: v for k, v in record.items() if k != "id"})
            return 200, {"id": remote_id, "record": copy.deepcopy(stored)}

    @staticmethod
    def _record_key(method: str, headers: Any, body: Any, remote_id: str | None) -> str | None:
        """Header first so the engine (or a test) can always be explicit about the record."""
        explicit = headers.get("X-Record-Key")
        if explicit:
            return str(explicit)
        if method == "POST" and isinstance(body, dict) and body.get("email") is not None:
            return str(body["email"])
        if method in ("PATCH", "DELETE") and remote_id is not None:
            return remote_id
        return None

    def _pop_answer(self, key: str | None) -> Answer | None:
        if key is None:
            return None
        with self._lock:
            queue = self._scripts.get(key)
            return queue.popleft() if queue else None

    def _wait_until_answering(self) -> None:
        while not self._answering.wait(0.05):
            if self._stopping.is_set():
                raise _Drop

    def _stall(self, answer: Answer) -> None:
        """Hold the request as `answer` says, then let it be handled; dropped, never applied, when
        the target was reset meanwhile: the test that programmed the stall is over, and a stall
        outliving it (a 60-second one in test_serve_signals) would make a record in the next."""
        with self._lock:
            woken = self._reset_woken
            self.stalled += 1
        try:
            self._hold(answer, woken)
        finally:
            with self._lock:
                self.stalled -= 1
        if woken.is_set():  # the target was reset (or stopped) meanwhile
            raise _Drop

    def _hold(self, answer: Answer, woken: threading.Event) -> None:
        """Until the stall ends, or `woken` is set (a reset or a stop)."""
        connection: socket.socket | None = getattr(_answering_socket, "value", None)
        if answer.kind == "timeout" or connection is None:  # no socket to watch without a request
            woken.wait(answer.seconds)
            return
        deadline = time.monotonic() + answer.seconds
        while time.monotonic() < deadline and not woken.is_set():
            readable, _, _ = select.select([connection], [], [], 0.05)
            if readable:
                # The end of the stream (or a reset): the client closed the connection. A
                # pipelined request would read the same, and no client of these tests sends one.
                return

    def _sleep(self, seconds: float) -> None:
        """Interruptible by :meth:`stop`, so a slow answer never outlives its test."""
        if self._stopping.wait(seconds):
            raise _Drop

    def _scripted(self, answer: Answer, method: str, headers: dict[str, str]) -> _Reply | None:
        """Build the scripted reply, or ``None`` when the answer defers to default behaviour."""
        success = 201 if method == "POST" else 200
        if answer.kind == "status":
            assert answer.code is not None
            return _Reply.of_json(answer.code, answer.body, answer.headers)
        if answer.kind in ("timeout", "given_up"):
            self._stall(answer)
            return None
        if answer.kind == "no_id":
            return _Reply.of_json(success, {"status": "created"})
        if answer.kind == "not_json":
            return _Reply(code=success, body=b"ok", content_type="text/plain")
        if answer.kind == "drop":
            raise _Drop
        if answer.kind == "raw":
            assert answer.code is not None and answer.headers is not None
            return _Reply(code=answer.code, body=answer.body, content_type=answer.headers["Content-Type"])
        if answer.kind == "echo_headers":
            assert answer.code is not None
            return _Reply.of_json(answer.code, {"error": f"scripted {answer.code}", "headers": headers})
        if answer.kind == "bad_gzip":
            # Without a code the request takes effect first; _dispatch then breaks its answer.
            return None if answer.code is None else _not_gzip(answer.code)
        raise AssertionError(f"unknown answer kind {answer.kind!r}")

    def _default(
        self,
        method: str,
        collection: str,
        remote_id: str | None,
        body: Any,
        idempotency_key: str | None,
    ) -> _Reply:
        """The well-behaved REST API the scripts deviate from."""
        with self._lock:
            store = self._collections.setdefault(collection, {})
            if remote_id is None:
                if method == "GET":
                    return _Reply.of_json(200, list(store.values()))
                if method == "POST":
                    return self._create(store, collection, body, idempotency_key)
                return _Reply.of_json(405, {"error": "method not allowed"})

            record = store.get(remote_id)
            if record is None or method not in ("GET", "PATCH", "DELETE"):
                code, error = (404, "not found") if record is None else (405, "method not allowed")
                return _Reply.of_json(code, {"error": error})
            if method == "GET":
                return _Reply.of_json(200, record)
            if method == "DELETE":
                del store[remote_id]
                return _Reply(code=204, content_type=None)
            if not isinstance(body, dict):
                return _Reply.of_json(400, {"error": "body must be a JSON object"})
            record.update({k: v for k, v in body.items() if k != "id"})
            return _Reply.of_json(200, record)

    def _create(
        self,
        store: dict[str, dict[str, Any]],
        collection: str,
        body: Any,
        idempotency_key: str | None,
    ) -> _Reply:
        """Check-and-create under the caller's lock so concurrent retries make one record."""
        if not isinstance(body, dict):
            return _Reply.of_json(400, {"error": "body must be a JSON object"})
        return _Reply.of_json(*self._create_record(store, collection, body, idempotency_key))

    def _create_record(
        self,
        store: dict[str, dict[str, Any]],
        collection: str,
        body: dict[str, Any],
        idempotency_key: str | None,
    ) -> tuple[int, dict[str, Any]]:
        """Create (or replay, for a key seen before) under the caller's lock: the single create
        and every batch create item share it, so a key is honoured whichever way it comes."""
        if idempotency_key:
            seen = self._idempotency.get((collection, idempotency_key))
            if seen is not None:
                # Prefer the live record (it may have been patched); fall back
                # to the original answer if a test deleted it since.
                current = store.get(seen["id"], seen)
                return 201, copy.deepcopy(current)
        new_id = f"r-{self._next_id}"
        self._next_id += 1
        record = {"id": new_id, **{k: v for k, v in body.items() if k != "id"}}
        store[new_id] = record
        if idempotency_key:
            self._idempotency[(collection, idempotency_key)] = copy.deepcopy(record)
        return 201, copy.deepcopy(record)


def _item_key(method: str, item: Any) -> str | None:
    """A batch item's record key, as the single endpoint keys its request: a create by its
    record's ``email``, an update by its ``id``."""
    if not isinstance(item, dict):
        return None
    if method == "POST":
        record = item.get("record")
        email = record.get("email") if isinstance(record, dict) else None
        return None if email is None else str(email)
    remote_id = item.get("id")
    return None if remote_id is None else str(remote_id)


def _not_gzip(code: int) -> _Reply:
    return _Reply(code=code, body=NOT_GZIP, headers={"Content-Encoding": "gzip"})


def _parse_path(path: str) -> tuple[str | None, str | None]:
    """Split ``/api/{collection}[/{id}]``; anything else yields ``(None, None)`` → 404."""
    if not path.startswith(API_PREFIX + "/"):
        return None, None
    parts = [p for p in path[len(API_PREFIX) + 1 :].split("/") if p]
    if len(parts) == 1:
        return parts[0], None
    if len(parts) == 2:
        return parts[0], parts[1]
    return None, None
