"""The sandbox's HTTP face: a Starlette app over the store and the fault injector.

Routing, requests and responses are Starlette's; what is the sandbox's own is the contract of the
`rest` driver (ids, idempotent creates, 404 for unknown ids, the batch endpoints), the bearer
token, the order in which a write meets its fault (dice, latency, 503, and only then its body) and
the counters `_stats` reports. Every error answer is a JSON object `{"error": "..."}`.

A batch call (`POST`/`PATCH /api/{collection}/batch`, the `rest` driver's wire format, see
`delivery/writers/rest.py`) is one request: it meets the dice, latency and 503 once, as a whole;
then each item is handled as its single endpoint would handle it, and answered in `results`, one
per item in order, with the status that endpoint would have given it.
"""

from __future__ import annotations

import contextlib
import hmac
import json
import secrets
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import replace
from http import HTTPStatus
from typing import Any
from urllib.parse import parse_qs

from starlette.applications import Starlette
from starlette.authentication import AuthCredentials, AuthenticationBackend, AuthenticationError, SimpleUser
from starlette.convertors import Convertor, register_url_convertor
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.authentication import AuthenticationMiddleware
from starlette.requests import ClientDisconnect, HTTPConnection, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute, Route
from starlette.types import Receive, Scope, Send

from playground.sandbox.faults import FaultInjector
from playground.sandbox.settings import SandboxSettings
from playground.sandbox.store import SandboxStore

__all__ = ["MAX_BODY_BYTES", "SandboxApp", "create_app"]

#: Bodies beyond this are refused with 413: a sandbox has no business storing megabytes per record.
MAX_BODY_BYTES = 1 << 20
#: The order `Allow` lists methods in, whatever order Starlette keeps them in.
_METHOD_ORDER = ("GET", "POST", "PUT", "PATCH", "DELETE")
Endpoint = Callable[[Request], Awaitable[Response]]
_STAT_KEYS = ("requests", "batches", "creates", "replays", "updates", "deletes", "not_found", "faults", "hangs")


class _CollectionName(Convertor[str]):
    """A collection is one path segment not starting with `_`: those are the sandbox's own
    endpoints (`_stats`, `_faults`), so `POST /api/_stats` is a 405 and `/api/_nope` a 404, never
    a collection of that name."""

    regex = "[^/_][^/]*"

    def convert(self, value: str) -> str:
        return value

    def to_string(self, value: str) -> str:
        return value


register_url_convertor("sandbox_collection", _CollectionName())


