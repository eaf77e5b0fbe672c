"""The configuration file (`delivery apply CONFIG.yaml`): its shape, and every check that happens
before anything is written. Save-time validation (ADR-0030, CFX-217) lives here: a rule whose target driver
has no writer, or whose policy needs a verb the writer's type lacks, is refused."""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Iterable
from pathlib import Path
from types import UnionType
from typing import Annotated, Any, Literal, Union, get_args, get_origin

import httpx
import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator, model_validator

from delivery import templates
from delivery.domain import (
    DEFAULT_MAX_DELETES_PER_CHAIN,
    DEFAULT_MAX_PAUSE_SECONDS,
    AuthSettings,
    BatchEndpoints,
    BatchShape,
    BreakerSettings,
    ConnectionSpec,
    ConnectionStatus,
    DeletePolicy,
    Forbidden,
    Nulls,
    Policy,
    RateLimit,
    RequestShape,
    RuleSpec,
    SavedRule,
    SettleMode,
    Verb,
    rule_verbs,
)
from delivery.errors import ConfigError
from delivery.storable import text_problem
from delivery.templates import METHODS
from delivery.writers.base import Writer, batch_verbs_of, verbs_of
from delivery.writers.registry import find_writer, registered_drivers

Name = Annotated[str, Field(min_length=1, max_length=200, pattern=r"^[A-Za-z0-9][A-Za-z0-9_.\-]*$")]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=False, frozen=True)

    @field_validator("*", mode="before")
    @classmethod
    def _no_yes_or_no_for_a_number(cls, value: Any, info: ValidationInfo) -> Any:
        # Lax pydantic reads `true` as 1 for a number: `timeout_seconds: true` would save 1 second.
        annotation = cls.model_fields[info.field_name or ""].annotation
        if get_origin(annotation) in (Union, UnionType):  # an optional number: `float | None`
            annotation = next(arg for arg in get_args(annotation) if arg is not type(None))
        if get_origin(annotation) is list:
            annotation, values = get_args(annotation)[0], value if isinstance(value, list) else [value]
        else:
            values = [value]
        if get_origin(annotation) is Annotated:
            annotation = get_args(annotation)[0]
        if annotation in (int, float) and any(isinstance(item, bool) for item in values):
            raise ValueError("must be a number, not true or false")
        return value


#: The smallest durations and rate the engine computes with: a second's thousandth, and one request
#: in a thousand seconds. Below them a value is refused at apply, naming its field, rather than
#: accepted and met later as an overflow in every chain (`per_second: 1e-300` spaces its slots
#: further apart than a date can reach) or as a timeout no request can meet.
MIN_SECONDS = 0.001
MIN_PER_SECOND = 0.001


class BreakerConfig(_Strict):
    fail_max: int = Field(default=5, ge=1, le=10_000)
    reset_seconds: float = Field(default=60.0, ge=MIN_SECONDS, le=86_400)


class RateLimitConfig(_Strict):
    per_second: float | None = Field(default=None, ge=MIN_PER_SECOND, le=100_000)
    per_day: int | None = Field(default=None, ge=1, le=1_000_000_000)

    @model_validator(mode="after")
    def _some_limit(self) -> RateLimitConfig:
        if self.per_second is None and self.per_day is None:
            raise ValueError("give per_second, per_day or both")
        return self


# A path under the connection's base URL: no scheme, no query, no leading slash.
BatchPath = Annotated[str, Field(min_length=1, max_length=500, pattern=r"^[A-Za-z0-9_\-.~][A-Za-z0-9_\-.~/]*$")]


class BatchRequestConfig(_Strict):
    """One verb's batch call, as the target documents it (see `delivery.domain.BatchShape`)."""

    method: str | None = None
    path: str = Field(min_length=1, max_length=500)
    body: Any = Field(default_factory=lambda: {"items": "{{ items }}"})
    item: Any = "{{ fields }}"
    results_at: str = Field(default="results", min_length=1, max_length=200, pattern=r"^[^.\s]+(\.[^.\s]+)*$")
    match: str | None = Field(default=None, min_length=1, max_length=200)
    id_at: str | None = Field(default=None, min_length=1, max_length=200, pattern=r"^[^.\s]+(\.[^.\s]+)*$")

    def shape(self, verb: str) -> BatchShape:
        method = self.method or METHODS[verb][0]
        item = self.item
        if verb == "delete":
            # A batch delete carries a body, which a DELETE request should not: POST, unless told.
            method = self.method or "POST"
            if "item" not in self.model_fields_set:
                item = {"id": "{{ remote_id }}"}  # a delete's item names the record, and nothing else
        return BatchShape(method, self.path, self.body, item, self.results_at, self.match, self.id_at)


