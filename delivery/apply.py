"""`delivery apply`: check a configuration against what is saved, then save it.

The save-time checks (ADR-0030, CFX-217: every rule's target has a writer offering the verbs its policy
needs, saved rules included) need the writer registry; the store does not know it, so they run
here, before the store is asked to save, in the caller's transaction."""

from __future__ import annotations

import sqlalchemy as sa

from delivery.config import DeliveryConfig, check_rules, check_text
from delivery.store import catalog


def apply_config(conn: sa.Connection, config: DeliveryConfig) -> catalog.ApplyReport:
    """Upsert every connection and rule of `config` inside the caller's transaction, after the
    save-time checks; a refused config raises `ConfigError` before anything is written."""
    check_text(config)
    known = catalog.connection_drivers(conn)
    # The file's connections override the saved ones: the rules are checked against the result.
    known.update({c.name: c.driver for c in config.connections})
    check_rules(config, known, catalog.saved_rules(conn))
    return catalog.save_config(conn, [c.spec() for c in config.connections], [r.spec() for r in config.rules])