class _Refused(Exception):
    """An answer the sandbox gives on purpose: rendered as `{"error": message}` with `status`."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class _BearerToken(AuthenticationBackend):
    """Everything under `/api` needs the token, or an access token `/oauth/token` issued that has
    not expired (unknown paths too); `/healthz` and `/oauth/token` never do."""

    def __init__(self, token: str | None) -> None:
        self._token = token.encode("utf-8") if token is not None else None
        self.refused = 0
        #: Access tokens issued, and when each expires (monotonic seconds).
        self.issued: dict[str, float] = {}

    async def authenticate(self, conn: HTTPConnection) -> tuple[AuthCredentials, SimpleUser] | None:
        if str(conn.scope["path"]).split("/")[1:2] != ["api"]:
            return None
        scheme, _, credentials = conn.headers.get("authorization", "").partition(" ")
        given = credentials.strip()
        static = self._token is not None and hmac.compare_digest(given.encode("utf-8"), self._token)
        issued = self.issued.get(given, 0.0) > time.monotonic()
        if scheme.lower() != "bearer" or not (static or issued):
            self.refused += 1
            raise AuthenticationError("missing, wrong or expired bearer token")
        return AuthCredentials(["api"]), SimpleUser("sandbox")


class SandboxApp:
    """The ASGI application. Everything runs on the server's event loop thread; waits use
    `asyncio.sleep` so latency and hangs never serialize concurrent requests."""

    def __init__(self, settings: SandboxSettings) -> None:
        settings.validate()
        self.settings = replace(settings)  # our own copy: later edits to the caller's do nothing
        self._faults = FaultInjector(settings.faults(), settings.seed)
        self._store = SandboxStore(settings.db_path)
        self._stats: dict[str, Counter[str]] = {}
        oauth2 = settings.oauth2_client_id is not None
        self._auth = _BearerToken(settings.token) if settings.token is not None or oauth2 else None
        self.token_requests = 0
        middleware = [] if self._auth is None else [Middleware(AuthenticationMiddleware, self._auth, _unauthorized)]
        self._asgi = Starlette(
            routes=self._routes(),
            middleware=middleware,
            exception_handlers={_Refused: _refused, HTTPException: _routing_error},
            lifespan=self._lifespan,
        )
        # Both spellings are routed (see `_both`): a redirect would be an answer the `rest` driver
        # and a curl without -L do not follow.
        self._asgi.router.redirect_slashes = False

    @property
    def faults(self) -> dict[str, Any]:
        """The fault settings in force now (they change with `PUT /api/_faults`)."""
        return self._faults.settings

    def faults_in_words(self) -> str:
        """The same, as the sandbox's log says them."""
        return self._faults.in_words()

    def release_waits(self) -> None:
        """Cut short every latency sleep and hang in progress; called when the server stops so a
        hanging request cannot hold shutdown for `hang_seconds`."""
        self._faults.release_waits()

    def close(self) -> None:
        self.release_waits()
        self._store.close()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self._asgi(scope, receive, send)

    @contextlib.asynccontextmanager
    async def _lifespan(self, _app: Starlette) -> AsyncIterator[None]:
        yield
        self.close()

    def _routes(self) -> list[BaseRoute]:
        collection = "/api/{collection:sandbox_collection}"
        return [
            *_both("/healthz", self._healthz, ["GET"]),
            *_both("/api/_stats", self._stats_endpoint, ["GET"]),
            *_both("/api/_faults", self._faults_endpoint, ["GET", "PUT"]),
            *_both("/oauth/token", self._token_endpoint, ["POST"]),
            *_both(collection, self._collection, ["GET", "POST"]),
            # Before the record's route: `PATCH .../batch` is the batch update, not record "batch".
            *_both(collection + "/batch", self._batch, ["POST", "PATCH"]),
            *_both(collection + "/{record_id}", self._record, ["GET", "PATCH", "DELETE"]),
        ]

    # -- endpoints ------------------------------------------------------------------------------

    async def _healthz(self, _request: Request) -> Response:
        return JSONResponse({"ok": True})

    async def _stats_endpoint(self, _request: Request) -> Response:
        return JSONResponse(self._stats_payload())

    async def _token_endpoint(self, request: Request) -> Response:
        """OAuth2's client-credentials grant (RFC 6749 section 4.4), the client's credentials in the
        form body: an access token that expires `token_lifetime_seconds` later."""
        settings = self.settings
        form = {k: v[0] for k, v in parse_qs((await request.body()).decode("utf-8", "replace")).items()}
        self.token_requests += 1
        if settings.oauth2_client_id is None or self._auth is None:
            return JSONResponse({"error": "unsupported_grant_type"}, status_code=400)
        if form.get("grant_type") != "client_credentials":
            return JSONResponse({"error": "unsupported_grant_type"}, status_code=400)
        if (
            form.get("client_id") != settings.oauth2_client_id
            or form.get("client_secret") != settings.oauth2_client_secret
        ):
            return JSONResponse({"error": "invalid_client"}, status_code=401)
        access = "sandbox-" + secrets.token_urlsafe(16)
        lifetime = settings.token_lifetime_seconds
        self._auth.issued[access] = time.monotonic() + lifetime
        return JSONResponse({"access_token": access, "token_type": "bearer", "expires_in": lifetime})

    async def _faults_endpoint(self, request: Request) -> Response:
        if request.method == "PUT":
            try:
                return JSONResponse(self._faults.change(await _json_object(request)))
            except (TypeError, ValueError) as exc:
                raise _Refused(400, str(exc)) from exc
        return JSONResponse(self._faults.settings)

    async def _collection(self, request: Request) -> Response:
        name: str = request.path_params["collection"]
        stats = self._count_request(name)
        fault = await self._suffer_faults(request, stats)
        if fault is not None:
            return fault
        if request.method == "GET":
            return JSONResponse(self._store.records(name, _limit(request)))
        record, created = self._store.create(name, await _json_object(request), _idempotency_key(request))
        stats["creates" if created else "replays"] += 1
        if created:
            return JSONResponse(record, status_code=201)
        return JSONResponse(record, headers={"Idempotent-Replayed": "true"})

    async def _batch(self, request: Request) -> Response:
        name: str = request.path_params["collection"]
        stats = self._count_request(name)
        stats["batches"] += 1
        fault = await self._suffer_faults(request, stats)
        if fault is not None:
            return fault
        items = (await _json_object(request)).get("items")
        if not isinstance(items, list):
            raise _Refused(400, 'body must be {"items": [...]}, a list of items')
        if request.method == "POST":
            return JSONResponse({"results": [self._create_item(name, item, stats) for item in items]})
        return JSONResponse({"results": [self._update_item(name, item, stats) for item in items]})

    def _create_item(self, name: str, item: Any, stats: Counter[str]) -> dict[str, Any]:
        """`POST /api/{name}` for one batch item: its own idempotency key, the same store."""
        record = item.get("record") if isinstance(item, dict) else None
        key = item.get("idempotency_key") if isinstance(item, dict) else None
        if not isinstance(record, dict):
            return {"status": 400, "error": "an item is an object with a 'record' object"}
        if key is not None and not isinstance(key, str):
            return {"status": 400, "error": "idempotency_key must be a string"}
        stored, created = self._store.create(name, record, key or None)
        stats["creates" if created else "replays"] += 1
        return {"status": 201 if created else 200, "id": stored["id"], "record": stored}

    def _update_item(self, name: str, item: Any, stats: Counter[str]) -> dict[str, Any]:
        """`PATCH /api/{name}/{id}` for one batch item."""
        record = item.get("record") if isinstance(item, dict) else None
        record_id = item.get("id") if isinstance(item, dict) else None
        if not isinstance(record, dict) or not isinstance(record_id, str):
            return {"status": 400, "error": "an item is an object with a string 'id' and a 'record' object"}
        patched = self._store.update(name, record_id, record)
        if patched is None:
            stats["not_found"] += 1
            return {"status": 404, "error": f"no record {record_id!r} in {name!r}"}
        stats["updates"] += 1
        return {"status": 200, "id": record_id, "record": patched}

    async def _record(self, request: Request) -> Response:
        name: str = request.path_params["collection"]
        record_id: str = request.path_params["record_id"]
        stats = self._count_request(name)
        fault = await self._suffer_faults(request, stats)
        if fault is not None:
            return fault
        if request.method == "PATCH":
            patched = self._store.update(name, record_id, await _json_object(request))
            if patched is None:
                raise _not_found(stats, name, record_id)
            stats["updates"] += 1
            return JSONResponse(patched)
        if request.method == "DELETE":
            if not self._store.delete(name, record_id):
                raise _not_found(stats, name, record_id)
            stats["deletes"] += 1
            return Response(status_code=204)
        found = self._store.get(name, record_id)
        if found is None:
            raise _not_found(stats, name, record_id)
        return JSONResponse(found)

    # -- faults and counters --------------------------------------------------------------------

    def _count_request(self, collection: str) -> Counter[str]:
        stats = self._stats.setdefault(collection, Counter())
        stats["requests"] += 1
        return stats

    async def _suffer_faults(self, request: Request, stats: Counter[str]) -> Response | None:
        """The 503 an injected fault answers with, after its latency (and hang); None to go on."""
        verdict = self._faults.verdict(write=request.method in ("POST", "PATCH"))
        await self._faults.pause(verdict.latency_seconds)
        if not verdict.fail:
            return None
        stats["faults"] += 1
        if verdict.hang_seconds is not None:
            stats["hangs"] += 1
            await self._faults.pause(verdict.hang_seconds)
        # No Retry-After: the engine's own backoff schedule is what a demo should show.
        return JSONResponse({"error": "injected fault: the sandbox is simulating an outage"}, status_code=503)

    def _stats_payload(self) -> dict[str, Any]:
        """Counters since start (not persisted) plus the records held now (persisted)."""
        stored = self._store.counts()
        names = sorted(set(self._stats) | set(stored))
        collections = {
            name: {**{k: self._stats.get(name, Counter())[k] for k in _STAT_KEYS}, "records": stored.get(name, 0)}
            for name in names
        }
        total = {k: sum(c[k] for c in collections.values()) for k in (*_STAT_KEYS, "records")}
        return {
            "collections": collections,
            "total": total,
            "unauthorized": 0 if self._auth is None else self._auth.refused,
            "token_requests": self.token_requests,
            "faults": self._faults.settings,
        }


