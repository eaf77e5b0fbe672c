"""The writer contract. ADR-0021: a writer states which verbs it offers in its *type*, so a
target without create or without update is an ordinary target, not a broken one. Capabilities
are ABC mixins, checked with `issubclass`/`isinstance` at save time and at write time."""

from __future__ import annotations

import os
from abc import ABC, abstractmethod
from collections.abc import Mapping
from typing import Any, ClassVar

from delivery.domain import Connection, Verb


class Writer(ABC):
    """Talks to one target connection for one rule's collection, for the length of one chain."""

    #: Whether a connection using this writer must declare `base_url` (checked at save time).
    needs_base_url: ClassVar[bool] = False
    #: Whether one instance may be called from several threads at once (a rule's `concurrency`
    #: above 1 is honoured only then; otherwise its writes stay one at a time).
    thread_safe: ClassVar[bool] = False

    def __init__(self, target: Connection, collection: str) -> None:
        self.target = target
        self.collection = collection

    def close(self) -> None:  # noqa: B027 - optional hook, most writers hold nothing
        """Release pooled connections at the end of the chain."""

    def __enter__(self) -> Writer:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()


class Creates(ABC):
    @abstractmethod
    def create(self, body: Mapping[str, Any], idempotency_key: str) -> str:
        """Create the record; return the target's id for it. Raises a `RecordFault`."""


class Updates(ABC):
    @abstractmethod
    def update(self, remote_id: str, body: Mapping[str, Any]) -> None:
        """Update the record the target knows as `remote_id`. Raises a `RecordFault`."""


def verbs_of(writer_type: type[Writer]) -> frozenset[Verb]:
    verbs = set()
    if issubclass(writer_type, Creates):
        verbs.add(Verb.CREATE)
    if issubclass(writer_type, Updates):
        verbs.add(Verb.UPDATE)
    return frozenset(verbs)


def token_for(target: Connection) -> str | None:
    """The bearer token, read from the environment at run time so it is never stored."""
    if not target.token_env:
        return None
    return os.environ.get(target.token_env) or None
