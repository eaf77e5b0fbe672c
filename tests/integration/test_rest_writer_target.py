"""The REST writer against the real local target server: a body JSON cannot carry never leaves the
process, and an answer whose body cannot be decoded (a broken `Content-Encoding: gzip`) is judged
by its status code, over a real socket and a pooled keep-alive connection."""

from __future__ import annotations

import http.client
from collections.abc import Iterator
from urllib.parse import urlsplit

import pytest

from delivery.domain import Connection, ConnectionStatus
from delivery.errors import RecordRejected, RemoteGone, TargetUnavailable, Unaddressable, UnsendablePayload
from delivery.writers.rest import RestWriter
from tests.target_server import NOT_GZIP, Answer, TargetServer

SECRET = "s3cr3t-token-value"


@pytest.fixture
def writer(target: TargetServer) -> Iterator[RestWriter]:
    connection = Connection(
        id=1,
        name="crm",
        driver="rest",
        status=ConnectionStatus.ACTIVE,
        base_url=target.url,
        token_env="CRM_TOKEN",
        timeout_seconds=5,
    )
    with RestWriter(connection, "contacts") as rest:
        yield rest


def test_the_bad_gzip_answer_is_gzip_in_name_only(target: TargetServer) -> None:
    target.program("raw@x.io", Answer.bad_gzip())
    split = urlsplit(target.url)
    client = http.client.HTTPConnection(split.hostname or "", split.port)
    try:
        client.request(
            "POST",
            f"{split.path}/contacts",
            body=b'{"email": "raw@x.io"}',
            headers={"Authorization": f"Bearer {SECRET}", "Content-Type": "application/json"},
        )
        response = client.getresponse()
        assert response.status == 201
        assert response.getheader("Content-Encoding") == "gzip"
        assert response.read() == NOT_GZIP
    finally:
        client.close()
    assert len(target.records("contacts")) == 1  # without a code the request took effect


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")], ids=["nan", "inf", "minus-inf"])
def test_an_unsendable_create_never_reaches_the_target(writer: RestWriter, target: TargetServer, value: float) -> None:
    with pytest.raises(UnsendablePayload) as caught:
        writer.create({"email": "nan@x.io", "score": value}, "k-1")
    assert str(caught.value) == (
        "POST contacts: body cannot be encoded as JSON: Out of range float values are not JSON compliant"
    )
    assert target.requests == []
    # The writer and its pooled connection carry on with the next record.
    assert writer.create({"email": "ok@x.io", "score": 1.5}, "k-2") == "r-1"
    assert target.records("contacts") == {"r-1": {"id": "r-1", "email": "ok@x.io", "score": 1.5}}


def test_an_unsendable_update_never_reaches_the_target(writer: RestWriter, target: TargetServer) -> None:
    remote_id = writer.create({"email": "a@x.io", "score": 1}, "k")
    with pytest.raises(UnsendablePayload, match=r"^PATCH contacts/r-1: body cannot be encoded as JSON"):
        writer.update(remote_id, {"score": float("nan")})
    assert [r.method for r in target.requests] == ["POST"]
    assert target.records("contacts")[remote_id]["score"] == 1


def test_a_create_answered_2xx_with_an_undecodable_body_is_unaddressable(
    writer: RestWriter, target: TargetServer
) -> None:
    target.program("gz@x.io", Answer.bad_gzip())
    with pytest.raises(Unaddressable) as caught:
        writer.create({"email": "gz@x.io"}, "k-gz")
    assert str(caught.value).startswith("POST contacts: HTTP 201 answer body cannot be decoded: ")
    assert "incorrect header check" in str(caught.value)
    # The target made the record: a second create would make a second copy, hence Unaddressable.
    assert list(target.records("contacts").values()) == [{"id": "r-1", "email": "gz@x.io"}]
    assert writer.create({"email": "next@x.io"}, "k-next") == "r-2"  # the connection is still usable


def test_an_update_answered_2xx_with_an_undecodable_body_went_through(writer: RestWriter, target: TargetServer) -> None:
    remote_id = writer.create({"email": "up@x.io", "name": "Ada"}, "k")
    target.program_remote(remote_id, Answer.bad_gzip())
    assert writer.update(remote_id, {"name": "Grace"}) is None
    assert target.records("contacts")[remote_id]["name"] == "Grace"
    assert target.pending(remote_id) == 0


def test_an_update_of_a_gone_record_with_an_undecodable_body_is_remote_gone(
    writer: RestWriter, target: TargetServer
) -> None:
    target.program_remote("r-404", Answer.bad_gzip())  # default behaviour: 404, the record is unknown
    with pytest.raises(RemoteGone) as caught:
        writer.update("r-404", {"name": "x"})
    assert str(caught.value).startswith("PATCH contacts/r-404: HTTP 404: <answer body not decodable: ")


@pytest.mark.parametrize(("code", "fault"), [(503, TargetUnavailable), (429, TargetUnavailable), (422, RecordRejected)])
def test_a_refusal_with_an_undecodable_body_is_judged_by_its_status(
    writer: RestWriter, target: TargetServer, code: int, fault: type[Exception]
) -> None:
    target.program("bad@x.io", Answer.bad_gzip(code))
    with pytest.raises(fault) as caught:
        writer.create({"email": "bad@x.io"}, "k")
    assert str(caught.value).startswith(f"POST contacts: HTTP {code}: <answer body not decodable: ")
    assert SECRET not in str(caught.value)
    assert target.records("contacts") == {}
