"""The engine's one clock: every moment it stamps, judges or waits for is read from a `Clock`.

One instance is made at the edge (the deliver-rule flow, the tick, a CLI command; `SYSTEM` is the
default wherever a caller gives none) and handed down: to the chain and each job's `JobContext`,
the target's breaker and its database storage, the target's traffic control, and the store functions
that stamp a time (they take `now`, read from the caller's clock). Nothing below the edge reads
`datetime.now` or `time.monotonic` for a decision of its own, so a test that hands the engine a
`FakeClock` moves time by hand (`advance`) and nothing in it waits on real time: a breaker's
cooldown, a pause's end, a slot of the rate budget, a heartbeat's age, a retry's due time.

What a clock gives:

- `now()`: aware UTC wall time, what is stamped in the database and compared with what is there;
- `monotonic()`: seconds for the engine's own short intervals (how old a cached read is, how long
  a wait took), immune to the wall clock being set;
- `wait(event, seconds)`: block until `event` is set or `seconds` pass (a traffic wait, which a
  stop signal ends early); `sleep(seconds)` and `sleep_async(seconds)`: the same without an event.
  A `FakeClock` waits by advancing itself, at once.

The breaker is pybreaker's, which reads `datetime.now(UTC)` itself in one place: an open breaker
compares it with its storage's `opened_at` plus `reset_timeout`. Our storage
(`delivery.store.breaker.DatabaseBreakerStorage`) keeps the moment it opened on the engine's clock
and reports it to pybreaker shifted by `Clock.skew()` (how far the clock runs ahead of the system's
wall time; zero for `SystemClock`), so pybreaker's own comparison follows the engine's clock
without any of its private parts being touched.

A `Clock` is also callable (`clock()` is `clock.now()`): the engine's older signatures take a
`Callable[[], datetime]`, and a clock serves there as it is.
"""

from __future__ import annotations

import abc
import asyncio
import threading
import time
from datetime import UTC, datetime, timedelta


def utcnow() -> datetime:
    """The system's wall time, aware UTC; for code outside the engine's paths (the CLI's reads)."""
    return datetime.now(UTC)


class Clock(abc.ABC):
    """Where the engine reads time and waits (see the module's docstring)."""

    @abc.abstractmethod
    def now(self) -> datetime:
        """Aware UTC wall time."""

    def __call__(self) -> datetime:
        return self.now()

    @abc.abstractmethod
    def monotonic(self) -> float:
        """Seconds, for intervals only."""

    def skew(self) -> timedelta:
        """How far this clock runs ahead of the system's wall time (see the module's docstring)."""
        return timedelta(0)

    @abc.abstractmethod
    def wait(self, event: threading.Event, seconds: float) -> bool:
        """Wait for `event` at most `seconds`; whether it is set."""

    @abc.abstractmethod
    def sleep(self, seconds: float) -> None: ...

    @abc.abstractmethod
    async def sleep_async(self, seconds: float) -> None: ...


class SystemClock(Clock):
    """Real time: the system's wall clock, its monotonic clock, and real waits."""

    def now(self) -> datetime:
        return datetime.now(UTC)

    def monotonic(self) -> float:
        return time.monotonic()

    def wait(self, event: threading.Event, seconds: float) -> bool:
        return event.wait(max(seconds, 0.0))

    def sleep(self, seconds: float) -> None:
        time.sleep(max(seconds, 0.0))

    async def sleep_async(self, seconds: float) -> None:
        await asyncio.sleep(max(seconds, 0.0))


#: The system clock, for a caller that is given none.
SYSTEM = SystemClock()


class FakeClock(Clock):
    """A clock tests move by hand. It stands still until `advance` (or a wait or sleep, which
    advance it by what they would have waited instead of blocking); thread-safe."""

    def __init__(self, start: datetime | None = None) -> None:
        self._lock = threading.Lock()
        self._now = start if start is not None else datetime.now(UTC)
        self._monotonic = 0.0

    def now(self) -> datetime:
        with self._lock:
            return self._now

    def monotonic(self) -> float:
        with self._lock:
            return self._monotonic

    def skew(self) -> timedelta:
        return self.now() - datetime.now(UTC)

    def advance(self, seconds: float) -> datetime:
        """Move the clock `seconds` on; returns the new now."""
        if seconds < 0:
            raise ValueError("a clock does not go back")
        with self._lock:
            self._now += timedelta(seconds=seconds)
            self._monotonic += seconds
            return self._now

    def set(self, moment: datetime) -> None:
        """Move the clock on to `moment`."""
        self.advance((moment - self.now()).total_seconds())

    def wait(self, event: threading.Event, seconds: float) -> bool:
        if event.is_set():
            return True
        self.advance(max(seconds, 0.0))
        return event.is_set()

    def sleep(self, seconds: float) -> None:
        self.advance(max(seconds, 0.0))

    async def sleep_async(self, seconds: float) -> None:
        self.advance(max(seconds, 0.0))
        await asyncio.sleep(0)  # still a turn of the loop, as a real sleep gives the others
