"""The built-in `rest` driver family over httpx (JSON).

create = POST {base_url}/{collection} (id read from `id_field` of the answer),
update = PATCH {base_url}/{collection}/{remote_id}. Every httpx outcome is translated into our
own record faults here and nowhere else, most specific first. The body is encoded here too, before
anything is sent, so a record JSON cannot carry (NaN, Infinity) is refused as that record's fault.
Each verb also comes as a coroutine (`acreate`, `aupdate`) over `httpx.AsyncClient`s with as many
connections in all as the sync pool, split into small pools (`delivery.writers.pools`), made on the
job's loop (`aopen`); both kinds of client's answers and transport failures are judged by the same
code.

Batch verbs, where the connection names them (`batch: {create_path, update_path, max_items}`, paths
under `base_url`; `for_batch` gives the type with `CreatesMany` and/or `UpdatesMany`):

    POST  {base_url}/{create_path}  {"items": [{"idempotency_key": K, "record": BODY}, ...]}
    PATCH {base_url}/{update_path}  {"items": [{"id": REMOTE_ID, "record": BODY}, ...]}

answered with one result per item, in item order:

    {"results": [{"status": 201, "id": "c-1"}, {"status": 422, "error": "email is invalid"}, ...]}

`status` is the HTTP status the item would have had on its own, judged as the one-record verbs
judge it (2xx done, 404/410 gone for an update, 429/5xx unavailable, another 4xx refused, 401 or
403-as-token refuses the credentials of the whole call); a created item carries its id under the
connection's `id_field`; `error` (optional) says why an item failed; `retry_after` (optional,
seconds or an HTTP date) delays a 429/503 item, else the answer's own `Retry-After` header does. Each
create item carries its own idempotency key, honoured as the one-record create's header is. The
whole call: a transport failure, 429 or 5xx raises `TargetUnavailable` for every item; 401 (403)
`Unauthorized`; any other status without a usable result list raises `BatchRefused` (the engine
splits the call). A 2xx whose result list is missing or does not match the items (not JSON, no
`results` list, a different length): every create item is `Unaddressable`, since the target may
have made them and only the answer says which id each got; every update item `AnswerSaysNothing`
(in doubt: it may have been applied, so its next offer is sent whatever its body), and an update
sent again changes nothing. An item without a usable `status` is judged the same way.
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
import re
import ssl
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from email.utils import parsedate_to_datetime
from typing import Any, cast
from urllib.parse import quote

import httpx

from delivery import attempts
from delivery.clock import utcnow
from delivery.domain import BatchEndpoints, BatchShape, Connection, Forbidden, MirrorRecord, RequestShape
from delivery.errors import (
    AnswerSaysNothing,
    RecordRejected,
    RemoteGone,
    TargetUnavailable,
    Unaddressable,
    Unauthorized,
    UnsendablePayload,
)
from delivery.redact import margin, redact, redact_start
from delivery.storable import remote_id_problem
from delivery.templates import MissingValue, Template, at_path
from delivery.writers.base import (
    DEFAULT_MAX_ITEMS,
    BatchRefused,
    CreateItem,
    CreateResult,
    Creates,
    CreatesAsync,
    CreatesMany,
    DeleteItem,
    DeleteResult,
    Deletes,
    DeletesAsync,
    DeletesMany,
    ItemResult,
    UpdateItem,
    UpdateResult,
    Updates,
    UpdatesAsync,
    UpdatesMany,
    Writer,
    token_for,
    token_source,
)
from delivery.writers.oauth2 import OAuth2Bearer, OAuth2Settings, RefreshTokenStore, TokenSource
from delivery.writers.oauth2 import token_source as oauth2_token_source
from delivery.writers.pools import AsyncPools, shard_sizes

#: How much of a refusing target's body reaches `last_error`: enough to see the reason.
BODY_EXCERPT = 200
#: Transport failures raised before any byte of the request went out: the write was not applied.
#: Every other one (a read or write timeout, a connection lost mid-exchange) may have been.
NOT_SENT = (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout, httpx.UnsupportedProtocol, httpx.ProxyError)
#: Answers of the 429/5xx kind that say the request was not acted on (too many requests, not
#: implemented, unavailable). A 500 says the target failed while handling it, and a 502/504 that a
#: gateway never heard back: the write may have been applied.
NOT_APPLIED = frozenset({429, 501, 503})


def retry_after_seconds(value: str | None) -> float | None:
    """Retry-After is either seconds or an HTTP date (RFC 9110 §10.2.3)."""
    if not value:
        return None
    value = value.strip()
    try:
        seconds = float(value)
    except ValueError:
        pass
    else:  # lenient about "1.5" and "-5", but "nan" and "inf" are no delay
        return max(seconds, 0.0) if math.isfinite(seconds) else None
    try:
        when = parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    if when.tzinfo is None:  # the asctime form and "-0000" carry no zone: HTTP dates are UTC
        when = when.replace(tzinfo=UTC)
    return max((when - utcnow()).total_seconds(), 0.0)


_CHARSET = re.compile(r"""(?:^|[;\s])charset\s*=\s*["']?([\w.:-]+)""", re.IGNORECASE)


