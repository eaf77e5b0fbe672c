"""Where a scan job moves the cursor (`delivery.chain.cursor_after`), as a pure function of the page
and what its job attempted: past the attempted records up to the first hole, never backwards."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from hypothesis import given
from hypothesis import strategies as st

from delivery.chain import cursor_after
from delivery.domain import Candidate, Cursor, LedgerStatus, MirrorRecord

T0 = datetime(2025, 1, 1, tzinfo=UTC)


def _page(steps: list[tuple[int, int]]) -> list[Candidate]:
    """Candidates in the scan's (changed_at, id) order: each step moves the time on by 0 or more
    seconds and the id on by 1 or more."""
    page, at, record_id = [], T0, 0
    for seconds, ids in steps:
        at, record_id = at + timedelta(seconds=seconds), record_id + ids
        record = MirrorRecord(record_id, 1, "contact", f"e{record_id}", {}, False, at)
        page.append(Candidate(record, None))
    return page


def _cursor(candidate: Candidate) -> Cursor:
    return Cursor(candidate.record.changed_at, candidate.record.id)


statuses = st.one_of(st.none(), st.sampled_from(list(LedgerStatus)))
pages = st.lists(st.tuples(st.integers(0, 3), st.integers(1, 3)), max_size=30).flatmap(
    lambda steps: st.tuples(st.just(_page(steps)), st.lists(statuses, min_size=len(steps), max_size=len(steps)))
)
starts = st.one_of(st.none(), st.integers(-5, 100).map(lambda s: Cursor(T0 + timedelta(seconds=s), s)))


@given(pages, starts)
def test_the_cursor_never_moves_backwards(
    page_and_attempted: tuple[list[Candidate], list], since: Cursor | None
) -> None:
    page, attempted = page_and_attempted
    to = cursor_after(page, attempted, since)
    if to is not None and since is not None:
        assert to > since


@given(pages)
def test_it_moves_to_the_highest_record_attempted_before_the_first_one_not_attempted(
    page_and_attempted: tuple[list[Candidate], list],
) -> None:
    page, attempted = page_and_attempted
    to = cursor_after(page, attempted, None)
    prefix = 0
    while prefix < len(page) and attempted[prefix] is not None:
        prefix += 1
    if prefix == 0:
        assert to is None
    else:
        assert to == _cursor(page[prefix - 1])
        assert all(_cursor(c) <= to for c in page[:prefix])  # the highest of those attempted
        # Nothing at or after the first hole is passed, even a record attempted beyond it.
        assert all(_cursor(c) > to for c in page[prefix:])


def test_a_page_with_a_hole_stops_before_it_and_an_empty_page_moves_nothing() -> None:
    page = _page([(1, 1), (1, 1), (1, 1)])
    delivered = LedgerStatus.DELIVERED
    assert cursor_after(page, [delivered, None, delivered], None) == _cursor(page[0])
    assert cursor_after(page, [delivered, delivered, delivered], None) == _cursor(page[2])
    assert cursor_after(page, [None, delivered, delivered], None) is None
    assert cursor_after([], [], None) is None
    # A page read from behind the cursor (a late allowance re-reads a window) moves only forward.
    assert cursor_after(page, [delivered, delivered, delivered], _cursor(page[2])) is None
    assert cursor_after(page, [delivered, delivered, delivered], _cursor(page[1])) == _cursor(page[2])
