"""Four processes migrating one empty database at once (every process migrates on first use) end
with one schema at head and no error: on PostgreSQL under an advisory lock with the revision
re-checked once it is taken, on SQLite under its write lock.

Each child imports everything first, then waits at a barrier (a line on stdin) so that all four
call into the migration within milliseconds of each other; each reports when its call started and
ended, which revision its first check saw, and how often it ran Alembic's upgrade. Each test
asserts that in at least one round the four calls overlapped in time and at least two set out to
migrate, so a pass means the race happened and was survived.

Measured before the fixes: without the advisory lock every PostgreSQL round failed (27 of 27,
mostly three of four processes on a duplicate key of `alembic_version`); without the re-check
every round ran Alembic four times. SQLite never failed in the migration itself, but in 8 of 174
`shared_engine` rounds (none of 120 through the CLI) a process failed to switch the new file to
WAL with "database is locked": the last test stages that case without luck."""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from delivery import db
from tests.support.databases import create_postgres_database, drop_postgres_database

PROCESSES = 4
ROUNDS = 3
ROOT = Path(__file__).resolve().parents[2]

#: The child: `shared_engine` is what every command and flow calls first; `cli` is `delivery db upgrade`.
#: Imports cost seconds, so one child serves every round: each line on stdin is a database URL
#: (the barrier), and each answer a line "result {json}".
CHILD = r"""
import json, os, sys, time
from alembic import command
from delivery import db

entry = sys.argv[1]
seen, migrated, engines = [], [], []
real_revision, real_upgrade, real_create_engine = db.current_revision, command.upgrade, db.create_engine

def current_revision(engine):
    revision = real_revision(engine)
    seen.append(revision)
    return revision

def upgrade(*args, **kwargs):
    migrated.append(time.time())
    return real_upgrade(*args, **kwargs)

def create_engine(url=None):
    engines.append(real_create_engine(url))
    return engines[-1]

db.current_revision = current_revision
command.upgrade = upgrade
db.create_engine = create_engine
if entry == "cli":
    from flows.cli import app
print("ready", flush=True)
for line in sys.stdin:
    url = line.strip()
    seen.clear()
    migrated.clear()
    start = time.time()
    error = None
    try:
        if entry == "cli":
            os.environ["DELIVERY_DATABASE_URL"] = url
            app(["db", "upgrade"], standalone_mode=False)
        else:
            db.shared_engine(url)
    except Exception as exc:
        error = f"{type(exc).__name__}: {exc}"[:500]
    end = time.time()
    report = {"start": start, "end": end, "seen": list(seen), "migrated": len(migrated), "error": error}
    # Close this round's pools: rounds times children must not run the server out of connections.
    db.dispose_engines()
    for engine in engines:
        engine.dispose()
    engines.clear()
    print("result " + json.dumps(report), flush=True)
"""


