"""The bench's own PostgreSQL databases: created at the start, dropped at the end, whatever happens."""

from __future__ import annotations

import os

import sqlalchemy as sa

ADMIN_URL_ENV = "DELIVERY_BENCH_POSTGRES_URL"
DEFAULT_ADMIN_URL = "postgresql+psycopg://postgres@127.0.0.1:5432/postgres"


def admin_url() -> str:
    return os.environ.get(ADMIN_URL_ENV) or DEFAULT_ADMIN_URL


def _with_database(name: str) -> str:
    return sa.engine.make_url(admin_url()).set(database=name).render_as_string(hide_password=False)


def _admin(sql: str) -> None:
    engine = sa.create_engine(admin_url(), isolation_level="AUTOCOMMIT")
    try:
        with engine.connect() as conn:
            conn.exec_driver_sql(sql)
    finally:
        engine.dispose()


def create_database(name: str) -> str:
    """A new empty database `name` (dropped first if a crashed run left it); returns its URL."""
    _admin(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    _admin(f'CREATE DATABASE "{name}"')
    return _with_database(name)


def drop_database(name: str) -> None:
    _admin(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def server_version() -> str | None:
    engine = sa.create_engine(admin_url())
    try:
        with engine.connect() as conn:
            return str(conn.exec_driver_sql("SHOW server_version").scalar())
    except Exception:
        return None
    finally:
        engine.dispose()
