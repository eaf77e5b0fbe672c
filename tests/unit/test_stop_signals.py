"""SIGTERM and SIGINT as a stop request: counted, never raised, and waking the waiter at once."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import pytest

from flows.stop_signals import STOP_SIGNALS, StopSignals


@pytest.fixture
def stop() -> Iterator[StopSignals]:
    """Installed in this process, past start-up (a signal must not end pytest); pytest's own
    handlers come back afterwards."""
    before = {signum: signal.getsignal(signum) for signum in STOP_SIGNALS}
    stop = StopSignals()
    stop.install()
    stop.started_something()
    try:
        yield stop
    finally:
        for signum, handler in before.items():
            signal.signal(signum, handler)


def test_signals_are_counted_and_nothing_is_raised(stop: StopSignals) -> None:
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(0.05)  # the handler runs here; with Python's defaults this line would raise or kill
    os.kill(os.getpid(), signal.SIGINT)
    time.sleep(0.05)
    assert (stop.count, stop.first) == (2, "SIGTERM")
    assert stop.announcement("serving") == "stopping on SIGTERM, received while serving"


def test_a_signal_wakes_the_waiter_at_once(stop: StopSignals) -> None:
    sender = threading.Timer(0.2, os.kill, (os.getpid(), signal.SIGTERM))
    started = time.monotonic()
    sender.start()
    # A poll of 30 s: only the signal's wake-up can end this wait early.
    finished = stop.wait_until(lambda: False, 30, until_count=1, poll=30)
    waited = time.monotonic() - started
    sender.join()
    assert not finished
    assert 0.15 < waited < 5, waited


def test_wait_until_returns_when_done_and_on_a_second_signal_only_when_asked(stop: StopSignals) -> None:
    assert stop.wait_until(lambda: True, 0, until_count=1)
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(0.05)
    started = time.monotonic()
    assert not stop.wait_until(lambda: False, 0.3, until_count=2, poll=0.05)  # one signal: the timeout ends it
    assert time.monotonic() - started >= 0.3
    os.kill(os.getpid(), signal.SIGINT)
    time.sleep(0.05)
    started = time.monotonic()
    assert not stop.wait_until(lambda: False, 30, until_count=2)
    assert time.monotonic() - started < 1


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_before_anything_started_a_signal_exits_0_on_the_spot(signum: signal.Signals) -> None:
    script = (
        "import os, signal, time\n"
        "from flows.stop_signals import StopSignals\n"
        "stop = StopSignals()\n"
        "stop.install()\n"
        f"os.kill(os.getpid(), {int(signum)})\n"
        "time.sleep(10)\n"
        "raise SystemExit(3)\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout == f"stopping on {signum.name}, received while starting\nstopped\n"
