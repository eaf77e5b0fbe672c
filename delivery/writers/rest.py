"""The built-in `rest` driver family over httpx (JSON).

create = POST {base_url}/{collection} (id read from `id_field` of the answer),
update = PATCH {base_url}/{collection}/{remote_id}. Every httpx outcome is translated into our
own record faults here and nowhere else, most specific first.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from datetime import UTC
from email.utils import parsedate_to_datetime
from typing import Any
from urllib.parse import quote

import httpx

from delivery.clock import utcnow
from delivery.domain import Connection
from delivery.errors import RecordRejected, RemoteGone, TargetUnavailable, Unaddressable
from delivery.redact import redact
from delivery.writers.base import Creates, Updates, Writer, token_for

#: How much of a refusing target's body reaches `last_error`: enough to see the reason.
BODY_EXCERPT = 200


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


class _RestWriter(Writer):
    """The transport and the answer mapping every variant shares; verbs come from the mixins."""

    needs_base_url = True
    thread_safe = True  # httpx.Client is safe to share between threads

    def __init__(self, target: Connection, collection: str, transport: httpx.BaseTransport | None = None) -> None:
        super().__init__(target, collection)
        if not target.base_url:
            raise ValueError(f"connection {target.name!r} has no base_url")
        self._token = token_for(target)
        headers = {"Accept": "application/json", "User-Agent": "delivery-engine"}
        if self._token:
            headers["Authorization"] = f"Bearer {self._token}"
        # One pooled client for the whole chain: connection reuse is most of the throughput.
        self._client = httpx.Client(
            base_url=target.base_url.rstrip("/") + "/",
            headers=headers,
            timeout=httpx.Timeout(target.timeout_seconds),
            transport=transport,
        )

    def close(self) -> None:
        self._client.close()

    def _send(self, method: str, path: str, body: Mapping[str, Any], headers: dict[str, str]) -> httpx.Response:
        try:
            return self._client.request(method, path, json=dict(body), headers=headers)
        except httpx.TimeoutException as exc:
            raise TargetUnavailable(self._clean(f"{method} {path}: timed out ({type(exc).__name__})")) from exc
        except httpx.TransportError as exc:
            raise TargetUnavailable(self._clean(f"{method} {path}: connection error: {exc}")) from exc

    def _refuse(self, method: str, path: str, response: httpx.Response, *, gone_on_404: bool) -> Exception:
        code = response.status_code
        what = f"{method} {path}: HTTP {code}: {self._excerpt(response)}"
        if code in (404, 410) and gone_on_404:
            return RemoteGone(what)
        if code == 429 or code >= 500:
            return TargetUnavailable(what, retry_after_seconds(response.headers.get("Retry-After")))
        return RecordRejected(what)

    def _clean(self, text: str) -> str:
        return redact(text, self._token)

    def _excerpt(self, response: httpx.Response) -> str:
        # Redact before cutting: a token straddling the cut would otherwise leak its first part.
        return self._clean(response.text)[:BODY_EXCERPT]

    def _create(self, body: Mapping[str, Any], idempotency_key: str) -> str:
        path = self.collection
        response = self._send("POST", path, body, {"Idempotency-Key": idempotency_key})
        if not response.is_success:
            raise self._refuse("POST", path, response, gone_on_404=False)
        try:
            answer = response.json()
        except ValueError as exc:
            raise Unaddressable(self._clean(f"POST {path}: HTTP {response.status_code} answer is not JSON")) from exc
        remote_id = answer.get(self.target.id_field) if isinstance(answer, dict) else None
        if remote_id is None or isinstance(remote_id, (dict, list, bool)) or str(remote_id) == "":
            raise Unaddressable(
                f"POST {path}: HTTP {response.status_code} answer has no usable {self.target.id_field!r}: "
                f"{self._excerpt(response)}"
            )
        return str(remote_id)

    def _update(self, remote_id: str, body: Mapping[str, Any]) -> None:
        path = f"{self.collection}/{_segment(remote_id)}"
        response = self._send("PATCH", path, body, {})
        if not response.is_success:
            raise self._refuse("PATCH", path, response, gone_on_404=True)


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
