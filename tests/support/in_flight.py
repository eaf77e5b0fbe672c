"""Requests in flight at the target, counted per collection and in all: how a test sees that calls
overlapped (or that a rule's never did)."""

from __future__ import annotations

import threading
from collections import Counter
from typing import Any
from urllib.parse import urlsplit

from tests.target_server import TargetServer


class InFlight:
    """Counts the target's requests in flight, per collection and in all."""

    def __init__(self, target: TargetServer) -> None:
        self._lock = threading.Lock()
        self._now: Counter[str] = Counter()
        self.most: Counter[str] = Counter()
        self._all = 0
        self.most_at_once = 0
        real = target._dispatch

        def dispatch(method: str, raw_path: str, headers: Any, raw: bytes) -> Any:
            collection = urlsplit(raw_path).path.split("/")[2]
            with self._lock:
                self._now[collection] += 1
                self._all += 1
                self.most[collection] = max(self.most[collection], self._now[collection])
                self.most_at_once = max(self.most_at_once, self._all)
            try:
                return real(method, raw_path, headers, raw)
            finally:
                with self._lock:
                    self._now[collection] -= 1
                    self._all -= 1

        target._dispatch = dispatch  # type: ignore[method-assign]
