"""OAuth2 access tokens for a target (RFC 6749: the client-credentials grant, §4.4, and the
refresh-token grant, §6), through Authlib's OAuth2 client, over httpx.

One `TokenSource` per connection and process: every chain of a warm worker sending to that target
shares its access token. The token is renewed shortly before it expires (a tenth of its lifetime,
at most 60 s, before `expires_in` runs out; a token without a lifetime is kept until a 401), and
once when a request is answered 401: the request is sent again with the new token, and only a 401
on a token fetched for that very request reaches the writer (`Unauthorized`). Several requests
meeting the same expired token renew it once.

A token answer carrying a new refresh token (rotation) hands it to the connection's
`RefreshTokenStore` (the chain keeps it in the delivery database, so the next process starts from
it); the configured secret itself is never stored. The token endpoint refusing the client or the
grant (400, 401, 403) is `Unauthorized`, a fault of the rule; one that cannot be reached or answers
429 or 5xx is a `TargetUnavailable` of the record being sent (retried, counted by the breaker, and,
as any outage, never parking a record).
"""

from __future__ import annotations

import asyncio
import functools
import threading
import time
from collections.abc import AsyncGenerator, Callable, Generator, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import httpx

from delivery.errors import TargetUnavailable, Unauthorized

#: The longest before its expiry a token is renewed; a token living less renews at a tenth of it.
MAX_EARLY_SECONDS = 60.0
GRANTS = ("refresh_token", "client_credentials")


class RefreshTokenStore(Protocol):
    """Where a rotated refresh token is kept between processes (the delivery database)."""

    def load(self) -> str | None: ...

    def save(self, refresh_token: str) -> None: ...

    def forget(self) -> None: ...


@dataclass(frozen=True)
class OAuth2Settings:
    """What a connection's `auth: {kind: oauth2, ...}` says, with its secrets read."""

    connection: str
    token_url: str
    grant: str
    client_id: str
    client_secret: str
    refresh_token: str | None = None
    scope: str | None = None
    #: Where the secrets come from, as messages name them (never a value).
    source: str = "oauth2"


@functools.cache
def _authlib() -> tuple[Any, Any]:
    """Authlib's OAuth2 client over httpx, and its error class. Imported when a token is first
    fetched: Authlib is a tenth of a second, and every process that looks up a writer imports this
    module, `delivery run` with nothing to do included (issue #33 point 6)."""
    from authlib.integrations.base_client.errors import OAuthError
    from authlib.oauth2.auth import ClientAuth
    from authlib.oauth2.client import OAuth2Client

    class FormClientAuth(httpx.Auth, ClientAuth):  # type: ignore[misc]
        """Authlib's client authentication (the credentials in the form body) as an httpx auth."""

        requires_request_body = True

        def auth_flow(self, request: httpx.Request) -> Generator[httpx.Request, httpx.Response, None]:
            url, headers, body = self.prepare(request.method, str(request.url), request.headers, request.content)
            content = body.encode() if isinstance(body, str) else body
            yield httpx.Request(
                request.method, url, headers={**headers, "Content-Length": str(len(content))}, content=content
            )

    class Client(OAuth2Client):  # type: ignore[misc]
        client_auth_class = FormClientAuth
        oauth_error_class = OAuthError

    return Client, OAuthError


class _Token:
    def __init__(self, access_token: str, expires_in: Any, clock: Callable[[], float]) -> None:
        self.access_token = access_token
        self.clock = clock
        lifetime = float(expires_in) if isinstance(expires_in, (int, float, str)) and _number(expires_in) else None
        self.renew_at = None if lifetime is None else clock() + renew_after(lifetime)

    def due(self) -> bool:
        return self.renew_at is not None and self.clock() >= self.renew_at


def renew_after(lifetime: float) -> float:
    """How long after it was issued a token living `lifetime` seconds is renewed: a tenth of its
    lifetime, at most `MAX_EARLY_SECONDS`, before it runs out."""
    return lifetime - min(MAX_EARLY_SECONDS, lifetime / 10)


def _number(value: Any) -> bool:
    try:
        return float(value) > 0
    except (TypeError, ValueError):
        return False


