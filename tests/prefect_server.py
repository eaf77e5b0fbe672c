"""A real `prefect server start` of a test module's own (the acceptance tests that need what the
test harness lacks: schedules, lease repossession, deployments served by another process)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx

START_TIMEOUT = 150.0


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def healthy(api: str) -> bool:
    try:
        return httpx.get(f"{api}/health", timeout=2).status_code == 200
    except httpx.TransportError:
        return False


def api_call(method: str, url: str, json: object = None, attempts: int = 5) -> Any:
    """One call to a test's Prefect server, its JSON answer. A busy server answers late, or 500
    ("database is locked" on SQLite, a known upstream issue) or 503, now and then under the full
    suite's load: such an answer, or a refused connection, is tried again; any other failure names
    the answer."""
    for attempt in range(attempts):
        try:
            answer = httpx.request(method, url, json=json, timeout=30)
        except httpx.TransportError:
            if attempt == attempts - 1:
                raise
        else:
            if answer.status_code < 500 or attempt == attempts - 1:
                assert answer.is_success, f"{method} {url}: {answer.status_code} {answer.text[:500]}"
                return answer.json()
        time.sleep(1 + attempt)
    raise AssertionError("unreachable")


def stop_group(process: subprocess.Popen[bytes]) -> None:
    """SIGTERM to the process group, SIGKILL after 30 s."""
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


@contextmanager
def prefect_server(home: Path, extra_env: dict[str, str] | None = None) -> Iterator[str]:
    """Start a server with its own PREFECT_HOME, wait until it answers, yield its API URL, stop it."""
    port = free_port()
    env = {**os.environ, "PREFECT_HOME": str(home), "PREFECT_SERVER_ANALYTICS_ENABLED": "false", **(extra_env or {})}
    env.pop("PREFECT_API_URL", None)
    process = subprocess.Popen(
        [sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1", "--port", str(port)],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    api = f"http://127.0.0.1:{port}/api"
    try:
        deadline = time.monotonic() + START_TIMEOUT
        while not healthy(api):
            assert process.poll() is None, f"the Prefect server exited with {process.returncode}"
            assert time.monotonic() < deadline, f"the Prefect server did not answer within {START_TIMEOUT:.0f} s"
            time.sleep(0.5)
        yield api
    finally:
        stop_group(process)
