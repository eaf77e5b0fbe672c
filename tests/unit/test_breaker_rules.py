"""The breaker's rules that need no database: which change of the stored state begins or ends an
outage (what the breaker events and their alerts say), and what a refused call is."""

from __future__ import annotations

import itertools

import pybreaker
import pytest

from delivery.breaker import OPEN, Outage, Refused, outage_change
from flows.breaker_events import CLOSED, OPENED, breaker_event

STATES = [pybreaker.STATE_CLOSED, pybreaker.STATE_OPEN, pybreaker.STATE_HALF_OPEN]
EXPECTED = {
    (pybreaker.STATE_CLOSED, pybreaker.STATE_OPEN): Outage.BEGAN,  # a trip
    (pybreaker.STATE_HALF_OPEN, pybreaker.STATE_CLOSED): Outage.ENDED,  # a trial call that worked
    (pybreaker.STATE_OPEN, pybreaker.STATE_CLOSED): Outage.ENDED,  # a reset
}


@pytest.mark.parametrize(("old", "new"), list(itertools.permutations(STATES, 2)))
def test_an_outage_begins_at_a_trip_and_ends_at_a_close_and_nothing_else_says_a_word(old: str, new: str) -> None:
    """A failed trial (half-open to open) is the same outage going on; a trial let through (open to
    half-open) is not yet its end."""
    change = EXPECTED.get((old, new))
    assert outage_change(old, new) is change
    assert breaker_event(old, new) == (None if change is None else {Outage.BEGAN: OPENED, Outage.ENDED: CLOSED}[change])


def test_a_refused_call_is_pybreakers_refusal_and_open_its_open_state() -> None:
    assert Refused is pybreaker.CircuitBreakerError
    assert OPEN == pybreaker.STATE_OPEN
