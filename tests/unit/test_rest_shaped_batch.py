"""Batch calls described by templates (`batch.create` / `batch.update`) in the REST writer, over a
mock transport: items rendered and matched to results by key in any order, an item left out when
its template lacks a value or JSON cannot carry it, results that say nothing, and a result with its
own status."""

from __future__ import annotations

import json
from typing import Any

import httpx

from delivery.domain import BatchEndpoints, BatchShape, Connection, ConnectionStatus, MirrorRecord
from delivery.errors import AnswerSaysNothing, RecordRejected, Unaddressable, UnsendablePayload
from delivery.writers.base import CreateItem, UpdateItem
from delivery.writers.rest import RestWriter

CREATE = BatchShape(
    "POST",
    "crm/{{ collection }}/batch/create",
    {"inputs": "{{ items }}"},
    {"properties": "{{ fields }}", "trace": "{{ idempotency_key }}", "ext": "{{ record.ext }}"},
    "results",
    "trace",
    "id",
)
UPDATE = BatchShape(
    "POST", "crm/{{ collection }}/batch/update", {"inputs": "{{ items }}"}, {"id": "{{ remote_id }}"}, "results", "id"
)


def _writer(handler: Any) -> RestWriter:
    batch = BatchEndpoints(CREATE.path, UPDATE.path, 100, CREATE, UPDATE)
    target = Connection(1, "crm", "rest", ConnectionStatus.ACTIVE, base_url="https://api.example.com", batch=batch)
    writer_type = RestWriter.for_batch(batch)
    return writer_type(target, "contacts", transport=httpx.MockTransport(handler), token="s3cr3t-token-value")  # type: ignore[call-arg,return-value]


def _record(ext: str | None) -> MirrorRecord:
    from datetime import UTC, datetime

    return MirrorRecord(1, 1, "contact", "e", {} if ext is None else {"ext": ext}, False, datetime.now(UTC))


def test_items_rendered_and_matched_by_key_in_any_order() -> None:
    sent: list[Any] = []

    def handler(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        sent.append((request.method, request.url.path, body))
        results = [{"id": f"id-{one['trace']}", "trace": one["trace"]} for one in reversed(body["inputs"])]
        return httpx.Response(201, json={"status": "COMPLETE", "results": results})

    items = [CreateItem({"n": i}, f"k{i}", _record(f"x{i}")) for i in range(3)]
    assert _writer(handler).create_many(items) == ["id-k0", "id-k1", "id-k2"]  # type: ignore[attr-defined]
    ((method, path, body),) = sent
    assert (method, path) == ("POST", "/crm/contacts/batch/create")
    assert body["inputs"][1] == {"properties": {"n": 1}, "trace": "k1", "ext": "x1"}


def test_an_item_lacking_a_value_or_unencodable_is_left_out_and_the_rest_go() -> None:
    sent: list[Any] = []

    def handler(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        sent.append(body)
        return httpx.Response(201, json={"results": [{"id": "r", "trace": one["trace"]} for one in body["inputs"]]})

    items = [
        CreateItem({"n": 1}, "k1", _record(None)),  # no `ext`
        CreateItem({"n": float("nan")}, "k2", _record("x")),  # JSON cannot carry it
        CreateItem({"n": 3}, "k3", _record("x")),
    ]
    missing, unsendable, done = _writer(handler).create_many(items)  # type: ignore[attr-defined]
    assert isinstance(missing, RecordRejected) and "{{ record.ext }}" in str(missing)
    assert isinstance(unsendable, UnsendablePayload)
    assert done == "r"
    assert [one["trace"] for one in sent[0]["inputs"]] == ["k3"]


def test_items_no_result_speaks_for_and_a_result_with_its_own_status() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        ids = [one["id"] for one in body["inputs"]]
        return httpx.Response(207, json={"results": [{"id": ids[0]}, {"id": ids[1], "status": 422, "error": "no"}]})

    updated = _writer(handler).update_many([UpdateItem(f"r{i}", {"n": i}) for i in range(3)])  # type: ignore[attr-defined]
    assert updated[0] is None
    assert isinstance(updated[1], RecordRejected)
    assert isinstance(updated[2], AnswerSaysNothing) and updated[2].outcome_unknown

    def nothing(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, json={"status": "COMPLETE"})

    created = _writer(nothing).create_many([CreateItem({"n": 1}, "k1", _record("x"))])  # type: ignore[attr-defined]
    assert isinstance(created[0], Unaddressable)
