"""Alembic environment: the engine comes from `delivery.db` (DELIVERY_DATABASE_URL or the SQLite default)."""

from __future__ import annotations

from alembic import context

from delivery.db import create_engine
from delivery.store.tables import metadata

config = context.config


def render_item(type_: str, obj: object, autogen_context: object) -> str | bool:
    # Migrations must not import the models: UTCDateTime is stored as a plain DATETIME.
    if type_ == "type" and type(obj).__name__ == "UTCDateTime":
        return "sa.DateTime()"
    return False


engine = config.attributes.get("engine") or create_engine()

with engine.begin() as connection:
    context.configure(
        connection=connection,
        target_metadata=metadata,
        render_as_batch=True,  # SQLite cannot ALTER most things; batch mode rebuilds the table.
        compare_type=True,
        render_item=render_item,
    )
    context.run_migrations()
