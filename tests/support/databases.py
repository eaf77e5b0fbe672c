"""Databases and names of the tests' own: PostgreSQL databases made and dropped by a test, and
names no other test (or worker) uses."""

from __future__ import annotations

import os
import uuid

import sqlalchemy as sa

POSTGRES_URL = os.environ.get("DELIVERY_TEST_POSTGRES_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test")


def _with_database(url: str, name: str) -> str:
    return sa.engine.make_url(url).set(database=name).render_as_string(hide_password=False)


def create_postgres_database(name: str) -> str:
    admin = sa.create_engine(POSTGRES_URL, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.exec_driver_sql(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        conn.exec_driver_sql(f'CREATE DATABASE "{name}"')
    admin.dispose()
    return _with_database(POSTGRES_URL, name)


def drop_postgres_database(name: str) -> None:
    admin = sa.create_engine(POSTGRES_URL, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.exec_driver_sql(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    admin.dispose()


def unique(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"
