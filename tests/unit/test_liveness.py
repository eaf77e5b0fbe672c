"""The liveness predicates and thresholds (`delivery.liveness`) at their boundaries: a heartbeat
exactly as old as the window is alive, a microsecond older is dead, for every judge (the tick, the
handover, a lock's waiter), and every window keeps the value and the setting it had."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
from hypothesis import given
from hypothesis import settings as hypothesis_settings
from hypothesis import strategies as st

from delivery import liveness
from delivery.liveness import Holder
from delivery.store.chains import ChainRow

NOW = datetime(2026, 3, 1, 12, 0, tzinfo=UTC)
TICK = timedelta(microseconds=1)
HERE = "worker-1"


def never_asked(pid: int) -> bool:
    raise AssertionError(f"a holder on another host had its pid {pid} looked up here")


def _open_chain(started_at: datetime, heartbeat_at: datetime, *, running: bool = True) -> ChainRow:
    return ChainRow(
        token=f"t-{started_at.timestamp()}-{heartbeat_at.timestamp()}", rule_id=1, flow_run_id=None,
        started_at=started_at, heartbeat_at=heartbeat_at, ended_at=None, ended_by=None, message=None,
        report=None, lease_id=None, holder_host=None, holder_pid=None,
        running_at=started_at if running else None,
    )  # fmt: skip


# -- the one rule -------------------------------------------------------------------------------


def test_a_heartbeat_exactly_as_old_as_the_window_is_fresh_and_a_microsecond_older_is_not() -> None:
    window = timedelta(minutes=15)
    assert liveness.fresh(NOW - window, NOW, window) is True
    assert liveness.fresh(NOW - window - TICK, NOW, window) is False
    assert liveness.fresh(NOW, NOW, window) is True
    # A heartbeat written by a clock a little ahead of the judge's is fresh, not dead.
    assert liveness.fresh(NOW + timedelta(seconds=5), NOW, window) is True


_moments = st.datetimes(min_value=datetime(2000, 1, 1), max_value=datetime(2100, 1, 1), timezones=st.just(UTC))
_windows = st.timedeltas(min_value=timedelta(0), max_value=timedelta(days=8))


@hypothesis_settings(max_examples=300, deadline=None)
@given(heartbeat_at=_moments, now=_moments, window=_windows)
def test_the_query_cutoff_and_the_predicate_agree_everywhere(
    heartbeat_at: datetime, now: datetime, window: timedelta
) -> None:
    """The store is handed `cutoff` and keeps `heartbeat_at >= cutoff`; the tick and a waiter use
    `fresh`. One rule both ways, or a chain could be alive to one judge and dead to another."""
    alive = liveness.fresh(heartbeat_at, now, window)
    assert alive == (heartbeat_at >= liveness.cutoff(now, window))
    other_host = Holder("t", "lease", "worker-2", 42, heartbeat_at)
    assert liveness.holder_is_dead(other_host, now, window, HERE, alive=never_asked) is (not alive)


@hypothesis_settings(max_examples=200, deadline=None)
@given(now=_moments, window=_windows)
def test_just_alive_and_just_dead_for_any_window(now: datetime, window: timedelta) -> None:
    assert liveness.fresh(now - window, now, window)
    assert not liveness.fresh(now - window - TICK, now, window)


# -- the tick's window --------------------------------------------------------------------------


def test_the_dead_chain_window_is_the_setting_unless_the_tick_overrides_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("DELIVERY_DEAD_CHAIN_MINUTES", raising=False)
    assert liveness.dead_chain_after() == timedelta(minutes=15)
    monkeypatch.setenv("DELIVERY_DEAD_CHAIN_MINUTES", "2")
    assert liveness.dead_chain_after() == timedelta(minutes=2)
    assert liveness.dead_chain_after(0.5) == timedelta(seconds=30)


# -- the handover's window ----------------------------------------------------------------------


def test_the_handover_window_is_two_wait_steps_and_ten_seconds(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("DELIVERY_LOCK_WAIT_STEP_SECONDS", raising=False)
    assert liveness.lock_wait_step_seconds() == 15.0
    assert liveness.handover_window() == timedelta(seconds=40)
    monkeypatch.setenv("DELIVERY_LOCK_WAIT_STEP_SECONDS", "1")
    assert liveness.handover_window() == timedelta(seconds=12)


# -- a lock's holder ----------------------------------------------------------------------------


def test_a_holder_may_be_silent_two_minutes_and_twice_its_targets_timeout() -> None:
    assert liveness.holder_stale_after(10.0) == timedelta(seconds=140)
    assert liveness.holder_stale_after(0.5) == timedelta(seconds=121)


@pytest.mark.parametrize("target_timeout", [0.5, 10.0, 300.0])
def test_a_silent_holder_is_alive_at_its_window_and_dead_just_past_it(target_timeout: float) -> None:
    stale = liveness.holder_stale_after(target_timeout)
    just_alive = Holder("t", "lease", "worker-2", 42, NOW - stale)
    just_dead = Holder("t", "lease", "worker-2", 42, NOW - stale - TICK)
    assert liveness.holder_is_dead(just_alive, NOW, stale, HERE, alive=never_asked) is False
    assert liveness.holder_is_dead(just_dead, NOW, stale, HERE, alive=never_asked) is True


def test_a_holder_whose_process_is_gone_on_this_host_is_dead_at_once() -> None:
    beating = Holder("t", "lease", HERE, 42, NOW)
    assert liveness.holder_is_dead(beating, NOW, timedelta(minutes=2), HERE, alive=lambda pid: False) is True
    assert liveness.holder_is_dead(beating, NOW, timedelta(minutes=2), HERE, alive=lambda pid: True) is False


def test_a_slot_nobody_holds_on_record_is_lost_once_a_lease_has_surely_expired() -> None:
    assert liveness.UNACCOUNTED_SECONDS == liveness.LEASE_SECONDS + 15.0 == 75.0
    assert liveness.slot_lost(liveness.UNACCOUNTED_SECONDS - 0.001) is False
    assert liveness.slot_lost(liveness.UNACCOUNTED_SECONDS) is True
    assert liveness.slot_lost(0.0) is False


def test_the_lease_and_heartbeat_lengths_keep_their_values() -> None:
    """These are promises the docs make (docs/design.md, "Who is judged dead"): a change here is a
    change of behaviour, not a refactor."""
    assert liveness.LEASE_SECONDS == 60.0
    assert liveness.LEASE_RENEW_SECONDS == 45.0
    assert liveness.HEARTBEAT_SECONDS == 1.0
    assert liveness.STALE_HOLDER_SECONDS == 120.0
    assert liveness.HANDOVER_MARGIN_SECONDS == 10.0


# -- the tick's judgement of open chains (`judge`: rows, now, threshold) -------------------------


@pytest.mark.parametrize("threshold", [timedelta(minutes=15), timedelta(seconds=30), timedelta(days=7)])
def test_a_running_chain_is_alive_at_its_threshold_and_dead_a_microsecond_past_it(threshold: timedelta) -> None:
    beat = NOW - timedelta(hours=1)
    row = _open_chain(NOW - timedelta(days=8), beat)
    (alive,) = liveness.judge([row], beat + threshold, threshold)
    (dead,) = liveness.judge([row], beat + threshold + TICK, threshold)
    assert alive.alive and alive.silent_for == threshold and not alive.never_started
    assert not dead.alive and dead.silent_for == threshold + TICK and not dead.never_started


def test_a_launch_no_worker_started_is_dead_past_the_never_started_bound_whatever_its_heartbeat() -> None:
    bound = timedelta(seconds=liveness.NEVER_STARTED_SECONDS)
    launched = _open_chain(NOW, NOW, running=False)
    (waiting,) = liveness.judge([launched], NOW + bound, timedelta(days=1))
    (given_up,) = liveness.judge([launched], NOW + bound + TICK, timedelta(days=1))
    assert waiting.alive and not waiting.never_started
    assert not given_up.alive and given_up.never_started
    started = _open_chain(NOW, NOW)  # its run began: judged by its heartbeat alone
    (running,) = liveness.judge([started], NOW + bound + TICK, timedelta(days=1))
    assert running.alive and not running.never_started


@given(
    st.lists(st.tuples(st.timedeltas(timedelta(0), timedelta(days=2)), st.booleans()), max_size=6),
    st.timedeltas(timedelta(0), timedelta(days=1)),
)
def test_the_judgement_is_the_one_rule_for_every_row_in_order(
    ages: list[tuple[timedelta, bool]], threshold: timedelta
) -> None:
    rows = [
        _open_chain(NOW - age - timedelta(seconds=i), NOW - age, running=running)
        for i, (age, running) in enumerate(ages)
    ]
    lives = liveness.judge(rows, NOW, threshold)
    assert [life.token for life in lives] == [row.token for row in rows]
    for row, life in zip(rows, lives, strict=True):
        never = row.running_at is None and NOW - row.started_at > timedelta(seconds=liveness.NEVER_STARTED_SECONDS)
        assert life.never_started is never
        assert life.alive is (liveness.fresh(row.heartbeat_at, NOW, threshold) and not never)
