"""The `rest` writer's async verbs judge every answer and every transport failure exactly as its
sync verbs do (one translation for both clients), and the verbs-as-types helpers count them.
Over httpx.MockTransport: nothing here opens a socket."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from typing import Any

import httpx
import pytest
from hypothesis import given
from hypothesis import settings as hypothesis_settings
from hypothesis import strategies as st

from delivery.domain import Connection, ConnectionStatus, Verb
from delivery.writers.base import Creates, CreatesAsync, Updates, Writer, async_verbs_of, offers_async, verbs_of
from delivery.writers.rest import RestCreateOnlyWriter, RestUpdateOnlyWriter, RestWriter

CRM = Connection(
    id=1,
    name="crm",
    driver="rest",
    status=ConnectionStatus.ACTIVE,
    base_url="http://target.test/api",
    token_env=None,
    timeout_seconds=5,
    id_field="id",
)
Handler = Callable[[httpx.Request], httpx.Response]


def _outcome(call: Callable[[], Any]) -> tuple[str, str]:
    try:
        return "returned", repr(call())
    except Exception as exc:
        return type(exc).__name__, f"{exc} {vars(exc)}"


def _both(handler: Handler, verb: str, *args: Any) -> tuple[tuple[str, str], tuple[str, str]]:
    writer = RestWriter(CRM, "contacts", httpx.MockTransport(handler), async_transport=httpx.MockTransport(handler))

    async def asynchronous() -> tuple[str, str]:
        await writer.aopen()
        try:
            try:
                result = await getattr(writer, "a" + verb)(*args)
            except Exception as exc:
                return type(exc).__name__, f"{exc} {vars(exc)}"
            return "returned", repr(result)
        finally:
            await writer.aclose()

    try:
        return _outcome(lambda: getattr(writer, verb)(*args)), asyncio.run(asynchronous())
    finally:
        writer.close()


_ANSWERS = st.builds(
    lambda code, body, retry_after: (code, body, retry_after),
    st.integers(min_value=200, max_value=599),
    st.one_of(
        st.just(b""),
        st.just(b"not json"),
        st.dictionaries(st.sampled_from(["id", "error", "x"]), st.one_of(st.text(max_size=8), st.integers()))
        .map(json.dumps)
        .map(str.encode),
    ),
    st.sampled_from([None, "2", "Wed, 21 Oct 2015 07:28:00 GMT", "nan"]),
)


@hypothesis_settings(max_examples=60, deadline=None)
@given(answer=_ANSWERS, verb=st.sampled_from(["create", "update"]))
def test_an_answer_is_judged_alike_by_the_sync_and_the_async_verbs(
    answer: tuple[int, bytes, str | None], verb: str
) -> None:
    code, body, retry_after = answer
    headers = {"Retry-After": retry_after} if retry_after else {}

    def handler(_request: httpx.Request) -> httpx.Response:
        return httpx.Response(code, content=body, headers=headers)

    args = ({"email": "a@example.com"}, "key-1") if verb == "create" else ("r-1", {"email": "a@example.com"})
    sync, asynchronous = _both(handler, verb, *args)
    assert sync == asynchronous


@pytest.mark.parametrize(
    "failure",
    [
        httpx.ConnectError("refused"),
        httpx.ReadTimeout("slow"),
        httpx.RemoteProtocolError("dropped"),
        httpx.PoolTimeout("full"),
    ],
    ids=lambda exc: type(exc).__name__,
)
def test_a_transport_failure_is_translated_alike(failure: Exception) -> None:
    def handler(_request: httpx.Request) -> httpx.Response:
        raise failure

    sync, asynchronous = _both(handler, "create", {"email": "a@example.com"}, "key-1")
    assert sync == asynchronous and sync[0] == "TargetUnavailable"


def test_a_body_json_cannot_carry_is_refused_before_sending_alike() -> None:
    sent: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        sent.append(request)
        return httpx.Response(201, json={"id": "x"})

    sync, asynchronous = _both(handler, "create", {"score": float("nan")}, "key-1")
    assert sync == asynchronous and sync[0] == "UnsendablePayload" and sent == []


class _SyncOnly(Writer, Creates, Updates):
    def create(self, body: Any, idempotency_key: str) -> str:
        return "x"

    def update(self, remote_id: str, body: Any) -> None:
        return None


class _AsyncCreateOnly(Writer, CreatesAsync):
    async def acreate(self, body: Any, idempotency_key: str) -> str:
        return "x"


def test_async_verbs_count_as_the_writers_verbs() -> None:
    assert async_verbs_of(RestWriter) == verbs_of(RestWriter) == {Verb.CREATE, Verb.UPDATE, Verb.DELETE}
    assert async_verbs_of(RestCreateOnlyWriter) == {Verb.CREATE}
    assert async_verbs_of(RestUpdateOnlyWriter) == {Verb.UPDATE}
    assert async_verbs_of(_SyncOnly) == frozenset()
    assert verbs_of(_AsyncCreateOnly) == {Verb.CREATE}
    assert offers_async(RestWriter(CRM, "contacts"))
    assert not offers_async(_SyncOnly(CRM, "contacts"))
    assert offers_async(_AsyncCreateOnly(CRM, "contacts"))
