"""A target's rate budget as a schedule of send slots: a pure function of the moment a sender asks,
what the target's traffic row holds (the next free slot, the day's count, a pause) and the budget.

The schedule is a generic cell rate algorithm with no burst: one slot every
`SPACING_MARGIN / per_second` seconds, whoever sends. A sender that gets a slot waits for it and
sends within `late_allowance` of it (later, it asks again); a pause holds every slot back until it
ends. With those two, no window of one second holds more than `ceil(per_second)` sends, and none
starts inside a pause (tests/unit/test_budget.py checks both over generated schedules). The store
(`delivery.store.traffic.take_slot`) reads and writes the row around this function in one short
transaction; `delivery.traffic` waits.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from datetime import datetime, timedelta

from delivery.domain import RateLimit

#: Slots are spaced this much wider than `1 / per_second`: a request's own delays between taking
#: its slot and reaching the target (a thread woken late, a busy network) must not bunch two
#: requests closer than the target counts, or one window would see one request too many.
SPACING_MARGIN = 1.05
#: A sender that wakes this far (a fraction of the interval between slots) past its slot takes a
#: new one (see `late_allowance`).
LATE_FRACTION = 0.25


@dataclass(frozen=True)
class Slot:
    """A send may start at `at` (now or later): it has been counted against the budget."""

    at: datetime


@dataclass(frozen=True)
class Held:
    """No send may start before `until`; `reason` says why (a pause, the day's budget spent, the
    next free slot). Nothing was counted."""

    until: datetime
    reason: str
    paused: bool = False


@dataclass(frozen=True)
class Ledger:
    """What the target's traffic row says of its budget: the next free slot, the UTC day counted
    and its count, the end of a pause (each None where there is none)."""

    next_send_at: datetime | None = None
    day: str | None = None
    day_count: int = 0
    paused_until: datetime | None = None
    pause_reason: str | None = None


def interval(per_second: float) -> timedelta:
    """The spacing between two slots."""
    return timedelta(seconds=SPACING_MARGIN / per_second)


def late_allowance(per_second: float) -> float:
    """How late past its slot a request may still go out, in seconds: `LATE_FRACTION` of the
    interval between slots, but at most half the room the spacing leaves. `ceil(per_second) + 1`
    requests span as many intervals, a little over a second (`SPACING_MARGIN`); a first one sent
    later than that span less a second would put them all in one second's window. At 20/s the
    quarter interval is the smaller (13 ms of 50 ms of room); from 10/s down it is more than half
    the room (at 5/s, more than all of it), and the other half is kept for the way from here to
    the target."""
    step = SPACING_MARGIN / per_second
    room = math.ceil(per_second) * step - 1.0
    return min(LATE_FRACTION * step, room / 2)


def next_slot(
    row: Ledger, limit: RateLimit | None, now: datetime, latest: datetime
) -> tuple[Slot | Held, dict[str, object]]:
    """The first moment the budget lets one more send start, asked at `now`, with the changes to
    write to the row when it is counted (none when it is not). Held: the target is paused (until
    the pause's end), the day's budget is spent (until the next UTC midnight), or the next free
    slot is after `latest` (the asker's deadline); nothing is counted then."""
    if row.paused_until is not None and row.paused_until > now:
        return Held(row.paused_until, row.pause_reason or "paused", paused=True), {}
    if limit is None:
        return Slot(now), {}
    changes: dict[str, object] = {}
    if limit.per_day is not None:
        today = now.date().isoformat()
        count = row.day_count if row.day == today else 0
        if count >= limit.per_day:
            midnight = datetime.combine(now.date() + timedelta(days=1), datetime.min.time(), now.tzinfo)
            return Held(midnight, f"the day's budget of {limit.per_day} requests is spent"), {}
        changes.update(day=today, day_count=count + 1)
    at = now
    if limit.per_second is not None:
        at = max(row.next_send_at or now, now)
        if at > latest:
            return Held(at, f"the budget of {limit.per_second:g} requests a second is taken until then"), {}
        changes["next_send_at"] = at + interval(limit.per_second)
    return Slot(at), changes