class Racers:
    """Four children, imported and waiting; `race(url)` releases them together on one database."""

    def __init__(self, entry: str) -> None:
        self.entry = entry
        env = {**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": "200"}
        env.pop(db.DATABASE_URL_ENV, None)
        self.children = [
            subprocess.Popen(
                [sys.executable, "-c", CHILD, entry],
                cwd=ROOT,
                env=env,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=None,  # inherited: pytest shows a failing child's traceback
                text=True,
            )
            for _ in range(PROCESSES)
        ]
        for child in self.children:
            assert self._line(child) == "ready"

    @staticmethod
    def _line(child: subprocess.Popen[str]) -> str:
        assert child.stdout is not None
        line = child.stdout.readline()
        assert line, f"child {child.pid} ended early with exit code {child.wait(timeout=10)}"
        return line.strip()

    def race(self, url: str) -> list[dict[str, Any]]:
        for child in self.children:
            assert child.stdin is not None
            child.stdin.write(url + "\n")
            child.stdin.flush()
        return [self._result(child) for child in self.children]

    def _result(self, child: subprocess.Popen[str]) -> dict[str, Any]:
        line = self._line(child)
        while not line.startswith("result "):  # what the command itself printed
            line = self._line(child)
        report: dict[str, Any] = json.loads(line.removeprefix("result "))
        return report

    def close(self) -> None:
        for child in self.children:
            if child.stdin is not None:
                child.stdin.close()
        for child in self.children:
            try:
                child.wait(timeout=30)
            except subprocess.TimeoutExpired:
                child.kill()
                child.wait()
            if child.stdout is not None:
                child.stdout.close()


@pytest.fixture(params=["shared_engine", "cli"])
def racers(request: pytest.FixtureRequest) -> Iterator[Racers]:
    started = Racers(request.param)
    yield started
    started.close()


def raced(results: list[dict[str, Any]], entry: str) -> bool:
    """Every call started before any of them finished (all four were in it together), and, for
    `shared_engine`, at least two found the database not at head at their first, unlocked look:
    both set out to migrate. (`delivery db upgrade` always sets out to.)"""
    overlapped = max(r["start"] for r in results) < min(r["end"] for r in results)
    set_out = sum(r["seen"][0] is None for r in results) if entry == "shared_engine" else len(results)
    return overlapped and set_out >= 2


def assert_one_schema_at_head(url: str) -> None:
    engine = db.create_engine(url)
    try:
        with engine.connect() as conn:
            versions = conn.exec_driver_sql("SELECT version_num FROM alembic_version").scalars().all()
        assert versions == [db.head_revision(engine)]
        assert {"connections", "rules", "mirror_records", "ledger", "chains", "breaker_states"} <= set(
            sa.inspect(engine).get_table_names()
        )
    finally:
        engine.dispose()


@pytest.fixture
def empty_postgres() -> Iterator[Callable[[], str]]:
    names: list[str] = []

    def make() -> str:
        name = f"delivery_race_{uuid.uuid4().hex[:10]}"
        names.append(name)
        return create_postgres_database(name)

    yield make
    for name in names:
        drop_postgres_database(name)


@pytest.mark.slow
@pytest.mark.postgres
def test_four_processes_migrate_an_empty_postgres_database_once(
    racers: Racers, empty_postgres: Callable[[], str]
) -> None:
    races = 0
    for _round in range(ROUNDS):
        url = empty_postgres()
        results = racers.race(url)
        assert [r["error"] for r in results] == [None] * PROCESSES, results
        races += raced(results, racers.entry)
        # Exactly one ran Alembic: the others re-checked once they held the lock and did nothing.
        assert sum(r["migrated"] for r in results) == 1, results
        assert_one_schema_at_head(url)
    assert races > 0, "no round raced: the test proved nothing"


@pytest.mark.slow
def test_four_processes_migrate_an_empty_sqlite_file(racers: Racers, tmp_path: Path) -> None:
    races = 0
    for round_ in range(ROUNDS):
        url = f"sqlite:///{tmp_path / f'race-{round_}.db'}"
        results = racers.race(url)
        assert [r["error"] for r in results] == [None] * PROCESSES, results
        races += raced(results, racers.entry)
        # Alembic may run more than once here: the write lock makes the later runs find head.
        assert_one_schema_at_head(url)
    assert races > 0, "no round raced: the test proved nothing"


def test_a_new_sqlite_file_waits_for_the_write_lock_to_switch_to_wal(tmp_path: Path) -> None:
    """The one SQLite failure the race above can hit (a few rounds in forty): switching a new
    file to WAL while another process holds its write lock is refused at once, busy_timeout or
    not. Staged here without luck: another connection holds the write lock of a new file for
    0.3 s while this process opens its first connection, which must wait and succeed."""
    path = tmp_path / "new.db"
    other = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
    other.execute("BEGIN IMMEDIATE")
    released: list[float] = []

    def release() -> None:
        released.append(time.monotonic())
        other.execute("ROLLBACK")

    timer = threading.Timer(0.3, release)
    timer.start()
    engine = db.create_engine(f"sqlite:///{path}")
    try:
        with engine.connect() as conn:
            connected = time.monotonic()
            assert conn.exec_driver_sql("PRAGMA journal_mode").scalar() == "wal"
        assert released and connected >= released[0]  # it really met the held lock, and waited
        db.ensure_schema(engine)
        assert db.current_revision(engine) == db.head_revision(engine)
    finally:
        timer.join()
        other.close()
        engine.dispose()


def test_threads_of_one_process_opening_a_database_together_share_one_engine(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A warm worker starts several chains at once, each on a thread of its own, and each asks for
    the shared engine first. Making an engine is slowed down here so that, without the lock, every
    thread would make one (and all but one pool would leak)."""
    url = f"sqlite:///{tmp_path / 'shared.db'}"
    made: list[sa.Engine] = []
    real_create_engine = db.create_engine

    def slow_create_engine(url: str | None = None) -> sa.Engine:
        made.append(real_create_engine(url))
        time.sleep(0.3)
        return made[-1]

    monkeypatch.setattr(db, "create_engine", slow_create_engine)
    threads = 8
    start = threading.Barrier(threads, timeout=30)
    got: list[sa.Engine] = []

    def open_it() -> None:
        start.wait()
        got.append(db.shared_engine(url))

    racing = [threading.Thread(target=open_it) for _ in range(threads)]
    try:
        for thread in racing:
            thread.start()
        for thread in racing:
            thread.join(timeout=60)
        assert len(got) == threads and len(made) == 1
        assert all(engine is made[0] for engine in got)
    finally:
        db.dispose_engines()
        for engine in made:
            engine.dispose()