def create_app(settings: SandboxSettings) -> SandboxApp:
    """The ASGI application for `settings`; opens (or creates) the SQLite file right away so a bad
    `db_path` fails here with a ValueError rather than on the first request."""
    return SandboxApp(settings)


def _both(path: str, endpoint: Endpoint, methods: Sequence[str]) -> list[Route]:
    """The route with and without a trailing slash, answering exactly `methods`."""
    routes = [Route(path, endpoint, methods=methods), Route(path + "/", endpoint, methods=methods)]
    for route in routes:
        # Starlette adds HEAD to every GET route; the sandbox has always answered HEAD with a 405,
        # and its `Allow` headers never listed it.
        route.methods = set(methods)
    return routes


async def _json_object(request: Request) -> dict[str, Any]:
    """The body as a JSON object, or a 400/413 saying what is wrong with it. The body is read to
    its end either way, but never kept beyond `MAX_BODY_BYTES`."""
    body = bytearray()
    size = 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size <= MAX_BODY_BYTES:
                body += chunk
    except ClientDisconnect as exc:
        raise _Refused(400, "the client went away before its body arrived") from exc
    if size > MAX_BODY_BYTES:
        raise _Refused(413, f"body larger than {MAX_BODY_BYTES} bytes")
    try:
        value = json.loads(body.decode("utf-8"), parse_constant=_refuse_constant)
    except (UnicodeDecodeError, ValueError) as exc:
        raise _Refused(400, f"body is not valid JSON: {exc}") from exc
    if not isinstance(value, dict):
        raise _Refused(400, f"body must be a JSON object, got {type(value).__name__}")
    return value


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _not_found(stats: Counter[str], collection: str, record_id: str) -> _Refused:
    stats["not_found"] += 1
    return _Refused(404, f"no record {record_id!r} in {collection!r}")


