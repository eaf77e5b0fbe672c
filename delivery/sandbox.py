"""`delivery sandbox`: a small but real REST target to deliver to, for demos and trying rules out.

It speaks exactly the contract of the built-in `rest` driver (DESIGN.md §8), so a connection with
`driver: rest` and `base_url: http://127.0.0.1:8900/api` works against it unchanged:

    POST   /api/{collection}        JSON object -> 201 with the stored record and its string "id";
                                    a repeated `Idempotency-Key` replays the first record (200)
    PATCH  /api/{collection}/{id}   shallow-merges the JSON object -> 200, or 404 for unknown ids
    GET    /api/{collection}        the records in creation order (`?limit=N`)
    GET    /api/{collection}/{id}   one record, or 404
    DELETE /api/{collection}/{id}   204: the record is gone, so the engine's next update parks it
    GET    /api/_stats              requests, creates, updates and injected faults per collection
    GET    /api/_faults             the fault settings in force
    PUT    /api/_faults             change them while running (a demo flips an outage on and off)
    GET    /healthz                 {"ok": true}, never behind the token

Why it exists beside `tests/target_server.py`: that one is scripted per record for assertions; this
one is a believable target a person runs, looks into, breaks (fault injection, deleting records) and
restarts (an optional SQLite file keeps the records and idempotency keys).

Why a plain ASGI callable and not Starlette/FastAPI: only uvicorn is a declared dependency; those
two come in through Prefect and could change under us, and a dozen routes do not need a framework.
This module imports no Prefect either, so `delivery sandbox` starts fast.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import math
import random
import socket
import sqlite3
import threading
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Iterator, MutableMapping
from dataclasses import asdict, dataclass, field, replace
from types import FrameType, TracebackType
from typing import Any
from urllib.parse import parse_qs, unquote

import uvicorn

__all__ = ["SandboxApp", "SandboxServer", "SandboxSettings", "create_app", "serve"]

logger = logging.getLogger("delivery.sandbox")

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

#: Bodies beyond this are refused with 413: a sandbox has no business storing megabytes per record.
MAX_BODY_BYTES = 1 << 20
#: How often a sleeping request checks whether the server is stopping, so a 30 s hang never holds
#: up Ctrl-C or a test's `stop()`.
_PAUSE_STEP = 0.05
#: Collection names starting with this are the sandbox's own endpoints (`_stats`, `_faults`).
_RESERVED = "_"


# --------------------------------------------------------------------------------------- settings


@dataclass
class SandboxSettings:
    """How to listen, whom to let in, where to keep records and how badly to behave.

    `fail_rate` of the POST/PATCH requests answer 503 without taking effect; `timeout_share` of
    those first sleep `hang_seconds` (longer than a client's timeout, so the client sees a timeout
    rather than a 503). `latency_ms` is added to every collection request. `seed` makes the fault
    sequence repeatable. `db_path` None keeps records in memory only.
    """

    host: str = "127.0.0.1"
    port: int = 8900
    token: str | None = None
    fail_rate: float = 0.0
    latency_ms: int = 0
    timeout_share: float = 0.0
    hang_seconds: float = 30.0
    db_path: str | None = None
    seed: int | None = None

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raise ValueError naming the first bad field. Also run by `create_app`, because a
        dataclass can be changed after construction."""
        if not isinstance(self.host, str) or not self.host.strip():
            raise ValueError(f"host must be a non-empty string, got {self.host!r}")
        port = _integer("port", self.port)
        if not 0 <= port <= 65535:
            raise ValueError(f"port must be between 0 and 65535 (0 picks a free port), got {port}")
        if self.token is not None and (not isinstance(self.token, str) or not self.token.strip()):
            raise ValueError("token must be a non-empty string or None")
        if self.db_path is not None and (not isinstance(self.db_path, str) or not self.db_path.strip()):
            raise ValueError(f"db_path must be a non-empty path or None, got {self.db_path!r}")
        if self.seed is not None:
            _integer("seed", self.seed)
        _FaultSettings(self.fail_rate, self.latency_ms, self.timeout_share, self.hang_seconds)


