"""Counting what an engine sends: statements, or committed transactions."""

from __future__ import annotations

from typing import Any, ClassVar, Self

import sqlalchemy as sa


class _Counted:
    #: The SQLAlchemy engine event counted.
    event: ClassVar[str]

    def __init__(self, engine: sa.Engine) -> None:
        self.engine = engine
        self.count = 0

    def _seen(self, *_: Any) -> None:
        self.count += 1

    def __enter__(self) -> Self:
        sa.event.listen(self.engine, self.event, self._seen)
        return self

    def __exit__(self, *_: Any) -> None:
        sa.event.remove(self.engine, self.event, self._seen)


class Statements(_Counted):
    """Counts the SQL statements an engine sends."""

    event = "before_cursor_execute"


class Commits(_Counted):
    """Counts the transactions an engine commits."""

    event = "commit"