def answer_text(response: httpx.Response, chars: int) -> str:
    """At least the first `chars` characters of an answer's body, as text: decoded by the charset
    its Content-Type names (UTF-8 when it names none, or one Python does not know; what does not
    decode is replaced). httpx's `Response.text` reads the charset through the standard library's
    email parser, about 50 µs an answer, and decodes the whole body; this runs for every request a
    record's history keeps."""
    charset = _CHARSET.search(response.headers.get("content-type", ""))
    content = response.content[: chars * 4]  # no encoding spends more than four bytes on a character
    if charset is not None:
        # An unknown name, or a codec that is no text encoding (idna, punycode: no "replace").
        with contextlib.suppress(LookupError, UnicodeError):
            return content.decode(charset.group(1), errors="replace")
    return content.decode("utf-8", errors="replace")


@dataclass(frozen=True)
class _Answer:
    """The target's answer, read whole. `undecodable` says why its body could not be read (a broken
    Content-Encoding, say): the status code and headers still count, the body does not."""

    response: httpx.Response
    undecodable: str | None = None

    @property
    def status_code(self) -> int:
        return self.response.status_code

    @property
    def is_success(self) -> bool:
        return self.response.is_success


def encode_body(body: Mapping[str, Any]) -> bytes:
    """JSON as httpx would send it, but refusing what JSON cannot carry (NaN, Infinity, lone
    surrogates, values of no JSON type) instead of letting httpx raise mid-request."""
    text = json.dumps(dict(body), ensure_ascii=False, separators=(",", ":"), allow_nan=False)
    return text.encode("utf-8")


