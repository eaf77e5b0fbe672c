"""The built-in `rest` driver family over httpx (JSON).

create = POST {base_url}/{collection} (id read from `id_field` of the answer),
update = PATCH {base_url}/{collection}/{remote_id}. Every httpx outcome is translated into our
own record faults here and nowhere else, most specific first. The body is encoded here too, before
anything is sent, so a record JSON cannot carry (NaN, Infinity) is refused as that record's fault.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC
from email.utils import parsedate_to_datetime
from typing import Any
from urllib.parse import quote

import httpx

from delivery.clock import utcnow
from delivery.domain import Connection, Forbidden
from delivery.errors import (
    RecordRejected,
    RemoteGone,
    TargetUnavailable,
    Unaddressable,
    Unauthorized,
    UnsendablePayload,
)
from delivery.redact import redact
from delivery.storable import remote_id_problem
from delivery.writers.base import Creates, Updates, Writer, token_for, token_source

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

    def __init__(
        self,
        target: Connection,
        collection: str,
        transport: httpx.BaseTransport | None = None,
        *,
        token: str | None = None,
        concurrency: int = 1,
    ) -> None:
        # Built outside a chain (tests, the sandbox) with no token given: the environment's, if any.
        token = token if token is not None else token_for(target)
        super().__init__(target, collection, token=token, concurrency=concurrency)
        if not target.base_url:
            raise ValueError(f"connection {target.name!r} has no base_url")
        self._token = self.token
        headers = {"Accept": "application/json", "User-Agent": "delivery-engine"}
        if self._token:
            headers["Authorization"] = f"Bearer {self._token}"
        # One pooled client for the whole chain: connection reuse is most of the throughput.
        self._client = httpx.Client(
            base_url=target.base_url.rstrip("/") + "/",
            headers=headers,
            timeout=httpx.Timeout(target.timeout_seconds),
            # As many connections as calls in flight, each kept alive between calls (httpx keeps
            # 20 by default: at a concurrency of 64 most calls would open a new connection).
            limits=httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency),
            transport=transport,
        )

    def close(self) -> None:
        self._client.close()

    def _send(self, method: str, path: str, body: Mapping[str, Any], headers: dict[str, str]) -> _Answer:
        try:
            content = encode_body(body)
        except (TypeError, ValueError) as exc:  # UnicodeEncodeError is a ValueError
            # Refused before sending: the target never saw it, so the breaker must not count it.
            raise UnsendablePayload(self._clean(f"{method} {path}: body cannot be encoded as JSON: {exc}")) from exc
        request = self._client.build_request(
            method, path, content=content, headers={**headers, "Content-Type": "application/json"}
        )
        try:
            # Streamed so that a body httpx cannot decode still leaves us the status code to judge by.
            response = self._client.send(request, stream=True)
            try:
                response.read()
            except httpx.DecodingError as exc:
                return _Answer(response, undecodable=self._clean(str(exc)) or type(exc).__name__)
            finally:
                response.close()
        except httpx.TimeoutException as exc:
            unknown = not isinstance(exc, NOT_SENT)
            message = self._clean(f"{method} {path}: timed out ({type(exc).__name__})")
            raise TargetUnavailable(message, outcome_unknown=unknown) from exc
        except httpx.TransportError as exc:
            unknown = not isinstance(exc, NOT_SENT)
            message = self._clean(f"{method} {path}: connection error: {exc}")
            raise TargetUnavailable(message, outcome_unknown=unknown) from exc
        return _Answer(response)

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
            )
        return RecordRejected(what)

    def _clean(self, text: str) -> str:
        return redact(text, self._token)

    def _excerpt(self, answer: _Answer) -> str:
        if answer.undecodable is not None:
            return f"<answer body not decodable: {answer.undecodable}>"[:BODY_EXCERPT]
        # Redact before cutting: a token straddling the cut would otherwise leak its first part.
        return self._clean(answer.response.text)[:BODY_EXCERPT]

    def _create(self, body: Mapping[str, Any], idempotency_key: str) -> str:
        path = self.collection
        answer = self._send("POST", path, body, {"Idempotency-Key": idempotency_key})
        if not answer.is_success:
            raise self._refuse("POST", path, answer, gone_on_404=False)
        if answer.undecodable is not None:
            # The create went through, but the id it made is in the body we cannot read.
            raise Unaddressable(
                f"POST {path}: HTTP {answer.status_code} answer body cannot be decoded: {answer.undecodable}"
            )
        try:
            decoded = answer.response.json()
        except ValueError as exc:
            raise Unaddressable(self._clean(f"POST {path}: HTTP {answer.status_code} answer is not JSON")) from exc
        remote_id = decoded.get(self.target.id_field) if isinstance(decoded, dict) else None
        problem = None if remote_id is None else remote_id_problem(remote_id)
        if remote_id is None or problem is not None:
            why = "" if problem is None else f" (it {problem})"
            raise Unaddressable(
                f"POST {path}: HTTP {answer.status_code} answer has no usable {self.target.id_field!r}{why}: "
                f"{self._excerpt(answer)}"
            )
        return str(remote_id)

    def _update(self, remote_id: str, body: Mapping[str, Any]) -> None:
        path = f"{self.collection}/{_segment(remote_id)}"
        answer = self._send("PATCH", path, body, {})
        # A 2xx whose body cannot be decoded is still a success: an update needs nothing from it.
        if not answer.is_success:
            raise self._refuse("PATCH", path, answer, gone_on_404=True)


def _segment(remote_id: str) -> str:
    """One URL path segment. "." and ".." would be collapsed by URL normalisation and address the
    collection or its parent instead of the record, so they are percent-encoded too."""
    if remote_id in (".", ".."):
        return remote_id.replace(".", "%2E")
    return quote(remote_id, safe="")


class RestWriter(_RestWriter, Creates, Updates):
    """`rest`: creates and updates."""

    def create(self, body: Mapping[str, Any], idempotency_key: str) -> str:
        return self._create(body, idempotency_key)

    def update(self, remote_id: str, body: Mapping[str, Any]) -> None:
        self._update(remote_id, body)


class RestCreateOnlyWriter(_RestWriter, Creates):
    """`rest-create-only`: a target that takes new records and offers no update."""

    def create(self, body: Mapping[str, Any], idempotency_key: str) -> str:
        return self._create(body, idempotency_key)


class RestUpdateOnlyWriter(_RestWriter, Updates):
    """`rest-update-only`: a target whose records exist already and can only be updated."""

    def update(self, remote_id: str, body: Mapping[str, Any]) -> None:
        self._update(remote_id, body)
