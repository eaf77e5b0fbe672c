"""A refresh token an OAuth2 token endpoint rotated in, kept per connection in the delivery
database so the next process starts from it (`delivery.writers.oauth2.RefreshTokenStore`). The
configured secret is never written here; no command, log or artifact shows this table."""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime

import sqlalchemy as sa
from sqlalchemy.exc import IntegrityError

from delivery.clock import utcnow
from delivery.store.tables import oauth_refresh_tokens_table


class RefreshTokens:
    """The rotated refresh token of one connection."""

    def __init__(self, engine: sa.Engine, connection_id: int, clock: Callable[[], datetime] = utcnow) -> None:
        self.engine = engine
        self.connection_id = connection_id
        self.clock = clock

    def load(self) -> str | None:
        table = oauth_refresh_tokens_table
        with self.engine.connect().execution_options(readonly=True) as conn:
            value = conn.execute(
                sa.select(table.c.refresh_token).where(table.c.connection_id == self.connection_id)
            ).scalar()
        return None if value is None else str(value)

    def save(self, refresh_token: str) -> None:
        table = oauth_refresh_tokens_table
        values = {"refresh_token": refresh_token, "updated_at": self.clock()}
        with self.engine.begin() as conn:
            updated = conn.execute(table.update().where(table.c.connection_id == self.connection_id).values(**values))
            if updated.rowcount == 0:
                try:
                    with conn.begin_nested():
                        conn.execute(table.insert().values(connection_id=self.connection_id, **values))
                except IntegrityError:  # another process saved one first: ours is the newer
                    conn.execute(table.update().where(table.c.connection_id == self.connection_id).values(**values))

    def forget(self) -> None:
        """Drop it (a connection whose auth changed must not start from another grant's token)."""
        table = oauth_refresh_tokens_table
        with self.engine.begin() as conn:
            conn.execute(table.delete().where(table.c.connection_id == self.connection_id))
