"""Pure decisions behind alerting and lock liveness: when a rule's health changes (alert once, not
once per failing chain), and when a lock holder is dead rather than slow."""

from __future__ import annotations

import os
import subprocess
import sys
from datetime import UTC, datetime, timedelta

import pytest

from delivery.domain import ChainEnd
from delivery.liveness import Holder, holder_is_dead, pid_alive
from delivery.rule_health import Transition, transition

# -- rule_health.transition ---------------------------------------------------------------------

PREVIOUS: list[str | None] = [None, *(end.value for end in ChainEnd)]


def expected_transition(previous: str | None, current: ChainEnd) -> Transition | None:
    """The rule is failing while its chains end by a rule fault and recovered when one catches up;
    superseded and disabled chains, closed routes and open breakers say nothing either way."""
    if current not in (ChainEnd.CAUGHT_UP, ChainEnd.RULE_FAULT):
        return None
    was_failing = previous == ChainEnd.RULE_FAULT.value
    if current is ChainEnd.RULE_FAULT:
        return None if was_failing else Transition.FAILING
    return Transition.RECOVERED if was_failing else None


@pytest.mark.parametrize("current", list(ChainEnd), ids=lambda c: c.value)
@pytest.mark.parametrize("previous", PREVIOUS, ids=lambda p: f"after-{p}")
def test_transition_for_every_combination(previous: str | None, current: ChainEnd) -> None:
    assert transition(previous, current) is expected_transition(previous, current)


def test_event_names_are_the_ones_the_automations_expect() -> None:
    assert Transition.FAILING.value == "delivery.rule.failing"
    assert Transition.RECOVERED.value == "delivery.rule.recovered"


def test_first_chain_of_a_rule_that_faults_is_failing() -> None:
    assert transition(None, ChainEnd.RULE_FAULT) is Transition.FAILING


def test_a_second_rule_fault_says_nothing() -> None:
    assert transition(ChainEnd.RULE_FAULT.value, ChainEnd.RULE_FAULT) is None


def test_first_caught_up_chain_after_faults_is_recovered() -> None:
    assert transition(ChainEnd.RULE_FAULT.value, ChainEnd.CAUGHT_UP) is Transition.RECOVERED


@pytest.mark.parametrize(
    "current", [ChainEnd.ROUTE_CLOSED, ChainEnd.BREAKER_OPEN, ChainEnd.DISABLED], ids=lambda c: c.value
)
def test_a_closed_route_or_open_breaker_does_not_clear_a_failing_rule(current: ChainEnd) -> None:
    assert transition(ChainEnd.RULE_FAULT.value, current) is None


@pytest.mark.parametrize("previous", PREVIOUS, ids=lambda p: f"after-{p}")
def test_superseded_says_nothing(previous: str | None) -> None:
    assert transition(previous, ChainEnd.SUPERSEDED) is None


@pytest.mark.parametrize("current", [ChainEnd.ROUTE_CLOSED, ChainEnd.BREAKER_OPEN], ids=lambda c: c.value)
@pytest.mark.parametrize("previous", [None, "caught_up", "route_closed", "breaker_open"])
def test_closed_route_and_open_breaker_are_not_failing(previous: str | None, current: ChainEnd) -> None:
    assert transition(previous, current) is None


def test_a_run_of_chains_alerts_once_per_change_of_health() -> None:
    ends = [
        ChainEnd.CAUGHT_UP,
        ChainEnd.RULE_FAULT,
        ChainEnd.RULE_FAULT,
        ChainEnd.RULE_FAULT,
        ChainEnd.CAUGHT_UP,
        ChainEnd.BREAKER_OPEN,
        ChainEnd.RULE_FAULT,
        ChainEnd.ROUTE_CLOSED,
    ]
    previous: str | None = None
    alerts = []
    for end in ends:
        alerts.append(transition(previous, end))
        if end in (ChainEnd.CAUGHT_UP, ChainEnd.RULE_FAULT):  # what chains.previous_end looks back to
            previous = end.value
    assert alerts == [
        None,
        Transition.FAILING,
        None,
        None,
        Transition.RECOVERED,
        None,
        Transition.FAILING,
        None,  # a closed route does not clear a failing rule: only a chain that catches up does
    ]


# -- liveness.holder_is_dead --------------------------------------------------------------------

NOW = datetime(2026, 3, 1, 12, 0, tzinfo=UTC)
STALE_AFTER = timedelta(seconds=120)
HOST = "worker-1"


def holder(*, host: str | None = HOST, pid: int | None = 4242, age_seconds: float = 5.0) -> Holder:
    return Holder("token", "lease", host, pid, NOW - timedelta(seconds=age_seconds))


class FakeAlive:
    """Stands in for pid_alive and records which pids it was asked about."""

    def __init__(self, alive: bool) -> None:
        self.alive = alive
        self.asked: list[int] = []

    def __call__(self, pid: int) -> bool:
        self.asked.append(pid)
        return self.alive


def test_same_host_and_dead_pid_is_dead_even_with_a_fresh_heartbeat() -> None:
    alive = FakeAlive(False)
    assert holder_is_dead(holder(age_seconds=0), NOW, STALE_AFTER, HOST, alive=alive) is True
    assert alive.asked == [4242]


def test_same_host_live_pid_and_fresh_heartbeat_is_alive() -> None:
    alive = FakeAlive(True)
    assert holder_is_dead(holder(), NOW, STALE_AFTER, HOST, alive=alive) is False
    assert alive.asked == [4242]


def test_other_host_with_a_fresh_heartbeat_is_alive_and_its_pid_is_not_checked_here() -> None:
    alive = FakeAlive(False)  # a pid on another machine means nothing on this one
    assert holder_is_dead(holder(host="worker-2"), NOW, STALE_AFTER, HOST, alive=alive) is False
    assert alive.asked == []


def test_holder_without_host_or_pid_and_fresh_heartbeat_is_alive() -> None:
    alive = FakeAlive(False)
    assert holder_is_dead(holder(host=None, pid=None), NOW, STALE_AFTER, HOST, alive=alive) is False
    assert holder_is_dead(holder(pid=None), NOW, STALE_AFTER, HOST, alive=alive) is False


@pytest.mark.parametrize(
    ("host", "pid_is_alive"),
    [(HOST, True), ("worker-2", True), ("worker-2", False), (None, True)],
    ids=["same-host-live-pid", "other-host", "other-host-dead-pid-elsewhere", "unknown-host"],
)
def test_stale_heartbeat_is_dead_anywhere(host: str | None, pid_is_alive: bool) -> None:
    stale = holder(host=host, age_seconds=STALE_AFTER.total_seconds() + 1)
    assert holder_is_dead(stale, NOW, STALE_AFTER, HOST, alive=FakeAlive(pid_is_alive)) is True


def test_heartbeat_exactly_at_the_threshold_is_still_alive() -> None:
    edge = holder(host="worker-2", age_seconds=STALE_AFTER.total_seconds())
    assert holder_is_dead(edge, NOW, STALE_AFTER, HOST, alive=FakeAlive(True)) is False


# -- liveness.pid_alive -------------------------------------------------------------------------


def test_pid_alive_for_this_process() -> None:
    assert pid_alive(os.getpid()) is True


def test_pid_of_a_finished_subprocess_is_not_alive() -> None:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    assert child.wait(timeout=30) == 0  # reaped: the pid no longer names a process
    assert pid_alive(child.pid) is False
