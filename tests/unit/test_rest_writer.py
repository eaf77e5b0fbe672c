"""The built-in `rest` writers over httpx.MockTransport, the writer registry and `verbs_of`.

Every httpx outcome must come out as one of our record faults (ADR-0029 §4); nothing here opens a
socket."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from typing import Any

import httpx
import pytest

from delivery.domain import Connection, ConnectionStatus, Forbidden, Verb
from delivery.errors import (
    RecordFault,
    RecordRejected,
    RemoteGone,
    RuleFault,
    TargetUnavailable,
    Unaddressable,
    Unauthorized,
    UnsendablePayload,
)
from delivery.writers import base, registry
from delivery.writers.base import Creates, Updates, Writer, token_for, verbs_of
from delivery.writers.registry import find_writer, register_writer, registered_drivers, reset_registry
from delivery.writers.rest import (
    BODY_EXCERPT,
    RestCreateOnlyWriter,
    RestUpdateOnlyWriter,
    RestWriter,
    retry_after_seconds,
)

TOKEN = "s3cr3t-crm-token-0123456789abcdef"
NOW = datetime(2026, 9, 10, 12, 0, 0, tzinfo=UTC)
Handler = Callable[[httpx.Request], httpx.Response]

CRM = Connection(
    id=1,
    name="crm",
    driver="rest",
    status=ConnectionStatus.ACTIVE,
    base_url="http://target.test/api",
    token_env="CRM_TOKEN",
    timeout_seconds=5,
    id_field="id",
)


@pytest.fixture(autouse=True)
def _token(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CRM_TOKEN", TOKEN)


@pytest.fixture(autouse=True)
def _frozen_clock(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("delivery.writers.rest.utcnow", lambda: NOW)


class Target:
    """A scripted target: records every request and answers with the handler given."""

    def __init__(self) -> None:
        self.requests: list[httpx.Request] = []
        self.writers: list[Writer] = []

    def writer(
        self,
        handler: Handler,
        cls: type[RestWriter] | type[RestCreateOnlyWriter] | type[RestUpdateOnlyWriter] = RestWriter,
        connection: Connection = CRM,
        collection: str = "contacts",
    ) -> Any:
        def recording(request: httpx.Request) -> httpx.Response:
            request.read()
            self.requests.append(request)
            return handler(request)

        writer = cls(connection, collection, transport=httpx.MockTransport(recording))
        self.writers.append(writer)
        return writer

    @property
    def only(self) -> httpx.Request:
        (request,) = self.requests
        return request


@pytest.fixture
def target() -> Iterator[Target]:
    scripted = Target()
    yield scripted
    for writer in scripted.writers:
        writer.close()


def answer(status: int, body: Any = None, *, text: str | None = None, headers: dict[str, str] | None = None) -> Handler:
    def handler(_request: httpx.Request) -> httpx.Response:
        if text is not None:
            return httpx.Response(status, text=text, headers=headers)
        if body is None:
            return httpx.Response(status, headers=headers)
        return httpx.Response(status, json=body, headers=headers)

    return handler


def raising(exc_type: type[httpx.TransportError], message: str = "boom") -> Handler:
    def handler(request: httpx.Request) -> httpx.Response:
        raise exc_type(message, request=request)

    return handler


# --- create ------------------------------------------------------------------------------------


def test_create_posts_json_to_the_collection(target: Target) -> None:
    writer = target.writer(answer(201, {"id": "r-1", "email": "a@x.io"}))
    assert writer.create({"email": "a@x.io", "n": 1}, "key-1") == "r-1"
    request = target.only
    assert request.method == "POST"
    assert str(request.url) == "http://target.test/api/contacts"
    assert request.headers["Content-Type"] == "application/json"
    assert json.loads(request.content) == {"email": "a@x.io", "n": 1}


def test_create_sends_idempotency_key_and_bearer_token(target: Target) -> None:
    target.writer(answer(201, {"id": "r-1"})).create({}, "abc123")
    headers = target.only.headers
    assert headers["Idempotency-Key"] == "abc123"
    assert headers["Authorization"] == f"Bearer {TOKEN}"
    assert headers["Accept"] == "application/json"
    assert headers["User-Agent"] == "delivery-engine"


def test_each_create_sends_its_own_idempotency_key(target: Target) -> None:
    writer = target.writer(answer(201, {"id": "r-1"}))
    writer.create({}, "k1")
    writer.create({}, "k2")
    assert [r.headers["Idempotency-Key"] for r in target.requests] == ["k1", "k2"]


def test_create_with_base_url_trailing_slash(target: Target) -> None:
    connection = Connection(
        id=1, name="crm", driver="rest", status=ConnectionStatus.ACTIVE, base_url="http://target.test/api/"
    )
    target.writer(answer(201, {"id": 1}), connection=connection).create({}, "k")
    assert str(target.only.url) == "http://target.test/api/contacts"


def test_create_into_a_nested_collection(target: Target) -> None:
    target.writer(answer(201, {"id": 1}), collection="v2/contacts").create({}, "k")
    assert str(target.only.url) == "http://target.test/api/v2/contacts"


@pytest.mark.parametrize("status", [200, 201, 202])
def test_create_accepts_any_2xx(target: Target, status: int) -> None:
    assert target.writer(answer(status, {"id": "r-9"})).create({}, "k") == "r-9"


@pytest.mark.parametrize(("remote_id", "expected"), [(42, "42"), (0, "0"), ("r-1", "r-1"), ("0", "0")])
def test_create_returns_the_id_as_str(target: Target, remote_id: Any, expected: str) -> None:
    result = target.writer(answer(201, {"id": remote_id})).create({}, "k")
    assert result == expected
    assert isinstance(result, str)


def test_create_reads_a_custom_id_field(target: Target) -> None:
    connection = Connection(
        id=1,
        name="crm",
        driver="rest",
        status=ConnectionStatus.ACTIVE,
        base_url="http://target.test/api",
        id_field="uuid",
    )
    writer = target.writer(answer(201, {"id": 7, "uuid": "0b8f"}), connection=connection)
    assert writer.create({}, "k") == "0b8f"


def test_create_custom_id_field_missing_is_unaddressable(target: Target) -> None:
    connection = Connection(
        id=1,
        name="crm",
        driver="rest",
        status=ConnectionStatus.ACTIVE,
        base_url="http://target.test/api",
        id_field="uuid",
    )
    with pytest.raises(Unaddressable, match="'uuid'"):
        target.writer(answer(201, {"id": 7}), connection=connection).create({}, "k")


@pytest.mark.parametrize(
    "body",
    [{}, {"id": None}, {"id": ""}, {"id": True}, {"id": False}, {"id": {}}, {"id": {"v": 1}}, {"id": [1]}, {"ID": 1}],
    ids=["no-id", "null", "empty", "true", "false", "empty-object", "object", "list", "wrong-case"],
)
def test_create_2xx_without_usable_id_is_unaddressable(target: Target, body: dict[str, Any]) -> None:
    with pytest.raises(Unaddressable) as caught:
        target.writer(answer(201, body)).create({}, "k")
    assert "POST contacts: HTTP 201 answer has no usable 'id'" in str(caught.value)


@pytest.mark.parametrize("answer_body", [[{"id": "r-1"}], ["r-1"], "r-1", 17, None], ids=str)
def test_create_2xx_json_that_is_not_an_object_is_unaddressable(target: Target, answer_body: Any) -> None:
    handler = answer(201, text=json.dumps(answer_body))
    with pytest.raises(Unaddressable, match="no usable 'id'"):
        target.writer(handler).create({}, "k")


@pytest.mark.parametrize("text", ["created", "<html>ok</html>", "{not json", ""])
def test_create_2xx_non_json_is_unaddressable(target: Target, text: str) -> None:
    with pytest.raises(Unaddressable, match=r"^POST contacts: HTTP 201 answer is not JSON$"):
        target.writer(answer(201, text=text)).create({}, "k")


def test_create_204_no_content_is_unaddressable(target: Target) -> None:
    with pytest.raises(Unaddressable):
        target.writer(answer(204)).create({}, "k")


def test_unaddressable_message_carries_a_body_excerpt(target: Target) -> None:
    body = {"ok": True, "note": "x" * 1000}
    with pytest.raises(Unaddressable) as caught:
        target.writer(answer(201, body)).create({}, "k")
    message = str(caught.value)
    assert message.endswith(json.dumps(body, separators=(",", ":"))[:BODY_EXCERPT])
    assert "x" * (BODY_EXCERPT + 1) not in message


@pytest.mark.parametrize("status", [500, 502, 503, 504, 599])
def test_create_5xx_is_target_unavailable(target: Target, status: int) -> None:
    with pytest.raises(TargetUnavailable) as caught:
        target.writer(answer(status, text="down")).create({}, "k")
    assert str(caught.value) == f"POST contacts: HTTP {status}: down"
    assert caught.value.retry_after_seconds is None


def test_create_503_with_retry_after(target: Target) -> None:
    with pytest.raises(TargetUnavailable) as caught:
        target.writer(answer(503, text="", headers={"Retry-After": "120"})).create({}, "k")
    assert caught.value.retry_after_seconds == 120.0


def test_create_429_with_retry_after_seconds(target: Target) -> None:
    with pytest.raises(TargetUnavailable) as caught:
        target.writer(answer(429, {"error": "slow down"}, headers={"Retry-After": "30"})).create({}, "k")
    assert caught.value.retry_after_seconds == 30.0
    assert "HTTP 429" in str(caught.value)


def test_create_429_with_retry_after_http_date(target: Target) -> None:
    headers = {"Retry-After": "Thu, 10 Sep 2026 12:05:00 GMT"}  # NOW + 300 s
    with pytest.raises(TargetUnavailable) as caught:
        target.writer(answer(429, text="", headers=headers)).create({}, "k")
    assert caught.value.retry_after_seconds == 300.0


def test_create_429_with_asctime_retry_after_is_still_target_unavailable(target: Target) -> None:
    headers = {"Retry-After": "Thu Sep 10 12:05:00 2026"}
    with pytest.raises(TargetUnavailable) as caught:
        target.writer(answer(429, text="", headers=headers)).create({}, "k")
    assert caught.value.retry_after_seconds == 300.0


def test_create_429_without_retry_after(target: Target) -> None:
    with pytest.raises(TargetUnavailable) as caught:
        target.writer(answer(429, text="")).create({}, "k")
    assert caught.value.retry_after_seconds is None


def test_create_429_with_garbage_retry_after(target: Target) -> None:
    with pytest.raises(TargetUnavailable) as caught:
        target.writer(answer(429, text="", headers={"Retry-After": "soon"})).create({}, "k")
    assert caught.value.retry_after_seconds is None


@pytest.mark.parametrize("status", [400, 405, 409, 413, 422])
def test_create_4xx_is_record_rejected(target: Target, status: int) -> None:
    with pytest.raises(RecordRejected) as caught:
        target.writer(answer(status, {"error": "email is invalid"})).create({}, "k")
    message = str(caught.value)
    assert message.startswith(f"POST contacts: HTTP {status}: ")
    assert "email is invalid" in message


@pytest.mark.parametrize("status", [404, 410])
def test_create_404_or_410_is_rejected_not_gone(target: Target, status: int) -> None:
    with pytest.raises(RecordRejected) as caught:
        target.writer(answer(status, text="no such collection")).create({}, "k")
    assert not isinstance(caught.value, RemoteGone)
    assert str(caught.value) == f"POST contacts: HTTP {status}: no such collection"


def test_rejection_body_excerpt_is_at_most_200_chars(target: Target) -> None:
    body = "".join(chr(ord("a") + i % 26) for i in range(1000))
    with pytest.raises(RecordRejected) as caught:
        target.writer(answer(422, text=body)).create({}, "k")
    assert BODY_EXCERPT == 200
    assert str(caught.value) == f"POST contacts: HTTP 422: {body[:200]}"


def test_rejection_with_empty_body(target: Target) -> None:
    with pytest.raises(RecordRejected, match=r"^POST contacts: HTTP 400: $"):
        target.writer(answer(400, text="")).create({}, "k")


def test_record_faults_are_record_faults() -> None:
    for cls in (TargetUnavailable, RecordRejected, RemoteGone, Unaddressable, UnsendablePayload):
        assert issubclass(cls, RecordFault)
    # The engine keeps it out of the breaker: the target never saw the record.
    assert not issubclass(UnsendablePayload, TargetUnavailable)


# --- update ------------------------------------------------------------------------------------


def test_update_patches_the_record(target: Target) -> None:
    writer = target.writer(answer(200, {"id": "r-1"}))
    assert writer.update("r-1", {"email": "b@x.io"}) is None
    request = target.only
    assert request.method == "PATCH"
    assert str(request.url) == "http://target.test/api/contacts/r-1"
    assert json.loads(request.content) == {"email": "b@x.io"}
    assert request.headers["Authorization"] == f"Bearer {TOKEN}"
    assert request.headers["Content-Type"] == "application/json"
    assert "Idempotency-Key" not in request.headers


@pytest.mark.parametrize("status", [200, 202, 204])
def test_update_accepts_any_2xx_whatever_the_body(target: Target, status: int) -> None:
    target.writer(answer(status, text="" if status == 204 else "fine")).update("r-1", {})


@pytest.mark.parametrize(
    ("remote_id", "raw_path"),
    [
        ("a/b", b"/api/contacts/a%2Fb"),
        ("a b", b"/api/contacts/a%20b"),
        ("?x", b"/api/contacts/%3Fx"),
        ("#y", b"/api/contacts/%23y"),
        ("50%", b"/api/contacts/50%25"),
        ("caf\u00e9", b"/api/contacts/caf%C3%A9"),
        ("42", b"/api/contacts/42"),
    ],
)
def test_update_url_quotes_the_remote_id(target: Target, remote_id: str, raw_path: bytes) -> None:
    target.writer(answer(204)).update(remote_id, {})
    assert target.only.url.raw_path == raw_path


@pytest.mark.parametrize(("remote_id", "raw_path"), [("..", b"/api/contacts/%2E%2E"), (".", b"/api/contacts/%2E")])
def test_update_dot_segment_remote_id_stays_in_the_collection(target: Target, remote_id: str, raw_path: bytes) -> None:
    target.writer(answer(204)).update(remote_id, {})
    assert target.only.url.raw_path == raw_path


@pytest.mark.parametrize("status", [404, 410])
def test_update_404_or_410_is_remote_gone(target: Target, status: int) -> None:
    with pytest.raises(RemoteGone) as caught:
        target.writer(answer(status, text="gone")).update("r-1", {})
    assert str(caught.value) == f"PATCH contacts/r-1: HTTP {status}: gone"


@pytest.mark.parametrize("status", [400, 409, 422])
def test_update_other_4xx_is_rejected(target: Target, status: int) -> None:
    with pytest.raises(RecordRejected) as caught:
        target.writer(answer(status, text="bad field")).update("r-1", {})
    assert not isinstance(caught.value, RemoteGone)
    assert str(caught.value) == f"PATCH contacts/r-1: HTTP {status}: bad field"


@pytest.mark.parametrize("status", [500, 503])
def test_update_5xx_is_target_unavailable(target: Target, status: int) -> None:
    with pytest.raises(TargetUnavailable):
        target.writer(answer(status, text="")).update("r-1", {})


def test_update_429_with_retry_after(target: Target) -> None:
    with pytest.raises(TargetUnavailable) as caught:
        target.writer(answer(429, text="", headers={"Retry-After": "45"})).update("r-1", {})
    assert caught.value.retry_after_seconds == 45.0


# --- bodies JSON cannot carry ------------------------------------------------------------------

NOT_JSON_COMPLIANT = "body cannot be encoded as JSON: Out of range float values are not JSON compliant"


@pytest.mark.parametrize(
    "body",
    [
        {"score": float("nan")},
        {"score": float("inf")},
        {"score": float("-inf")},
        {"address": {"lat": float("nan")}},
        {"scores": [1.0, float("inf")]},
    ],
    ids=["nan", "infinity", "minus-infinity", "nested", "in-a-list"],
)
def test_create_of_a_non_finite_number_is_unsendable_and_sends_nothing(target: Target, body: dict[str, Any]) -> None:
    with pytest.raises(UnsendablePayload) as caught:
        target.writer(answer(201, {"id": "r-1"})).create(body, "k")
    assert str(caught.value) == f"POST contacts: {NOT_JSON_COMPLIANT}"
    assert target.requests == []


def test_update_of_a_non_finite_number_is_unsendable_and_sends_nothing(target: Target) -> None:
    with pytest.raises(UnsendablePayload) as caught:
        target.writer(answer(200, {"id": "r-1"})).update("r-1", {"score": float("nan")})
    assert str(caught.value) == f"PATCH contacts/r-1: {NOT_JSON_COMPLIANT}"
    assert target.requests == []


def test_a_lone_surrogate_is_unsendable(target: Target) -> None:
    # json.loads accepts "\ud800", so a mirror payload can hold one; UTF-8 cannot carry it.
    with pytest.raises(UnsendablePayload, match=r"^POST contacts: body cannot be encoded as JSON: .*surrogates"):
        target.writer(answer(201, {"id": "r-1"})).create({"name": "\ud800"}, "k")
    assert target.requests == []


@pytest.mark.parametrize(
    "value", [datetime(2026, 1, 1, tzinfo=UTC), {1, 2}, object()], ids=["datetime", "set", "object"]
)
def test_a_value_of_no_json_type_is_unsendable(target: Target, value: Any) -> None:
    with pytest.raises(
        UnsendablePayload, match=r"^POST contacts: body cannot be encoded as JSON: .*not JSON serializable"
    ):
        target.writer(answer(201, {"id": "r-1"})).create({"v": value}, "k")
    assert target.requests == []


def test_the_writer_stays_usable_after_an_unsendable_body(target: Target) -> None:
    writer = target.writer(answer(201, {"id": "r-2"}))
    with pytest.raises(UnsendablePayload):
        writer.create({"n": float("nan")}, "k1")
    assert writer.create({"n": 1.5}, "k2") == "r-2"
    assert [json.loads(r.content) for r in target.requests] == [{"n": 1.5}]


def test_the_body_is_compact_utf8_json_as_httpx_would_send_it(target: Target) -> None:
    target.writer(answer(201, {"id": 1})).create({"name": "Zo\u00eb", "n": 1, "x": None}, "k")
    request = target.only
    assert request.content == '{"name":"Zo\u00eb","n":1,"x":null}'.encode()
    assert request.headers["Content-Type"] == "application/json"
    assert request.headers["Content-Length"] == str(len(request.content))


def test_finite_floats_and_big_ints_are_sent(target: Target) -> None:
    body = {"f": 1e308, "tiny": 5e-324, "big": 10**30, "neg": -0.0}
    target.writer(answer(201, {"id": 1})).create(body, "k")
    assert json.loads(target.only.content) == body


# --- answers whose body cannot be decoded --------------------------------------------------------


def broken_gzip(status: int, headers: dict[str, str] | None = None) -> Handler:
    """A body that claims gzip and is not. Passed as a stream so httpx decodes it the way it does
    a network answer (while the client reads it), not while the mock builds the response."""

    def handler(_request: httpx.Request) -> httpx.Response:
        all_headers = {"Content-Encoding": "gzip", "Content-Type": "application/json", **(headers or {})}
        return httpx.Response(status, headers=all_headers, stream=httpx.ByteStream(b"not gzip at all"))

    return handler


def test_broken_gzip_raises_decoding_error_in_plain_httpx() -> None:
    # The premise: httpx raises DecodingError from request(), when it reads the body.
    with (
        httpx.Client(transport=httpx.MockTransport(broken_gzip(201))) as client,
        pytest.raises(httpx.DecodingError),
    ):
        client.post("http://target.test/api/contacts", json={})


@pytest.mark.parametrize("status", [200, 201])
def test_create_2xx_with_an_undecodable_body_is_unaddressable(target: Target, status: int) -> None:
    with pytest.raises(Unaddressable) as caught:
        target.writer(broken_gzip(status)).create({}, "k")
    message = str(caught.value)
    assert message.startswith(f"POST contacts: HTTP {status} answer body cannot be decoded: ")
    assert "incorrect header check" in message
    assert len(target.requests) == 1


@pytest.mark.parametrize("status", [200, 202, 204])
def test_update_2xx_with_an_undecodable_body_is_a_success(target: Target, status: int) -> None:
    assert target.writer(broken_gzip(status)).update("r-1", {"a": 1}) is None
    assert target.only.method == "PATCH"


def test_create_503_with_an_undecodable_body_is_unavailable_with_a_placeholder(target: Target) -> None:
    with pytest.raises(TargetUnavailable) as caught:
        target.writer(broken_gzip(503, {"Retry-After": "60"})).create({}, "k")
    message = str(caught.value)
    assert message.startswith("POST contacts: HTTP 503: <answer body not decodable: ")
    assert "incorrect header check" in message
    assert caught.value.retry_after_seconds == 60.0


@pytest.mark.parametrize("status", [400, 422, 404])
def test_create_4xx_with_an_undecodable_body_is_rejected_with_a_placeholder(target: Target, status: int) -> None:
    with pytest.raises(RecordRejected) as caught:
        target.writer(broken_gzip(status)).create({}, "k")
    assert str(caught.value).startswith(f"POST contacts: HTTP {status}: <answer body not decodable: ")


@pytest.mark.parametrize(("status", "fault"), [(404, RemoteGone), (410, RemoteGone), (429, TargetUnavailable)])
def test_update_refusal_with_an_undecodable_body_keeps_its_status_meaning(
    target: Target, status: int, fault: type[RecordFault]
) -> None:
    with pytest.raises(fault) as caught:
        target.writer(broken_gzip(status)).update("r-1", {})
    assert str(caught.value).startswith(f"PATCH contacts/r-1: HTTP {status}: <answer body not decodable: ")


class _FailingStream(httpx.SyncByteStream):
    """An answer whose body breaks off after the status line and headers arrived."""

    def __init__(self, exc_type: type[httpx.TransportError]) -> None:
        self.exc_type = exc_type

    def __iter__(self) -> Iterator[bytes]:
        yield b'{"id": '
        raise self.exc_type("body cut off")


@pytest.mark.parametrize(
    ("exc_type", "expected"),
    [
        (httpx.ReadTimeout, "POST contacts: timed out (ReadTimeout)"),
        (httpx.ReadError, "POST contacts: connection error: body cut off"),
    ],
)
def test_a_body_cut_off_while_reading_is_target_unavailable(
    target: Target, exc_type: type[httpx.TransportError], expected: str
) -> None:
    def handler(_request: httpx.Request) -> httpx.Response:
        return httpx.Response(201, stream=_FailingStream(exc_type))

    with pytest.raises(TargetUnavailable) as caught:
        target.writer(handler).create({}, "k")
    assert str(caught.value) == expected


# --- transport failures ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "exc_type", [httpx.ReadTimeout, httpx.ConnectTimeout, httpx.WriteTimeout, httpx.PoolTimeout], ids=str
)
def test_create_timeout_is_target_unavailable(target: Target, exc_type: type[httpx.TransportError]) -> None:
    with pytest.raises(TargetUnavailable) as caught:
        target.writer(raising(exc_type)).create({}, "k")
    assert str(caught.value) == f"POST contacts: timed out ({exc_type.__name__})"
    assert caught.value.retry_after_seconds is None
    assert isinstance(caught.value.__cause__, exc_type)


def test_update_timeout_is_target_unavailable(target: Target) -> None:
    with pytest.raises(TargetUnavailable, match=r"^PATCH contacts/r-1: timed out \(ReadTimeout\)$"):
        target.writer(raising(httpx.ReadTimeout)).update("r-1", {})


@pytest.mark.parametrize(
    "exc_type", [httpx.ConnectError, httpx.ReadError, httpx.RemoteProtocolError, httpx.WriteError], ids=str
)
def test_connection_errors_are_target_unavailable(target: Target, exc_type: type[httpx.TransportError]) -> None:
    with pytest.raises(TargetUnavailable) as caught:
        target.writer(raising(exc_type, "connection refused")).create({}, "k")
    assert str(caught.value) == "POST contacts: connection error: connection refused"
    assert isinstance(caught.value.__cause__, exc_type)


def test_update_connection_error_is_target_unavailable(target: Target) -> None:
    with pytest.raises(TargetUnavailable, match=r"^PATCH contacts/r-1: connection error: refused$"):
        target.writer(raising(httpx.ConnectError, "refused")).update("r-1", {})


def test_timeout_setting_reaches_the_request(target: Target) -> None:
    target.writer(answer(201, {"id": 1})).create({}, "k")
    assert target.only.extensions["timeout"] == {"connect": 5, "read": 5, "write": 5, "pool": 5}


# --- the token never leaks ---------------------------------------------------------------------


def test_rejection_echoing_the_token_is_redacted(target: Target) -> None:
    body = f"bad header: Authorization: Bearer {TOKEN}"
    with pytest.raises(RecordRejected) as caught:
        target.writer(answer(422, text=body)).create({}, "k")
    message = str(caught.value)
    assert TOKEN not in message
    assert message == "POST contacts: HTTP 422: bad header: Authorization: Bearer ***"


# --- credentials refused: a fault of the rule ---------------------------------------------------


@pytest.mark.parametrize("status", [401, 403])
@pytest.mark.parametrize("verb", ["create", "update"])
def test_credentials_refused_is_unauthorized(target: Target, status: int, verb: str) -> None:
    writer = target.writer(answer(status, text=f"token {TOKEN} is not valid"))
    with pytest.raises(Unauthorized) as caught:
        writer.create({}, "k") if verb == "create" else writer.update("r-1", {})
    message = str(caught.value)
    assert isinstance(caught.value, RuleFault)
    assert TOKEN not in message  # the answer's body is not repeated at all
    assert f"HTTP {status}" in message and "'crm'" in message and "$CRM_TOKEN" in message


def test_unauthorized_names_a_secret_block_as_the_source(target: Target) -> None:
    connection = dataclasses.replace(CRM, token_env=None, token_secret="crm-token")
    with pytest.raises(Unauthorized) as caught:
        target.writer(answer(401), connection=connection).create({}, "k")
    assert "the Prefect Secret block 'crm-token'" in str(caught.value)
    assert str(caught.value.for_rule("contacts")).startswith("rule 'contacts': target 'crm' refused")


def test_403_is_a_record_refusal_where_the_connection_says_so(target: Target) -> None:
    connection = dataclasses.replace(CRM, forbidden=Forbidden.RECORD)
    with pytest.raises(RecordRejected) as caught:
        target.writer(answer(403, text="not your record"), connection=connection).update("r-1", {})
    assert str(caught.value) == "PATCH contacts/r-1: HTTP 403: not your record"
    with pytest.raises(Unauthorized):  # a 401 still says the token is wrong
        target.writer(answer(401), connection=connection).update("r-1", {})


# --- whether a failed write may have been applied -----------------------------------------------


@pytest.mark.parametrize(
    ("status", "unknown"), [(429, False), (500, True), (501, False), (502, True), (503, False), (504, True)]
)
def test_an_answer_says_whether_the_write_may_have_been_applied(target: Target, status: int, unknown: bool) -> None:
    with pytest.raises(TargetUnavailable) as caught:
        target.writer(answer(status, text="")).update("r-1", {})
    assert caught.value.outcome_unknown is unknown


@pytest.mark.parametrize(
    ("exc_type", "unknown"),
    [
        (httpx.ConnectError, False),
        (httpx.ConnectTimeout, False),
        (httpx.PoolTimeout, False),
        (httpx.ReadTimeout, True),
        (httpx.WriteTimeout, True),
        (httpx.ReadError, True),
        (httpx.WriteError, True),
        (httpx.RemoteProtocolError, True),
    ],
)
def test_a_transport_failure_says_whether_the_request_went_out(
    target: Target, exc_type: type[httpx.TransportError], unknown: bool
) -> None:
    with pytest.raises(TargetUnavailable) as caught:
        target.writer(raising(exc_type)).update("r-1", {})
    assert caught.value.outcome_unknown is unknown


def test_gone_echoing_the_token_is_redacted(target: Target) -> None:
    with pytest.raises(RemoteGone) as caught:
        target.writer(answer(404, text=f"{TOKEN} not found")).update("r-1", {})
    assert str(caught.value) == "PATCH contacts/r-1: HTTP 404: *** not found"


def test_unavailable_echoing_the_token_is_redacted(target: Target) -> None:
    with pytest.raises(TargetUnavailable) as caught:
        target.writer(answer(503, text=f"[{TOKEN}]")).create({}, "k")
    assert TOKEN not in str(caught.value)
    assert "[***]" in str(caught.value)


def test_unaddressable_echoing_the_token_is_redacted(target: Target) -> None:
    with pytest.raises(Unaddressable) as caught:
        target.writer(answer(201, {"token": TOKEN})).create({}, "k")
    assert TOKEN not in str(caught.value)
    assert "***" in str(caught.value)


def test_connection_error_echoing_the_token_is_redacted(target: Target) -> None:
    with pytest.raises(TargetUnavailable) as caught:
        target.writer(raising(httpx.ConnectError, f"proxy said {TOKEN}")).create({}, "k")
    assert str(caught.value) == "POST contacts: connection error: proxy said ***"


def test_token_cut_by_the_excerpt_does_not_leak_a_prefix(target: Target) -> None:
    body = "x" * (BODY_EXCERPT - 10) + TOKEN
    with pytest.raises(RecordRejected) as caught:
        target.writer(answer(422, text=body)).create({}, "k")
    assert TOKEN[:10] not in str(caught.value)


@pytest.mark.parametrize("token", ["Sekr3t/Tok+en==", 'Qu0te"Back\\slash/Pl+us'], ids=["slashed", "quoted"])
def test_a_token_echoed_json_escaped_is_redacted(target: Target, monkeypatch: pytest.MonkeyPatch, token: str) -> None:
    # PHP's json_encode writes `/` as `\/`; every JSON encoder escapes `"` and `\`.
    monkeypatch.setenv("CRM_TOKEN", token)
    php = json.dumps({"auth": f"Bearer {token}"}).replace("/", "\\/")
    with pytest.raises(RecordRejected) as caught:
        target.writer(answer(422, text=php)).create({}, "k")
    assert str(caught.value) == 'POST contacts: HTTP 422: {"auth": "Bearer ***"}'
    with pytest.raises(RecordRejected) as caught:
        target.writer(answer(422, {"auth": f"Bearer {token}"})).create({}, "k")
    assert str(caught.value) == 'POST contacts: HTTP 422: {"auth":"Bearer ***"}'


def test_a_json_escaped_token_cut_by_the_excerpt_does_not_leak_a_prefix(
    target: Target, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CRM_TOKEN", "Sekr3t/Tok+en==")
    body = "x" * (BODY_EXCERPT - 10) + "Sekr3t\\/Tok+en=="
    with pytest.raises(RecordRejected) as caught:
        target.writer(answer(422, text=body)).create({}, "k")
    assert "Sekr3t" not in str(caught.value)
    assert str(caught.value).endswith("x***")


def test_no_authorization_header_without_a_token(target: Target, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CRM_TOKEN")
    target.writer(answer(201, {"id": 1})).create({}, "k")
    assert "Authorization" not in target.only.headers


def test_no_authorization_header_for_an_empty_token(target: Target, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CRM_TOKEN", "")
    target.writer(answer(201, {"id": 1})).create({}, "k")
    assert "Authorization" not in target.only.headers


def test_no_authorization_header_without_token_env(target: Target) -> None:
    connection = Connection(
        id=1, name="crm", driver="rest", status=ConnectionStatus.ACTIVE, base_url="http://target.test/api"
    )
    target.writer(answer(201, {"id": 1}), connection=connection).create({}, "k")
    assert "Authorization" not in target.only.headers


def test_token_for_reads_the_environment_at_call_time(monkeypatch: pytest.MonkeyPatch) -> None:
    assert token_for(CRM) == TOKEN
    monkeypatch.setenv("CRM_TOKEN", "other")
    assert token_for(CRM) == "other"
    monkeypatch.delenv("CRM_TOKEN")
    assert token_for(CRM) is None


# --- the variants and their construction ---------------------------------------------------------


@pytest.mark.parametrize("cls", [RestWriter, RestCreateOnlyWriter, RestUpdateOnlyWriter])
def test_writer_needs_a_base_url(cls: type[Writer]) -> None:
    connection = Connection(id=1, name="crm", driver="rest", status=ConnectionStatus.ACTIVE)
    with pytest.raises(ValueError, match="connection 'crm' has no base_url"):
        cls(connection, "contacts")
    assert cls.needs_base_url is True


def test_writer_is_a_context_manager_that_closes_its_client(target: Target) -> None:
    writer = target.writer(answer(201, {"id": 1}))
    with writer as entered:
        assert entered is writer
        entered.create({}, "k")
    with pytest.raises(RuntimeError):
        writer.create({}, "k")


def test_create_only_writer_creates(target: Target) -> None:
    assert target.writer(answer(201, {"id": 3}), cls=RestCreateOnlyWriter).create({}, "k") == "3"
    assert target.only.method == "POST"


def test_update_only_writer_updates(target: Target) -> None:
    target.writer(answer(204), cls=RestUpdateOnlyWriter).update("r-3", {"a": 1})
    assert target.only.method == "PATCH"


def test_single_verb_writers_do_not_offer_the_other_verb() -> None:
    assert not hasattr(RestCreateOnlyWriter, "update")
    assert not hasattr(RestUpdateOnlyWriter, "create")


def test_writer_keeps_target_and_collection(target: Target) -> None:
    writer = target.writer(answer(204), collection="deals")
    assert writer.target is CRM
    assert writer.collection == "deals"


# --- retry_after_seconds -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (None, None),
        ("", None),
        ("120", 120.0),
        ("0", 0.0),
        (" 7 ", 7.0),
        ("1.5", 1.5),
        ("-5", 0.0),
        ("soon", None),
        ("Thu, 10 Sep 2026 12:05:00 GMT", 300.0),
        ("Thu, 10 Sep 2026 13:00:00 +0000", 3600.0),
        ("Thursday, 10-Sep-26 12:01:00 GMT", 60.0),
        ("Thu, 10 Sep 2026 11:00:00 GMT", 0.0),
        ("Mon, 01 Jan 1990 00:00:00 GMT", 0.0),
    ],
)
def test_retry_after_seconds(value: str | None, expected: float | None) -> None:
    assert retry_after_seconds(value) == expected


def test_retry_after_seconds_asctime_date() -> None:
    # RFC 9110 §5.6.7: recipients must accept the asctime form, which is in GMT.
    assert retry_after_seconds("Thu Sep 10 12:02:00 2026") == 120.0


def test_retry_after_seconds_nan_is_not_a_delay() -> None:
    assert retry_after_seconds("nan") is None


# --- verbs_of and the registry -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("cls", "verbs"),
    [
        (RestWriter, {Verb.CREATE, Verb.UPDATE, Verb.DELETE}),
        (RestCreateOnlyWriter, {Verb.CREATE}),
        (RestUpdateOnlyWriter, {Verb.UPDATE}),
    ],
)
def test_verbs_of_rest_writers(cls: type[Writer], verbs: set[Verb]) -> None:
    assert verbs_of(cls) == frozenset(verbs)


def test_verbs_follow_the_capability_types() -> None:
    assert issubclass(RestWriter, Creates) and issubclass(RestWriter, Updates)
    assert issubclass(RestCreateOnlyWriter, Creates) and not issubclass(RestCreateOnlyWriter, Updates)
    assert issubclass(RestUpdateOnlyWriter, Updates) and not issubclass(RestUpdateOnlyWriter, Creates)


class NoVerbWriter(Writer):
    pass


class FakeCreator(Writer, Creates):
    def create(self, body: Any, idempotency_key: str) -> str:
        return "fake"


def test_verbs_of_a_writer_without_verbs() -> None:
    assert verbs_of(NoVerbWriter) == frozenset()
    assert verbs_of(Writer) == frozenset()


def test_verbs_of_a_third_party_writer() -> None:
    assert verbs_of(FakeCreator) == frozenset({Verb.CREATE})
    assert FakeCreator.needs_base_url is False


def test_base_writer_close_is_a_no_op() -> None:
    with NoVerbWriter(CRM, "contacts") as writer:
        assert writer.collection == "contacts"
    writer.close()


@pytest.fixture
def fresh_registry() -> Iterator[None]:
    reset_registry()
    yield
    reset_registry()


@pytest.mark.usefixtures("fresh_registry")
@pytest.mark.parametrize(
    ("driver", "cls"),
    [("rest", RestWriter), ("rest-create-only", RestCreateOnlyWriter), ("rest-update-only", RestUpdateOnlyWriter)],
)
def test_find_writer_builtins(driver: str, cls: type[Writer]) -> None:
    assert find_writer(driver) is cls


@pytest.mark.usefixtures("fresh_registry")
@pytest.mark.parametrize("driver", [None, "", "soap", "REST", "rest "])
def test_find_writer_unknown_is_none(driver: str | None) -> None:
    assert find_writer(driver) is None


@pytest.mark.usefixtures("fresh_registry")
def test_registered_drivers_sorted() -> None:
    assert registered_drivers() == ["rest", "rest-create-only", "rest-update-only"]


@pytest.mark.usefixtures("fresh_registry")
def test_register_writer_and_reset_registry() -> None:
    register_writer("fake", FakeCreator)
    assert find_writer("fake") is FakeCreator
    assert "fake" in registered_drivers()
    reset_registry()
    assert find_writer("fake") is None
    assert find_writer("rest") is RestWriter


@pytest.mark.usefixtures("fresh_registry")
def test_register_writer_can_replace_a_builtin() -> None:
    register_writer("rest", FakeCreator)
    assert find_writer("rest") is FakeCreator
    reset_registry()
    assert find_writer("rest") is RestWriter


class _EntryPoint:
    def __init__(self, name: str, loaded: object) -> None:
        self.name = name
        self._loaded = loaded

    def load(self) -> object:
        return self._loaded


@pytest.mark.usefixtures("fresh_registry")
def test_entry_points_add_writers_but_never_replace_builtins(monkeypatch: pytest.MonkeyPatch) -> None:
    found = [
        _EntryPoint("fake", FakeCreator),
        _EntryPoint("rest", FakeCreator),
        _EntryPoint("not-a-class", object()),
        _EntryPoint("not-a-writer", dict),
    ]
    groups: list[str] = []

    def fake_entry_points(*, group: str) -> list[_EntryPoint]:
        groups.append(group)
        return found

    monkeypatch.setattr(registry, "entry_points", fake_entry_points)
    assert find_writer("fake") is FakeCreator
    assert find_writer("rest") is RestWriter
    assert find_writer("not-a-class") is None
    assert find_writer("not-a-writer") is None
    assert groups == ["delivery.writers"]


@pytest.mark.usefixtures("fresh_registry")
def test_registry_is_cached_until_reset(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []

    def fake_entry_points(*, group: str) -> list[_EntryPoint]:
        calls.append(group)
        return []

    monkeypatch.setattr(registry, "entry_points", fake_entry_points)
    find_writer("rest")
    registered_drivers()
    assert len(calls) == 1
    reset_registry()
    find_writer("rest")
    assert len(calls) == 2


def test_base_module_exports() -> None:
    assert base.Writer is Writer


def test_writers_share_the_processs_tls_context(monkeypatch: pytest.MonkeyPatch) -> None:
    """A long-lived worker builds a writer per chain: the TLS settings (about 20 ms of CPU to
    build) are built once per process, not once per writer."""
    import ssl

    from delivery.writers.rest import tls_context

    tls_context()
    built: list[object] = []
    real = ssl.create_default_context

    def counting(*args: Any, **kwargs: Any) -> ssl.SSLContext:
        built.append(args)
        return real(*args, **kwargs)

    monkeypatch.setattr(ssl, "create_default_context", counting)
    for _ in range(3):
        RestWriter(CRM, "contacts").close()
    assert built == []