class _RestWriter(Writer):
    """The transport and the answer mapping every variant shares; verbs come from the mixins."""

    needs_base_url = True
    thread_safe = True  # httpx.Client is safe to share between threads
    takes_record = True  # for the connection's request templates

    def __init__(
        self,
        target: Connection,
        collection: str,
        transport: httpx.BaseTransport | None = None,
        *,
        token: str | None = None,
        concurrency: int = 1,
        async_transport: httpx.AsyncBaseTransport | None = None,
        credentials: Mapping[str, str] | None = None,
        refresh_store: RefreshTokenStore | None = None,
    ) -> None:
        # Built outside a chain (tests, the sandbox) with no token given: the environment's, if any.
        token = token if token is not None else token_for(target)
        super().__init__(target, collection, token=token, concurrency=concurrency)
        if not target.base_url:
            raise ValueError(f"connection {target.name!r} has no base_url")
        for capability, path in (
            (CreatesMany, "create_path"),
            (UpdatesMany, "update_path"),
            (DeletesMany, "delete_path"),
        ):
            if isinstance(self, capability) and getattr(target.batch, path, None) is None:
                # The type claims a batch verb the connection gives no endpoint for.
                raise ValueError(f"connection {target.name!r} has no batch.{path}; build its writer with for_batch")
        self._token = self.token
        self._credentials = dict(credentials or {})
        self._oauth2: TokenSource | None = None
        headers = {"Accept": "application/json", "User-Agent": "delivery-engine", **dict(target.headers)}
        auth = self._authenticate(headers, refresh_store)
        self._requests = {verb: _Compiled.of(shape) for verb, shape in target.requests}
        #: Where a create's answer keeps the new id: the create template's `id_at`, else `id_field`.
        create = target.request("create")
        self._id_at = create.id_at if create is not None and create.id_at else None
        self._client_options: dict[str, Any] = {
            "auth": auth,
            "base_url": target.base_url.rstrip("/") + "/",
            "headers": headers,
            "timeout": httpx.Timeout(target.timeout_seconds),
            # As many connections as calls in flight, each kept alive between calls (httpx keeps
            # 20 by default: at a concurrency of 64 most calls would open a new connection).
            "limits": httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency),
            # The process's TLS settings, built once (see `tls_context`).
            "verify": tls_context(),
        }
        # One pooled client for the whole chain: connection reuse is most of the throughput.
        self._client = httpx.Client(**self._client_options, transport=transport)
        self._async_transport = async_transport
        #: The async verbs' clients, bound to the event loop of the job that opened them (`aopen`).
        self._apools: AsyncPools | None = None

    def _authenticate(self, headers: dict[str, str], refresh_store: RefreshTokenStore | None) -> httpx.Auth | None:
        """Put the connection's credentials where its auth kind says (`delivery.domain.AuthSettings`);
        the httpx auth for the kinds that need one (basic, oauth2)."""
        auth = self.target.auth
        kind = "bearer" if auth is None else auth.kind
        token = self._credentials.get("token") or self._token
        if kind == "bearer":
            if token:
                headers["Authorization"] = f"Bearer {token}"
            return None
        assert auth is not None
        if kind == "header":
            header = auth.get("header")
            if token and header:
                headers[header] = token
            return None
        if kind == "basic":
            return httpx.BasicAuth(self._credentials.get("username", ""), self._credentials.get("password", ""))
        settings = OAuth2Settings(
            connection=self.target.name,
            token_url=auth.get("token_url") or "",
            grant=auth.get("grant") or "client_credentials",
            client_id=self._credentials.get("client_id", ""),
            client_secret=self._credentials.get("client_secret", ""),
            refresh_token=self._credentials.get("refresh_token"),
            scope=auth.get("scope"),
            source=token_source(self.target) or "oauth2",
        )
        self._oauth2 = oauth2_token_source(settings, refresh_store, self.target.timeout_seconds)
        return OAuth2Bearer(self._oauth2)

    @classmethod
    def for_batch(cls, batch: BatchEndpoints | None) -> type[Writer]:
        """This type with `CreatesMany` where `batch` names a create path and the type creates,
        `UpdatesMany` where it names an update path and the type updates, and `DeletesMany` where
        it names a delete path and the type deletes (a batch path for a verb the type lacks adds
        nothing: the save-time check refuses it)."""
        plain: type[_RestWriter] = cls.__dict__.get("_plain", cls)
        create = batch is not None and batch.create_path is not None and issubclass(plain, Creates)
        update = batch is not None and batch.update_path is not None and issubclass(plain, Updates)
        delete = batch is not None and batch.delete_path is not None and issubclass(plain, Deletes)
        return _batching(plain, create, update, delete)

    def close(self) -> None:
        self._client.close()

    async def aopen(self) -> None:
        """The async verbs' clients, made on the job's loop: as many connections as the sync
        client's pool, split into small pools (`delivery.writers.pools`). A transport given
        (tests) is one pool already: one client over it."""
        if self._apools is None:
            options = {k: v for k, v in self._client_options.items() if k != "limits"}
            transport = self._async_transport
            sizes = [self.concurrency] if transport is not None else shard_sizes(self.concurrency)
            self._apools = AsyncPools(
                sizes, lambda limits: httpx.AsyncClient(**options, limits=limits, transport=transport)
            )

    async def aclose(self) -> None:
        pools, self._apools = self._apools, None
        if pools is not None:
            await pools.aclose()

    def _encode(self, method: str, path: str, body: Mapping[str, Any] | None) -> bytes:
        if body is None:
            return b""  # a request without a body (a delete's, by default)
        try:
            return encode_body(body)
        except (TypeError, ValueError) as exc:  # UnicodeEncodeError is a ValueError
            # Refused before sending: the target never saw it, so the breaker must not count it.
            raise UnsendablePayload(self._clean(f"{method} {path}: body cannot be encoded as JSON: {exc}")) from exc

    def _send(self, method: str, path: str, body: Mapping[str, Any] | None, headers: dict[str, str]) -> _Answer:
        return self._send_content(method, path, self._encode(method, path, body), headers)

    async def _asend(self, method: str, path: str, body: Mapping[str, Any] | None, headers: dict[str, str]) -> _Answer:
        content = self._encode(method, path, body)
        started, clock = utcnow(), time.monotonic()
        try:
            answer = await self._aexchange(method, path, content, headers)
        except TargetUnavailable as fault:
            self._tell(method, path, started, clock, None, str(fault))
            raise
        self._tell(method, path, started, clock, answer, None)
        return answer

    async def _aexchange(self, method: str, path: str, content: bytes, headers: dict[str, str]) -> _Answer:
        pools = self._apools
        if pools is None:
            raise RuntimeError("an async verb before aopen(): the job opens the writer on its loop")
        async with pools.lend() as client:
            request = client.build_request(method, path, content=content, headers=self._headers(headers, content))
            with self._transport_faults(method, path):
                # Streamed so that a body httpx cannot decode still leaves us the status code to judge by.
                response = await client.send(request, stream=True)
                try:
                    await response.aread()
                except httpx.DecodingError as exc:
                    return self._undecodable(response, exc)
                finally:
                    await response.aclose()
        return _Answer(response)

    def _send_content(self, method: str, path: str, content: bytes, headers: dict[str, str]) -> _Answer:
        started, clock = utcnow(), time.monotonic()
        try:
            answer = self._exchange(method, path, content, headers)
        except TargetUnavailable as fault:
            self._tell(method, path, started, clock, None, str(fault))
            raise
        self._tell(method, path, started, clock, answer, None)
        return answer

    def _tell(
        self, method: str, path: str, started: datetime, clock: float, answer: _Answer | None, error: str | None
    ) -> None:
        """The request for the record's history (`delivery.attempts`), its answer's start masked."""
        if not attempts.listened():
            return  # outside a chain's step (a preview, a check): nobody keeps it
        excerpt = None
        if answer is not None:
            if answer.undecodable is None:
                excerpt = self._answer_start(answer.response, attempts.EXCERPT_CHARS) or None
            else:
                excerpt = self._clean(f"<not decodable: {answer.undecodable}>")[: attempts.EXCERPT_CHARS]
        attempts.heard(
            at=started,
            method=method,
            path=path,
            status_code=answer.status_code if answer is not None else None,
            error=error,
            duration_ms=round((time.monotonic() - clock) * 1000),
            answer_excerpt=excerpt,
        )

    def _exchange(self, method: str, path: str, content: bytes, headers: dict[str, str]) -> _Answer:
        request = self._client.build_request(method, path, content=content, headers=self._headers(headers, content))
        with self._transport_faults(method, path):
            # Streamed so that a body httpx cannot decode still leaves us the status code to judge by.
            response = self._client.send(request, stream=True)
            try:
                response.read()
            except httpx.DecodingError as exc:
                return self._undecodable(response, exc)
            finally:
                response.close()
        return _Answer(response)

    @staticmethod
    def _headers(headers: dict[str, str], content: bytes = b"{}") -> dict[str, str]:
        # A request without a body says nothing of a type: some APIs refuse a typed empty body.
        return {**headers, "Content-Type": "application/json"} if content else dict(headers)

    def _undecodable(self, response: httpx.Response, exc: httpx.DecodingError) -> _Answer:
        return _Answer(response, undecodable=self._clean(str(exc)) or type(exc).__name__)

    @contextlib.contextmanager
    def _transport_faults(self, method: str, path: str) -> Iterator[None]:
        """httpx's transport failures as our faults, for the sync and the async client alike (the
        one place they are translated)."""
        try:
            yield
        except httpx.TimeoutException as exc:
            unknown = not isinstance(exc, NOT_SENT)
            message = self._clean(f"{method} {path}: timed out ({type(exc).__name__})")
            raise TargetUnavailable(message, outcome_unknown=unknown) from exc
        except httpx.TransportError as exc:
            unknown = not isinstance(exc, NOT_SENT)
            message = self._clean(f"{method} {path}: connection error: {exc}")
            raise TargetUnavailable(message, outcome_unknown=unknown) from exc

    def _refuse(self, method: str, path: str, answer: _Answer, *, gone_on_404: bool) -> Exception:
        code = answer.status_code
        what = f"{method} {path}: HTTP {code}: {self._excerpt(answer)}"
        if code in (404, 410) and gone_on_404:
            return RemoteGone(what)
        if code == 401 or (code == 403 and self.target.forbidden is Forbidden.TOKEN):
            return Unauthorized(self.target.name, token_source(self.target), f"{method} {path}: HTTP {code}")
        if code == 429 or code >= 500:
            return TargetUnavailable(
                what,
                retry_after_seconds(answer.response.headers.get("Retry-After")),
                outcome_unknown=code not in NOT_APPLIED,
                status_code=code,
            )
        return RecordRejected(what)

    def _clean(self, text: str) -> str:
        return redact(text, *self._secrets())

    def _answer_start(self, response: httpx.Response, chars: int) -> str:
        """The first `chars` characters of an answer's body, masked before the cut (`redact_start`):
        read as far past the cut as the longest secret spelling reaches, and no further."""
        secrets = self._secrets()
        return redact_start(answer_text(response, chars + margin(*secrets)), chars, *secrets)

    def _secrets(self) -> tuple[str | None, ...]:
        held = self._oauth2.secrets() if self._oauth2 is not None else ()
        return (self._token, *self._credentials.values(), *held)

    def _excerpt(self, answer: _Answer) -> str:
        if answer.undecodable is not None:
            return f"<answer body not decodable: {answer.undecodable}>"[:BODY_EXCERPT]
        return self._answer_start(answer.response, BODY_EXCERPT)

    def _create(self, body: Mapping[str, Any], idempotency_key: str, record: MirrorRecord | None = None) -> str:
        method, path, content = self._request("create", body, record, idempotency_key=idempotency_key)
        answer = self._send(method, path, content, {"Idempotency-Key": idempotency_key})
        return self._created_id(method, path, answer)

    async def _acreate(self, body: Mapping[str, Any], idempotency_key: str, record: MirrorRecord | None = None) -> str:
        method, path, content = self._request("create", body, record, idempotency_key=idempotency_key)
        answer = await self._asend(method, path, content, {"Idempotency-Key": idempotency_key})
        return self._created_id(method, path, answer)

    def _request(
        self, verb: str, body: Mapping[str, Any], record: MirrorRecord | None, **values: Any
    ) -> tuple[str, str, Any]:
        """The method, path and body of one record's request: the connection's template for the
        verb (`requests`), or the built-in one (POST to the collection, PATCH to the record's
        path, the mapped body whole). A value the template needs and the record lacks refuses
        the record before anything is sent."""
        compiled = self._requests.get(verb)
        if compiled is None:
            if verb == "create":
                return "POST", self.collection, body
            if verb == "delete":
                return "DELETE", f"{self.collection}/{_segment(values['remote_id'])}", None
            return "PATCH", f"{self.collection}/{_segment(values['remote_id'])}", body
        context = self._item_values(body, record, **values)
        try:
            return compiled.shape.method, compiled.path.render(context), compiled.body.render(context)
        except MissingValue as missing:
            raise RecordRejected(
                self._clean(f"{compiled.shape.method} {compiled.shape.path}: {missing}; nothing was sent")
            ) from None

    def _created_id(self, method: str, path: str, answer: _Answer) -> str:
        """A create's answer judged: the id it made, or the fault it met."""
        if not answer.is_success:
            raise self._refuse(method, path, answer, gone_on_404=False)
        if answer.undecodable is not None:
            # The create went through, but the id it made is in the body we cannot read.
            raise Unaddressable(
                f"{method} {path}: HTTP {answer.status_code} answer body cannot be decoded: {answer.undecodable}"
            )
        try:
            decoded = answer.response.json()
        except ValueError as exc:
            raise Unaddressable(self._clean(f"{method} {path}: HTTP {answer.status_code} answer is not JSON")) from exc
        if self._id_at is not None:
            remote_id = at_path(decoded, self._id_at)
        else:
            remote_id = decoded.get(self.target.id_field) if isinstance(decoded, dict) else None
        if (unusable := self._unusable(remote_id)) is not None:
            raise Unaddressable(
                self._clean(
                    f"{method} {path}: HTTP {answer.status_code} answer has {unusable}: {self._excerpt(answer)}"
                )
            )
        return str(remote_id)

    def _unusable(self, remote_id: Any) -> str | None:
        """What is wrong with the id a create's answer gave (None: it can address the record)."""
        problem = None if remote_id is None else remote_id_problem(remote_id)
        if remote_id is not None and problem is None:
            return None
        where = self._id_at or self.target.id_field
        return f"no usable {where!r}" + ("" if problem is None else f" (it {problem})")

    def _update(self, remote_id: str, body: Mapping[str, Any], record: MirrorRecord | None = None) -> None:
        method, path, content = self._request("update", body, record, remote_id=remote_id)
        self._updated(method, path, self._send(method, path, content, {}))

    async def _aupdate(self, remote_id: str, body: Mapping[str, Any], record: MirrorRecord | None = None) -> None:
        method, path, content = self._request("update", body, record, remote_id=remote_id)
        self._updated(method, path, await self._asend(method, path, content, {}))

    def _updated(self, method: str, path: str, answer: _Answer) -> None:
        # A 2xx whose body cannot be decoded is still a success: an update (or a delete) needs
        # nothing from it. A 404/410 is `RemoteGone`: for a delete, done already.
        if not answer.is_success:
            raise self._refuse(method, path, answer, gone_on_404=True)

    def _delete(
        self, remote_id: str, record: MirrorRecord | None = None, body: Mapping[str, Any] | None = None
    ) -> None:
        method, path, content = self._request("delete", body or {}, record, remote_id=remote_id)
        self._updated(method, path, self._send(method, path, content, {}))

    async def _adelete(
        self, remote_id: str, record: MirrorRecord | None = None, body: Mapping[str, Any] | None = None
    ) -> None:
        method, path, content = self._request("delete", body or {}, record, remote_id=remote_id)
        self._updated(method, path, await self._asend(method, path, content, {}))

    # -- batch verbs -----------------------------------------------------------------------------

    def _create_many(self, items: Sequence[CreateItem]) -> list[CreateResult]:
        shape = self.target.batch.create_shape if self.target.batch else None
        if shape is not None:
            values = [self._item_values(item.body, item.record, idempotency_key=item.idempotency_key) for item in items]
            return cast("list[CreateResult]", self._shaped_many(shape, values, creating=True))
        path = self._batch_path("create_path")
        entries = [{"idempotency_key": item.idempotency_key, "record": dict(item.body)} for item in items]
        return cast("list[CreateResult]", self._many("POST", path, entries, creating=True))

    def _update_many(self, items: Sequence[UpdateItem]) -> list[UpdateResult]:
        shape = self.target.batch.update_shape if self.target.batch else None
        if shape is not None:
            values = [self._item_values(item.body, item.record, remote_id=item.remote_id) for item in items]
            return cast("list[UpdateResult]", self._shaped_many(shape, values, creating=False))
        path = self._batch_path("update_path")
        entries = [{"id": item.remote_id, "record": dict(item.body)} for item in items]
        return cast("list[UpdateResult]", self._many("PATCH", path, entries, creating=False))

    def _delete_many(self, items: Sequence[DeleteItem]) -> list[DeleteResult]:
        shape = self.target.batch.delete_shape if self.target.batch else None
        if shape is not None:
            values = [self._item_values({}, item.record, remote_id=item.remote_id) for item in items]
            return cast("list[DeleteResult]", self._shaped_many(shape, values, creating=False, deleting=True))
        path = self._batch_path("delete_path")
        entries = [{"id": item.remote_id} for item in items]
        return cast("list[DeleteResult]", self._many("POST", path, entries, creating=False, deleting=True))

    def _item_values(self, body: Mapping[str, Any], record: MirrorRecord | None, **values: Any) -> dict[str, Any]:
        """What a template of one record's request (or batch item) is rendered with."""
        return {
            "fields": dict(body),
            "record": dict(record.payload) if record is not None else {},
            "external_id": record.external_id if record is not None else None,
            "collection": self.collection,
            **values,
        }

    def _shaped_many(
        self, shape: BatchShape, values: list[dict[str, Any]], *, creating: bool, deleting: bool = False
    ) -> list[ItemResult]:
        """One batch call described by `shape` (`batch.create`, `batch.update`, `batch.delete`):
        each item rendered from its template (one lacking a value is that record's refusal, left
        out), the body from its template with the items in it, and the results read where the
        shape says, matched to their items by `match` (or in order). An item no result speaks for,
        in a 2xx answer, is judged as a result list that does not fit: a create `Unaddressable` (it
        may exist, and nothing says which id is its), an update or a delete `AnswerSaysNothing` (in
        doubt, sent again). A delete answered 2xx with no result list at all (HubSpot's batch
        archive answers 204) deleted every item."""
        count = len(values)
        results: list[ItemResult] = [None] * count
        rendered: list[tuple[int, Any]] = []
        item_template = Template(shape.item)
        for index, context in enumerate(values):
            try:
                rendered.append((index, item_template.render(context)))
            except MissingValue as missing:
                refused = f"{shape.method} {shape.path}: {missing}; nothing was sent"
                results[index] = RecordRejected(self._clean(refused))
        method = shape.method
        while True:
            if not rendered:
                return results
            common = {"collection": self.collection, "items": [item for _, item in rendered]}
            path = Template(shape.path, path=True).render(common)
            try:
                content = encode_body(Template(shape.body).render(common))
                break
            except (TypeError, ValueError):
                # Rare: find the items JSON cannot carry (NaN, a lone surrogate) and leave them out.
                rendered = self._encodable(shape, rendered, results, count)
        answer = self._send_content(method, path, content, {})
        found = self._shaped_results(method, path, answer, shape)
        if deleting and isinstance(found, str):
            return results  # every item sent was deleted (see above); None is "applied"
        for position, (index, item) in enumerate(rendered):
            where = f"{method} {path} (item {index + 1} of {count})"
            if isinstance(found, str):
                result: Any = None
                why = found
            elif shape.match is None:
                result = found[position] if len(found) == len(rendered) else None
                why = f"answer has {len(found)} results for {len(rendered)} items"
            else:
                key = item.get(shape.match) if isinstance(item, Mapping) else None
                matches = [
                    r
                    for r in found
                    if isinstance(r, Mapping) and key is not None and str(r.get(shape.match)) == str(key)
                ]
                result = matches[0] if len(matches) == 1 else None
                why = f"no result has {shape.match} = {key!r}"
            status = result.get("status") if isinstance(result, Mapping) else None
            if result is None:
                what = self._clean(f"{where}: HTTP {answer.status_code} {why}: {self._excerpt(answer)}")
                results[index] = Unaddressable(what) if creating else AnswerSaysNothing(what)
            elif isinstance(status, int) and not isinstance(status, bool) and not 200 <= status < 300:
                # A result carrying its item's own HTTP status, judged as the one-record verb would.
                results[index] = self._item(where, answer, result, creating=creating)
            elif creating:
                remote_id = at_path(result, shape.id_at or self.target.id_field)
                if (unusable := self._unusable(remote_id)) is not None:
                    results[index] = Unaddressable(self._clean(f"{where}: result has {unusable}"))
                else:
                    results[index] = str(remote_id)
            else:
                results[index] = None
        return results

    def _encodable(
        self, shape: BatchShape, rendered: list[tuple[int, Any]], results: list[ItemResult], count: int
    ) -> list[tuple[int, Any]]:
        """The rendered items JSON can carry; each other one is that record's `UnsendablePayload`."""
        kept = []
        for index, item in rendered:
            try:
                encode_body({"item": item})
            except (TypeError, ValueError) as exc:
                what = f"{shape.method} {shape.path} (item {index + 1} of {count}): body cannot be encoded: {exc}"
                results[index] = UnsendablePayload(self._clean(what))
                continue
            kept.append((index, item))
        if len(kept) == len(rendered):  # the body's own constants cannot be encoded: none can go
            for index, _ in rendered:
                results[index] = UnsendablePayload(self._clean(f"{shape.method} {shape.path}: body cannot be encoded"))
            return []
        return kept

    def _shaped_results(self, method: str, path: str, answer: _Answer, shape: BatchShape) -> list[Any] | str:
        """The results of a described batch call, or why a 2xx answer has none usable. Raises for
        the whole call as the built-in wire format does (429/5xx, a refused token, another
        refusal: `BatchRefused`, which splits the call)."""
        code = answer.status_code
        if not answer.is_success:
            refusal = self._refuse(method, path, answer, gone_on_404=False)
            if not isinstance(refusal, RecordRejected):
                raise refusal
            excerpt = self._excerpt(answer)
            raise BatchRefused(f"{method} {path}: HTTP {code}: {excerpt}", code, excerpt)
        if answer.undecodable is not None:
            return f"answer body cannot be decoded: {answer.undecodable}"
        try:
            decoded = answer.response.json()
        except ValueError:
            return "answer is not JSON"
        found = at_path(decoded, shape.results_at)
        if not isinstance(found, list):
            return f"answer has no {shape.results_at!r} list"
        return found

    def _batch_path(self, name: str) -> str:
        path = getattr(self.target.batch, name, None)
        if path is None:  # __init__ refuses such a writer; kept for a subclass that skips it
            raise ValueError(f"connection {self.target.name!r} has no batch.{name}")
        return str(path)

    def _many(
        self, method: str, path: str, entries: list[dict[str, Any]], *, creating: bool, deleting: bool = False
    ) -> list[ItemResult]:
        """One batch call for `entries` (each item as the wire carries it): one result per entry,
        in order. An entry JSON cannot carry is that item's `UnsendablePayload`, left out of the
        call; when every entry is, nothing is sent. A delete answered 2xx without a result list
        deleted every item."""
        limit: int = getattr(self, "max_items", DEFAULT_MAX_ITEMS)  # the batch mixins' (CreatesMany...)
        if len(entries) > limit:
            raise ValueError(f"{method} {path}: {len(entries)} items, more than the {limit} one call may carry")
        count = len(entries)
        results: list[ItemResult] = [None] * count
        sent: list[int] = []
        encoded: list[bytes] = []
        for index, entry in enumerate(entries):
            try:
                encoded.append(encode_body(entry))
            except (TypeError, ValueError) as exc:  # UnicodeEncodeError is a ValueError
                what = f"{method} {path} (item {index + 1} of {count}): body cannot be encoded as JSON: {exc}"
                results[index] = UnsendablePayload(self._clean(what))
                continue
            sent.append(index)
        if not sent:
            return results
        answer = self._send_content(method, path, b'{"items":[' + b",".join(encoded) + b"]}", {})
        read = self._results(method, path, answer, len(sent))
        if deleting and isinstance(read, str):
            return results
        for position, index in enumerate(sent):
            where = f"{method} {path} (item {index + 1} of {count})"
            if isinstance(read, str):
                # A 2xx without a usable list: see the module docstring for why these faults.
                what = f"{where}: HTTP {answer.status_code} {read}"
                results[index] = Unaddressable(what) if creating else AnswerSaysNothing(what)
            else:
                results[index] = self._item(where, answer, read[position], creating=creating)
        return results

    def _results(self, method: str, path: str, answer: _Answer, count: int) -> list[Any] | str:
        """The answer's per-item results, or why a 2xx answer has none usable. Raises for the
        whole call: 429/5xx, a refused token, or any other refusal without a usable result list."""
        code = answer.status_code
        if not answer.is_success and (code in (401, 403, 429) or code >= 500):
            refusal = self._refuse(method, path, answer, gone_on_404=False)
            if not isinstance(refusal, RecordRejected):  # a 403 the connection calls a record's
                raise refusal
        read = self._result_list(answer, count)
        if isinstance(read, str) and not answer.is_success:
            excerpt = self._excerpt(answer)
            raise BatchRefused(f"{method} {path}: HTTP {code}: {excerpt}", code, excerpt)
        return read

    def _result_list(self, answer: _Answer, count: int) -> list[Any] | str:
        if answer.undecodable is not None:
            return f"answer body cannot be decoded: {answer.undecodable}"
        try:
            decoded = answer.response.json()
        except ValueError:
            return f"answer is not JSON: {self._excerpt(answer)}"
        results = decoded.get("results") if isinstance(decoded, dict) else None
        if not isinstance(results, list):
            return f"answer has no 'results' list: {self._excerpt(answer)}"
        if len(results) != count:
            return f"answer has {len(results)} results for {count} items: {self._excerpt(answer)}"
        return results

    def _item(self, where: str, answer: _Answer, result: Any, *, creating: bool) -> ItemResult:
        """One item's result, judged as the one-record verb judges its answer."""
        status = result.get("status") if isinstance(result, dict) else None
        if not isinstance(status, int) or isinstance(status, bool) or not 100 <= status <= 599:
            what = f"{where}: result has no usable 'status': {self._item_excerpt(result)}"
            return Unaddressable(what) if creating else AnswerSaysNothing(what)
        if 200 <= status < 300:
            return self._created(where, status, result) if creating else None
        what = f"{where}: HTTP {status}: {self._item_excerpt(result)}"
        if status == 401 or (status == 403 and self.target.forbidden is Forbidden.TOKEN):
            raise Unauthorized(self.target.name, token_source(self.target), f"{where}: HTTP {status}")
        if status in (404, 410) and not creating:
            return RemoteGone(what)
        if status == 429 or status >= 500:
            given = result.get("retry_after")
            if isinstance(given, (int, float)) and not isinstance(given, bool):
                given = str(given)
            if not isinstance(given, str):
                given = answer.response.headers.get("Retry-After")
            return TargetUnavailable(
                what, retry_after_seconds(given), outcome_unknown=status not in NOT_APPLIED, status_code=status
            )
        return RecordRejected(what)

    def _created(self, where: str, status: int, result: dict[str, Any]) -> str | Unaddressable:
        remote_id = result.get(self.target.id_field)
        if (unusable := self._unusable(remote_id)) is not None:
            return Unaddressable(f"{where}: HTTP {status} result has {unusable}: {self._item_excerpt(result)}")
        return str(remote_id)

    def _item_excerpt(self, result: Any) -> str:
        """An item's `error` when it is text, else the item as JSON; the token masked before the
        cut, as `_excerpt` does."""
        error = result.get("error") if isinstance(result, dict) else None
        if not isinstance(error, str):
            error = json.dumps(result, ensure_ascii=False, separators=(",", ":"), default=str)
        return self._clean(error)[:BODY_EXCERPT]


