"""The `rest` writers' batch verbs against the real local target server (tests/target_server.py):
one request per call, each item judged alone, the whole call's failures raised, per-item
idempotency keys honoured, over a real socket and a pooled keep-alive connection."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterator
from typing import Any

import pytest

from delivery.domain import BatchEndpoints, Connection, ConnectionStatus
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
from delivery.writers import BatchRefused, CreateItem, UpdateItem
from delivery.writers.registry import writer_for
from tests.target_server import Answer, TargetServer

SECRET = "s3cr3t-token-value"


def connection(target: TargetServer, **changes: Any) -> Connection:
    crm = Connection(
        id=1,
        name="crm",
        driver="rest",
        status=ConnectionStatus.ACTIVE,
        base_url=target.url,
        token_env="CRM_TOKEN",
        timeout_seconds=5,
        batch=BatchEndpoints(create_path="contacts/batch", update_path="contacts/batch", max_items=50),
    )
    return dataclasses.replace(crm, **changes)


@pytest.fixture
def writer(target: TargetServer) -> Iterator[Any]:
    writer_type = writer_for(connection(target))
    assert writer_type is not None
    with writer_type(connection(target), "contacts") as rest:
        yield rest


def creates(*emails: str) -> list[CreateItem]:
    return [CreateItem({"email": email, "name": email.split("@")[0]}, f"key-{email}") for email in emails]


def text(result: object) -> str:
    assert isinstance(result, RecordFault)
    return str(result)


def test_all_succeed_in_one_request(writer: Any, target: TargetServer) -> None:
    ids = writer.create_many(creates("a@x.io", "b@x.io", "c@x.io"))
    assert ids == ["r-1", "r-2", "r-3"]
    (request,) = target.requests
    assert (request.method, request.path, request.batch) == ("POST", "/api/contacts/batch", True)
    assert request.item_keys == ("a@x.io", "b@x.io", "c@x.io")
    assert [item["idempotency_key"] for item in request.items] == ["key-a@x.io", "key-b@x.io", "key-c@x.io"]
    assert target.records("contacts")["r-2"] == {"id": "r-2", "email": "b@x.io", "name": "b"}

    assert writer.update_many([UpdateItem("r-1", {"name": "A"}), UpdateItem("r-3", {"name": "C"})]) == [None, None]
    assert target.records("contacts")["r-1"]["name"] == "A"
    assert target.records("contacts")["r-3"]["name"] == "C"
    assert len(target.requests) == 2
    assert target.count("a@x.io") == 1 and target.count("r-1") == 1


def test_one_item_refused_gone_or_without_id_among_good_ones(writer: Any, target: TargetServer) -> None:
    target.program("bad@x.io", Answer.status(422, {"error": "email is not deliverable"}))
    target.program("noid@x.io", Answer.no_id())
    created = writer.create_many(creates("a@x.io", "bad@x.io", "noid@x.io", "d@x.io"))
    assert created[0] == "r-1" and created[3] == "r-2"
    assert isinstance(created[1], RecordRejected)
    assert text(created[1]) == "POST contacts/batch (item 2 of 4): HTTP 422: email is not deliverable"
    assert isinstance(created[2], Unaddressable)
    assert set(target.records("contacts")) == {"r-1", "r-2"}
    assert len(target.requests) == 1

    updated = writer.update_many(
        [UpdateItem("r-1", {"name": "A"}), UpdateItem("r-404", {"name": "?"}), UpdateItem("r-2", {"name": "D"})]
    )
    assert updated[0] is None and updated[2] is None
    assert isinstance(updated[1], RemoteGone)
    assert text(updated[1]) == "PATCH contacts/batch (item 2 of 3): HTTP 404: not found"
    assert target.records("contacts")["r-2"]["name"] == "D"


def test_an_item_answered_429_carries_its_retry_after(writer: Any, target: TargetServer) -> None:
    target.program("slow@x.io", Answer.status(429, headers={"Retry-After": "17"}))
    created = writer.create_many(creates("slow@x.io", "b@x.io"))
    assert isinstance(created[0], TargetUnavailable)
    assert created[0].retry_after_seconds == 17.0
    assert created[0].outcome_unknown is False
    assert created[1] == "r-1"


def test_the_same_key_twice_makes_one_record(writer: Any, target: TargetServer) -> None:
    first = writer.create_many(creates("a@x.io", "b@x.io"))
    again = writer.create_many(creates("b@x.io", "a@x.io", "c@x.io"))  # a retried call, reordered
    assert again == [first[1], first[0], "r-3"]
    assert len(target.records("contacts")) == 3
    # Within one call too, and across the single and the batch endpoint.
    same = writer.create_many([CreateItem({"email": "d@x.io"}, "k-d"), CreateItem({"email": "d@x.io"}, "k-d")])
    assert same[0] == same[1]
    assert writer.create({"email": "d@x.io"}, "k-d") == same[0]
    assert len(target.records("contacts")) == 4


def test_a_timed_out_item_is_created_all_the_same_and_a_replay_finds_it(writer: Any, target: TargetServer) -> None:
    short = dataclasses.replace(connection(target), timeout_seconds=0.3)
    writer_type = writer_for(short)
    assert writer_type is not None
    with writer_type(short, "contacts") as impatient:
        target.program_batch(Answer.timeout(0.8))
        with pytest.raises(TargetUnavailable) as caught:
            impatient.create_many(creates("a@x.io", "b@x.io"))
        assert caught.value.outcome_unknown is True
        assert str(caught.value) == "POST contacts/batch: timed out (ReadTimeout)"
    # The target made them after the client gave up; the replay, with the same keys, learns the ids.
    for _ in range(50):
        if len(target.records("contacts")) == 2:
            break
        time.sleep(0.05)
    assert writer.create_many(creates("a@x.io", "b@x.io")) == ["r-1", "r-2"]
    assert len(target.records("contacts")) == 2


@pytest.mark.parametrize(("status", "unknown"), [(500, True), (503, False), (429, False)])
def test_a_whole_call_5xx_or_429_with_retry_after(
    writer: Any, target: TargetServer, status: int, unknown: bool
) -> None:
    target.program_batch(Answer.status(status, headers={"Retry-After": "30"}))
    with pytest.raises(TargetUnavailable) as caught:
        writer.create_many(creates("a@x.io", "b@x.io"))
    assert caught.value.retry_after_seconds == 30.0
    assert caught.value.outcome_unknown is unknown
    assert target.records("contacts") == {}


def test_a_target_down_is_unavailable_for_the_whole_call(writer: Any, target: TargetServer) -> None:
    target.down = True
    with pytest.raises(TargetUnavailable):
        writer.update_many([UpdateItem("r-1", {"a": 1})])


def test_a_dropped_connection_is_unavailable(writer: Any, target: TargetServer) -> None:
    target.program_batch(Answer.drop())
    with pytest.raises(TargetUnavailable) as caught:
        writer.create_many(creates("a@x.io"))
    assert caught.value.outcome_unknown is True


def test_a_whole_400_without_results_is_refused_as_a_batch(writer: Any, target: TargetServer) -> None:
    target.program_batch(Answer.status(400, {"error": "item 2 is malformed"}), method="PATCH")
    assert writer.create_many(creates("a@x.io")) == ["r-1"]  # the script waits for a PATCH
    with pytest.raises(BatchRefused) as caught:
        writer.update_many([UpdateItem("r-1", {"a": 1}), UpdateItem("r-1", {"b": 2})])
    assert caught.value.status_code == 400
    assert str(caught.value) == 'PATCH contacts/batch: HTTP 400: {"error": "item 2 is malformed"}'
    assert target.records("contacts")["r-1"] == {"id": "r-1", "email": "a@x.io", "name": "a"}


def test_a_batch_path_the_target_does_not_have_is_refused_as_a_batch(target: TargetServer) -> None:
    lost = connection(target, batch=BatchEndpoints(create_path="nowhere/at/all"))
    writer_type = writer_for(lost)
    assert writer_type is not None
    with writer_type(lost, "contacts") as writer, pytest.raises(BatchRefused) as caught:
        writer.create_many(creates("a@x.io"))
    assert caught.value.status_code == 404


def test_a_result_list_of_the_wrong_length(writer: Any, target: TargetServer) -> None:
    target.program_batch(Answer.status(200, {"results": [{"status": 201, "id": "r-9"}]}))
    created = writer.create_many(creates("a@x.io", "b@x.io"))
    assert [type(result) for result in created] == [Unaddressable, Unaddressable]
    assert text(created[0]).startswith("POST contacts/batch (item 1 of 2): HTTP 200 answer has 1 results for 2 items")
    target.program_batch(Answer.no_id())  # the target did the work and answered without results
    updated = writer.update_many([UpdateItem("r-1", {"a": 1})])
    assert [type(result) for result in updated] == [AnswerSaysNothing]  # in doubt: it may have been applied


def test_an_item_result_that_is_not_an_object(writer: Any, target: TargetServer) -> None:
    target.program("odd@x.io", Answer.not_json())
    created = writer.create_many(creates("odd@x.io", "b@x.io"))
    assert isinstance(created[0], Unaddressable)
    assert text(created[0]) == "POST contacts/batch (item 1 of 2): result has no usable 'status': \"ok\""
    assert created[1] == "r-1"


def test_an_unsendable_item_never_reaches_the_target(writer: Any, target: TargetServer) -> None:
    items = [CreateItem({"email": "a@x.io", "score": float("nan")}, "k-a"), *creates("b@x.io")]
    created = writer.create_many(items)
    assert isinstance(created[0], UnsendablePayload)
    assert created[1] == "r-1"
    (request,) = target.requests
    assert request.item_keys == ("b@x.io",)


def test_the_token_never_reaches_an_error(writer: Any, target: TargetServer) -> None:
    target.program("echo@x.io", Answer.echo_headers(422))
    target.program("said@x.io", Answer.status(422, {"error": f"token {SECRET} may not write here"}))
    created = writer.create_many(creates("echo@x.io", "said@x.io"))
    assert isinstance(created[0], RecordRejected)
    assert SECRET not in text(created[0])
    assert text(created[1]) == "POST contacts/batch (item 2 of 2): HTTP 422: token *** may not write here"
    (request,) = target.requests
    assert request.headers["authorization"] == f"Bearer {SECRET}"  # what the item's answer echoed
    target.program_batch(Answer.echo_headers(400))
    with pytest.raises(BatchRefused) as refused:
        writer.create_many(creates("b@x.io"))
    assert SECRET not in str(refused.value) and SECRET not in refused.value.excerpt
    target.program_batch(Answer.echo_headers(503))
    with pytest.raises(TargetUnavailable) as unavailable:
        writer.create_many(creates("b@x.io"))
    assert SECRET not in str(unavailable.value)


def test_a_wrong_token_is_unauthorized_for_the_whole_call(
    target: TargetServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CRM_TOKEN", "not-the-token")
    writer_type = writer_for(connection(target))
    assert writer_type is not None
    with writer_type(connection(target), "contacts") as writer, pytest.raises(Unauthorized) as caught:
        writer.create_many(creates("a@x.io"))
    assert "not-the-token" not in str(caught.value)
    assert "(POST contacts/batch: HTTP 401)" in str(caught.value)
    assert target.records("contacts") == {}


def test_batches_and_single_records_share_the_pooled_connection(writer: Any, target: TargetServer) -> None:
    for round_ in range(5):
        emails = [f"{round_}-{n}@x.io" for n in range(10)]
        assert all(isinstance(result, str) for result in writer.create_many(creates(*emails)))
        assert writer.create({"email": f"{round_}@x.io"}, f"single-{round_}").startswith("r-")
    assert len(target.records("contacts")) == 55
    assert len(target.batch_requests()) == 5
