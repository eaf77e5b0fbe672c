"""The chain passes `concurrency` only to a writer that takes it: a third-party writer written
before the keyword existed is still built."""

from __future__ import annotations

from typing import Any

from delivery.domain import Connection
from delivery.writers.base import Writer, accepts_concurrency
from delivery.writers.rest import RestWriter


class Older(Writer):
    def __init__(self, target: Connection, collection: str, *, token: str | None = None) -> None:
        super().__init__(target, collection, token=token)


class Open(Writer):
    def __init__(self, target: Connection, collection: str, **options: Any) -> None:
        super().__init__(target, collection, **options)


def test_only_writers_that_take_the_keyword_get_concurrency() -> None:
    assert accepts_concurrency(RestWriter)
    assert accepts_concurrency(Writer)
    assert accepts_concurrency(Open)
    assert not accepts_concurrency(Older)
