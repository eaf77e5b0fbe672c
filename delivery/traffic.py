"""Traffic control of one target, as a chain's workers see it: its rate budget and the pause a
Retry-After asked for, both shared through the database by every rule, worker and process sending
to that target (`delivery.store.traffic`).

Waiting here is neither a record fault nor a rule fault: it spends no attempt and counts nothing
for the breaker. A job waits as long as its deadline allows; a wait that would outlast it ends the
job with `TrafficHeld`, and the chain ends `rate_limited` (Completed): the next tick resumes.
"""

from __future__ import annotations

import threading
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

import sqlalchemy as sa

from delivery.budget import Held, Slot, late_allowance
from delivery.clock import Clock
from delivery.domain import Connection
from delivery.errors import TargetUnavailable, TrafficHeld
from delivery.store import traffic as store

#: How long a pause read from the database stands for a target with no rate budget (one with a
#: budget reads it with every slot it takes): another process's 429 is seen this much later at most.
PAUSE_READ_SECONDS = 0.5
#: The shortest pause a Retry-After makes.
MIN_PAUSE_SECONDS = 1.0
#: How often one request is sent again after pauses it met, within one job: a target that answers
#: every try with a pause gets the record back to wait for the next chain, not a request a second.
MAX_RESENDS = 3
#: How often a wait on an event loop looks at the job's stop signal.
STOP_STEP_SECONDS = 0.05
#: A wait longer than this is announced as it begins (`TrafficListener.waiting`), once per what is
#: waited for, and again after `WAIT_NOTICE_REPEAT_SECONDS` of waiting for the same.
WAIT_NOTICE_SECONDS = 1.0
WAIT_NOTICE_REPEAT_SECONDS = 60.0


@dataclass(frozen=True)
class JobBounds:
    """What a job's traffic wait must respect: the job's deadline (no wait may outlast it) and the
    job's stop signal (a batch cut short, a timeout, a cancellation: the wait ends, nothing is sent)."""

    deadline: datetime
    stop: threading.Event = field(default_factory=threading.Event)


class TrafficListener:
    """Told when a target is paused (by the process whose write paused it) and when the pause is
    over (by the process that found it over first)."""

    def paused(self, target: str, until: datetime, reason: str) -> None:
        """Override."""

    def resumed(self, target: str, paused_at: datetime | None, until: datetime | None) -> None:
        """Override."""

    def waiting(self, target: str, until: datetime, what: str) -> None:
        """A sender of this chain begins a wait of more than `WAIT_NOTICE_SECONDS` for the target's
        traffic, until `until`, for `what` (its pause, its rate budget). Override."""


