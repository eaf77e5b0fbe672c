"""Alembic environment: the engine comes from `delivery.db` (DELIVERY_DATABASE_URL or the SQLite default)."""

from __future__ import annotations

from alembic import context

from delivery.db import create_engine
from delivery.store.tables import metadata

config = context.config
engine = config.attributes.get("engine") or create_engine()

with engine.begin() as connection:
    context.configure(
        connection=connection,
        target_metadata=metadata,
        render_as_batch=True,  # SQLite cannot ALTER most things; batch mode rebuilds the table.
        compare_type=True,
    )
    context.run_migrations()
