"""The sandbox target in its own process (`delivery sandbox`), so that its CPU is not the bench's."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class SandboxProcess:
    """`delivery sandbox --port P --latency-ms L` as a child process; `stop()` is always safe."""

    def __init__(self, latency_ms: int, log_path: Path) -> None:
        self.latency_ms = latency_ms
        self.log_path = log_path
        self.port = _free_port()
        self._process: subprocess.Popen[bytes] | None = None
        self._log: Any = None

    @property
    def pid(self) -> int | None:
        return None if self._process is None else self._process.pid

    @property
    def root(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def api(self) -> str:
        """The `base_url` of a `rest` connection to it."""
        return f"{self.root}/api"

    def start(self, timeout: float = 30.0) -> SandboxProcess:
        command = [
            str(Path(sys.executable).with_name("delivery")),
            "sandbox",
            "--port",
            str(self.port),
            "--latency-ms",
            str(self.latency_ms),
        ]
        # Its access log (one line a request) goes to a file: a pipe nobody reads would fill up
        # and stall the target.
        self._log = self.log_path.open("wb")
        self._process = subprocess.Popen(command, stdout=self._log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout
        while True:
            if self._process.poll() is not None:
                raise RuntimeError(f"the sandbox exited with {self._process.returncode}; see {self.log_path}")
            try:
                if httpx.get(f"{self.root}/healthz", timeout=1.0).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"the sandbox did not answer /healthz within {timeout:.0f} s; see {self.log_path}")
            time.sleep(0.1)

    def stats(self) -> dict[str, Any]:
        response = httpx.get(f"{self.api}/_stats", timeout=10.0)
        response.raise_for_status()
        data: dict[str, Any] = response.json()
        return data

    def creates(self, collection: str) -> int:
        return int(self.stats()["collections"].get(collection, {}).get("creates", 0))

    def stop(self) -> None:
        process, self._process = self._process, None
        if process is not None and process.poll() is None:
            process.terminate()
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(timeout=10)
        if self._log is not None:
            self._log.close()
            self._log = None
