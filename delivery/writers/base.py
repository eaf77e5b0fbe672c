"""The writer contract. ADR-0021: a writer states which verbs it offers in its *type*, so a
target without create or without update is an ordinary target, not a broken one. Capabilities
are ABC mixins, checked with `issubclass`/`isinstance` at save time and at write time.

A verb comes in two forms: one record per call (`Creates`, `Updates`, `Deletes`) and many records
per call (`CreatesMany`, `UpdatesMany`, `DeletesMany`, the batch verbs). A writer offers a verb if it offers either form
(`verbs_of`); `batch_verbs_of` says which verbs it offers in batch form. A driver whose batch verbs
depend on its connection (the `rest` family sends batches only where the connection names a batch
path) says so in `Writer.for_batch`, which returns the type that writes to that connection.

A batch verb answers one result per item, in item order: the item's outcome (a remote id for a
create, None for an update) or the `RecordFault` that item met, exactly the fault the one-record
verb would have raised for it. What concerns the whole call is raised, as the one-record verb
raises it: `TargetUnavailable` (the call failed in transport, or the target answered 429/5xx to the
whole call: every item's outcome is that fault), `Unauthorized` (the target refused the
credentials), and `BatchRefused` (a 4xx to the whole call without per-item results: the engine
splits the call and sends the halves, so that one bad record never parks its neighbours).

A verb also comes as a coroutine (`CreatesAsync`, `UpdatesAsync`: `acreate`, `aupdate`), raising
exactly what its one-record form raises. A writer offering them is called on one event loop, its
calls in flight as tasks, instead of a thread per call (`delivery.send_loop`): the job opens the
writer on that loop first (`aopen`, where a client bound to the loop is made) and closes it there
last (`aclose`). A writer may offer both forms (the `rest` family does): which one is called is the
job's choice (`delivery.senders.choose`). `thread_safe` then also says whether calls may
overlap on the loop: a writer keeping per-call state between awaits leaves it False and gets one
call at a time.
"""

from __future__ import annotations

import inspect
import re
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, TypeAlias

from delivery.domain import BatchEndpoints, Connection, MirrorRecord, Verb
from delivery.errors import RecordFault, RecordRejected
from delivery.settings import secret


class Writer(ABC):
    """Talks to one target connection for one rule's collection, for the length of one chain."""

    #: Whether a connection using this writer must declare `base_url` (checked at save time).
    needs_base_url: ClassVar[bool] = False
    #: Whether one instance may be called from several threads at once (a rule's `concurrency`
    #: above 1 is honoured only then; otherwise its writes stay one at a time).
    thread_safe: ClassVar[bool] = False
    #: Whether its one-record verbs take the mirrored record as a last argument (`record`), for
    #: requests described by templates (`{{ record.email }}`, `{{ external_id }}`).
    takes_record: ClassVar[bool] = False

    def __init__(self, target: Connection, collection: str, *, token: str | None = None, concurrency: int = 1) -> None:
        """`token`: the bearer token the chain resolved for `target` (`token_for`), None for a
        target that takes none. A writer sends what it is given and reads no credential itself.
        `concurrency`: how many calls the chain may make at once (the rule's, for a thread-safe
        writer; else 1): a pooled writer keeps that many connections. A writer that defines its own
        `__init__` must accept the `token` keyword, and gets `concurrency` only if it accepts it
        (`accepts_concurrency`)."""
        self.target = target
        self.collection = collection
        self.token = token
        self.concurrency = concurrency

    @classmethod
    def for_batch(cls, batch: BatchEndpoints | None) -> type[Writer]:
        """The type that writes to a connection with these batch endpoints (None: it names none).
        This type itself, unless the driver offers batch verbs only where its connection names
        them: the `rest` family returns a subclass with `CreatesMany` and/or `UpdatesMany`. Only
        the batch form of a verb the type already offers may be added: the verbs a driver offers
        (`verbs_of`) are judged on its registered type, without a connection."""
        return cls

    def close(self) -> None:  # noqa: B027 - optional hook, most writers hold nothing
        """Release pooled connections at the end of the chain."""

    def __enter__(self) -> Writer:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()


