"""The writer contract. ADR-0021: a writer states which verbs it offers in its *type*, so a
target without create or without update is an ordinary target, not a broken one. Capabilities
are ABC mixins, checked with `issubclass`/`isinstance` at save time and at write time."""

from __future__ import annotations

import inspect
import re
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from typing import Any, ClassVar

from delivery.domain import Connection, Verb
from delivery.settings import secret


class Writer(ABC):
    """Talks to one target connection for one rule's collection, for the length of one chain."""

    #: Whether a connection using this writer must declare `base_url` (checked at save time).
    needs_base_url: ClassVar[bool] = False
    #: Whether one instance may be called from several threads at once (a rule's `concurrency`
    #: above 1 is honoured only then; otherwise its writes stay one at a time).
    thread_safe: ClassVar[bool] = False

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


def accepts_concurrency(writer_type: type[Writer]) -> bool:
    """Whether the writer's constructor takes the `concurrency` keyword (or any keyword): a
    third-party writer written before it existed is still built, without it."""
    parameters = inspect.signature(writer_type.__init__).parameters.values()
    return any(p.name == "concurrency" or p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters)


def verbs_of(writer_type: type[Writer]) -> frozenset[Verb]:
    verbs = set()
    if issubclass(writer_type, Creates):
        verbs.add(Verb.CREATE)
    if issubclass(writer_type, Updates):
        verbs.add(Verb.UPDATE)
    return frozenset(verbs)


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
    takes none."""
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
