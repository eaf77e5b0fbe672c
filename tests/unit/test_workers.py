"""The batch's worker pool: order with one worker, cuts, the first exception, and a job interrupted
from outside stopping every worker before it returns."""

from __future__ import annotations

import threading
import time

import pytest

from delivery.domain import ChainEnd
from delivery.workers import Cut, Signals, work_through


def test_one_worker_runs_the_steps_in_order_in_this_thread() -> None:
    seen: list[tuple[int, str]] = []

    def step(index: int, own: str, _signals: Signals) -> int:
        seen.append((index, threading.current_thread().name))
        return index * 10

    results, cuts = work_through(4, 1, lambda: "own", step)
    assert results == [0, 10, 20, 30] and cuts == []
    assert seen == [(i, threading.current_thread().name) for i in range(4)]


def test_each_worker_gets_what_it_owns_from_new_own() -> None:
    owned: list[object] = []

    def new_own() -> object:
        owned.append(object())
        return owned[-1]

    used: set[int] = set()

    def step(index: int, own: object, _signals: Signals) -> int:
        used.add(id(own))
        time.sleep(0.01)
        return index

    results, _ = work_through(20, 4, new_own, step)
    assert results == list(range(20)) and len(owned) == 4 and used <= {id(own) for own in owned}


def test_a_cut_stops_taking_records_and_the_calls_in_flight_still_give_their_result() -> None:
    started = threading.Barrier(4)

    def step(index: int, _own: None, _signals: Signals) -> int | Cut:
        if index < 4:
            started.wait(timeout=5)  # four calls in flight at once
        if index == 0:
            return Cut(ChainEnd.BREAKER_OPEN)
        time.sleep(0.05)
        return index

    results, cuts = work_through(40, 4, lambda: None, step)
    assert cuts == [ChainEnd.BREAKER_OPEN]
    assert results[0] is None and results[1:4] == [1, 2, 3]  # in flight when the cut came
    assert results[4:] == [None] * 36  # none taken after it


def test_the_first_exception_is_raised_after_every_worker_stopped() -> None:
    running = threading.Event()

    def step(index: int, _own: None, _signals: Signals) -> int:
        if index == 0:
            raise ValueError("boom")
        running.set()
        time.sleep(0.1)
        return index

    before = threading.active_count()
    with pytest.raises(ValueError, match="boom"):
        work_through(40, 4, lambda: None, step)
    assert threading.active_count() == before


def test_a_job_interrupted_from_outside_waits_for_its_workers_which_write_nothing_after() -> None:
    """What the batch timeout does: an exception raised into the waiting thread."""
    written: list[int] = []
    over_seen: list[int] = []

    def step(index: int, _own: None, signals: Signals) -> int | None:
        time.sleep(0.2)  # the call
        if signals.over.is_set():
            over_seen.append(index)
            return None
        written.append(index)
        return index

    caller = threading.get_ident()

    def interrupt() -> None:
        time.sleep(0.3)
        import ctypes

        ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(caller), ctypes.py_object(TimeoutError))

    threading.Thread(target=interrupt).start()
    with pytest.raises(TimeoutError):
        work_through(100, 4, lambda: None, step)
    ended_with = len(written)
    time.sleep(0.5)
    assert len(written) == ended_with < 100
    assert over_seen  # the calls in flight at the interrupt finished, and wrote nothing