class Creates(ABC):
    @abstractmethod
    def create(self, body: Mapping[str, Any], idempotency_key: str) -> str:
        """Create the record; return the target's id for it. Raises a `RecordFault`: a body the
        writer cannot encode raises `UnsendablePayload` before anything is sent."""


class Updates(ABC):
    @abstractmethod
    def update(self, remote_id: str, body: Mapping[str, Any]) -> None:
        """Update the record the target knows as `remote_id`. Raises a `RecordFault`: a body the
        writer cannot encode raises `UnsendablePayload` before anything is sent."""


class Deletes(ABC):
    @abstractmethod
    def delete(self, remote_id: str) -> None:
        """Delete the record the target knows as `remote_id`. Raises a `RecordFault`: `RemoteGone`
        when the target answers that it holds no such record (404/410), which the engine takes as
        done. A delete is idempotent: one whose answer was never seen is sent again."""


class _AsyncVerbs(ABC):
    """What both async verbs share: the job's event loop opens and closes the writer's async side."""

    async def aopen(self) -> None:  # noqa: B027 - optional hook
        """Called on the job's event loop before its first call: make what is bound to the loop
        (an `httpx.AsyncClient`). Called once per job; each job has a loop of its own."""

    async def aclose(self) -> None:  # noqa: B027 - optional hook
        """Called on the same loop after the job's last call, however the job ended."""


class CreatesAsync(_AsyncVerbs):
    @abstractmethod
    async def acreate(self, body: Mapping[str, Any], idempotency_key: str) -> str:
        """`Creates.create` as a coroutine: the same answer, the same faults. It may be cancelled
        while it waits for the target (the job ended): its outcome then stays unknown."""


class UpdatesAsync(_AsyncVerbs):
    @abstractmethod
    async def aupdate(self, remote_id: str, body: Mapping[str, Any]) -> None:
        """`Updates.update` as a coroutine: the same faults; it may be cancelled as `acreate`."""


class DeletesAsync(_AsyncVerbs):
    @abstractmethod
    async def adelete(self, remote_id: str) -> None:
        """`Deletes.delete` as a coroutine: the same faults; it may be cancelled as `acreate`."""


def async_verbs_of(writer_type: type[Writer]) -> frozenset[Verb]:
    """The verbs the type offers as coroutines (`CreatesAsync`, `UpdatesAsync`, `DeletesAsync`)."""
    return _offered(writer_type, CreatesAsync, UpdatesAsync, DeletesAsync)


def offers_async(writer: Writer) -> bool:
    """Whether the writer offers every verb it has in one record per call as a coroutine too (and
    at least one): then its records can be sent from one event loop (`delivery.send_loop`)."""
    asynchronous = async_verbs_of(type(writer))
    return bool(asynchronous) and single_verbs_of(type(writer)) <= asynchronous


#: How many items one batch call carries when the connection does not say (`batch.max_items`).
DEFAULT_MAX_ITEMS = 100


@dataclass(frozen=True)
class CreateItem:
    """One record of a `create_many` call: its body and its own Idempotency-Key (the key the
    one-record `create` would send for it, so a replay, batched or not, makes one record)."""

    body: Mapping[str, Any]
    idempotency_key: str
    #: The mirrored record, for a call whose items are described by templates.
    record: MirrorRecord | None = None


@dataclass(frozen=True)
class UpdateItem:
    """One record of an `update_many` call: the id the target knows it by, and its body."""

    remote_id: str
    body: Mapping[str, Any]
    record: MirrorRecord | None = None


@dataclass(frozen=True)
class DeleteItem:
    """One record of a `delete_many` call: the id the target knows it by."""

    remote_id: str
    record: MirrorRecord | None = None


