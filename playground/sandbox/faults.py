"""Fault injection: what the dice say for each request, and the waits (latency, hangs) that follow.

The settings can change while the sandbox runs (`PUT /api/_faults`): a demo flips an outage on and
off. Waits are `asyncio.sleep`s in small steps, so latency never serializes concurrent requests and
a server that is stopping is never held up for `hang_seconds`.
"""

from __future__ import annotations

import asyncio
import logging
import random
import threading
from dataclasses import asdict, dataclass
from typing import Any

from playground.sandbox.settings import FaultSettings

__all__ = ["FaultInjector", "Verdict"]

logger = logging.getLogger("playground.sandbox")

#: How often a sleeping request checks whether the server is stopping, so a 30 s hang never holds
#: up Ctrl-C or a test's `stop()`.
_PAUSE_STEP = 0.05


@dataclass(frozen=True)
class Verdict:
    """What happens to one request, decided on arrival so the fault sequence follows the seed in
    arrival order even when latency lets requests overlap."""

    latency_seconds: float
    fail: bool
    #: How long a failing request sleeps before its 503 (None: it answers at once).
    hang_seconds: float | None


class FaultInjector:
    """The fault settings in force and the seeded dice. Everything but `release_waits` runs on the
    server's event loop thread."""

    def __init__(self, settings: FaultSettings, seed: int | None) -> None:
        self._settings = settings
        self._random = random.Random(seed)
        # A threading.Event, not an asyncio one: the server's owner sets it from its own thread.
        self._stopping = threading.Event()

    @property
    def settings(self) -> dict[str, Any]:
        return asdict(self._settings)

    def in_words(self) -> str:
        return self._settings.in_words()

    def change(self, patch: object) -> dict[str, Any]:
        """Apply a `PUT /api/_faults` body; ValueError or TypeError names what is wrong with it."""
        self._settings = self._settings.changed(patch)
        logger.info("sandbox faults now: %s", self._settings.in_words())
        return self.settings

    def verdict(self, write: bool) -> Verdict:
        """Only writes (POST, PATCH) fail; every request gets the latency."""
        faults = self._settings
        fail = hang = False
        if write:
            # Two draws every time, whatever the rates: the seed then fixes the same sequence of
            # coin flips even after `PUT /api/_faults` changes the rates.
            fail_draw, hang_draw = self._random.random(), self._random.random()
            fail, hang = fail_draw < faults.fail_rate, hang_draw < faults.timeout_share
        return Verdict(faults.latency_ms / 1000, fail, faults.hang_seconds if fail and hang else None)

    async def pause(self, seconds: float) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + seconds
        while not self._stopping.is_set():
            remaining = deadline - loop.time()
            if remaining <= 0:
                return
            await asyncio.sleep(min(remaining, _PAUSE_STEP))

    def release_waits(self) -> None:
        """Cut short every latency sleep and hang in progress, from any thread."""
        self._stopping.set()
