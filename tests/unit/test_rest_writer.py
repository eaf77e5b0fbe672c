"""The built-in `rest` writers over httpx.MockTransport, the writer registry and `verbs_of`.

Every httpx outcome must come out as one of our record faults (ADR-0029 §4); nothing here opens a
socket."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from typing import Any

import httpx
import pytest

from delivery.domain import Connection, ConnectionStatus, Verb
from delivery.errors import RecordFault, RecordRejected, RemoteGone, TargetUnavailable, Unaddressable
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


@pytest.mark.parametrize("status", [400, 401, 403, 405, 409, 413, 422])
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
    for cls in (TargetUnavailable, RecordRejected, RemoteGone, Unaddressable):
        assert issubclass(cls, RecordFault)


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
        target.writer(answer(401, text=body)).create({}, "k")
    message = str(caught.value)
    assert TOKEN not in message
    assert message == "POST contacts: HTTP 401: bad header: Authorization: Bearer ***"


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
        cls(connection, "contacts")  # type: ignore[call-arg]
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
        (RestWriter, {Verb.CREATE, Verb.UPDATE}),
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