#: One create item's result: the target's id for the record, or the fault that item met.
CreateResult: TypeAlias = str | RecordFault
#: One update (or delete) item's result: None when it was applied, or the fault that item met.
UpdateResult: TypeAlias = RecordFault | None
DeleteResult: TypeAlias = RecordFault | None
#: Any item's result.
ItemResult: TypeAlias = str | RecordFault | None


class BatchRefused(Exception):
    """The target refused a whole batch call with a 4xx and no per-item results (a 400 for one
    malformed record, a 413 for a call too large, a 404 for a batch path it does not have).

    Not a `RecordFault`: no item is known to be at fault. The engine splits the call in halves and
    sends each, down to single items; a single item refused this way is that record's fault
    (`as_record_fault`). `excerpt` is the start of the answer's body with the token masked."""

    def __init__(self, message: str, status_code: int, excerpt: str) -> None:
        self.status_code = status_code
        self.excerpt = excerpt
        super().__init__(message)

    def as_record_fault(self) -> RecordRejected:
        """The refusal as the fault of the one record a call carried."""
        return RecordRejected(str(self))


class _Batches(ABC):
    """What both batch verbs share: how many items one call may carry."""

    target: Connection

    @property
    def max_items(self) -> int:
        """How many items one call may carry: the connection's `batch.max_items` unless the writer
        knows better. A call with more is a bug of the caller (ValueError); one with none sends
        nothing."""
        batch = self.target.batch
        return batch.max_items if batch is not None else DEFAULT_MAX_ITEMS


class CreatesMany(_Batches):
    @abstractmethod
    def create_many(self, items: Sequence[CreateItem]) -> list[CreateResult]:
        """Create the records in one call. Returns one result per item, in item order: the
        target's id for it, or the `RecordFault` it met (`UnsendablePayload` for a body the writer
        cannot encode, which is left out of the call; `RecordRejected`; `Unaddressable` when the
        target answered without a usable id for it; `TargetUnavailable` for an item answered
        429/5xx). Raises for the whole call: `TargetUnavailable`, `Unauthorized`, `BatchRefused`."""


class UpdatesMany(_Batches):
    @abstractmethod
    def update_many(self, items: Sequence[UpdateItem]) -> list[UpdateResult]:
        """Update the records in one call. Returns one result per item, in item order: None when
        it was applied, or the `RecordFault` it met (`RemoteGone` for an item answered 404/410, and
        as `create_many` for the others). Raises for the whole call as `create_many` does."""


class DeletesMany(_Batches):
    @abstractmethod
    def delete_many(self, items: Sequence[DeleteItem]) -> list[DeleteResult]:
        """Delete the records in one call. Returns one result per item, in item order: None when
        it was deleted, or the `RecordFault` it met (`RemoteGone` for an item answered 404/410,
        which the engine takes as done). Raises for the whole call as `create_many` does."""


def accepts_concurrency(writer_type: type[Writer]) -> bool:
    """Whether the writer's constructor takes the `concurrency` keyword (or any keyword): a
    third-party writer written before it existed is still built, without it."""
    parameters = inspect.signature(writer_type.__init__).parameters.values()
    return any(p.name == "concurrency" or p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters)


def _offered(writer_type: type[Writer], creates: type, updates: type, deletes: type) -> frozenset[Verb]:
    """CREATE if the type is a `creates`, UPDATE if an `updates`, DELETE if a `deletes` (one of the
    forms above)."""
    kinds = ((Verb.CREATE, creates), (Verb.UPDATE, updates), (Verb.DELETE, deletes))
    return frozenset(verb for verb, kind in kinds if issubclass(writer_type, kind))


def verbs_of(writer_type: type[Writer]) -> frozenset[Verb]:
    """The verbs the type offers, one record per call (plain or as a coroutine) or in batches: a
    writer offering only `CreatesMany` still creates."""
    return single_verbs_of(writer_type) | async_verbs_of(writer_type) | batch_verbs_of(writer_type)