class BatchConfig(_Strict):
    create_path: BatchPath | None = None
    update_path: BatchPath | None = None
    delete_path: BatchPath | None = None
    max_items: int = Field(default=100, ge=1, le=10_000)
    create: BatchRequestConfig | None = None
    update: BatchRequestConfig | None = None
    delete: BatchRequestConfig | None = None

    @model_validator(mode="after")
    def _some_path(self) -> BatchConfig:
        verbs = ("create", "update", "delete")
        if all(getattr(self, f"{v}_path") is None and getattr(self, v) is None for v in verbs):
            raise ValueError("give create_path, update_path, delete_path, create, update or delete")
        for verb in verbs:
            if getattr(self, f"{verb}_path") is not None and getattr(self, verb) is not None:
                raise ValueError(f"{verb}_path and {verb}: describe the batch {verb} once")
        return self

    def endpoints(self) -> BatchEndpoints:
        create = None if self.create is None else self.create.shape("create")
        update = None if self.update is None else self.update.shape("update")
        delete = None if self.delete is None else self.delete.shape("delete")
        return BatchEndpoints(
            create.path if create else self.create_path,
            update.path if update else self.update_path,
            self.max_items,
            create,
            update,
            delete.path if delete else self.delete_path,
            delete,
        )


EnvName = Annotated[str, Field(max_length=200, pattern=r"^[A-Za-z_][A-Za-z0-9_]*$")]
# A Prefect Secret block's name (Prefect allows lowercase letters, digits and dashes).
BlockName = Annotated[str, Field(max_length=200, pattern=r"^[a-z0-9][a-z0-9-]*$")]
# An HTTP header's name (RFC 9110's token characters) and a value a header can carry.
HeaderName = Annotated[str, Field(min_length=1, max_length=200, pattern=r"^[!#$%&'*+\-.^_`|~0-9A-Za-z]+$")]
HeaderValue = Annotated[str, Field(max_length=2000, pattern=r"^[\x20-\x7e]*$")]

#: The secrets each auth kind reads, each from an environment variable (`NAME_env`) or a Prefect
#: Secret block (`NAME_secret`).
AUTH_SECRETS: dict[str, tuple[str, ...]] = {
    "bearer": ("token",),
    "header": ("token",),
    "basic": ("username", "password"),
    "oauth2": ("client_id", "client_secret", "refresh_token"),
}


class AuthConfig(_Strict):
    """How requests to a target prove who sends them (see `delivery.domain.AuthSettings`)."""

    kind: Literal["bearer", "header", "basic", "oauth2"]
    header: HeaderName | None = None
    token_env: EnvName | None = None
    token_secret: BlockName | None = None
    username_env: EnvName | None = None
    username_secret: BlockName | None = None
    password_env: EnvName | None = None
    password_secret: BlockName | None = None
    token_url: str | None = Field(default=None, max_length=2000, pattern=r"^https?://[^\s]+$")
    grant: Literal["refresh_token", "client_credentials"] | None = None
    client_id_env: EnvName | None = None
    client_id_secret: BlockName | None = None
    client_secret_env: EnvName | None = None
    client_secret_secret: BlockName | None = None
    refresh_token_env: EnvName | None = None
    refresh_token_secret: BlockName | None = None
    scope: str | None = Field(default=None, min_length=1, max_length=1000, pattern=r"^[\x21-\x7e]+( [\x21-\x7e]+)*$")

    @model_validator(mode="after")
    def _keys_of_the_kind(self) -> AuthConfig:
        problems = []
        needed = set(AUTH_SECRETS[self.kind])
        if self.kind == "oauth2" and self.grant == "client_credentials":
            needed.discard("refresh_token")
        for secret in sorted({name for names in AUTH_SECRETS.values() for name in names}):
            env, block = getattr(self, f"{secret}_env"), getattr(self, f"{secret}_secret")
            if secret not in needed:
                if env is not None or block is not None:
                    given = f"{secret}_env" if env is not None else f"{secret}_secret"
                    problems.append(f"{given} is not read by kind {self.kind}" + _grant_note(self, secret))
            elif env is None and block is None:
                problems.append(f"kind {self.kind} needs {secret}_env or {secret}_secret")
            elif env is not None and block is not None:
                problems.append(f"{secret}_env and {secret}_secret: name one of them, not both")
        only = {"header": self.kind == "header", "token_url": self.kind == "oauth2", "grant": self.kind == "oauth2"}
        for key, belongs in only.items():
            if belongs and getattr(self, key) is None:
                problems.append(f"kind {self.kind} needs {key}")
            elif not belongs and getattr(self, key) is not None:
                problems.append(f"{key} is not read by kind {self.kind}")
        if self.scope is not None and self.kind != "oauth2":
            problems.append(f"scope is not read by kind {self.kind}")
        if problems:
            raise ValueError("; ".join(problems))
        return self

    def settings(self) -> AuthSettings:
        return AuthSettings(
            kind=self.kind,
            keys=tuple((key, value) for key, value in self.model_dump(exclude_none=True).items() if key != "kind"),
        )


