"""The engine's own threads in this process: a test that must show a job stopped sending and
writing waits for them to end, instead of sleeping and seeing nothing more happen."""

from __future__ import annotations

import threading
import time

#: The names the engine gives its threads (delivery/workers.py, settle.py, send_loop.py).
ENGINE_THREADS = ("delivery-worker", "delivery-settle", "delivery-loop", "delivery-db", "delivery-wait")


def engine_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith(ENGINE_THREADS) and t.is_alive()]


def wait_for_engine_threads_to_end(timeout: float = 30) -> None:
    """Until none of the engine's threads is alive here (each polls its stop signal between
    calls; one in a call ends with the call's own timeout); fails after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while left := engine_threads():
        assert time.monotonic() < deadline, f"the engine's threads still run {timeout:.0f} s on: {left}"
        time.sleep(0.02)