class TargetTraffic:
    """One chain's view of a target's traffic; thread-safe (the chain's workers share it). Every
    moment it reads, and every wait, is `clock`'s (`delivery.clock`): on a `FakeClock` a wait for a
    pause or a slot advances the clock instead of passing real time."""

    def __init__(
        self,
        engine: sa.Engine,
        target: Connection,
        clock: Clock,
        listeners: Sequence[TrafficListener] = (),
    ) -> None:
        self.engine = engine
        self.target = target
        self.clock = clock
        self.listeners = list(listeners)
        self._lock = threading.Lock()
        self._waited = 0.0
        self._pause: tuple[float, Held | None] | None = None
        #: The last wait announced: what for, and until when (see `_announce`).
        self._announced: tuple[str, datetime] | None = None
        # One read when the chain opens; a write only for a target never sent to, or a pause that
        # ended while no chain was sending (it ends here, and is told of as over).
        now = clock.now()
        with engine.connect().execution_options(readonly=True) as conn:
            row = store.traffic_of(conn, [target.id]).get(target.id)
        if row is None:
            store.ensure_row(engine, target.id)
        elif row.paused_until is not None and row.paused_until <= now:
            self._resume()
        else:
            self._pause = (self.clock.monotonic(), _held(row))

    @property
    def waited_seconds(self) -> float:
        """Seconds this chain's workers have spent waiting for the target's traffic, all told."""
        with self._lock:
            return self._waited

    def admit(self, bounds: JobBounds) -> bool:
        """Wait until the target lets one more request out, and count it against its budget.
        Returns False when `bounds.stop` was set meanwhile (nothing may be sent); raises
        `TrafficHeld` when the wait would outlast the job's deadline (nothing was counted)."""
        while True:
            now = self.clock.now()
            got = self._take(now, bounds.deadline)
            if isinstance(got, Slot):
                waits = got.at > self.clock.now()  # a slot for now was read with the pause: no wait, no read
                self._announce(got.at, "its rate budget")
                if not self._wait(got.at, bounds):
                    return False
                if waits and self._paused_meanwhile():
                    continue  # a pause began while it waited for its slot: it waits for the pause
                if self._too_late(got.at):
                    continue  # the slot has passed: sending now would crowd the next one's
                return True
            if got.until > bounds.deadline:
                raise TrafficHeld(self.target.name, got.until, got.reason)
            self._announce(got.until, f"its pause ({got.reason})" if got.paused else f"its rate budget ({got.reason})")
            if not self._wait(got.until, bounds):
                return False
            if got.paused:
                self._resume()

    async def admit_async(self, bounds: JobBounds, off_loop: Callable[..., Awaitable[Any]]) -> bool:
        """`admit` for a request made from an event loop: the slot is taken (a database write) or
        the pause read `off_loop`, but the wait for it is spent on the loop, so that the request
        goes out right after the wait's last check that it is not too late (a hop back from a
        thread, on a busy machine, could land it on the next slot's heels)."""
        while True:
            now = self.clock.now()
            got = await off_loop(self._take, now, bounds.deadline)
            if isinstance(got, Slot):
                waits = got.at > self.clock.now()
                self._announce(got.at, "its rate budget")
                if not await self._wait_async(got.at, bounds):
                    return False
                if waits and await off_loop(self._paused_meanwhile):
                    continue
                if self._too_late(got.at):
                    continue
                return True
            if got.until > bounds.deadline:
                raise TrafficHeld(self.target.name, got.until, got.reason)
            self._announce(got.until, f"its pause ({got.reason})" if got.paused else f"its rate budget ({got.reason})")
            if not await self._wait_async(got.until, bounds):
                return False
            if got.paused:
                await off_loop(self._resume)

    def admits_at_once(self) -> bool:
        """Whether one more request may go out now without a wait or a database read: the target
        has no rate budget and the pause last read (at most `PAUSE_READ_SECONDS` ago) holds
        nothing back. False says only "ask `admit`" (on a thread, from an event loop), which does
        the read or the wait. What the async job asks first, so that a request costs no thread."""
        if self.target.rate_limit is not None:
            return False
        with self._lock:
            cached = self._pause
        if cached is None or self.clock.monotonic() - cached[0] >= PAUSE_READ_SECONDS:
            return False
        return cached[1] is None  # a pause, even one just over, is `admit`'s to wait out or end

    def pause_end(self, fault: TargetUnavailable, now: datetime) -> datetime:
        """When the pause `fault` asks for ends: its Retry-After, at least `MIN_PAUSE_SECONDS` (a
        `Retry-After: 0` would have every sender ask again at once), capped by the connection."""
        seconds = max(fault.retry_after_seconds or 0.0, MIN_PAUSE_SECONDS)
        return now + timedelta(seconds=min(seconds, self.target.max_pause_seconds))

    def pause(self, fault: TargetUnavailable) -> datetime:
        """Pause every send to the target as `fault` (a 429 or 503 with Retry-After) asks. Returns
        when the pause ends."""
        now = self.clock.now()
        until = self.pause_end(fault, now)
        reason = f"HTTP {fault.status_code or '-'}, Retry-After {fault.retry_after_seconds:g} s"
        with self.engine.begin() as conn:
            news = store.pause(conn, self.target.id, until, reason, now)
        with self._lock:
            self._pause = (self.clock.monotonic(), Held(until, reason, paused=True))
        if news:
            for listener in self.listeners:
                listener.paused(self.target.name, until, reason)
        return until

    def paused_past(self, moment: datetime) -> bool:
        """Whether a pause this chain set or read lasts beyond `moment` (no database read)."""
        until = self.pause_seen()
        return until is not None and until > moment

    def pause_seen(self) -> datetime | None:
        """When the last pause this chain set or read ends (no database read), if it does."""
        with self._lock:
            cached = self._pause
        return None if cached is None or cached[1] is None else cached[1].until

    def paused_until(self) -> datetime | None:
        """When the target's pause ends, if it is paused now (read from the database)."""
        with self.engine.connect().execution_options(readonly=True) as conn:
            row = store.paused_until(conn, self.target.id, self.clock.now())
        return None if row is None else row.paused_until

    # -- inside --------------------------------------------------------------------------------

    def _take(self, now: datetime, latest: datetime) -> Slot | Held:
        if self.target.rate_limit is not None:
            with self.engine.begin() as conn:
                return store.take_slot(conn, self.target.id, self.target.rate_limit, self.clock.now, latest)
        with self._lock:
            cached = self._pause
        if cached is None or self.clock.monotonic() - cached[0] >= PAUSE_READ_SECONDS:
            with self.engine.connect().execution_options(readonly=True) as conn:
                row = store.paused_until(conn, self.target.id, now)
            held = _held(row)
            cached = (self.clock.monotonic(), held)
            with self._lock:
                self._pause = cached
        held = cached[1]
        return held if held is not None and held.until > now else Slot(now)

    def _paused_meanwhile(self) -> bool:
        """Whether the target is paused now: read after a wait for a slot, which was handed out
        before a pause that began meanwhile (here, or in another process) could hold it back. A
        slot is not a pass through a pause: nothing leaves for a paused target but the requests
        already on their way when the pause began."""
        now = self.clock.now()
        with self._lock:
            cached = self._pause
        if cached is not None and cached[1] is not None and cached[1].until > now:
            return True
        with self.engine.connect().execution_options(readonly=True) as conn:
            row = store.paused_until(conn, self.target.id, now)
        held = _held(row)
        with self._lock:
            self._pause = (self.clock.monotonic(), held)
        return held is not None

    def _too_late(self, slot: datetime) -> bool:
        """Whether a sender woke so late for its slot (a busy machine) that its request would reach
        the target close behind the next slot's: it takes a new slot instead. So a request goes
        out within `late_allowance` of its slot, and no window of a second sees more than the
        budget."""
        limit = self.target.rate_limit
        if limit is None or limit.per_second is None:
            return False
        return (self.clock.now() - slot).total_seconds() > late_allowance(limit.per_second)

    def _announce(self, until: datetime, what: str) -> None:
        """Tell the listeners a wait of more than `WAIT_NOTICE_SECONDS` begins: once for what it
        waits for, again only after `WAIT_NOTICE_REPEAT_SECONDS` (a saturated budget makes every
        sender wait in turn; the run log needs to hear of it, not of each of them)."""
        if (until - self.clock.now()).total_seconds() <= WAIT_NOTICE_SECONDS or not self.listeners:
            return
        with self._lock:
            last = self._announced
            if last is not None and last[0] == what and (until - last[1]).total_seconds() < WAIT_NOTICE_REPEAT_SECONDS:
                return
            self._announced = (what, until)
        for listener in self.listeners:
            listener.waiting(self.target.name, until, what)

    def _wait(self, until: datetime, bounds: JobBounds) -> bool:
        seconds = (until - self.clock.now()).total_seconds()
        if seconds <= 0:
            return not bounds.stop.is_set()
        began = self.clock.monotonic()
        stopped = self.clock.wait(bounds.stop, seconds)
        with self._lock:
            self._waited += self.clock.monotonic() - began
        return not stopped

    async def _wait_async(self, until: datetime, bounds: JobBounds) -> bool:
        """`_wait` on the loop: asleep in steps, so a stop (the batch cut short) ends it too."""
        began = self.clock.monotonic()
        try:
            while (seconds := (until - self.clock.now()).total_seconds()) > 0 and not bounds.stop.is_set():
                await self.clock.sleep_async(min(seconds, STOP_STEP_SECONDS))
        finally:
            with self._lock:
                self._waited += self.clock.monotonic() - began
        return not bounds.stop.is_set()

    def _resume(self) -> None:
        with self.engine.begin() as conn:
            row = store.end_pause(conn, self.target.id, self.clock.now())
        with self._lock:
            self._pause = None
        if row is not None:
            for listener in self.listeners:
                listener.resumed(self.target.name, row.paused_at, row.paused_until)


def _held(row: store.TrafficRow | None) -> Held | None:
    """The pause a traffic row holds, if any (whether it is over is the caller's to judge)."""
    if row is None or row.paused_until is None:
        return None
    return Held(row.paused_until, row.pause_reason or "paused", paused=True)
