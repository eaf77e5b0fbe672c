"""The circuit breaker of a target connection (pybreaker), its state shared through the database.

Only a target that did not take a write (timeout, connection error, 5xx, 429) counts against it; the
connection's status is never touched by it (ADR-0029: the breaker's cooldown is the recovery).

This module owns the breaker's rules: what counts as a failure (`_not_the_targets_fault`), when an
open breaker lets a trial call through (`reopens_at`), until when it is open (`open_until`, for a
breaker object and for the stored row alike) and the target counts as down (`outage_until`), and
the state in words that the chain, `delivery status` and `delivery preview` show (`open_message`,
`state_in_words`), what a refused call is (`Refused`: the call was not made) and which change of
state begins or ends an outage (`outage_change`, what the flows' breaker events say). The state
itself is kept by `delivery.store.breaker`; pybreaker's private names are read only in
`delivery.pybreaker_private`; no other module of the engine or the flows imports pybreaker
(tests/unit/test_pybreaker_private.py).
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime, timedelta
from typing import Any

import pybreaker
import sqlalchemy as sa

from delivery import pybreaker_private
from delivery.clock import SYSTEM, Clock
from delivery.domain import Connection, Rule
from delivery.errors import TargetUnavailable
from delivery.store.breaker import DatabaseBreakerStorage, breaker_state

#: What a breaker raises instead of making a call it refuses (open, or half-open with its one trial
#: call taken): nothing went out.
Refused = pybreaker.CircuitBreakerError
#: The stored state of an open breaker (pybreaker's name), for those told of a change.
OPEN = pybreaker.STATE_OPEN


class Outage(enum.Enum):
    BEGAN = "began"
    ENDED = "ended"


def outage_change(old: str, new: str) -> Outage | None:
    """What a change of the stored state means for the target: a trip (closed to open) begins an
    outage and any close ends it. A failed trial call (half-open to open) is the same outage going on,
    and a trial let through (open to half-open) is not yet its end: one page per outage, not one per
    cooldown."""
    if new == pybreaker.STATE_OPEN and old == pybreaker.STATE_CLOSED:
        return Outage.BEGAN
    if new == pybreaker.STATE_CLOSED:
        return Outage.ENDED
    return None


def _not_the_targets_fault(exc: BaseException) -> bool:
    """A refused or gone record, an unaddressable answer, a body we could not encode, and any other
    exception from a writer (a bug, loud as a rule fault) say nothing about whether the target is up.
    Nor does a 429/503 with Retry-After: the target is up and asks for a pause (`delivery.traffic`)."""
    return not isinstance(exc, TargetUnavailable) or exc.pauses_target


def reopens_at(opened_at: datetime | None, reset_seconds: float) -> datetime | None:
    """When an open breaker lets a trial call through."""
    return None if opened_at is None else opened_at + timedelta(seconds=reset_seconds)


def _open_until(state: str, opened_at: datetime | None, reset_seconds: float, now: datetime) -> datetime | None:
    if state != pybreaker.STATE_OPEN:
        return None
    until = reopens_at(opened_at, reset_seconds)
    return until if until is not None and until > now else None


def stored_open_until(conn: sa.Connection, target: Connection, now: datetime) -> datetime | None:
    """`TargetBreaker.open_until`, read from the stored state without a breaker object (making one
    writes its row): what `delivery preview` asks."""
    row = breaker_state(conn, target.id)
    if row is None:
        return None
    return _open_until(row.state, row.opened_at, target.breaker.reset_seconds, now)


def _until_in_words(until: datetime) -> str:
    """When the breaker lets a trial call through, as the operator's lines say a time (`13:57:41 UTC`;
    a cooldown is minutes, the day goes without saying)."""
    return until.astimezone(UTC).strftime("%H:%M:%S UTC")


def open_message(target: str, until: datetime | None) -> str:
    """How a chain the open breaker stops (or a preview of it) says so."""
    when = f" until {_until_in_words(until)}" if until else ""
    return f"breaker open for target {target!r}{when}; the connection status is unchanged"


def state_in_words(conn: sa.Connection, target: Connection, now: datetime) -> str:
    """The target's breaker as `delivery status` shows it, read from the stored state."""
    state = breaker_state(conn, target.id)
    if state is None or state.state == pybreaker.STATE_CLOSED:
        return "closed" if state is None or not state.fail_counter else f"closed ({state.fail_counter} failures)"
    until = reopens_at(state.opened_at, target.breaker.reset_seconds)
    if state.state == pybreaker.STATE_OPEN and until is not None:
        if until > now:
            return f"open until {_until_in_words(until)}"
        return "open (a trial call is due)"
    return str(state.state)