def _grant_note(auth: AuthConfig, secret: str) -> str:
    return " with grant client_credentials" if auth.kind == "oauth2" and secret == "refresh_token" else ""


class RequestConfig(_Strict):
    """One verb's request, as the target documents it (see `delivery.templates`)."""

    method: str | None = None
    path: str = Field(min_length=1, max_length=2000)
    body: Any = "{{ fields }}"
    id_at: str | None = Field(default=None, min_length=1, max_length=200, pattern=r"^[^.\s]+(\.[^.\s]+)*$")


class RequestsConfig(_Strict):
    create: RequestConfig | None = None
    update: RequestConfig | None = None
    delete: RequestConfig | None = None


class ConnectionConfig(_Strict):
    name: Name
    driver: str | None = Field(default=None, min_length=1, max_length=200)
    # None: a new connection starts active, an existing one keeps the status an operator gave it.
    status: ConnectionStatus | None = None
    base_url: str | None = Field(default=None, max_length=2000, pattern=r"^https?://[^\s]+$")
    token_env: str | None = Field(default=None, max_length=200, pattern=r"^[A-Za-z_][A-Za-z0-9_]*$")
    # A Prefect Secret block's name (Prefect allows lowercase letters, digits and dashes).
    token_secret: str | None = Field(default=None, max_length=200, pattern=r"^[a-z0-9][a-z0-9-]*$")
    timeout_seconds: float = Field(default=10.0, ge=MIN_SECONDS, le=600)
    id_field: str = Field(default="id", min_length=1, max_length=200)
    breaker: BreakerConfig = BreakerConfig()
    # As a target: how chains commit the ledger writes of what they deliver to it (see SettleMode).
    settle: SettleMode = SettleMode.GROUPED
    # As a target: what its HTTP 403 means (see Forbidden): the token's fault (the rule's), or the record's.
    forbidden: Forbidden = Forbidden.TOKEN
    # As a target: its request budget, shared by every rule and worker sending to it.
    rate_limit: RateLimitConfig | None = None
    # As a target: the longest a Retry-After (with a 429 or 503) pauses every send to it.
    max_pause_seconds: float = Field(default=DEFAULT_MAX_PAUSE_SECONDS, ge=MIN_SECONDS, le=86_400)
    # As a target: its batch endpoints.
    batch: BatchConfig | None = None
    # As a target: headers sent with every request, each verb's request, and how it authenticates.
    headers: dict[HeaderName, HeaderValue] | None = None
    requests: RequestsConfig | None = None
    auth: AuthConfig | None = None

    @field_validator("base_url")
    @classmethod
    def _base_url_a_client_can_use(cls, value: str | None) -> str | None:
        problem = None if value is None else base_url_problem(value)
        if problem is not None:
            raise ValueError(problem)
        return value

    @model_validator(mode="after")
    def _one_token_source(self) -> ConnectionConfig:
        # Two sources would leave it to the engine to pick one, and an operator rotating one of
        # them would not know whether it counts.
        if self.token_env is not None and self.token_secret is not None:
            raise ValueError("token_env and token_secret: name one of them, not both")
        if self.auth is not None and (self.token_env is not None or self.token_secret is not None):
            given = "token_env" if self.token_env is not None else "token_secret"
            raise ValueError(
                f"auth and {given}: name the credentials in one place (auth: {{kind: bearer, {given}: ...}})"
            )
        return self

    def spec(self) -> ConnectionSpec:
        return ConnectionSpec(
            name=self.name,
            driver=self.driver,
            status=self.status,
            base_url=self.base_url,
            token_env=self.token_env,
            timeout_seconds=self.timeout_seconds,
            id_field=self.id_field,
            breaker=BreakerSettings(self.breaker.fail_max, self.breaker.reset_seconds),
            token_secret=self.token_secret,
            settle=self.settle,
            forbidden=self.forbidden,
            rate_limit=None
            if self.rate_limit is None
            else RateLimit(self.rate_limit.per_second, self.rate_limit.per_day),
            max_pause_seconds=self.max_pause_seconds,
            batch=None if self.batch is None else self.batch.endpoints(),
            headers=tuple(sorted((self.headers or {}).items())),
            requests=self._request_shapes(),
            auth=None if self.auth is None else self.auth.settings(),
        )

    def _request_shapes(self) -> tuple[tuple[str, RequestShape], ...]:
        if self.requests is None:
            return ()
        shapes = []
        for verb in ("create", "update", "delete"):
            request: RequestConfig | None = getattr(self.requests, verb)
            if request is not None:
                method = request.method or METHODS[verb][0]
                body = request.body
                if verb == "delete" and "body" not in request.model_fields_set:
                    body = None  # a delete sends no body unless its template gives one
                shapes.append((verb, RequestShape(method, request.path, body, request.id_at)))
        return tuple(shapes)