def _idempotency_key(request: Request) -> str | None:
    return request.headers.get("idempotency-key") or None


def _limit(request: Request) -> int | None:
    values = request.query_params.getlist("limit")
    if not values:
        return None
    try:
        limit = int(values[-1])
    except ValueError:
        limit = -1
    if limit < 0:
        raise _Refused(400, f"limit must be a non-negative integer, got {values[-1]!r}")
    return limit


async def _refused(_request: Request, exc: Exception) -> Response:
    assert isinstance(exc, _Refused)
    return JSONResponse({"error": str(exc)}, status_code=exc.status)


async def _routing_error(_request: Request, exc: Exception) -> Response:
    """Starlette's own 404 and 405, in the sandbox's JSON shape."""
    assert isinstance(exc, HTTPException)
    headers = dict(exc.headers or {})
    if "Allow" in headers:
        allowed = {method.strip() for method in headers["Allow"].split(",")}
        headers["Allow"] = ", ".join(m for m in _METHOD_ORDER if m in allowed)
    return JSONResponse({"error": HTTPStatus(exc.status_code).phrase.lower()}, exc.status_code, headers)


def _unauthorized(_conn: HTTPConnection, exc: AuthenticationError) -> Response:
    return JSONResponse({"error": str(exc)}, status_code=401, headers={"WWW-Authenticate": "Bearer"})
