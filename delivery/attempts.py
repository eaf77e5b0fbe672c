"""A record's requests as its history keeps them: a writer tells what it sent and heard
(`heard`), the step listens around each call it makes (`listening`) and turns what it heard into
the `Attempt`s its outcome carries to the settle, which writes them in the same transaction.

A context variable carries the listener, so a writer needs no new argument and a call on a
thread or an event-loop task hears only its own requests.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from datetime import datetime

from delivery.domain import Attempt

#: How much of an answer a record's history keeps (secrets masked before the cut).
EXCERPT_CHARS = 500


@dataclasses.dataclass(frozen=True)
class Exchange:
    """One request and what came of it, as the writer saw it."""

    at: datetime
    method: str
    path: str
    status_code: int | None
    error: str | None
    duration_ms: int
    answer_excerpt: str | None

    def attempt(self, verb: str, chain_run_id: str | None) -> Attempt:
        """The request as a record's history keeps it: what the writer saw, the verb and the run."""
        # Field by field: `dataclasses.asdict` deep-copies, 18 µs a request against 3 µs here.
        return Attempt(
            at=self.at,
            verb=verb,
            method=self.method,
            path=self.path,
            status_code=self.status_code,
            error=self.error,
            duration_ms=self.duration_ms,
            answer_excerpt=self.answer_excerpt,
            chain_run_id=chain_run_id,
        )


_listener: ContextVar[list[Exchange] | None] = ContextVar("delivery_exchanges", default=None)

#: Told of every request a step made (target, verb, exchange): the metrics' timing, where enabled.
Observer = Callable[[str, str, Exchange], None]
_observers: list[Observer] = []


def observe(observer: Observer) -> None:
    """Tell `observer` of every request made from now on, in this process (after its step heard it)."""
    _observers.append(observer)


def told(target: str, verb: str, exchange: Exchange) -> None:
    """A step's request, for the observers (`observe`); an observer's failure is not the step's."""
    for observer in _observers:
        try:
            observer(target, verb, exchange)
        except Exception:
            continue


def heard(exchange: Exchange) -> None:
    """A writer's request and its answer (or transport error), kept if someone listens."""
    found = _listener.get()
    if found is not None:
        found.append(exchange)


@contextlib.contextmanager
def listening() -> Iterator[list[Exchange]]:
    """The exchanges made within the block, on this thread or task, in order."""
    found: list[Exchange] = []
    token = _listener.set(found)
    try:
        yield found
    finally:
        _listener.reset(token)
