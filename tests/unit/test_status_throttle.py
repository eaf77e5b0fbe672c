"""When a chain's end publishes the `delivery-status` artifact (`flows.chain_reporting.StatusThrottle`):
always for a chain run alone, at most every N seconds in a process that runs many, and always at
the end of the last chain in flight."""

from __future__ import annotations

import threading

import pytest

from flows import chain_reporting
from flows.chain_reporting import StatusThrottle


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_unthrottled_every_end_publishes() -> None:
    throttle = StatusThrottle(Clock())
    for _ in range(3):
        throttle.started()
    assert [throttle.ended() for _ in range(3)] == [True, True, True]


def test_throttled_an_end_publishes_at_most_every_interval_and_always_when_the_last_chain_ends() -> None:
    clock = Clock()
    throttle = StatusThrottle(clock)
    throttle.throttle(30.0)
    for _ in range(5):
        throttle.started()
    assert throttle.ended() is True  # the first end of the process: nothing published yet
    clock.now += 10
    assert throttle.ended() is False  # 10 s later, chains still in flight
    clock.now += 25
    assert throttle.ended() is True  # 35 s after the last publish
    clock.now += 1
    assert throttle.ended() is False
    assert throttle.in_flight == 1
    clock.now += 1
    assert throttle.ended() is True  # the last chain in flight: the artifact is left as of it
    assert throttle.in_flight == 0


def test_a_chain_alone_in_a_throttled_process_always_publishes() -> None:
    clock = Clock()
    throttle = StatusThrottle(clock)
    throttle.throttle(30.0)
    for _ in range(3):
        throttle.started()
        clock.now += 1
        assert throttle.ended() is True


def test_throttling_off_again() -> None:
    clock = Clock()
    throttle = StatusThrottle(clock)
    throttle.throttle(30.0)
    throttle.started(), throttle.started(), throttle.started()
    assert throttle.ended() is True and throttle.ended() is False
    throttle.throttle(None)
    assert throttle.every_seconds is None
    throttle.started()
    assert throttle.ended() is True


def test_a_negative_interval_is_refused() -> None:
    with pytest.raises(ValueError, match="every_seconds"):
        StatusThrottle().throttle(-1)


def test_the_process_hook_sets_the_one_throttle(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(chain_reporting, "STATUS", StatusThrottle())
    chain_reporting.throttle_status(30.0)
    assert chain_reporting.STATUS.every_seconds == 30.0
    chain_reporting.throttle_status(None)
    assert chain_reporting.STATUS.every_seconds is None


def test_chains_ending_on_many_threads_at_once_publish_once_per_interval_and_at_the_last() -> None:
    clock = Clock()  # frozen: every end but the first and the last falls inside the interval
    throttle = StatusThrottle(clock)
    throttle.throttle(30.0)
    chains = 64
    for _ in range(chains):
        throttle.started()
    published: list[bool] = []
    lock = threading.Lock()
    start = threading.Barrier(chains)

    def end() -> None:
        start.wait(timeout=10)
        said = throttle.ended()
        with lock:
            published.append(said)

    threads = [threading.Thread(target=end) for _ in range(chains)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=10)
    assert len(published) == chains
    assert published.count(True) == 2  # the first end, and the last chain in flight
    assert throttle.in_flight == 0