class _RestCreatesMany(_RestWriter, CreatesMany):
    """The batch create of the `rest` family (mixed in by `for_batch`)."""

    def create_many(self, items: Sequence[CreateItem]) -> list[CreateResult]:
        return self._create_many(items)


class _RestUpdatesMany(_RestWriter, UpdatesMany):
    """The batch update of the `rest` family (mixed in by `for_batch`)."""

    def update_many(self, items: Sequence[UpdateItem]) -> list[UpdateResult]:
        return self._update_many(items)


class _RestDeletesMany(_RestWriter, DeletesMany):
    """The batch delete of the `rest` family (mixed in by `for_batch`)."""

    def delete_many(self, items: Sequence[DeleteItem]) -> list[DeleteResult]:
        return self._delete_many(items)


@functools.cache
def tls_context() -> ssl.SSLContext:
    """The TLS settings every REST writer of the process shares (httpx's defaults: certifi's CAs,
    or SSL_CERT_FILE / SSL_CERT_DIR). Building them costs about 20 ms of CPU, once per writer, so
    once per chain; a long-lived worker runs many chains."""
    return httpx.create_ssl_context()


@functools.cache
def _batching(plain: type[_RestWriter], create: bool, update: bool, delete: bool = False) -> type[_RestWriter]:
    """`plain` with the batch verbs asked for: one type per combination, made once, so that
    every writer for the same kind of connection has the same type."""
    chosen = [
        (create, _RestCreatesMany, "CreatesMany"),
        (update, _RestUpdatesMany, "UpdatesMany"),
        (delete, _RestDeletesMany, "DeletesMany"),
    ]
    mixins = [mixin for wanted, mixin, _ in chosen if wanted]
    if not mixins:
        return plain
    name = "+".join([plain.__name__, *(verb for wanted, _, verb in chosen if wanted)])
    namespace = {
        "__module__": plain.__module__,
        "__qualname__": name,
        "__doc__": f"{plain.__doc__} With batch verbs, as the connection names batch paths.",
        "_plain": plain,
    }
    return cast("type[_RestWriter]", type(name, (plain, *mixins), namespace))


