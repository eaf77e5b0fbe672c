"""Alembic environment: the engine comes from `delivery.db` (DELIVERY_DATABASE_URL or the SQLite default)."""

from __future__ import annotations

from alembic import context

from delivery.db import MIGRATION_LOCK_KEY, create_engine
from delivery.store.tables import metadata

config = context.config


def render_item(type_: str, obj: object, autogen_context: object) -> str | bool:
    # Migrations must not import the models: UTCDateTime is stored as a plain DATETIME.
    if type_ == "type" and type(obj).__name__ == "UTCDateTime":
        return "sa.DateTime()"
    return False


given = config.attributes.get("engine")
engine = given or create_engine()

with engine.begin() as connection:
    if given is None and connection.dialect.name == "postgresql":
        # A plain `alembic upgrade head`: take the lock `delivery.db.upgrade` takes (it holds it
        # itself when it runs us), so this cannot race a process migrating on first use.
        connection.exec_driver_sql(f"SELECT pg_advisory_xact_lock({MIGRATION_LOCK_KEY})")
    context.configure(
        connection=connection,
        target_metadata=metadata,
        render_as_batch=True,  # SQLite cannot ALTER most things; batch mode rebuilds the table.
        compare_type=True,
        render_item=render_item,
    )
    context.run_migrations()