def base_url_problem(url: str) -> str | None:
    """Why the REST writer could not send to `url`, or None: httpx must parse it, it must name a
    host and a port from 1 to 65535 (httpx takes 0 or 99999 and fails only when connecting), it
    must hold no query or fragment (the collection and the record's id are appended to its
    path), and the writer's client must build a request on it as it will (the URL with one
    trailing `/`). The reason never repeats the URL, which may carry a user and password."""
    try:
        parsed = httpx.URL(url)
        port = parsed.port
        # As the writer builds its client; a transport that sends nothing, so no TLS set-up.
        with httpx.Client(
            base_url=url.rstrip("/") + "/", transport=httpx.MockTransport(_no_sending), trust_env=False
        ) as client:
            client.build_request("POST", "x")
    except (httpx.InvalidURL, ValueError, TypeError) as exc:  # a bad IDNA host is a UnicodeError, a ValueError
        # httpx's reason quotes the part it stopped at: left out when the URL holds a user and password.
        return "httpx cannot read it as a URL" + ("" if "@" in url else f" ({exc})")
    if not parsed.host:
        return "names no host"
    if port is not None and not 1 <= port <= 65535:
        return f"has port {port}, outside 1 to 65535"
    if parsed.query or parsed.fragment or "?" in url or "#" in url:
        return "must hold no query (?...) or fragment (#...): the collection and record ids are appended to its path"
    return None


def _no_sending(request: httpx.Request) -> httpx.Response:  # pragma: no cover - never called
    raise AssertionError("base_url_problem builds a request and never sends it")


#: A percent-escape that a server may decode into a dot, a slash or a backslash after the URL was
#: checked: `%2e%2e` is `..` in disguise.
_PATH_ESCAPE = re.compile(r"%(2e|2f|5c)", re.IGNORECASE)


class RuleConfig(_Strict):
    name: Name
    source: Name
    domain: Annotated[str, Field(min_length=1, max_length=200)]
    target: Name
    collection: Annotated[str, Field(min_length=1, max_length=500, pattern=r"^[^\s?#]+$")]
    policy: Policy = Policy.CREATE_AND_UPDATE
    batch_size: int = Field(default=100, ge=1, le=10_000)
    overlap_seconds: int = Field(default=300, ge=0, le=86_400 * 7)
    max_attempts: int = Field(default=5, ge=1, le=1000)
    retry_schedule_seconds: list[Annotated[int, Field(ge=0, le=86_400 * 7)]] = Field(
        default_factory=lambda: [60, 300, 1800, 7200], min_length=1
    )
    fields: dict[str, str] | None = None
    enabled: bool = True
    concurrency: int = Field(default=1, ge=1, le=64)
    # A mapped field whose value is null: sent as null (clearing it in the target), or left out.
    nulls: Nulls = Nulls.SEND
    # A record deleted in the source: left in the target, or deleted where this rule created it.
    deletes: DeletePolicy = DeletePolicy.IGNORE
    # The most deletes one chain may send; a batch that would go past it sends nothing (0: none).
    max_deletes_per_chain: int = Field(default=DEFAULT_MAX_DELETES_PER_CHAIN, ge=0, le=1_000_000_000)

    @field_validator("collection")
    @classmethod
    def _collection_stays_under_the_base_url(cls, value: str) -> str:
        # Joined to the base URL as a relative path (httpx drops one leading `/`): a `.` or `..`
        # segment, or an escape a server decodes into one, would address a path outside it, and a
        # first segment holding `:` would read as a URL scheme. Anything else a path may hold
        # (`v1/records:batchCreate`, `My%20List`, `bücher`) is the target's business.
        segments = value.removeprefix("/").split("/")
        if any(segment in ("", ".", "..") for segment in segments) or "\\" in value or _PATH_ESCAPE.search(value):
            raise ValueError(
                "must stay under the base URL: path segments separated by '/', none empty, '.' or '..', "
                "no backslash, no %2e, %2f or %5c escape"
            )
        if ":" in segments[0]:
            raise ValueError("must not hold ':' in its first segment, which would read as a URL scheme")
        return value

    @field_validator("fields")
    @classmethod
    def _fields_not_empty(cls, value: dict[str, str] | None) -> dict[str, str] | None:
        if value is not None and not value:
            raise ValueError("must map at least one field, or be left out to send the whole payload")
        return value

    def spec(self) -> RuleSpec:
        return RuleSpec(
            name=self.name,
            source=self.source,
            domain=self.domain,
            target=self.target,
            collection=self.collection,
            policy=self.policy,
            batch_size=self.batch_size,
            overlap_seconds=self.overlap_seconds,
            max_attempts=self.max_attempts,
            retry_schedule_seconds=tuple(self.retry_schedule_seconds),
            fields=self.fields,
            enabled=self.enabled,
            concurrency=self.concurrency,
            nulls=self.nulls,
            deletes=self.deletes,
            max_deletes_per_chain=self.max_deletes_per_chain,
        )