class BreakerListener(pybreaker.CircuitBreakerListener):
    """Told once per change of a target's breaker, by the process whose write made it.

    pybreaker calls `state_change` both where a breaker changes state and wherever an instance
    merely notices a change another process or worker made (its cached state catching up with the
    stored one); several workers and processes share each breaker through the database, so that
    would tell one trip many times. `changed` is called only for the write that changed the stored
    state, and `old` is the state that write replaced."""

    def changed(self, breaker: TargetBreaker, old: str, new: str) -> None:
        """Override: `old` and `new` are pybreaker's state names (closed, open, half-open)."""

    def state_change(
        self, cb: pybreaker.CircuitBreaker, old_state: pybreaker.CircuitBreakerState | None, new_state: Any
    ) -> None:
        change = getattr(cb, "_change", None)
        if isinstance(cb, TargetBreaker) and change is not None and change[1] == new_state.name:
            self.changed(cb, change[0], change[1])


class TargetBreaker(pybreaker.CircuitBreaker):
    """pybreaker's breaker over a `DatabaseBreakerStorage`, with the two things the chain asks of it:
    take a row read alongside a fence check, and say until when it is open.

    Its time is `clock`'s, handed to its storage (see `delivery.clock`): when it opens, when its
    cooldown ends, how old a row it was handed is. Listeners reach the clock as `breaker.clock`."""

    def __init__(
        self, engine: sa.Engine, rule: Rule, listeners: Sequence[BreakerListener] = (), clock: Clock = SYSTEM
    ) -> None:
        settings = rule.target.breaker
        self.target = rule.target.name
        self.clock = clock
        self.storage = DatabaseBreakerStorage(engine, rule.target.id, clock)
        #: (replaced, new) while listeners are told of a change this instance wrote.
        self._change: tuple[str, str] | None = None
        super().__init__(
            fail_max=settings.fail_max,
            reset_timeout=settings.reset_seconds,
            exclude=[_not_the_targets_fault],
            state_storage=self.storage,
            name=rule.target.name,
            # The failure that trips the breaker is still that record's failure: it must be parked
            # as failed like the ones before it, so we want the original error, not a new one.
            throw_new_error_on_trip=False,
            listeners=list(listeners),
        )

    # pybreaker's open/half_open/close set the cached state (telling the listeners) before they
    # write the stored one. Here the stored state is written first, as a compare-and-set, so the
    # listeners can be told whether this write is the one that changed it.

    def open(self) -> bool:
        with pybreaker_private.lock(self):
            self.storage.mark_opened(self.clock.now())
            self._switch(pybreaker.STATE_OPEN)
            return pybreaker_private.throws_new_error_on_trip(self)

    def half_open(self) -> None:
        with pybreaker_private.lock(self):
            self._switch(pybreaker.STATE_HALF_OPEN)

    def close(self) -> None:
        with pybreaker_private.lock(self):
            self.storage.reset_success_counter()
            self._switch(pybreaker.STATE_CLOSED)

    def _switch(self, state: str) -> None:
        replaced = self.storage.change_state(state)
        self._change = None if replaced is None else (replaced, state)
        try:
            self.state = state  # pybreaker's setter takes the state's name
        finally:
            self._change = None

    def observe(
        self, conn: sa.Connection, row: Mapping[str, Any] | None, mark: int | None = None
    ) -> Mapping[str, Any] | None:
        """See `DatabaseBreakerStorage.observe`."""
        return self.storage.observe(conn, row, mark)

    def outage_until(self, now: datetime) -> datetime | None:
        """Until when the target counts as down, read just after one of its failures: the end of
        the cooldown while the breaker is open (it may have tripped on that very failure, or a
        trial call after a cooldown may have failed) or half-open; None while it is closed."""
        if self.current_state == pybreaker.STATE_CLOSED:
            return None
        until = reopens_at(self.storage.opened_on_clock, self.reset_timeout)
        return max(until, now) if until is not None else now + timedelta(seconds=self.reset_timeout)

    def failures_since_success(self) -> int:
        """The failures counted since the target last answered anyone successfully (pybreaker's
        consecutive-failure count, as stored), read fresh: 1 just after a failure means the target
        answered someone after every earlier failure."""
        return self.storage.fresh_counter()

    def open_until(self, now: datetime) -> datetime | None:
        """When an open breaker lets a trial call through; None when it is not open now."""
        if self.current_state != pybreaker.STATE_OPEN:
            return None
        return _open_until(pybreaker.STATE_OPEN, self.storage.opened_on_clock, self.reset_timeout, now)
