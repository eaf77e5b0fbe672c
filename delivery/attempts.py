"""A record's requests as its history keeps them: a writer tells what it sent and heard
(`heard`), the step listens around each call it makes (`Listening`, which knows the call's verb
and chain run) and its outcome carries the `Attempt`s heard to the settle, which writes them in
the same transaction.

A context variable carries the listener, so a writer needs no new argument and a call on a
thread or an event-loop task hears only its own requests.
"""

from __future__ import annotations

from collections.abc import Callable
from contextvars import ContextVar
from datetime import datetime

from delivery.domain import Attempt

#: How much of an answer a record's history keeps (secrets masked before the cut).
EXCERPT_CHARS = 500


class Listening:
    """The requests made within a `with` block on this thread or task (`heard`), kept as the
    record's history keeps them: each with the verb of the step's call and its chain run."""

    __slots__ = ("_token", "chain_run_id", "heard", "target", "verb")

    def __init__(self, target: str, verb: str, chain_run_id: str | None) -> None:
        self.target = target
        self.verb = verb
        self.chain_run_id = chain_run_id
        #: What was heard, oldest first.
        self.heard: list[Attempt] = []

    def __enter__(self) -> list[Attempt]:
        self._token = _listener.set(self)
        return self.heard

    def __exit__(self, *_: object) -> None:
        _listener.reset(self._token)


_listener: ContextVar[Listening | None] = ContextVar("delivery_listening", default=None)

#: Told of every request a step made (target, and the request as its history keeps it): the
#: metrics' timing, where enabled.
Observer = Callable[[str, Attempt], None]
_observers: list[Observer] = []


def observe(observer: Observer) -> Callable[[], None]:
    """Tell `observer` of every request a step makes from now on, in this process; returns what
    stops telling it."""
    _observers.append(observer)
    return lambda: _observers.remove(observer)


def listened() -> bool:
    """Whether a step listens here: a writer need not build what nobody keeps."""
    return _listener.get() is not None


def heard(
    at: datetime,
    method: str,
    path: str,
    status_code: int | None,
    error: str | None,
    duration_ms: int,
    answer_excerpt: str | None,
) -> None:
    """A writer's request and its answer (or transport error): kept if a step listens, and told
    to the observers (an observer's failure is not the step's)."""
    listening = _listener.get()
    if listening is None:
        return
    # One object per request, built once: it is what the settle writes.
    attempt = Attempt(
        at=at,
        verb=listening.verb,
        method=method,
        path=path,
        status_code=status_code,
        error=error,
        duration_ms=duration_ms,
        answer_excerpt=answer_excerpt,
        chain_run_id=listening.chain_run_id,
    )
    listening.heard.append(attempt)
    for observer in _observers:
        try:
            observer(listening.target, attempt)
        except Exception:
            continue