class DeliveryConfig(_Strict):
    connections: list[ConnectionConfig] = Field(default_factory=list)
    rules: list[RuleConfig] = Field(default_factory=list)


def _location(loc: tuple[int | str, ...]) -> str:
    path = ""
    for part in loc:
        path += f"[{part}]" if isinstance(part, int) else (f".{part}" if path else str(part))
    return path or "(top level)"


#: How deep mappings and lists may nest in a config file, aliases expanded. A config needs five
#: levels (the file, `rules`, a rule, `fields`, a value); the bound keeps YAML's own reader and the
#: checks after it, which all recurse, far from Python's recursion limit.
MAX_DEPTH = 50
#: How many nodes aliases may repeat in one file, all together. `<<: *defaults` in each of a
#: thousand rules stays far below it; a "billion laughs" (each anchor a list of aliases of the one
#: before) reaches it within a few lines, where it would otherwise expand into billions of values.
MAX_ALIASED_NODES = 100_000


class _LimitError(yaml.composer.ComposerError):
    """A file YAML would read, refused for what reading it would cost: a recursive alias, aliases
    that expand too far, nesting too deep."""


class _StrictLoader(yaml.SafeLoader):
    """PyYAML's safe loader, except that:

    - a key given twice in one mapping is an error: PyYAML keeps the last and drops the first
      without a word, so a second `connections:` would silently discard every connection of the
      first. Keys a merge (`<<: *anchor`) brings in may still be overridden, as YAML means them to be;
    - an alias inside the node it names (`a: &a [*a]`) is refused, and so are aliases that
      together repeat more than MAX_ALIASED_NODES nodes, and nesting deeper than MAX_DEPTH
      (aliases expanded): each is counted while the file is composed, before any value is built;
    - a value its tag cannot build (`!!int x`, a date that does not exist, an integer of more
      digits than Python reads) is an error at its place instead of a Python exception."""

    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        self._depth = 0
        #: The anchors whose node is being composed: an alias to one of them would be a cycle.
        self._open_anchors: set[str] = set()
        #: Per node composed (by id, while the document holds them all): the nodes it holds and
        #: the levels it spans, aliases expanded.
        self._sizes: dict[int, tuple[int, int]] = {}
        self._aliased = 0

    def compose_node(self, parent: yaml.Node | None, index: int) -> yaml.Node | None:
        event = self.peek_event()  # type: ignore[no-untyped-call]
        mark: Any = event.start_mark  # PyYAML's pure-Python mark (the stubs allow libyaml's too)
        if isinstance(event, yaml.AliasEvent):
            anchor = event.anchor
            if anchor in self._open_anchors:
                raise _LimitError(
                    None,
                    None,
                    f"the alias *{anchor} stands inside the node &{anchor} names: a recursive alias, which never ends",
                    mark,
                )
            node = super().compose_node(parent, index)  # an undefined alias: PyYAML's own error
            assert node is not None
            nodes, levels = self._sizes[id(node)]
            self._aliased += nodes
            if self._aliased > MAX_ALIASED_NODES:
                raise _LimitError(
                    None,
                    None,
                    f"with *{anchor}, aliases repeat more than {MAX_ALIASED_NODES:,} values in all "
                    "(aliases are limited: write the repeated part out, or repeat it less)",
                    mark,
                )
            if self._depth + levels > MAX_DEPTH:
                raise _LimitError(
                    None,
                    None,
                    f"with *{anchor} expanded, mappings and lists nest more than {MAX_DEPTH} levels deep",
                    mark,
                )
            return node
        self._depth += 1
        if self._depth > MAX_DEPTH:
            raise _LimitError(
                None, None, f"mappings and lists nest more than {MAX_DEPTH} levels deep", event.start_mark
            )
        anchor = getattr(event, "anchor", None)
        if anchor is not None:
            self._open_anchors.add(anchor)
        node = super().compose_node(parent, index)
        assert node is not None
        self._open_anchors.discard(anchor)
        self._depth -= 1
        self._sizes[id(node)] = self._size(node)
        return node

    def _size(self, node: yaml.Node) -> tuple[int, int]:
        if isinstance(node, yaml.MappingNode):
            children = [child for pair in node.value for child in pair]
        elif isinstance(node, yaml.SequenceNode):
            children = list(node.value)
        else:
            return 1, 1
        # Every child was composed before its parent (an alias's node before the alias).
        sizes = [self._sizes[id(child)] for child in children]
        return 1 + sum(nodes for nodes, _ in sizes), 1 + max((levels for _, levels in sizes), default=0)

    def construct_object(self, node: yaml.Node, deep: bool = False) -> Any:
        try:
            return super().construct_object(node, deep=deep)
        except (ArithmeticError, LookupError, TypeError, ValueError, AttributeError) as exc:
            # `!!bool x` is a KeyError, `!!timestamp x` an AttributeError, `2001-13-45` a ValueError.
            tag = node.tag.replace("tag:yaml.org,2002:", "!!")
            if isinstance(exc, ValueError) and "integer string conversion" in str(exc):
                problem = f"an integer of more than {sys.get_int_max_str_digits()} digits cannot be read"
            else:
                problem = f"this value cannot be read as {tag}" + (f" ({exc})" if isinstance(exc, ValueError) else "")
            raise yaml.constructor.ConstructorError(None, None, problem, node.start_mark) from exc

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        if not isinstance(node, yaml.MappingNode):  # `!!map [a]`: PyYAML's own check names it
            return super().construct_mapping(node, deep=deep)
        seen: dict[Any, yaml.Node] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = self.construct_object(key_node, deep=True)
            try:
                first = seen.get(key)
            except TypeError:  # an unhashable key: PyYAML's own check below names it
                continue
            if first is not None:
                raise yaml.constructor.ConstructorError(
                    None,
                    None,
                    f"the key {key!r} is given twice in one mapping (first at line {first.start_mark.line + 1})",
                    key_node.start_mark,
                )
            seen[key] = key_node
        return super().construct_mapping(node, deep=deep)


