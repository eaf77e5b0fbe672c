"""Which database, how to connect, and bringing its schema to the Alembic head."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory

DATABASE_URL_ENV = "DELIVERY_DATABASE_URL"
DEFAULT_URL = "sqlite:///delivery.db"


def database_url() -> str:
    """`DELIVERY_DATABASE_URL`, or a SQLite file `delivery.db` in the working directory."""
    url = os.environ.get(DATABASE_URL_ENV) or DEFAULT_URL
    # Plain postgresql:// would pick psycopg2, which we do not ship.
    if url.startswith("postgresql://") or url.startswith("postgres://"):
        url = "postgresql+psycopg://" + url.split("://", 1)[1]
    return url


def _on_sqlite_connect(dbapi_connection: Any, _record: Any) -> None:
    # WAL lets readers (the CLI, a status command) work while a chain writes; busy_timeout makes
    # a second writer wait instead of failing at once with "database is locked".
    dbapi_connection.isolation_level = None  # we emit BEGIN ourselves, see _sqlite_begin
    cursor = dbapi_connection.cursor()
    cursor.execute("PRAGMA journal_mode=WAL")
    cursor.execute("PRAGMA synchronous=NORMAL")
    cursor.execute("PRAGMA foreign_keys=ON")
    cursor.execute("PRAGMA busy_timeout=30000")
    cursor.close()


def _sqlite_begin(conn: sa.Connection) -> None:
    # A deferred BEGIN that reads and then writes fails at once (SQLITE_BUSY_SNAPSHOT) when another
    # writer committed in between; taking the write lock up front makes it wait its turn instead.
    # Connections marked readonly stay deferred so readers never queue behind a chain.
    readonly = conn.get_execution_options().get("readonly", False)
    conn.exec_driver_sql("BEGIN" if readonly else "BEGIN IMMEDIATE")


#: A batch's workers settle in parallel (a rule's `concurrency` is at most 64), each on a
#: connection of its own: the pool keeps enough to spare them a new connection per record, and
#: must never make them wait.
POOL_OPTIONS = {"pool_size": 10, "max_overflow": 64}


def create_engine(url: str | None = None) -> sa.Engine:
    url = url or database_url()
    if url.startswith("sqlite"):
        parsed = sa.make_url(url)
        # An in-memory database lives in one connection: there is no pool to size.
        in_memory = parsed.database in (None, "", ":memory:") or parsed.query.get("mode") == "memory"
        pool = {} if in_memory else POOL_OPTIONS
        engine = sa.create_engine(url, connect_args={"check_same_thread": False}, **pool)
        sa.event.listen(engine, "connect", _on_sqlite_connect)
        sa.event.listen(engine, "begin", _sqlite_begin)
        return engine
    return sa.create_engine(url, pool_pre_ping=True, **POOL_OPTIONS)


def migrations_dir() -> Path:
    here = Path(__file__).resolve().parent
    for candidate in (here / "_migrations", here.parent / "migrations"):
        if (candidate / "env.py").exists():
            return candidate
    raise RuntimeError("the Alembic migrations directory was not found next to the delivery package")


def alembic_config(engine: sa.Engine) -> Config:
    config = Config()
    config.set_main_option("script_location", str(migrations_dir()))
    config.attributes["engine"] = engine
    return config


def current_revision(engine: sa.Engine) -> str | None:
    with engine.connect() as conn:
        return MigrationContext.configure(conn).get_current_revision()


def head_revision(engine: sa.Engine) -> str | None:
    return ScriptDirectory.from_config(alembic_config(engine)).get_current_head()


def upgrade(engine: sa.Engine) -> None:
    command.upgrade(alembic_config(engine), "head")


def ensure_schema(engine: sa.Engine) -> None:
    """Migrate on first use, so a new user never needs a separate step."""
    if current_revision(engine) != head_revision(engine):
        upgrade(engine)


_engines: dict[str, sa.Engine] = {}


def shared_engine(url: str | None = None) -> sa.Engine:
    """One engine (one pool) per database per process, migrated on first use."""
    url = url or database_url()
    if url not in _engines:
        engine = create_engine(url)
        ensure_schema(engine)
        _engines[url] = engine
    return _engines[url]


def dispose_engines() -> None:
    for engine in _engines.values():
        engine.dispose()
    _engines.clear()