class TokenSource:
    """The access token of one connection in this process (see the module's docstring)."""

    def __init__(
        self,
        settings: OAuth2Settings,
        store: RefreshTokenStore | None,
        timeout: float,
        *,
        clock: Callable[[], float] = time.monotonic,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        self.settings = settings
        self.store = store
        self.timeout = timeout
        self.clock = clock
        self.transport = transport
        self._lock = threading.Lock()
        self._token: _Token | None = None
        #: Token requests made, all told (for tests and the run's report).
        self.fetches = 0

    def current(self) -> tuple[str, bool]:
        """The access token to send, and whether it was fetched by this call."""
        with self._lock:
            if self._token is not None and not self._token.due():
                return self._token.access_token, False
            return self._fetch(), True

    def cached(self) -> str | None:
        """The access token held, if it is not due for renewal; None when one must be fetched.
        Never waits for a fetch in progress (it then answers None, and the caller waits in
        `current`)."""
        if not self._lock.acquire(blocking=False):
            return None
        try:
            token = self._token
            return token.access_token if token is not None and not token.due() else None
        finally:
            self._lock.release()

    def renew(self, stale: str) -> str:
        """A new token after `stale` was answered 401, unless another request renewed it already."""
        with self._lock:
            if self._token is not None and self._token.access_token != stale and not self._token.due():
                return self._token.access_token
            return self._fetch()

    def secrets(self) -> tuple[str, ...]:
        """Every secret this source holds or held, for redaction."""
        with self._lock:
            held = [self.settings.client_secret, self.settings.refresh_token or ""]
            if self._token is not None:
                held.append(self._token.access_token)
        return tuple(s for s in held if s)

    def _fetch(self) -> str:
        settings = self.settings
        client_class, oauth_error = _authlib()
        with httpx.Client(timeout=self.timeout, trust_env=False, transport=self.transport) as session:
            client = client_class(
                session=session,
                client_id=settings.client_id,
                client_secret=settings.client_secret,
                token_endpoint_auth_method="client_secret_post",
                scope=settings.scope,
            )
            client.register_compliance_hook("access_token_response", self._judge)
            client.register_compliance_hook("refresh_token_response", self._judge)
            self.fetches += 1
            try:
                if settings.grant == "client_credentials":
                    token = client.fetch_token(settings.token_url, grant_type="client_credentials")
                else:
                    token = self._refresh(client)
            except oauth_error as exc:
                raise self._refused(f"{exc.error}") from None
            except httpx.TimeoutException as exc:
                # No request to the target went out: its outcome is known (not applied).
                raise TargetUnavailable(
                    f"token endpoint: timed out ({type(exc).__name__})", outcome_unknown=False
                ) from None
            except httpx.TransportError as exc:
                raise TargetUnavailable(
                    f"token endpoint: connection error: {type(exc).__name__}", outcome_unknown=False
                ) from None
            except (ValueError, KeyError) as exc:
                raise self._refused(f"an answer without a token ({type(exc).__name__})") from None
        access = token.get("access_token") if isinstance(token, Mapping) else None
        if not isinstance(access, str) or not access:
            raise self._refused("an answer without an access_token")
        rotated = token.get("refresh_token")
        store = self.store if settings.grant == "refresh_token" else None
        if store is not None and isinstance(rotated, str) and rotated not in ("", settings.refresh_token, store.load()):
            store.save(rotated)
        self._token = _Token(access, token.get("expires_in"), self.clock)
        return access

    def _refresh(self, client: Any) -> Any:
        """The refresh-token grant, with the token rotated in last (kept in the store) or else the
        configured one. A stored token the endpoint refuses (revoked, or from before the
        configured secret was changed) is forgotten, and the configured one tried once."""
        settings = self.settings
        stored = self.store.load() if self.store is not None else None
        if stored is None or stored == settings.refresh_token:
            return client.refresh_token(settings.token_url, refresh_token=settings.refresh_token)
        try:
            return client.refresh_token(settings.token_url, refresh_token=stored)
        except Unauthorized:
            assert self.store is not None
            self.store.forget()
            return client.refresh_token(settings.token_url, refresh_token=settings.refresh_token)

    def _judge(self, response: httpx.Response) -> httpx.Response:
        """The token endpoint's answer, before Authlib reads it: 429 and 5xx are the target's
        passing faults; a refusal is read by Authlib (`invalid_grant`, `invalid_client`)."""
        code = response.status_code
        if code == 429 or code >= 500:
            retry_after = response.headers.get("Retry-After")
            seconds = float(retry_after) if retry_after and retry_after.isdigit() else None
            raise TargetUnavailable(f"token endpoint: HTTP {code}", seconds, outcome_unknown=False, status_code=code)
        if code >= 400:
            try:
                error = response.json().get("error")
            except (ValueError, AttributeError):
                error = None
            raise self._refused(f"HTTP {code}" + (f" {error}" if isinstance(error, str) else ""))
        return response

    def _refused(self, why: str) -> Unauthorized:
        settings = self.settings
        return Unauthorized(
            settings.connection, settings.source, f"the token endpoint refused the {settings.grant} grant: {why}"
        )


class OAuth2Bearer(httpx.Auth):
    """Sends each request with the source's access token; a 401 renews it once and sends again."""

    def __init__(self, source: TokenSource) -> None:
        self.source = source

    def sync_auth_flow(self, request: httpx.Request) -> Generator[httpx.Request, httpx.Response, None]:
        token, fresh = self.source.current()
        request.headers["Authorization"] = f"Bearer {token}"
        response = yield request
        if response.status_code == 401 and not fresh:
            response.read()
            request.headers["Authorization"] = f"Bearer {self.source.renew(token)}"
            yield request

    async def async_auth_flow(self, request: httpx.Request) -> AsyncGenerator[httpx.Request, httpx.Response]:
        cached = self.source.cached()
        # Only a token request (network I/O) goes to a thread: the event loop never waits on it.
        token, fresh = (cached, False) if cached is not None else await asyncio.to_thread(self.source.current)
        request.headers["Authorization"] = f"Bearer {token}"
        response = yield request
        if response.status_code == 401 and not fresh:
            await response.aread()
            renewed = await asyncio.to_thread(self.source.renew, token)
            request.headers["Authorization"] = f"Bearer {renewed}"
            yield request


_SOURCES: dict[tuple[Any, ...], TokenSource] = {}
_SOURCES_LOCK = threading.Lock()


def token_source(settings: OAuth2Settings, store: RefreshTokenStore | None, timeout: float) -> TokenSource:
    """The process's token source for these settings (a warm worker's chains share it)."""
    key = (
        settings.connection,
        settings.token_url,
        settings.grant,
        settings.client_id,
        settings.client_secret,
        settings.refresh_token,
        settings.scope,
    )
    with _SOURCES_LOCK:
        source = _SOURCES.get(key)
        if source is None:
            source = _SOURCES[key] = TokenSource(settings, store, timeout)
        elif store is not None:
            source.store = store
        return source


def forget_token_sources() -> None:
    """Drop every cached token (tests, and a process that wants to start afresh)."""
    with _SOURCES_LOCK:
        _SOURCES.clear()