def _position(text: str, index: int) -> str:
    """The line and column of the character at `index`, both from 1."""
    line_start = text.rfind("\n", 0, index) + 1
    return f"line {text.count(chr(10), 0, index) + 1}, column {index - line_start + 1}"


def parse_config(text: str, origin: str = "config") -> DeliveryConfig:
    """Parse and validate the shape; every problem names where it is."""
    try:
        data: Any = yaml.load(text, Loader=_StrictLoader)
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark
        where = f"line {mark.line + 1}, column {mark.column + 1}" if mark else "unknown position"
        what = "refused" if isinstance(exc, _LimitError) else "not valid YAML"
        raise ConfigError([f"{origin}: {what} at {where}: {exc.problem}"]) from exc
    except yaml.reader.ReaderError as exc:
        # A character YAML does not take (a control character): PyYAML's message spans two lines
        # and counts characters from the start of the file.
        character = f"U+{exc.character:04X}" if isinstance(exc.character, int) else repr(exc.character)
        raise ConfigError(
            [f"{origin}: not valid YAML at {_position(text, exc.position)}: the character {character} ({exc.reason})"]
        ) from exc
    except yaml.YAMLError as exc:
        raise ConfigError([f"{origin}: not valid YAML: {' '.join(str(exc).split())}"]) from exc
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError([f"{origin}: the top level must be a mapping with 'connections' and 'rules'"])
    unstorable = _unstorable_text(data, ())
    if unstorable:
        raise ConfigError(unstorable)
    try:
        config = DeliveryConfig.model_validate(data)
    except ValidationError as exc:
        problems = []
        for error in exc.errors():
            message = error["msg"].removeprefix("Value error, ")
            problems.append(f"{_location(error['loc'])}: {message}")
        raise ConfigError(problems) from exc
    _check_unique_names(config)
    requests = _request_problems(config)
    if requests:
        raise ConfigError(requests)
    return config


#: `{{ items }}` as a string of its own in a batch body (it then takes the list itself).
_ITEMS_ALONE = re.compile(r'"\{\{\s*items\s*\}\}"')


def _json_problem(template: Any, where: str) -> list[str]:
    """A template must be JSON as written (a YAML date or a non-string key is not), so that what is
    saved is what is read back and sent."""
    try:
        if json.loads(json.dumps(template)) != template:
            return [f"{where}: keys must be strings (JSON objects have no other keys)"]
    except (TypeError, ValueError) as exc:
        return [f"{where}: not JSON ({exc}); quote dates and other values YAML reads as something else"]
    return []


