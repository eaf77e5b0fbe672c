"""The status table's cut of a long message (`delivery.status.shortened`)."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from delivery.status import shortened


def test_a_message_that_fits_is_kept_whole_and_a_long_one_is_cut_at_a_word() -> None:
    assert shortened("caught up: 2 delivered", 48) == "caught up: 2 delivered"
    said = "breaker open for target 'erp' until 13:57:41 UTC; the connection status is unchanged"
    assert shortened(said, 48) == "breaker open for target 'erp' until 13:57:41…"


@given(st.text(), st.integers(min_value=2, max_value=80))
def test_the_cut_is_never_longer_than_asked_and_is_the_start_of_the_message(text: str, chars: int) -> None:
    cut = shortened(text, chars)
    assert len(cut) <= chars
    if cut != text:
        assert cut.endswith("…") and text.startswith(cut[:-1].rstrip())
