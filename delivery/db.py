"""Which database, how to connect, and bringing its schema to the Alembic head."""

from __future__ import annotations

import sqlite3
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import TYPE_CHECKING, Any

import sqlalchemy as sa

from delivery.errors import DeliveryError, InputError
from delivery.package_data import package_data
from delivery.settings import DEFAULT_DATABASE_URL, env_name, settings

if TYPE_CHECKING:
    from alembic.config import Config

#: The newest migration's revision. Every process compares its database with it on first use
#: (`ensure_schema`) without importing Alembic, which is about an eighth of an idle `delivery run`;
#: Alembic comes in only to migrate. tests/integration/test_schema.py checks that it is the
#: scripts' head, so a new migration that forgets it fails there.
SCHEMA_HEAD = "0012"

DATABASE_URL_ENV = env_name("database_url")
DEFAULT_URL = DEFAULT_DATABASE_URL

#: The PostgreSQL advisory lock every process takes around migrations: b"delivery" read as a
#: big-endian bigint, so it is the same key in every process and unlikely to be another
#: application's.
MIGRATION_LOCK_KEY = int.from_bytes(b"delivery", "big")


def database_url() -> str:
    """`DELIVERY_DATABASE_URL`, or a SQLite file `delivery.db` in the working directory."""
    url = settings().database_url
    # Plain postgresql:// would pick psycopg2, which we do not ship.
    if url.startswith("postgresql://") or url.startswith("postgres://"):
        url = "postgresql+psycopg://" + url.split("://", 1)[1]
    return url


#: How long SQLite lets a writer wait for another one, and how long a new connection keeps trying
#: to switch a new file to WAL.
SQLITE_BUSY_SECONDS = 30


def _switch_to_wal(cursor: sqlite3.Cursor) -> None:
    """Switching a file that is not yet in WAL (a new database) takes an exclusive lock, and SQLite
    refuses it at once, without its busy handler, while another connection holds the write lock
    (waiting could deadlock). That happens when several processes first use one new file
    together: the one migrating holds the write lock. So try again until it is free; once the
    file is in WAL, the switch is a no-op that needs no lock."""
    deadline = time.monotonic() + SQLITE_BUSY_SECONDS
    pause = 0.005
    while True:
        try:
            cursor.execute("PRAGMA journal_mode=WAL")
            return
        except sqlite3.OperationalError as exc:
            busy = exc.sqlite_errorcode & 0xFF == sqlite3.SQLITE_BUSY  # extended codes keep it in the low byte
            if not busy or time.monotonic() >= deadline:
                raise
        time.sleep(pause)
        pause = min(pause * 2, 0.1)


def _on_sqlite_connect(dbapi_connection: Any, _record: Any) -> None:
    # WAL lets readers (the CLI, a status command) work while a chain writes; busy_timeout makes
    # a second writer wait instead of failing at once with "database is locked".
    dbapi_connection.isolation_level = None  # we emit BEGIN ourselves, see _sqlite_begin
    cursor = dbapi_connection.cursor()
    cursor.execute(f"PRAGMA busy_timeout={SQLITE_BUSY_SECONDS * 1000}")
    _switch_to_wal(cursor)
    cursor.execute("PRAGMA synchronous=NORMAL")
    cursor.execute("PRAGMA foreign_keys=ON")
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


#: Seconds to open a PostgreSQL connection (a `connect_timeout` in the URL wins).
CONNECT_TIMEOUT_SECONDS = 10


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
    # libpq waits for the operating system's TCP timeout (minutes) on a host that never answers:
    # a command or a chain should say the database is unreachable well before that.
    connect = {} if "connect_timeout" in sa.make_url(url).query else {"connect_timeout": CONNECT_TIMEOUT_SECONDS}
    return sa.create_engine(url, pool_pre_ping=True, connect_args=connect, **POOL_OPTIONS)


class DatabaseUrlError(InputError):
    """The database URL names a database the engine cannot open (a SQLite file in a directory that
    does not exist, a file that is no database): fix the URL. Exit 2 on the command line."""


class DatabaseUnavailable(DeliveryError):
    """The database server did not take the connection (down, unreachable, or it refused the user
    or the database). The command fails (exit 1): nothing was asked of it that was wrong, and the
    same command works once the server takes connections."""


def _reason(exc: sa.exc.DBAPIError, password: str | None) -> str:
    # The driver's first line says it all ("connection to server at ... failed: Connection refused");
    # a password never appears in libpq's messages, but a driver that echoed the DSN would show it.
    reason = str(exc.orig).strip().splitlines()[0] if str(exc.orig).strip() else type(exc.orig).__name__
    reason = reason.removeprefix("connection failed: ")
    return reason.replace(password, "***") if password else reason