def _request_problems(config: DeliveryConfig) -> list[str]:
    """Each verb's request template checked (`delivery.templates.problems`): its method, its
    placeholders (the verb's own), its path. Every problem names its key path."""
    problems = []
    for index, connection in enumerate(config.connections):
        if connection.requests is None:
            continue
        for verb in ("create", "update", "delete"):
            request: RequestConfig | None = getattr(connection.requests, verb)
            if request is None:
                continue
            where = f"connections[{index}].requests.{verb}"
            if request.method is not None and request.method not in METHODS[verb]:
                problems.append(f"{where}.method: {request.method!r} is not one of {' | '.join(METHODS[verb])}")
            allowed = templates.VERB_PLACEHOLDERS[verb]
            problems.extend(templates.problems(request.path, f"{where}.path", allowed, path=True))
            problems.extend(_json_problem(request.body, f"{where}.body"))
            problems.extend(templates.problems(request.body, f"{where}.body", allowed))
            if verb != "create" and request.id_at is not None:
                problems.append(f"{where}.id_at: only a create's answer gives the record's id")
    for index, connection in enumerate(config.connections):
        for verb in ("create", "update", "delete"):
            batch: BatchRequestConfig | None = getattr(connection.batch, verb, None)
            if batch is None:
                continue
            where = f"connections[{index}].batch.{verb}"
            if batch.method is not None and batch.method not in METHODS[verb]:
                problems.append(f"{where}.method: {batch.method!r} is not one of {' | '.join(METHODS[verb])}")
            problems.extend(templates.problems(batch.path, f"{where}.path", frozenset({"collection"}), path=True))
            problems.extend(_json_problem(batch.body, f"{where}.body") + _json_problem(batch.item, f"{where}.item"))
            problems.extend(templates.problems(batch.body, f"{where}.body", templates.BATCH_BODY_PLACEHOLDERS))
            problems.extend(templates.problems(batch.item, f"{where}.item", templates.VERB_PLACEHOLDERS[verb]))
            if not _ITEMS_ALONE.search(json.dumps(batch.body, default=str)):
                problems.append(f"{where}.body: holds no {{{{ items }}}}: the call would carry none of its records")
            if verb != "create" and batch.id_at is not None:
                problems.append(f"{where}.id_at: only a create's results give the records' ids")
    return problems


def check_text(config: DeliveryConfig) -> None:
    """Refuse a config holding text SQLite and PostgreSQL would not store alike, or a request
    template that would not be accepted from a file, for a config built without `parse_config`
    (which checks the file's own text and templates first)."""
    problems = _unstorable_text(config.model_dump(), ()) + _request_problems(config)
    if problems:
        raise ConfigError(problems)


def _unstorable_text(value: Any, loc: tuple[int | str, ...]) -> list[str]:
    """Every string, key or value, that SQLite and PostgreSQL would not store alike: YAML's "\\0"
    or "\\ud800" escapes make a NUL or a lone surrogate, which no pattern or length check refuses
    (a `domain` or a `fields` entry takes any text)."""
    problems = []
    if isinstance(value, str):
        problem = text_problem(value)
        if problem is not None:
            problems.append(f"{_location(loc)}: {problem}")
    elif isinstance(value, dict):
        for key, item in value.items():
            problem = text_problem(key) if isinstance(key, str) else None
            if problem is not None:
                # The key itself is left out of the path: it would print the character.
                problems.append(f"{_location(loc)}: a key {problem}")
            else:
                problems.extend(_unstorable_text(item, (*loc, str(key))))
    elif isinstance(value, list):
        for index, item in enumerate(value):
            problems.extend(_unstorable_text(item, (*loc, index)))
    return problems


def _check_unique_names(config: DeliveryConfig) -> None:
    problems = []
    for kind, names in (
        ("connections", [c.name for c in config.connections]),
        ("rules", [r.name for r in config.rules]),
    ):
        seen: dict[str, int] = {}
        for index, name in enumerate(names):
            if name in seen:
                problems.append(f"{kind}[{index}].name: {name!r} is already declared at {kind}[{seen[name]}]")
            else:
                seen[name] = index
    if problems:
        raise ConfigError(problems)


def load_config(path: Path) -> DeliveryConfig:
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError([f"{path}: cannot be read: {exc.strerror}"]) from exc
    except UnicodeDecodeError as exc:
        raise ConfigError([f"{path}: not valid UTF-8 (byte {exc.start})"]) from exc
    return parse_config(text, str(path))


