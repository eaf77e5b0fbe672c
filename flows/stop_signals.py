"""SIGTERM and SIGINT as a stop *request* for a long-running command (`delivery serve`).

Python's default turns SIGINT into a KeyboardInterrupt, and a handler that raises does the same for
SIGTERM: the exception surfaces wherever the main thread happens to be, inside Prefect's runner, an
HTTP call or a `finally` block, and the exit code depends on which. Here the handler only records
the signal and wakes whoever waits; the command decides at its own waiting points how to stop.

One exception: until the command has started anything (a server, a runner), there is nothing to
stop, and the process may be deep in imports that take seconds. A signal then ends the process on
the spot, with exit 0.

Prefect-free and cheap to import on purpose: the `delivery` console script (`flows.console.main`)
calls `claim_if_serving` before it imports the command line, so that on `delivery serve` a signal
during start-up is a stop too. Importing this module installs nothing: a handler is installed only
by `claim`, when a command starts.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import sys
import time
from collections.abc import Callable
from types import FrameType

# SIGINT first: Python catches it from the start, so once SIGTERM shows as caught both are ours.
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class StopSignals:
    """Counts SIGTERM/SIGINT: the first asks for a clean stop, a second one for a faster one."""

    def __init__(self) -> None:
        self.count = 0
        self.first: str | None = None
        # Until `started_something`: nothing to stop, a signal exits at once.
        self._nothing_started = True
        self._installed = False
        # A self-pipe: the handler writes one byte, `wait` selects on it. No lock is taken in the
        # handler, which may run while the main thread holds any lock (an Event's included).
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_w, False)

    def install(self) -> None:
        """Take SIGTERM and SIGINT over (main thread only; installing twice changes nothing)."""
        if self._installed:
            return
        for signum in STOP_SIGNALS:
            signal.signal(signum, self._on_signal)
        self._installed = True

    def started_something(self) -> None:
        """From now on a signal is a request the command answers by stopping what it started.

        Call it *before* starting the thing: a signal in between is then a request, seen at the
        command's next wait."""
        self._nothing_started = False

    @property
    def requested(self) -> bool:
        return self.count > 0

    def announcement(self, phase: str) -> str:
        """What the command prints when it sets out to stop (tests read it to see where it was)."""
        return f"stopping on {self.first}, received while {phase}"

    def _on_signal(self, signum: int, _frame: FrameType | None) -> None:
        self.count += 1
        if self.first is None:
            self.first = signal.Signals(signum).name
        if self._nothing_started:
            # Nothing was printed yet that a buffer could hold back; write past it all the same.
            os.write(sys.stdout.fileno(), f"{self.announcement('starting')}\nstopped\n".encode())
            os._exit(0)
        # Full pipe: a wake-up is already pending, which is all a waiter needs.
        with contextlib.suppress(BlockingIOError):
            os.write(self._wake_w, b"\0")

    def wait(self, timeout: float) -> None:
        """Sleep up to `timeout` seconds, returning at once when a stop signal arrives."""
        ready, _, _ = select.select([self._wake_r], [], [], max(timeout, 0.0))
        if ready:
            with contextlib.suppress(BlockingIOError):
                os.read(self._wake_r, 512)

    def wait_until(self, done: Callable[[], bool], timeout: float, *, until_count: int, poll: float = 0.1) -> bool:
        """Wait for `done()` for up to `timeout` seconds, or until `until_count` signals arrived.

        Returns `done()`. `poll` bounds how late a `done` that no signal announces is noticed."""
        deadline = time.monotonic() + timeout
        while not done():
            remaining = deadline - time.monotonic()
            if remaining <= 0 or self.count >= until_count:
                return False
            self.wait(min(poll, remaining))
        return True


_claimed: StopSignals | None = None


def claim() -> StopSignals:
    """The process's one StopSignals, installed on the first call (from the main thread)."""
    global _claimed
    if _claimed is None:
        _claimed = StopSignals()
        _claimed.install()
    return _claimed


def claim_if_serving(argv: list[str]) -> None:
    """Take the stop signals over at once when the command line is `delivery serve`."""
    if argv[1:2] == ["serve"] and os.path.basename(argv[0]) in ("delivery", "cli.py"):
        claim()