def _integer(name: str, value: object) -> int:
    # bool is an int subclass; `latency_ms: true` is a mistake, not 1 ms.
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    return value


def _number(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    return float(value)


@dataclass
class _FaultSettings:
    """The part of the settings `PUT /api/_faults` may change at run time; validated on every
    construction so both the settings and the endpoint refuse the same values the same way."""

    fail_rate: float
    latency_ms: int
    timeout_share: float
    hang_seconds: float

    def __post_init__(self) -> None:
        for name in ("fail_rate", "timeout_share"):
            value = _number(name, getattr(self, name))
            if not 0.0 <= value <= 1.0:
                raise ValueError(f"{name} must be between 0 and 1, got {value}")
            setattr(self, name, value)
        if _integer("latency_ms", self.latency_ms) < 0:
            raise ValueError(f"latency_ms must be >= 0, got {self.latency_ms}")
        self.hang_seconds = _number("hang_seconds", self.hang_seconds)
        if self.hang_seconds < 0:
            raise ValueError(f"hang_seconds must be >= 0, got {self.hang_seconds}")

    def changed(self, patch: object) -> _FaultSettings:
        """A copy with the keys of a `PUT /api/_faults` body applied; unknown keys are refused so a
        typo (`failrate`) does not silently leave the outage off."""
        if not isinstance(patch, dict):
            raise ValueError('the body must be a JSON object such as {"fail_rate": 0.5}')
        unknown = sorted(set(patch) - set(asdict(self)))
        if unknown:
            raise ValueError(f"unknown fault settings {unknown}; known: {sorted(asdict(self))}")
        return replace(self, **patch)


# ------------------------------------------------------------------------------------------ store


class _Store:
    """Records, id sequences and idempotency keys in SQLite: `:memory:` by default, or a file that
    survives restarts. One code path for both, so the in-memory sandbox is the tested one too.

    The lock is there because `close()` may come from another thread than the event loop's; the
    requests themselves all run on the loop thread, so check-then-create is never interleaved.
    """

    SCHEMA_VERSION = 1

    def __init__(self, path: str | None) -> None:
        self._lock = threading.Lock()
        target = path if path is not None else ":memory:"
        try:
            self._db = sqlite3.connect(target, check_same_thread=False, isolation_level=None, timeout=5.0)
            self._migrate(path)
        except sqlite3.Error as exc:
            raise ValueError(f"db_path {path!r} cannot be used as the sandbox database: {exc}") from exc
        self._closed = False

    def _migrate(self, path: str | None) -> None:
        version = int(self._db.execute("PRAGMA user_version").fetchone()[0])
        if version == self.SCHEMA_VERSION:
            return
        tables = self._db.execute("SELECT count(*) FROM sqlite_master WHERE type = 'table'").fetchone()[0]
        if version != 0 or tables:
            # Never add tables to somebody else's database (say, the engine's own SQLite file).
            raise ValueError(f"db_path {path!r} is an SQLite database but not a sandbox one")
        self._db.executescript(
            f"""
            BEGIN;
            CREATE TABLE records (
                collection TEXT NOT NULL, id TEXT NOT NULL, seq INTEGER NOT NULL, body TEXT NOT NULL,
                PRIMARY KEY (collection, id)
            );
            CREATE INDEX records_order ON records (collection, seq);
            -- Ids are never reused: a deleted record's id must stay gone for the engine's updates.
            CREATE TABLE sequences (collection TEXT PRIMARY KEY, last INTEGER NOT NULL);
            CREATE TABLE idempotency_keys (
                collection TEXT NOT NULL, key TEXT NOT NULL, record_id TEXT NOT NULL, answer TEXT NOT NULL,
                PRIMARY KEY (collection, key)
            );
            PRAGMA user_version = {self.SCHEMA_VERSION};
            COMMIT;
            """
        )

    @contextlib.contextmanager
    def _transaction(self) -> Iterator[sqlite3.Connection]:
        with self._lock:
            if self._closed:
                raise RuntimeError("the sandbox store is closed")
            self._db.execute("BEGIN IMMEDIATE")
            try:
                yield self._db
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            self._db.execute("COMMIT")

    def create(self, collection: str, body: dict[str, Any], key: str | None) -> tuple[dict[str, Any], bool]:
        """The stored record and whether it was created now (False: replayed for a known key)."""
        with self._transaction() as db:
            if key is not None:
                seen = db.execute(
                    "SELECT record_id, answer FROM idempotency_keys WHERE collection = ? AND key = ?",
                    (collection, key),
                ).fetchone()
                if seen is not None:
                    live = self._get(db, collection, seen[0])
                    # The live record if it was patched since; the first answer if it was deleted,
                    # so a late retry learns the id (and the engine's next update finds it gone).
                    return (live if live is not None else json.loads(seen[1])), False
            row = db.execute(
                "INSERT INTO sequences (collection, last) VALUES (?, 1) "
                "ON CONFLICT (collection) DO UPDATE SET last = last + 1 RETURNING last",
                (collection,),
            ).fetchone()
            seq = int(row[0])
            record = {"id": f"{_id_prefix(collection)}-{seq}", **{k: v for k, v in body.items() if k != "id"}}
            text = json.dumps(record)
            db.execute(
                "INSERT INTO records (collection, id, seq, body) VALUES (?, ?, ?, ?)",
                (collection, record["id"], seq, text),
            )
            if key is not None:
                db.execute(
                    "INSERT INTO idempotency_keys (collection, key, record_id, answer) VALUES (?, ?, ?, ?)",
                    (collection, key, record["id"], text),
                )
            return record, True

    def update(self, collection: str, record_id: str, patch: dict[str, Any]) -> dict[str, Any] | None:
        with self._transaction() as db:
            record = self._get(db, collection, record_id)
            if record is None:
                return None
            record.update({k: v for k, v in patch.items() if k != "id"})  # the id is the address
            db.execute(
                "UPDATE records SET body = ? WHERE collection = ? AND id = ?",
                (json.dumps(record), collection, record_id),
            )
            return record

    def get(self, collection: str, record_id: str) -> dict[str, Any] | None:
        with self._transaction() as db:
            return self._get(db, collection, record_id)

    def records(self, collection: str, limit: int | None) -> list[dict[str, Any]]:
        with self._transaction() as db:
            rows = db.execute(
                "SELECT body FROM records WHERE collection = ? ORDER BY seq LIMIT ?",
                (collection, -1 if limit is None else limit),
            ).fetchall()
        return [json.loads(body) for (body,) in rows]

    def delete(self, collection: str, record_id: str) -> bool:
        with self._transaction() as db:
            deleted = db.execute("DELETE FROM records WHERE collection = ? AND id = ?", (collection, record_id))
            return deleted.rowcount > 0

    def counts(self) -> dict[str, int]:
        with self._transaction() as db:
            rows = db.execute("SELECT collection, count(*) FROM records GROUP BY collection").fetchall()
        return {str(name): int(n) for name, n in rows}

    def close(self) -> None:
        """Idempotent: both the lifespan shutdown and the owner call it."""
        with self._lock:
            if not self._closed:
                self._closed = True
                self._db.close()

    @staticmethod
    def _get(db: sqlite3.Connection, collection: str, record_id: str) -> dict[str, Any] | None:
        row = db.execute("SELECT body FROM records WHERE collection = ? AND id = ?", (collection, record_id)).fetchone()
        if row is None:
            return None
        record: dict[str, Any] = json.loads(row[0])
        return record


def _id_prefix(collection: str) -> str:
    """`contacts` -> `c`, so ids read like `c-1` and a wrong-collection id is easy to spot."""
    first = collection[:1].lower()
    return first if first.isascii() and first.isalnum() else "r"


# --------------------------------------------------------------------------------- HTTP plumbing


@dataclass
class _Request:
    method: str
    segments: list[str]
    query: dict[str, list[str]]
    headers: dict[str, str]
    body: bytes
    too_large: bool = False

    @classmethod
    async def read(cls, scope: Scope, receive: Receive) -> _Request:
        # raw_path keeps %2F inside an id from splitting it into two segments.
        raw = scope.get("raw_path") or str(scope["path"]).encode("utf-8")
        path = raw.split(b"?", 1)[0].decode("latin-1")
        segments = [unquote(part) for part in path.split("/")[1:]]
        if segments and segments[-1] == "":
            segments.pop()  # tolerate a trailing slash
        headers: dict[str, str] = {}
        for name, value in scope.get("headers", []):
            headers[name.decode("latin-1").lower()] = value.decode("latin-1")
        chunks: list[bytes] = []
        size = 0
        too_large = False
        more = True
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                break
            chunk = message.get("body", b"")
            size += len(chunk)
            too_large = too_large or size > MAX_BODY_BYTES
            if not too_large:
                chunks.append(chunk)
            more = bool(message.get("more_body", False))
        query = parse_qs(bytes(scope.get("query_string", b"")).decode("latin-1"))
        return cls(str(scope["method"]).upper(), segments, query, headers, b"".join(chunks), too_large)

    def json_object(self) -> dict[str, Any]:
        """The body as a JSON object, or `_HTTPError(400)` saying what is wrong with it."""
        if self.too_large:
            raise _HTTPError(413, f"body larger than {MAX_BODY_BYTES} bytes")
        try:
            value = json.loads(self.body.decode("utf-8"), parse_constant=_refuse_constant)
        except (UnicodeDecodeError, ValueError) as exc:
            raise _HTTPError(400, f"body is not valid JSON: {exc}") from exc
        if not isinstance(value, dict):
            raise _HTTPError(400, f"body must be a JSON object, got {type(value).__name__}")
        return value


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


@dataclass
class _Response:
    status: int
    payload: Any = None
    headers: dict[str, str] = field(default_factory=dict)

    async def send(self, send: Send) -> None:
        body = b"" if self.status == 204 else json.dumps(self.payload, ensure_ascii=False).encode("utf-8")
        headers = [(b"content-length", str(len(body)).encode())]
        if body:
            headers.append((b"content-type", b"application/json"))
        headers += [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in self.headers.items()]
        await send({"type": "http.response.start", "status": self.status, "headers": headers})
        await send({"type": "http.response.body", "body": body})


class _HTTPError(Exception):
    def __init__(self, status: int, error: str, headers: dict[str, str] | None = None) -> None:
        super().__init__(error)
        self.response = _Response(status, {"error": error}, headers or {})


def _not_allowed(allowed: str) -> _HTTPError:
    return _HTTPError(405, "method not allowed", {"Allow": allowed})


# ------------------------------------------------------------------------------------ application


@dataclass
class _Fault:
    """What the dice said for one POST/PATCH, decided on arrival so the sequence follows the seed
    in arrival order even when latency lets requests overlap."""

    fail: bool
    hang: bool


class SandboxApp:
    """The ASGI application. Everything runs on the server's event loop thread; waits use
    `asyncio.sleep` so latency and hangs never serialize concurrent requests."""

    def __init__(self, settings: SandboxSettings) -> None:
        settings.validate()
        self.settings = replace(settings)  # our own copy: later edits to the caller's do nothing
        self._faults = _FaultSettings(
            settings.fail_rate, settings.latency_ms, settings.timeout_share, settings.hang_seconds
        )
        self._random = random.Random(settings.seed)
        self._store = _Store(settings.db_path)
        self._stats: dict[str, Counter[str]] = {}
        self._unauthorized = 0
        # A threading.Event, not an asyncio one: the server's owner sets it from its own thread.
        self._stopping = threading.Event()

    @property
    def faults(self) -> dict[str, Any]:
        """The fault settings in force now (they change with `PUT /api/_faults`)."""
        return asdict(self._faults)

    def release_waits(self) -> None:
        """Cut short every latency sleep and hang in progress; called when the server stops so a
        hanging request cannot hold shutdown for `hang_seconds`."""
        self._stopping.set()

    def close(self) -> None:
        self.release_waits()
        self._store.close()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
            return
        if scope["type"] != "http":
            return  # no websockets here; the server closes the connection
        request = await _Request.read(scope, receive)
        try:
            response = await self._route(request)
        except _HTTPError as exc:
            response = exc.response
        await response.send(send)

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                self.close()
                await send({"type": "lifespan.shutdown.complete"})
                return

    async def _route(self, request: _Request) -> _Response:
        segments, method = request.segments, request.method
        if segments == ["healthz"]:
            if method != "GET":
                raise _not_allowed("GET")
            return _Response(200, {"ok": True})
        if not segments or segments[0] != "api":
            raise _HTTPError(404, "not found")
        self._authorize(request)
        rest = segments[1:]
        if rest == ["_stats"]:
            if method != "GET":
                raise _not_allowed("GET")
            return _Response(200, self._stats_payload())
        if rest == ["_faults"]:
            return self._faults_endpoint(request)
        if not rest or len(rest) > 2 or not rest[0] or rest[0].startswith(_RESERVED):
            raise _HTTPError(404, "not found")
        collection = rest[0]
        record_id = rest[1] if len(rest) == 2 else None
        allowed = ("GET", "POST") if record_id is None else ("GET", "PATCH", "DELETE")
        if method not in allowed:
            raise _not_allowed(", ".join(allowed))
        return await self._collection_request(request, collection, record_id)

    def _authorize(self, request: _Request) -> None:
        token = self.settings.token
        if token is None:
            return
        scheme, _, credentials = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(
            credentials.strip().encode("utf-8"), token.encode("utf-8")
        ):
            self._unauthorized += 1
            raise _HTTPError(401, "missing or wrong bearer token", {"WWW-Authenticate": "Bearer"})

    async def _collection_request(self, request: _Request, collection: str, record_id: str | None) -> _Response:
        stats = self._stats.setdefault(collection, Counter())
        stats["requests"] += 1
        faults = self._faults
        fault: _Fault | None = None
        if request.method in ("POST", "PATCH"):
            # Two draws every time, whatever the rates: the seed then fixes the same sequence of
            # coin flips even after `PUT /api/_faults` changes the rates.
            fail_draw, hang_draw = self._random.random(), self._random.random()
            fault = _Fault(fail=fail_draw < faults.fail_rate, hang=hang_draw < faults.timeout_share)
        if faults.latency_ms:
            await self._pause(faults.latency_ms / 1000)
        if fault is not None and fault.fail:
            stats["faults"] += 1
            if fault.hang:
                stats["hangs"] += 1
                await self._pause(faults.hang_seconds)
            # No Retry-After: the engine's own backoff schedule is what a demo should show.
            return _Response(503, {"error": "injected fault: the sandbox is simulating an outage"})
        return self._handle(request, collection, record_id, stats)

    def _handle(self, request: _Request, collection: str, record_id: str | None, stats: Counter[str]) -> _Response:
        method = request.method
        if record_id is None and method == "POST":
            body = request.json_object()
            key = request.headers.get("idempotency-key") or None
            record, created = self._store.create(collection, body, key)
            stats["creates" if created else "replays"] += 1
            return _Response(201, record) if created else _Response(200, record, {"Idempotent-Replayed": "true"})
        if record_id is None:
            return _Response(200, self._store.records(collection, _limit(request)))
        if method == "PATCH":
            patched = self._store.update(collection, record_id, request.json_object())
            if patched is None:
                stats["not_found"] += 1
                raise _HTTPError(404, f"no record {record_id!r} in {collection!r}")
            stats["updates"] += 1
            return _Response(200, patched)
        if method == "DELETE":
            if not self._store.delete(collection, record_id):
                stats["not_found"] += 1
                raise _HTTPError(404, f"no record {record_id!r} in {collection!r}")
            stats["deletes"] += 1
            return _Response(204)
        found = self._store.get(collection, record_id)
        if found is None:
            stats["not_found"] += 1
            raise _HTTPError(404, f"no record {record_id!r} in {collection!r}")
        return _Response(200, found)

    def _faults_endpoint(self, request: _Request) -> _Response:
        if request.method == "PUT":
            try:
                self._faults = self._faults.changed(request.json_object())
            except (TypeError, ValueError) as exc:
                raise _HTTPError(400, str(exc)) from exc
            logger.info("sandbox faults now %s", asdict(self._faults))
        elif request.method != "GET":
            raise _not_allowed("GET, PUT")
        return _Response(200, asdict(self._faults))

    def _stats_payload(self) -> dict[str, Any]:
        """Counters since start (not persisted) plus the records held now (persisted)."""
        stored = self._store.counts()
        names = sorted(set(self._stats) | set(stored))
        keys = ("requests", "creates", "replays", "updates", "deletes", "not_found", "faults", "hangs")
        collections = {
            name: {**{k: self._stats.get(name, Counter())[k] for k in keys}, "records": stored.get(name, 0)}
            for name in names
        }
        total = {k: sum(c[k] for c in collections.values()) for k in (*keys, "records")}
        return {
            "collections": collections,
            "total": total,
            "unauthorized": self._unauthorized,
            "faults": asdict(self._faults),
        }

    async def _pause(self, seconds: float) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + seconds
        while not self._stopping.is_set():
            remaining = deadline - loop.time()
            if remaining <= 0:
                return
            await asyncio.sleep(min(remaining, _PAUSE_STEP))


def _limit(request: _Request) -> int | None:
    values = request.query.get("limit")
    if not values:
        return None
    try:
        limit = int(values[-1])
    except ValueError:
        limit = -1
    if limit < 0:
        raise _HTTPError(400, f"limit must be a non-negative integer, got {values[-1]!r}")
    return limit


def create_app(settings: SandboxSettings) -> SandboxApp:
    """The ASGI application for `settings`; opens (or creates) the SQLite file right away so a bad
    `db_path` fails here with a ValueError rather than on the first request."""
    return SandboxApp(settings)


# ---------------------------------------------------------------------------------------- running


class _UvicornServer(uvicorn.Server):
    """uvicorn's server, plus: Ctrl-C also releases requests hanging in an injected fault, which
    uvicorn's graceful shutdown would otherwise wait out."""

    def __init__(self, config: uvicorn.Config, app: SandboxApp) -> None:
        super().__init__(config)
        self._app = app

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        self._app.release_waits()
        super().handle_exit(sig, frame)


def _bind(host: str, port: int) -> socket.socket:
    """Bind here rather than in uvicorn, which calls `sys.exit` on a taken port: the caller gets an
    OSError naming the address, and port 0 is known before the server thread starts."""
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    family, kind, proto, _, address = infos[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
    except OSError as exc:
        sock.close()
        raise OSError(exc.errno, f"cannot listen on {host}:{port}: {exc.strerror}") from exc
    sock.set_inheritable(True)
    return sock


def _url(host: str, port: int) -> str:
    # A wildcard address is where we listen, not where a client connects.
    host = {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}.get(host, host)
    shown = f"[{host}]" if ":" in host else host
    return f"http://{shown}:{port}/api"


class SandboxServer:
    """The sandbox on a background thread, for the demo and the tests:

        with SandboxServer(SandboxSettings(port=0)) as server:
            httpx.post(f"{server.url}/contacts", json={...})

    Quiet (warnings only, no access log) and leaves the host process's logging configuration
    alone, because it runs inside someone else's process.
    """

    def __init__(self, settings: SandboxSettings) -> None:
        settings.validate()
        self.settings = replace(settings)
        self._app: SandboxApp | None = None
        self._server: _UvicornServer | None = None
        self._thread: threading.Thread | None = None
        self._socket: socket.socket | None = None
        self._port: int | None = None
        self._failure: BaseException | None = None

    def start(self) -> SandboxServer:
        """Return once the server accepts connections; raise if it could not start."""
        if self._thread is not None:
            return self
        app = create_app(self.settings)
        try:
            sock = _bind(self.settings.host, self.settings.port)
        except OSError:
            app.close()
            raise
        config = uvicorn.Config(
            app,
            log_config=None,
            log_level="warning",
            access_log=False,
            lifespan="on",
            ws="none",
            timeout_graceful_shutdown=5,
        )
        server = _UvicornServer(config, app)
        self._app, self._server, self._socket, self._failure = app, server, sock, None
        self._port = int(sock.getsockname()[1])
        self._thread = threading.Thread(target=self._run, name=f"delivery-sandbox-{self._port}", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 10
        while not server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                failure = self._failure
                self.stop()
                raise RuntimeError(f"the sandbox did not start on {self.settings.host}:{self._port}") from failure
            time.sleep(0.01)
        return self

    def _run(self) -> None:
        assert self._server is not None and self._socket is not None
        try:
            self._server.run(sockets=[self._socket])
        except BaseException as exc:  # uvicorn exits with SystemExit; keep it off the thread hook
            self._failure = exc
            logger.error("the sandbox server stopped with %r", exc)

    @property
    def port(self) -> int:
        if self._port is not None:
            return self._port
        if self.settings.port == 0:
            raise RuntimeError("the sandbox picks its port at start(); start it first")
        return self.settings.port

    @property
    def url(self) -> str:
        """The `base_url` a `rest` connection uses, e.g. `http://127.0.0.1:8900/api`."""
        return _url(self.settings.host, self.port)

    def stop(self) -> None:
        """Stop accepting, release hanging requests, finish in-flight ones, join the thread.
        Safe to call twice."""
        app, server, thread, sock = self._app, self._server, self._thread, self._socket
        if app is not None:
            app.release_waits()
        if server is not None:
            server.should_exit = True
        if thread is not None:
            thread.join(timeout=10)
            if thread.is_alive() and server is not None:
                server.force_exit = True
                thread.join(timeout=5)
        if sock is not None:
            sock.close()
        if app is not None:
            app.close()
        self._app = self._server = self._thread = self._socket = None
        self._port = None

    def __enter__(self) -> SandboxServer:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


def serve(settings: SandboxSettings) -> None:
    """Run in the foreground with uvicorn's logging and access log until Ctrl-C, which returns
    normally after a graceful shutdown (hanging requests are released first)."""
    app = create_app(settings)
    try:
        sock = _bind(settings.host, settings.port)
    except OSError:
        app.close()
        raise
    config = uvicorn.Config(app, log_level="info", lifespan="on", ws="none", timeout_graceful_shutdown=5)
    server = _UvicornServer(config, app)
    port = int(sock.getsockname()[1])
    logging.getLogger("uvicorn.error").info(
        "Sandbox target on %s (token %s, faults %s, records %s). Press Ctrl-C to stop.",
        _url(settings.host, port),
        "required" if settings.token else "not required",
        app.faults,
        settings.db_path or "in memory",
    )
    try:
        server.run(sockets=[sock])
    except KeyboardInterrupt:
        pass  # uvicorn re-raises the captured SIGINT after shutting down; that is the normal exit
    finally:
        sock.close()
        app.close()