def _segment(remote_id: str) -> str:
    """One URL path segment. "." and ".." would be collapsed by URL normalisation and address the
    collection or its parent instead of the record, so they are percent-encoded too."""
    if remote_id in (".", ".."):
        return remote_id.replace(".", "%2E")
    return quote(remote_id, safe="")


class RestWriter(_RestWriter, Creates, Updates, Deletes, CreatesAsync, UpdatesAsync, DeletesAsync):
    """`rest`: creates, updates and deletes (each also as a coroutine, for the async job)."""

    def delete(self, remote_id: str, record: MirrorRecord | None = None, body: Mapping[str, Any] | None = None) -> None:
        self._delete(remote_id, record, body)

    async def adelete(
        self, remote_id: str, record: MirrorRecord | None = None, body: Mapping[str, Any] | None = None
    ) -> None:
        await self._adelete(remote_id, record, body)

    def create(self, body: Mapping[str, Any], idempotency_key: str, record: MirrorRecord | None = None) -> str:
        return self._create(body, idempotency_key, record)

    def update(self, remote_id: str, body: Mapping[str, Any], record: MirrorRecord | None = None) -> None:
        self._update(remote_id, body, record)

    async def acreate(self, body: Mapping[str, Any], idempotency_key: str, record: MirrorRecord | None = None) -> str:
        return await self._acreate(body, idempotency_key, record)

    async def aupdate(self, remote_id: str, body: Mapping[str, Any], record: MirrorRecord | None = None) -> None:
        await self._aupdate(remote_id, body, record)


class RestCreateOnlyWriter(_RestWriter, Creates, CreatesAsync):
    """`rest-create-only`: a target that takes new records and offers no update."""

    def create(self, body: Mapping[str, Any], idempotency_key: str, record: MirrorRecord | None = None) -> str:
        return self._create(body, idempotency_key, record)

    async def acreate(self, body: Mapping[str, Any], idempotency_key: str, record: MirrorRecord | None = None) -> str:
        return await self._acreate(body, idempotency_key, record)


class RestUpdateOnlyWriter(_RestWriter, Updates, UpdatesAsync):
    """`rest-update-only`: a target whose records exist already and can only be updated."""

    def update(self, remote_id: str, body: Mapping[str, Any], record: MirrorRecord | None = None) -> None:
        self._update(remote_id, body, record)

    async def aupdate(self, remote_id: str, body: Mapping[str, Any], record: MirrorRecord | None = None) -> None:
        await self._aupdate(remote_id, body, record)


@dataclass(frozen=True)
class _Compiled:
    """One verb's request shape, its templates ready to render."""

    shape: RequestShape
    path: Template
    body: Template

    @classmethod
    def of(cls, shape: RequestShape) -> _Compiled:
        return cls(shape, Template(shape.path, path=True), Template(shape.body))
