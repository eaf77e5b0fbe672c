"""A request sent up to `late_allowance` past its slot never crowds more than the budget into one
second's window, whatever the rate, and keeps room to spare for the way to the target."""

from __future__ import annotations

import math

from hypothesis import given
from hypothesis import strategies as st

from delivery.budget import LATE_FRACTION, SPACING_MARGIN, late_allowance

rates = st.floats(min_value=0.01, max_value=100_000, allow_nan=False, allow_infinity=False)


@given(rates)
def test_a_late_first_request_still_leaves_its_followers_out_of_its_second(per_second: float) -> None:
    interval = SPACING_MARGIN / per_second
    budget = math.ceil(per_second)  # requests a window of one second may see
    allowance = late_allowance(per_second)
    assert 0 < allowance <= LATE_FRACTION * interval
    # budget + 1 slots in a row: the first request sent as late as allowed, the last on time.
    first_sent = 0.0 + allowance
    last_sent = budget * interval
    spare = last_sent - first_sent - 1.0
    assert spare > 0
    assert spare >= allowance - 1e-9  # as much again left for the way from here to the target


def test_at_twenty_a_second_a_quarter_interval_and_below_ten_half_the_room() -> None:
    assert math.isclose(late_allowance(20), LATE_FRACTION * SPACING_MARGIN / 20)
    assert math.isclose(late_allowance(2), (SPACING_MARGIN - 1) / 2)
    assert math.isclose(late_allowance(0.5), LATE_FRACTION * SPACING_MARGIN / 0.5)