def check_connection(engine: sa.Engine, origin: str = DATABASE_URL_ENV) -> None:
    """Connect once, and say in one line why that failed, naming `origin` (where the URL came
    from) and the URL with its password masked, instead of a driver's traceback."""
    try:
        with engine.connect():
            return
    except sa.exc.DBAPIError as exc:
        url = engine.url
        reason = _reason(exc, url.password)
        if url.get_backend_name() == "sqlite":
            directory = Path(url.database or ".").parent
            if not directory.is_dir():
                reason = f"its directory {directory} does not exist"
            raise DatabaseUrlError(f"{origin}: the SQLite database {url.database} cannot be opened: {reason}") from None
        shown = url.render_as_string(hide_password=True)
        if isinstance(exc, sa.exc.OperationalError):
            raise DatabaseUnavailable(f"{origin}: cannot connect to {shown}: {reason}") from None
        raise DatabaseUrlError(f"{origin}: {shown} cannot be used: {reason}") from None


def migrations_dir() -> Path:
    """The Alembic scripts: `delivery/_migrations` in a wheel, `migrations/` in a checkout."""
    return package_data("delivery", "_migrations", "migrations")


def alembic_config(engine: sa.Engine) -> Config:
    from alembic.config import Config

    config = Config()
    config.set_main_option("script_location", str(migrations_dir()))
    config.attributes["engine"] = engine
    return config


def current_revision(engine: sa.Engine) -> str | None:
    """The revision the database is at (Alembic's `alembic_version` row), None before the first."""
    with engine.connect() as conn:
        if not sa.inspect(conn).has_table("alembic_version"):
            return None
        revision = conn.execute(sa.text("SELECT version_num FROM alembic_version")).scalar()
        return None if revision is None else str(revision)


def head_revision(engine: sa.Engine) -> str | None:
    """The head of the migration scripts, as Alembic reads them."""
    from alembic.script import ScriptDirectory

    return ScriptDirectory.from_config(alembic_config(engine)).get_current_head()


@contextmanager
def _migration_lock(engine: sa.Engine) -> Iterator[None]:
    """Serialise migrations between processes. On PostgreSQL two processes migrating an empty
    database at once both create `alembic_version` and one fails on a duplicate key, so they take
    a session-level advisory lock. It is held on a connection of its own in autocommit, so that
    connection never sits idle in a transaction while Alembic migrates on another one. SQLite needs
    nothing: Alembic's transaction begins with BEGIN IMMEDIATE (`_sqlite_begin`), so the file's
    write lock already lets one process in at a time and the next finds the schema at head."""
    if engine.dialect.name != "postgresql":
        yield
        return
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        conn.execute(sa.text("SELECT pg_advisory_lock(:key)"), {"key": MIGRATION_LOCK_KEY})
        try:
            yield
        finally:
            # Unlock so the pooled connection goes back clean. If the session died, its end has
            # released the lock already, and the migration's own error is the one to report.
            with suppress(sa.exc.SQLAlchemyError):
                conn.execute(sa.text("SELECT pg_advisory_unlock(:key)"), {"key": MIGRATION_LOCK_KEY})


def upgrade(engine: sa.Engine) -> None:
    """Bring the schema to head, one process at a time: a process that waited for another one's
    migration re-checks the revision once it holds the lock, and then does nothing."""
    with _migration_lock(engine):
        if current_revision(engine) != head_revision(engine):
            from alembic import command

            command.upgrade(alembic_config(engine), "head")


def ensure_schema(engine: sa.Engine) -> None:
    """Migrate on first use, so a new user never needs a separate step. The unlocked look first
    keeps the everyday case (already at head) free of the lock."""
    if current_revision(engine) != SCHEMA_HEAD:
        upgrade(engine)


_engines: dict[str, sa.Engine] = {}
#: A warm worker starts several chains at once on threads of its own (flows/worker.py): without
#: the lock, each could make its own engine on first use, and all but one pool would leak.
_engines_lock = threading.Lock()


def shared_engine(url: str | None = None) -> sa.Engine:
    """One engine (one pool) per database per process, migrated on first use."""
    origin = DATABASE_URL_ENV if url is None else "database URL"
    url = url or database_url()
    engine = _engines.get(url)
    if engine is not None:
        return engine
    with _engines_lock:
        if url not in _engines:
            engine = create_engine(url)
            try:
                check_connection(engine, origin)
            except DeliveryError:
                engine.dispose()
                raise
            ensure_schema(engine)
            _engines[url] = engine
        return _engines[url]


def dispose_engines() -> None:
    with _engines_lock:
        for engine in _engines.values():
            engine.dispose()
        _engines.clear()
