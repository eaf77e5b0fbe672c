"""A real `prefect server start` of a test module's own (the acceptance tests that need what the
test harness lacks: schedules, lease repossession, deployments served by another process)."""

from __future__ import annotations

import contextlib
import fcntl
import functools
import os
import signal
import socket
import sqlite3
import subprocess
import sys
import tempfile
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
                return answer.json() if answer.content else None  # a 204 has no body
        time.sleep(1 + attempt)
    raise AssertionError("unreachable")


#: Where the migrated Prefect database of this test run lies: set once by the process that starts
#: the run (`tests/conftest.py`), inherited by its xdist workers, removed when the run ends.
TEMPLATE_ENV = "DELIVERY_TEST_PREFECT_TEMPLATE"


@functools.cache
def migrated_database() -> Path:
    """A Prefect database migrated once per test run (12 s of CPU each time it is done): the first
    process to need it migrates it, under a lock the others wait on, and every server copies it."""
    directory = Path(os.environ[TEMPLATE_ENV])  # set by tests/conftest.py before any test runs
    database = directory / "prefect.db"
    with (directory / "lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not database.exists():
            home = Path(tempfile.mkdtemp(prefix="home-", dir=directory))
            env = {**os.environ, "PREFECT_HOME": str(home), "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}
            env.pop("PREFECT_API_URL", None)
            env.pop("PREFECT_API_DATABASE_CONNECTION_URL", None)
            subprocess.run(
                [sys.executable, "-m", "prefect", "server", "database", "upgrade", "-y"],
                env=env, check=True, capture_output=True, timeout=300,
            )  # fmt: skip
            (home / "prefect.db").rename(database)  # whole, or not there: a waiter never copies half
    return database


def copy_database(to: Path) -> None:
    """The run's migrated Prefect database copied to `to` (SQLite's backup: a consistent copy)."""
    with (
        contextlib.closing(sqlite3.connect(migrated_database())) as source,
        contextlib.closing(sqlite3.connect(to)) as copy,
    ):
        source.backup(copy)


def migrated_home(home: Path) -> Path:
    """`home` as a PREFECT_HOME whose database is migrated already (a copy of one migrated once per
    test process), unless it has a database of its own. A server on it starts in seconds; the
    start-up on a new database is what `tests/acceptance/test_serve.py` checks."""
    home.mkdir(parents=True, exist_ok=True)
    if not (home / "prefect.db").exists():
        copy_database(home / "prefect.db")
    return home


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
    """Start a server with its own PREFECT_HOME (its database migrated already), wait until it
    answers, yield its API URL, stop it."""
    migrated_home(home)
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