def single_verbs_of(writer_type: type[Writer]) -> frozenset[Verb]:
    """The verbs the type offers one record per call (`Creates`, `Updates`, `Deletes`)."""
    return _offered(writer_type, Creates, Updates, Deletes)


def batch_verbs_of(writer_type: type[Writer]) -> frozenset[Verb]:
    """The verbs the type offers many records per call (`CreatesMany`, `UpdatesMany`,
    `DeletesMany`). For a driver whose batch verbs depend on its connection, ask the type
    `for_batch` returns."""
    return _offered(writer_type, CreatesMany, UpdatesMany, DeletesMany)


#: Reads a Prefect Secret block by name: its value, or None when there is no such block or it
#: holds nothing. Given by the flows layer (the engine never imports Prefect).
SecretReader = Callable[[str], str | None]


def token_for(target: Connection, secrets: SecretReader | None = None) -> str | None:
    """The bearer token for `target`, read now (when a chain starts), so it is never stored and a
    token changed at its source is used by the next chain: from the Prefect Secret block
    `token_secret` names (through `secrets`), or from the environment variable `token_env` names,
    without surrounding whitespace. None when the target takes no token, or when its token cannot
    be found or is blank."""
    if target.token_secret:
        token = secrets(target.token_secret) if secrets is not None else None
    elif target.token_env:
        token = secret(target.token_env)
    else:
        return None
    # A token file or a pasted value often ends with a line break, which is never part of a token.
    return (token.strip() or None) if token is not None else None


def token_source(target: Connection) -> str | None:
    """Where `target`'s token comes from, as a message names it (never the token): None when it
    takes none. With `auth`, where each of its secrets comes from."""
    if target.auth is not None:
        return ", ".join(_where(env, block) for _, env, block in secret_sources(target)) or None
    if target.token_secret:
        return f"the Prefect Secret block {target.token_secret!r}"
    if target.token_env:
        return f"${target.token_env}"
    return None


#: What a bearer token may hold: printable ASCII, no spaces (an HTTP header value cannot carry
#: other characters, and a space or a line break would change what the header says).
_TOKEN_CHARS = re.compile(r"[\x21-\x7e]+")


def token_problem(token: str) -> str | None:
    """Why `token` cannot be sent as a bearer token, or None. Names no character of it: a token
    pasted with a line break or a typographic character must fail loudly, not leak in a message."""
    if _TOKEN_CHARS.fullmatch(token):
        return None
    return "which holds characters an HTTP header cannot carry (a token is printable ASCII, without spaces)"


def _where(env: str | None, block: str | None) -> str:
    return f"the Prefect Secret block {block!r}" if block else f"${env}"


def secret_sources(target: Connection) -> list[tuple[str, str | None, str | None]]:
    """The secrets `target`'s `auth` reads, each as (name, variable, Secret block): one of the
    two is set. Empty without `auth`."""
    auth = target.auth
    if auth is None:
        return []
    names = ("token", "username", "password", "client_id", "client_secret", "refresh_token")
    found = []
    for name in names:
        env, block = auth.get(f"{name}_env"), auth.get(f"{name}_secret")
        if env or block:
            found.append((name, env, block))
    return found


def credentials_for(target: Connection, secrets: SecretReader | None = None) -> dict[str, str | None]:
    """The values of the secrets `target`'s `auth` reads (`secret_sources`), read now, stripped;
    None for one that cannot be found or is blank."""
    values: dict[str, str | None] = {}
    for name, env, block in secret_sources(target):
        value = (secrets(block) if secrets is not None else None) if block else secret(env or "")
        values[name] = (value.strip() or None) if value is not None else None
    return values


def accepts_credentials(writer_type: type[Writer]) -> bool:
    """Whether the writer's constructor takes `credentials` (the secrets of an `auth`)."""
    return "credentials" in inspect.signature(writer_type.__init__).parameters
