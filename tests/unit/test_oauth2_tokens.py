"""The OAuth2 access token of a connection (delivery/writers/oauth2.py) on a fake clock and a fake
token endpoint: renewed a tenth of its lifetime (at most 60 s) before it runs out, kept until a 401
when it has no lifetime, renewed once for many requests that met the same stale token, a rotated
refresh token handed to the store, and the endpoint's refusals and failures routed as the issue says."""

from __future__ import annotations

import threading
from urllib.parse import parse_qs

import httpx
import pytest

from delivery.errors import TargetUnavailable, Unauthorized
from delivery.writers.oauth2 import OAuth2Settings, TokenSource, renew_after

SETTINGS = OAuth2Settings("crm", "https://auth.example.com/token", "refresh_token", "id", "sec", "r0", None, "$X")


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class Endpoint:
    def __init__(self, *answers: httpx.Response | None, expires_in: int | None = 1800, rotate: bool = False) -> None:
        self.answers = list(answers)
        self.forms: list[dict[str, str]] = []
        self.expires_in = expires_in
        self.rotate = rotate
        self.lock = threading.Lock()

    def __call__(self, request: httpx.Request) -> httpx.Response:
        with self.lock:
            form = {k: v[0] for k, v in parse_qs(request.content.decode()).items()}
            self.forms.append(form)
            if self.answers:
                answer = self.answers.pop(0)
                if answer is not None:
                    return answer
            body: dict[str, object] = {"access_token": f"a{len(self.forms)}", "token_type": "bearer"}
            if self.expires_in is not None:
                body["expires_in"] = self.expires_in
            if self.rotate:
                body["refresh_token"] = f"r{len(self.forms)}"
            return httpx.Response(200, json=body)


class Store:
    def __init__(self) -> None:
        self.value: str | None = None

    def load(self) -> str | None:
        return self.value

    def save(self, refresh_token: str) -> None:
        self.value = refresh_token

    def forget(self) -> None:
        self.value = None


def _source(endpoint: Endpoint, clock: Clock, store: Store | None = None, **changes: object) -> TokenSource:
    settings = OAuth2Settings(**{**SETTINGS.__dict__, **changes})  # type: ignore[arg-type]
    return TokenSource(settings, store, 5.0, clock=clock, transport=httpx.MockTransport(endpoint))


@pytest.mark.parametrize(("lifetime", "after"), [(1800, 1740), (300, 270), (10, 9), (2, 1.8)])
def test_a_token_is_renewed_a_tenth_of_its_lifetime_at_most_60_s_before_it_runs_out(
    lifetime: int, after: float
) -> None:
    assert renew_after(lifetime) == pytest.approx(after)
    clock, endpoint = Clock(), Endpoint(expires_in=lifetime)
    source = _source(endpoint, clock)
    assert source.current() == ("a1", True)
    clock.now += after - 0.01
    assert source.current() == ("a1", False)
    clock.now += 0.02
    assert source.current() == ("a2", True)
    assert len(endpoint.forms) == 2


def test_a_token_without_a_lifetime_is_kept_until_a_401() -> None:
    clock, endpoint = Clock(), Endpoint(expires_in=None)
    source = _source(endpoint, clock, grant="client_credentials", refresh_token=None)
    assert source.current() == ("a1", True)
    clock.now += 10 * 86_400
    assert source.current() == ("a1", False)
    assert source.renew("a1") == "a2"
    assert endpoint.forms[0] == {"grant_type": "client_credentials", "client_id": "id", "client_secret": "sec"}


def test_many_requests_that_met_the_same_stale_token_renew_it_once() -> None:
    clock, endpoint = Clock(), Endpoint()
    source = _source(endpoint, clock)
    stale, _ = source.current()
    threads = [threading.Thread(target=source.renew, args=(stale,)) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(endpoint.forms) == 2 and source.current() == ("a2", False)


def test_a_rotated_refresh_token_is_stored_and_used_next() -> None:
    clock, endpoint, store = Clock(), Endpoint(rotate=True), Store()
    source = _source(endpoint, clock, store)
    source.current()
    assert store.value == "r1"
    source.renew("a1")
    assert endpoint.forms[1]["refresh_token"] == "r1" and store.value == "r2"


@pytest.mark.parametrize(
    ("answer", "fault"),
    [
        (httpx.Response(400, json={"error": "invalid_grant"}), Unauthorized),
        (httpx.Response(401, json={"error": "invalid_client"}), Unauthorized),
        (httpx.Response(429, headers={"Retry-After": "7"}), TargetUnavailable),
        (httpx.Response(503, text="down"), TargetUnavailable),
        (httpx.Response(200, json={"token_type": "bearer"}), Unauthorized),
    ],
)
def test_the_token_endpoint_refusing_is_the_rules_fault_and_failing_the_records(
    answer: httpx.Response, fault: type[Exception]
) -> None:
    source = _source(Endpoint(answer), Clock())
    with pytest.raises(fault) as caught:
        source.current()
    message = str(caught.value)
    assert "sec" not in message.replace("refresh", "") and "r0" not in message
    if fault is Unauthorized:
        assert "refresh_token grant" in message


def test_an_unreachable_token_endpoint_is_a_transport_fault() -> None:
    def down(_request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("refused")

    source = TokenSource(SETTINGS, None, 5.0, transport=httpx.MockTransport(down))
    with pytest.raises(TargetUnavailable):
        source.current()


def test_a_stored_refresh_token_refused_is_forgotten_and_the_configured_one_tried() -> None:
    """A rotated token kept from earlier, since revoked (or the configured secret was changed): the
    endpoint refuses it, the configured token is tried once, and the stale one is dropped."""
    store = Store()
    store.value = "stale"
    endpoint = Endpoint(httpx.Response(400, json={"error": "invalid_grant"}))
    source = _source(endpoint, Clock(), store)
    assert source.current() == ("a2", True)
    assert [form["refresh_token"] for form in endpoint.forms] == ["stale", "r0"]
    assert store.value is None


def test_a_cached_token_is_read_without_waiting_and_none_when_due() -> None:
    clock, endpoint = Clock(), Endpoint(expires_in=100)
    source = _source(endpoint, clock)
    assert source.cached() is None  # nothing fetched yet
    source.current()
    assert source.cached() == "a1"
    clock.now += 95
    assert source.cached() is None  # due: the caller fetches through `current`