def check_rules(
    config: DeliveryConfig, known_connections: dict[str, str | None], saved_rules: Iterable[SavedRule] = ()
) -> None:
    """Cross-checks that need the connections: referenced names exist, the target's writer offers
    every verb the policy needs (one record per call or in batches: `verbs_of`), and a connection's
    `batch` paths name only verbs its driver offers in batches. `known_connections` maps name ->
    driver, the file's connections overriding the database's. `saved_rules` are the rules already in the database:
    the file's connections can change the driver under them, so each one whose target the file
    declares (and that the file does not re-declare itself) is checked against the result too."""
    problems = []
    for index, rule in enumerate(config.rules):
        where = f"rules[{index}]"
        if rule.source not in known_connections:
            problems.append(f"{where}.source: rule {rule.name!r}: no connection named {rule.source!r}")
        if rule.target not in known_connections:
            problems.append(f"{where}.target: rule {rule.name!r}: no connection named {rule.target!r}")
            continue
        driver = known_connections[rule.target]
        writer = find_writer(driver)
        if writer is None:
            has = "has no driver" if driver is None else f"has driver {driver!r}, which has no registered writer"
            problems.append(
                f"{where}.target: rule {rule.name!r}: target {rule.target!r} {has} "
                f"(drivers with a writer: {', '.join(registered_drivers())})"
            )
            continue
        missing = sorted(rule.policy.verbs - verbs_of(writer))
        for verb in missing:
            problems.append(
                f"{where}.policy: rule {rule.name!r}: policy {rule.policy.value!r} needs the {verb.value!r} verb, "
                f"which driver {driver!r} does not offer"
            )
        if rule.deletes is DeletePolicy.PROPAGATE and Verb.DELETE not in verbs_of(writer):
            problems.append(
                f"{where}.deletes: rule {rule.name!r}: deletes 'propagate' needs the 'delete' verb, "
                f"which driver {driver!r} does not offer (set deletes: ignore, or use a driver that deletes)"
            )
    problems.extend(_saved_rule_problems(config, known_connections, saved_rules))
    for index, connection in enumerate(config.connections):
        writer = find_writer(connection.driver)
        if writer is not None and writer.needs_base_url and not connection.base_url:
            problems.append(
                f"connections[{index}].base_url: connection {connection.name!r} with driver "
                f"{connection.driver!r} needs a base_url"
            )
        problems.extend(_batch_problems(index, connection, writer))
    if problems:
        raise ConfigError(problems)


def _batch_problems(index: int, connection: ConnectionConfig, writer: type[Writer] | None) -> list[str]:
    """A batch path the connection's driver would never send to: the driver offers no batch form
    of that verb, for a connection with these paths (`Writer.for_batch`). A driver with no
    registered writer is not judged here: a rule targeting it is refused for that already."""
    batch = connection.spec().batch
    if batch is None:
        return []
    problems = []
    for field, path, verb in (
        ("create_path", batch.create_path, Verb.CREATE),
        ("update_path", batch.update_path, Verb.UPDATE),
        ("delete_path", batch.delete_path, Verb.DELETE),
    ):
        if path is None:
            continue
        head = f"connections[{index}].batch.{field}: connection {connection.name!r} names a batch {verb.value} path"
        if connection.driver is None:
            problems.append(f"{head}, but has no driver to send to it")
        elif writer is not None and verb not in batch_verbs_of(writer.for_batch(batch)):
            lacks = (
                f"does not offer the {verb.value!r} verb at all"
                if verb not in verbs_of(writer)
                else f"offers no batch {verb.value!r} verb"
            )
            problems.append(f"{head}, but driver {connection.driver!r} {lacks}: remove batch.{field}")
    return problems


def _saved_rule_problems(
    config: DeliveryConfig, known_connections: dict[str, str | None], saved_rules: Iterable[SavedRule]
) -> list[str]:
    """A saved rule is only as valid as its target's driver: a file that re-declares that target
    with another driver (or none, which writes null) is refused where it would break the rule,
    at the connection's entry, since the saved rule has no place in the file."""
    declared = {connection.name: index for index, connection in enumerate(config.connections)}
    in_file = {rule.name for rule in config.rules}
    problems = []
    for saved in saved_rules:
        if saved.name in in_file or saved.target not in declared:
            continue
        problem = _saved_rule_problem(saved, known_connections.get(saved.target))
        if problem is not None:
            problems.append(f"connections[{declared[saved.target]}].driver: {problem}")
    return problems


def _saved_rule_problem(saved: SavedRule, driver: str | None) -> str | None:
    writer = find_writer(driver)
    missing = sorted(rule_verbs(saved.policy, saved.deletes) - (frozenset() if writer is None else verbs_of(writer)))
    if not missing:
        return None
    verbs = " and ".join(repr(verb.value) for verb in missing)
    plural = "s" if len(missing) > 1 else ""
    if saved.deletes is DeletePolicy.PROPAGATE:
        needs = f"the {verbs} verb{plural} its policy {saved.policy.value!r} and deletes 'propagate' need"
    else:
        needs = f"the {verbs} verb{plural} its policy {saved.policy.value!r} needs"
    head = f"rule {saved.name!r} (saved) targets {saved.target!r}"
    if driver is None:
        return f"{head}, which the file declares without a driver, so no writer offers {needs}"
    if writer is None:
        return f"{head}, whose driver {driver!r} has no registered writer, so nothing offers {needs}"
    return f"{head}, whose driver {driver!r} does not offer {needs}"
