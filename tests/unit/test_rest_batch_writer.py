"""The `rest` writers' batch verbs over httpx.MockTransport: the wire format, and every kind of
answer (whole call and per item) mapped to one result per item or to the fault of the whole call.

Nothing here opens a socket; tests/integration/test_rest_batch_target.py runs the same verbs
against the real local target."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from typing import Any

import httpx
import pytest

from delivery.domain import BatchEndpoints, Connection, ConnectionStatus, Forbidden, Verb
from delivery.errors import (
    AnswerSaysNothing,
    RecordFault,
    RecordRejected,
    RemoteGone,
    TargetUnavailable,
    Unaddressable,
    Unauthorized,
    UnsendablePayload,
)
from delivery.writers import CreateItem, UpdateItem
from delivery.writers.base import (
    BatchRefused,
    Creates,
    CreatesMany,
    Updates,
    UpdatesMany,
    Writer,
    batch_verbs_of,
    single_verbs_of,
    verbs_of,
)
from delivery.writers.registry import find_writer, reset_registry, writer_for
from delivery.writers.rest import (
    BODY_EXCERPT,
    RestCreateOnlyWriter,
    RestUpdateOnlyWriter,
    RestWriter,
)

TOKEN = "s3cr3t-crm-token-0123456789abcdef"
NOW = datetime(2026, 9, 10, 12, 0, 0, tzinfo=UTC)
Handler = Callable[[httpx.Request], httpx.Response]

BATCH = BatchEndpoints(create_path="contacts/batch", update_path="contacts/batch-update", max_items=5)
CRM = Connection(
    id=1,
    name="crm",
    driver="rest",
    status=ConnectionStatus.ACTIVE,
    base_url="http://target.test/api",
    token_env="CRM_TOKEN",
    timeout_seconds=5,
    batch=BATCH,
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

    def writer(self, handler: Handler, connection: Connection = CRM, plain: type[Writer] = RestWriter) -> Any:
        def recording(request: httpx.Request) -> httpx.Response:
            request.read()
            self.requests.append(request)
            return handler(request)

        cls = plain.for_batch(connection.batch)
        writer = cls(connection, "contacts", transport=httpx.MockTransport(recording))  # type: ignore[call-arg]
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


def results(*items: dict[str, Any], status: int = 200, headers: dict[str, str] | None = None) -> Handler:
    return answer(status, {"results": list(items)}, headers=headers)


def raising(exc_type: type[httpx.TransportError], message: str = "boom") -> Handler:
    def handler(request: httpx.Request) -> httpx.Response:
        raise exc_type(message, request=request)

    return handler


def creates(count: int) -> list[CreateItem]:
    return [CreateItem({"email": f"{n}@x.io", "n": n}, f"key-{n}") for n in range(count)]


def updates(count: int) -> list[UpdateItem]:
    return [UpdateItem(f"r-{n}", {"n": n}) for n in range(count)]


def message(result: object) -> str:
    assert isinstance(result, RecordFault)
    return str(result)


# --- capabilities: which type offers what -------------------------------------------------------


@pytest.mark.parametrize(
    ("plain", "batch", "many"),
    [
        (RestWriter, BatchEndpoints("c/batch", "c/batch"), {Verb.CREATE, Verb.UPDATE}),
        (RestWriter, BatchEndpoints("c/batch", None), {Verb.CREATE}),
        (RestWriter, BatchEndpoints(None, "c/batch"), {Verb.UPDATE}),
        (RestWriter, None, set()),
        (RestCreateOnlyWriter, BatchEndpoints("c/batch", "c/batch"), {Verb.CREATE}),
        (RestUpdateOnlyWriter, BatchEndpoints("c/batch", "c/batch"), {Verb.UPDATE}),
        (RestCreateOnlyWriter, BatchEndpoints(None, "c/batch"), set()),
    ],
)
def test_for_batch_adds_the_batch_form_of_the_verbs_the_type_has(
    plain: type[Writer], batch: BatchEndpoints | None, many: set[Verb]
) -> None:
    batched = plain.for_batch(batch)
    assert batch_verbs_of(batched) == frozenset(many)
    assert single_verbs_of(batched) == single_verbs_of(plain)
    assert verbs_of(batched) == verbs_of(plain)  # the batch form never adds a verb to a rest type
    assert issubclass(batched, plain)
    assert (batched is plain) == (not many)


def test_the_batched_type_is_made_once_and_named_for_what_it_adds() -> None:
    both = RestWriter.for_batch(BatchEndpoints("a", "b"))
    assert both is RestWriter.for_batch(BatchEndpoints("x/batch", "y/batch", max_items=7))
    assert both.__name__ == "RestWriter+CreatesMany+UpdatesMany"
    assert issubclass(both, CreatesMany) and issubclass(both, UpdatesMany)
    assert issubclass(both, Creates) and issubclass(both, Updates)
    # Asked again of the batched type, for another connection: from the plain type, not stacked.
    assert both.for_batch(BatchEndpoints("a", None)) is RestWriter.for_batch(BatchEndpoints("a", None))
    assert both.for_batch(None) is RestWriter


def test_the_plain_types_offer_no_batch_verb() -> None:
    for plain in (RestWriter, RestCreateOnlyWriter, RestUpdateOnlyWriter):
        assert batch_verbs_of(plain) == frozenset()


def test_a_writer_is_refused_a_batch_verb_its_connection_names_no_path_for() -> None:
    both = RestWriter.for_batch(BatchEndpoints("a", "b"))
    without = dataclasses.replace(CRM, batch=BatchEndpoints("contacts/batch", None))
    with pytest.raises(ValueError, match=r"connection 'crm' has no batch.update_path; build its writer with for_batch"):
        both(without, "contacts")
    with pytest.raises(ValueError, match=r"has no batch.create_path"):
        both(dataclasses.replace(CRM, batch=None), "contacts")


def test_writer_for_equips_the_connection_with_its_batch_verbs() -> None:
    reset_registry()
    try:
        assert writer_for(CRM) is RestWriter.for_batch(BATCH)
        assert writer_for(dataclasses.replace(CRM, batch=None)) is RestWriter
        assert writer_for(dataclasses.replace(CRM, driver="rest-update-only")) is RestUpdateOnlyWriter.for_batch(BATCH)
        assert writer_for(dataclasses.replace(CRM, driver="soap")) is None
        assert writer_for(dataclasses.replace(CRM, driver=None)) is None
        assert find_writer("rest") is RestWriter  # the registered type is unchanged
    finally:
        reset_registry()


class OnlyManyWriter(Writer, CreatesMany, UpdatesMany):
    """A third-party writer offering its verbs only in batches."""

    def create_many(self, items: Any) -> list[Any]:
        return ["id" for _ in items]

    def update_many(self, items: Any) -> list[Any]:
        return [None for _ in items]


def test_a_writer_with_only_batch_verbs_still_offers_the_verbs() -> None:
    assert verbs_of(OnlyManyWriter) == frozenset({Verb.CREATE, Verb.UPDATE})
    assert batch_verbs_of(OnlyManyWriter) == frozenset({Verb.CREATE, Verb.UPDATE})
    assert single_verbs_of(OnlyManyWriter) == frozenset()
    assert OnlyManyWriter.for_batch(BATCH) is OnlyManyWriter


def test_max_items_comes_from_the_connection() -> None:
    assert OnlyManyWriter(CRM, "contacts").max_items == 5
    assert OnlyManyWriter(dataclasses.replace(CRM, batch=None), "contacts").max_items == 100


def test_batch_refused_as_the_fault_of_one_record() -> None:
    refused = BatchRefused("POST c/batch: HTTP 400: bad", 400, "bad")
    assert (refused.status_code, refused.excerpt, str(refused)) == (400, "bad", "POST c/batch: HTTP 400: bad")
    fault = refused.as_record_fault()
    assert isinstance(fault, RecordRejected)
    assert str(fault) == "POST c/batch: HTTP 400: bad"
    assert not isinstance(refused, RecordFault)


# --- the wire format --------------------------------------------------------------------------


def test_create_many_posts_the_items_with_their_keys(target: Target) -> None:
    writer = target.writer(results({"status": 201, "id": "r-1"}, {"status": 200, "id": 7}))
    assert writer.max_items == 5
    assert writer.create_many(creates(2)) == ["r-1", "7"]
    request = target.only
    assert (request.method, str(request.url)) == ("POST", "http://target.test/api/contacts/batch")
    assert request.headers["Content-Type"] == "application/json"
    assert request.headers["Authorization"] == f"Bearer {TOKEN}"
    assert "Idempotency-Key" not in request.headers  # each item carries its own
    assert json.loads(request.content) == {
        "items": [
            {"idempotency_key": "key-0", "record": {"email": "0@x.io", "n": 0}},
            {"idempotency_key": "key-1", "record": {"email": "1@x.io", "n": 1}},
        ]
    }


def test_update_many_patches_the_items_with_their_ids(target: Target) -> None:
    writer = target.writer(results({"status": 200}, {"status": 204}))
    assert writer.update_many(updates(2)) == [None, None]
    request = target.only
    assert (request.method, str(request.url)) == ("PATCH", "http://target.test/api/contacts/batch-update")
    assert json.loads(request.content) == {
        "items": [{"id": "r-0", "record": {"n": 0}}, {"id": "r-1", "record": {"n": 1}}]
    }


def test_the_id_is_read_from_the_connections_id_field(target: Target) -> None:
    writer = target.writer(results({"status": 201, "uuid": "0b8f", "id": 1}), dataclasses.replace(CRM, id_field="uuid"))
    assert writer.create_many(creates(1)) == ["0b8f"]


def test_no_items_sends_nothing(target: Target) -> None:
    writer = target.writer(results())
    assert writer.create_many([]) == []
    assert writer.update_many([]) == []
    assert target.requests == []


def test_more_items_than_max_items_is_a_bug_of_the_caller(target: Target) -> None:
    writer = target.writer(results())
    with pytest.raises(ValueError, match="6 items, more than the 5 one call may carry"):
        writer.create_many(creates(6))
    assert target.requests == []


# --- per-item results ----------------------------------------------------------------------------


def test_one_item_refused_gone_or_without_id_among_good_ones(target: Target) -> None:
    writer = target.writer(
        results(
            {"status": 201, "id": "r-1"},
            {"status": 422, "error": "email is invalid"},
            {"status": 201},
            {"status": 201, "id": "r-4"},
        )
    )
    first, refused, no_id, last = writer.create_many(creates(4))
    assert (first, last) == ("r-1", "r-4")
    assert isinstance(refused, RecordRejected)
    assert message(refused) == "POST contacts/batch (item 2 of 4): HTTP 422: email is invalid"
    assert isinstance(no_id, Unaddressable)
    assert message(no_id) == "POST contacts/batch (item 3 of 4): HTTP 201 result has no usable 'id': {\"status\":201}"


def test_an_update_item_answered_404_or_410_is_gone(target: Target) -> None:
    writer = target.writer(results({"status": 200}, {"status": 404, "error": "no such record"}, {"status": 410}))
    done, gone, gone_too = writer.update_many(updates(3))
    assert done is None
    assert isinstance(gone, RemoteGone) and isinstance(gone_too, RemoteGone)
    assert message(gone) == "PATCH contacts/batch-update (item 2 of 3): HTTP 404: no such record"
    assert message(gone_too) == 'PATCH contacts/batch-update (item 3 of 3): HTTP 410: {"status":410}'


@pytest.mark.parametrize("status", [404, 410])
def test_a_create_item_answered_404_is_refused_not_gone(target: Target, status: int) -> None:
    (result,) = target.writer(results({"status": status})).create_many(creates(1))
    assert type(result) is RecordRejected


@pytest.mark.parametrize(("status", "unknown"), [(429, False), (503, False), (500, True), (502, True)])
def test_an_item_answered_429_or_5xx_is_unavailable(target: Target, status: int, unknown: bool) -> None:
    writer = target.writer(results({"status": 201, "id": "r-1"}, {"status": status, "error": "slow down"}))
    done, unavailable = writer.create_many(creates(2))
    assert done == "r-1"
    assert isinstance(unavailable, TargetUnavailable)
    assert unavailable.outcome_unknown is unknown
    assert unavailable.retry_after_seconds is None


@pytest.mark.parametrize(
    ("given", "seconds"), [(7, 7.0), (2.5, 2.5), ("30", 30.0), ("Thu, 10 Sep 2026 12:01:00 GMT", 60.0)]
)
def test_an_items_own_retry_after(target: Target, given: Any, seconds: float) -> None:
    writer = target.writer(results({"status": 429, "retry_after": given}, headers={"Retry-After": "999"}))
    (result,) = writer.update_many(updates(1))
    assert isinstance(result, TargetUnavailable)
    assert result.retry_after_seconds == seconds


def test_an_item_says_its_own_status_so_a_429_with_retry_after_pauses_the_target(target: Target) -> None:
    writer = target.writer(
        results({"status": 429, "retry_after": 5}, {"status": 503}, {"status": 500, "retry_after": 5})
    )
    throttled, unavailable, failed = writer.update_many(updates(3))
    assert isinstance(throttled, TargetUnavailable) and throttled.status_code == 429 and throttled.pauses_target
    assert isinstance(unavailable, TargetUnavailable) and unavailable.status_code == 503
    assert not unavailable.pauses_target  # no Retry-After anywhere
    assert isinstance(failed, TargetUnavailable) and failed.status_code == 500 and not failed.pauses_target


def test_an_item_without_retry_after_takes_the_answers(target: Target) -> None:
    writer = target.writer(
        results({"status": 503}, {"status": 429, "retry_after": True}, headers={"Retry-After": "12"})
    )
    first, second = writer.update_many(updates(2))
    assert isinstance(first, TargetUnavailable) and first.retry_after_seconds == 12.0
    assert isinstance(second, TargetUnavailable) and second.retry_after_seconds == 12.0


@pytest.mark.parametrize("status", [401, 403])
def test_an_item_refusing_the_token_refuses_the_whole_call(target: Target, status: int) -> None:
    writer = target.writer(results({"status": 201, "id": "r-1"}, {"status": status, "error": f"bad {TOKEN}"}))
    with pytest.raises(Unauthorized) as caught:
        writer.create_many(creates(2))
    assert str(caught.value) == (
        f"target 'crm' refused the credentials (POST contacts/batch (item 2 of 2): HTTP {status}); "
        "it takes its token from $CRM_TOKEN: check the token and its permissions"
    )


def test_an_item_403_is_that_items_refusal_where_the_connection_says_so(target: Target) -> None:
    connection = dataclasses.replace(CRM, forbidden=Forbidden.RECORD)
    (result,) = target.writer(results({"status": 403, "error": "not yours"}), connection).create_many(creates(1))
    assert isinstance(result, RecordRejected)
    assert message(result) == "POST contacts/batch (item 1 of 1): HTTP 403: not yours"


@pytest.mark.parametrize(
    "item",
    [
        "ok",
        None,
        [201],
        {},
        {"status": "201"},
        {"status": True},
        {"status": 99},
        {"status": 600},
        {"status": 201.0},
    ],
    ids=str,
)
def test_an_item_result_without_a_usable_status(target: Target, item: Any) -> None:
    good = {"status": 201, "id": "r-1"}
    created = target.writer(answer(200, {"results": [good, item]})).create_many(creates(2))
    assert created[0] == "r-1"
    assert isinstance(created[1], Unaddressable)  # the target may have made it
    assert message(created[1]).startswith("POST contacts/batch (item 2 of 2): result has no usable 'status': ")
    updated = target.writer(answer(200, {"results": [{"status": 200}, item]})).update_many(updates(2))
    assert updated[0] is None
    # It may have been applied: in doubt, never a refusal (issue 29, point 3).
    assert type(updated[1]) is AnswerSaysNothing and updated[1].outcome_unknown


@pytest.mark.parametrize(
    "result", [{"status": 201, "id": None}, {"status": 201, "id": ""}, {"status": 201, "id": {"x": 1}}], ids=str
)
def test_a_created_item_without_a_usable_id_is_unaddressable(target: Target, result: dict[str, Any]) -> None:
    (created,) = target.writer(results(result)).create_many(creates(1))
    assert isinstance(created, Unaddressable)


def test_per_item_results_of_a_4xx_answer_are_used(target: Target) -> None:
    # A target answering the call 422 (or 207) with per-item results: each item is judged alone.
    writer = target.writer(results({"status": 201, "id": "r-1"}, {"status": 422, "error": "no"}, status=422))
    created, refused = writer.create_many(creates(2))
    assert created == "r-1"
    assert isinstance(refused, RecordRejected)


def test_an_unsendable_item_is_left_out_and_its_neighbours_go(target: Target) -> None:
    writer = target.writer(results({"status": 201, "id": "r-1"}, {"status": 201, "id": "r-3"}))
    items = [CreateItem({"n": 1}, "k1"), CreateItem({"n": float("nan")}, "k2"), CreateItem({"n": 3}, "k3")]
    first, unsendable, third = writer.create_many(items)
    assert (first, third) == ("r-1", "r-3")
    assert isinstance(unsendable, UnsendablePayload)
    assert message(unsendable) == (
        "POST contacts/batch (item 2 of 3): body cannot be encoded as JSON: "
        "Out of range float values are not JSON compliant"
    )
    assert [item["idempotency_key"] for item in json.loads(target.only.content)["items"]] == ["k1", "k3"]


def test_all_items_unsendable_sends_nothing(target: Target) -> None:
    writer = target.writer(results())
    (result,) = writer.update_many([UpdateItem("r-1", {"n": float("inf")})])
    assert isinstance(result, UnsendablePayload)
    assert target.requests == []


# --- a 2xx whose result list cannot be used --------------------------------------------------------


@pytest.mark.parametrize(
    ("handler", "why"),
    [
        (results({"status": 201, "id": "r-1"}), "HTTP 200 answer has 1 results for 2 items: "),
        (results(*[{"status": 201, "id": f"r-{n}"} for n in range(3)]), "HTTP 200 answer has 3 results for 2 items: "),
        (answer(200, {"status": "done"}), "HTTP 200 answer has no 'results' list: "),
        (answer(200, {"results": {"0": {"status": 201}}}), "HTTP 200 answer has no 'results' list: "),
        (answer(200, [{"status": 201, "id": "r-1"}]), "HTTP 200 answer has no 'results' list: "),
        (answer(200, text="ok"), "HTTP 200 answer is not JSON: ok"),
        (answer(204), "HTTP 204 answer is not JSON: "),
    ],
    ids=["short", "long", "no-results", "results-not-a-list", "bare-list", "text", "no-content"],
)
def test_a_2xx_without_a_matching_result_list(target: Target, handler: Handler, why: str) -> None:
    """Creates: every item Unaddressable, as a one-record create answered 2xx without an id (the
    target may have made each, and nothing says which id is whose). Updates: every item
    AnswerSaysNothing, in doubt and retried on the schedule (a 2xx for the call says nothing of
    each item: it may have been applied; sending an update again changes nothing), rather than
    delivered on faith or refused (a refusal would let a revert be suppressed as identical)."""
    created = target.writer(handler).create_many(creates(2))
    assert [type(result) for result in created] == [Unaddressable, Unaddressable]
    assert message(created[1]).startswith(f"POST contacts/batch (item 2 of 2): {why}")
    updated = target.writer(handler).update_many(updates(2))
    assert [type(result) for result in updated] == [AnswerSaysNothing, AnswerSaysNothing]
    assert all(result.outcome_unknown for result in updated)


def test_a_2xx_with_an_undecodable_body(target: Target) -> None:
    def broken(_request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, headers={"Content-Encoding": "gzip"}, stream=httpx.ByteStream(b"not gzip"))

    created = target.writer(broken).create_many(creates(1))
    assert isinstance(created[0], Unaddressable)
    assert message(created[0]).startswith("POST contacts/batch (item 1 of 1): HTTP 200 answer body cannot be decoded: ")


# --- the whole call ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("exc_type", "unknown"),
    [
        (httpx.ReadTimeout, True),
        (httpx.ConnectTimeout, False),
        (httpx.ConnectError, False),
        (httpx.RemoteProtocolError, True),
    ],
)
def test_a_transport_failure_raises_unavailable(
    target: Target, exc_type: type[httpx.TransportError], unknown: bool
) -> None:
    writer = target.writer(raising(exc_type, f"boom {TOKEN}"))
    with pytest.raises(TargetUnavailable) as caught:
        writer.create_many(creates(3))
    assert caught.value.outcome_unknown is unknown
    assert str(caught.value).startswith("POST contacts/batch: ")
    assert TOKEN not in str(caught.value)


@pytest.mark.parametrize(("status", "unknown"), [(500, True), (502, True), (503, False), (504, True), (429, False)])
def test_a_429_or_5xx_to_the_whole_call_raises_unavailable(target: Target, status: int, unknown: bool) -> None:
    writer = target.writer(answer(status, {"error": "later"}, headers={"Retry-After": "42"}))
    with pytest.raises(TargetUnavailable) as caught:
        writer.update_many(updates(2))
    assert caught.value.retry_after_seconds == 42.0
    assert caught.value.outcome_unknown is unknown
    assert str(caught.value) == f'PATCH contacts/batch-update: HTTP {status}: {{"error":"later"}}'


def test_a_5xx_with_results_still_fails_the_whole_call(target: Target) -> None:
    with pytest.raises(TargetUnavailable):
        target.writer(results({"status": 201, "id": "r-1"}, status=500)).create_many(creates(1))


@pytest.mark.parametrize("status", [400, 404, 405, 409, 413, 422])
def test_a_4xx_without_results_raises_batch_refused(target: Target, status: int) -> None:
    writer = target.writer(answer(status, {"error": "item 3: email is not a string"}))
    with pytest.raises(BatchRefused) as caught:
        writer.create_many(creates(4))
    assert caught.value.status_code == status
    assert caught.value.excerpt == '{"error":"item 3: email is not a string"}'
    assert str(caught.value) == f'POST contacts/batch: HTTP {status}: {{"error":"item 3: email is not a string"}}'


def test_a_4xx_with_a_result_list_of_the_wrong_length_is_refused_whole(target: Target) -> None:
    with pytest.raises(BatchRefused):
        target.writer(results({"status": 422}, status=400)).update_many(updates(2))


def test_a_4xx_with_an_undecodable_body_is_refused_with_a_placeholder(target: Target) -> None:
    def broken(_request: httpx.Request) -> httpx.Response:
        return httpx.Response(400, headers={"Content-Encoding": "gzip"}, stream=httpx.ByteStream(b"not gzip"))

    with pytest.raises(BatchRefused) as caught:
        target.writer(broken).create_many(creates(1))
    assert caught.value.excerpt.startswith("<answer body not decodable: ")


@pytest.mark.parametrize("status", [401, 403])
def test_a_refused_token_for_the_whole_call_is_unauthorized(target: Target, status: int) -> None:
    with pytest.raises(Unauthorized, match=rf"\(PATCH contacts/batch-update: HTTP {status}\)"):
        target.writer(answer(status, {"error": "who are you"})).update_many(updates(1))


def test_a_whole_call_403_is_refused_as_a_batch_where_the_connection_says_so(target: Target) -> None:
    connection = dataclasses.replace(CRM, forbidden=Forbidden.RECORD)
    with pytest.raises(BatchRefused) as caught:
        target.writer(answer(403, {"error": "nope"}), connection).create_many(creates(2))
    assert caught.value.status_code == 403


# --- the token never leaks --------------------------------------------------------------------


def test_the_token_is_masked_in_every_item_fault(target: Target) -> None:
    echoed = f"token {TOKEN} refused"
    writer = target.writer(
        results(
            {"status": 422, "error": echoed},
            {"status": 201, "note": echoed},
            {"status": 503, "error": {"detail": echoed}},
            {"status": "x", "token": TOKEN},
        )
    )
    created = writer.create_many(creates(4))
    assert [type(result) for result in created] == [RecordRejected, Unaddressable, TargetUnavailable, Unaddressable]
    for result in created:
        assert TOKEN not in message(result)
        assert "***" in message(result)


def test_the_token_is_masked_in_a_batch_refusal_and_in_a_short_result_list(target: Target) -> None:
    refusing = target.writer(answer(400, {"error": f"bad {TOKEN}"}))
    with pytest.raises(BatchRefused) as caught:
        refusing.create_many(creates(1))
    assert TOKEN not in str(caught.value) and TOKEN not in caught.value.excerpt
    short = target.writer(answer(200, {"results": [], "echo": TOKEN}))
    (result,) = short.create_many(creates(1))
    assert TOKEN not in message(result)


def test_a_token_cut_by_the_excerpt_does_not_leak_a_prefix(target: Target) -> None:
    error = "x" * (BODY_EXCERPT - 10) + TOKEN
    (result,) = target.writer(results({"status": 422, "error": error})).update_many(updates(1))
    assert TOKEN[:10] not in message(result)
    assert message(result).endswith("x" * (BODY_EXCERPT - 10) + "***")


def test_an_unauthorized_item_names_no_token(target: Target) -> None:
    with pytest.raises(Unauthorized) as caught:
        target.writer(results({"status": 401, "error": TOKEN})).update_many(updates(1))
    assert TOKEN not in str(caught.value)
