"""The rate budget's slot schedule (`delivery.budget.next_slot`) over generated schedules: senders
asking at any moments, each waking for its slot anywhere up to `late_allowance` late (or later, and
then asking again), pauses beginning at any moment. Two promises: no window of one second sees more
than `ceil(per_second)` sends, and no send starts inside a pause (issue 29, points 2 and 5).

A discrete-event simulation: what the senders of `delivery.traffic.TargetTraffic.admit` do, with the
clock and the waits simulated, so thousands of schedules run in a second."""

from __future__ import annotations

import heapq
import math
from dataclasses import replace
from datetime import UTC, datetime, timedelta

from hypothesis import given
from hypothesis import strategies as st

from delivery.budget import Held, Ledger, Slot, interval, late_allowance, next_slot
from delivery.domain import RateLimit

T0 = datetime(2026, 12, 7, 12, 0, tzinfo=UTC)
FAR = T0 + timedelta(days=30)

rates = st.one_of(
    st.integers(min_value=1, max_value=50).map(float),
    st.floats(min_value=0.05, max_value=60, allow_nan=False, allow_infinity=False),
)


def _at(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)


def _seconds(moment: datetime) -> float:
    return (moment - T0).total_seconds()


def _simulate(data: st.DataObject, per_second: float) -> tuple[list[float], list[tuple[float, float]]]:
    """Sends (seconds after T0) and pauses ([start, end) in seconds) of one generated schedule."""
    limit = RateLimit(per_second=per_second, per_day=None)
    allowance = late_allowance(per_second)
    step = interval(per_second).total_seconds()
    senders = data.draw(st.integers(min_value=1, max_value=6), label="senders")
    requests = data.draw(st.integers(min_value=1, max_value=25), label="requests per sender")
    row = Ledger()
    sends: list[float] = []
    pauses: list[tuple[float, float]] = []
    # (time, order, kind, sender, slot): kinds "ask", "wake", "pause"
    events: list[tuple[float, int, str, int, float]] = []
    order = 0

    def push(when: float, kind: str, sender: int = -1, slot: float = 0.0) -> None:
        nonlocal order
        order += 1
        heapq.heappush(events, (when, order, kind, sender, slot))

    for sender in range(senders):
        push(data.draw(st.floats(min_value=0, max_value=2 * step), label="first ask"), "ask", sender)
    for _ in range(data.draw(st.integers(min_value=0, max_value=3), label="pauses")):
        push(data.draw(st.floats(min_value=0, max_value=requests * step), label="pause at"), "pause")
    left = dict.fromkeys(range(senders), requests)
    while events:
        now, _, kind, sender, slot = heapq.heappop(events)
        if kind == "pause":
            length = data.draw(st.floats(min_value=1.0, max_value=10.0), label="pause length")
            until = max(row.paused_until or _at(now), _at(now + length))
            row = replace(row, paused_until=until, pause_reason="HTTP 429")
            pauses.append((now, _seconds(until)))
            continue
        if kind == "ask":
            got, changes = next_slot(row, limit, _at(now), FAR)
            row = replace(row, **changes)  # type: ignore[arg-type]
            if isinstance(got, Held):
                push(_seconds(got.until), "ask", sender)
                continue
            assert isinstance(got, Slot) and got.at >= _at(now)
            # The sender wakes on time, late within the allowance, or too late.
            late = data.draw(
                st.one_of(st.floats(min_value=0, max_value=allowance), st.floats(min_value=0, max_value=3 * step)),
                label="lateness",
            )
            push(_seconds(got.at) + late, "wake", sender, _seconds(got.at))
            continue
        # Awake for its slot: a pause that began meanwhile holds it (it asks again, and is held
        # till the pause ends); a slot passed by more than the allowance is given up.
        if (row.paused_until is not None and row.paused_until > _at(now)) or now - slot > allowance:
            push(now, "ask", sender)
        else:
            sends.append(now)
            left[sender] -= 1
            if left[sender]:
                push(now + data.draw(st.floats(min_value=0, max_value=step), label="think"), "ask", sender)
    return sends, pauses


@given(rates, st.data())
def test_no_second_sees_more_than_the_budget(per_second: float, data: st.DataObject) -> None:
    sends, _ = _simulate(data, per_second)
    budget = math.ceil(per_second)
    sends.sort()
    for first, beyond in zip(sends, sends[budget:], strict=False):
        assert beyond - first >= 1.0, (per_second, first, beyond)


@given(rates, st.data())
def test_nothing_starts_inside_a_pause(per_second: float, data: st.DataObject) -> None:
    sends, pauses = _simulate(data, per_second)
    for start, end in pauses:
        inside = [s for s in sends if start <= s < end]
        assert inside == [], (start, end, inside)


def test_a_pause_holds_the_slot_and_counts_nothing() -> None:
    row = Ledger(next_send_at=_at(0.5), paused_until=_at(3), pause_reason="HTTP 429")
    got, changes = next_slot(row, RateLimit(per_second=2, per_day=10), _at(1), FAR)
    assert got == Held(_at(3), "HTTP 429", paused=True) and changes == {}


def test_a_slot_after_the_deadline_counts_nothing() -> None:
    row = Ledger(next_send_at=_at(5))
    got, changes = next_slot(row, RateLimit(per_second=2, per_day=None), _at(1), _at(4))
    assert isinstance(got, Held) and got.until == _at(5) and changes == {}


def test_the_days_budget_and_the_next_slot_are_counted_together() -> None:
    limit = RateLimit(per_second=2, per_day=2)
    got, changes = next_slot(Ledger(day="2026-12-07", day_count=1), limit, _at(0), FAR)
    assert got == Slot(_at(0))
    assert changes == {"day": "2026-12-07", "day_count": 2, "next_send_at": _at(0.525)}
    spent, _ = next_slot(Ledger(day="2026-12-07", day_count=2), limit, _at(0), FAR)
    assert isinstance(spent, Held) and spent.until == datetime(2026, 12, 8, tzinfo=UTC)
