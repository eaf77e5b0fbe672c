"""`delivery apply` with batch paths, on SQLite and PostgreSQL: a path the target's driver offers
no batch verb for is refused and nothing is written; an accepted one is saved, and the writer built
for the saved connection offers the batch verbs it names."""

from __future__ import annotations

import pytest
import sqlalchemy as sa

from delivery.apply import apply_config
from delivery.config import parse_config
from delivery.domain import BatchEndpoints
from delivery.errors import ConfigError
from delivery.store import catalog
from delivery.writers.base import CreatesMany, UpdatesMany
from delivery.writers.registry import writer_for

CONFIG = """
connections:
  - name: crm
    driver: {driver}
    base_url: "http://127.0.0.1:9/api"
    batch: {{create_path: contacts/batch, update_path: contacts/batch, max_items: 250}}
  - {{name: shop}}
rules:
  - {{name: contacts-to-crm, source: shop, domain: contact, target: crm, collection: contacts, policy: {policy}}}
"""


def apply(engine: sa.Engine, driver: str, policy: str = "create_and_update") -> catalog.ApplyReport:
    with engine.begin() as conn:
        return apply_config(conn, parse_config(CONFIG.format(driver=driver, policy=policy)))


def test_batch_paths_are_saved_and_equip_the_writer(engine: sa.Engine) -> None:
    apply(engine, "rest")
    with engine.connect() as conn:
        (crm,) = [c for c in catalog.list_connections(conn) if c.name == "crm"]
    assert crm.batch == BatchEndpoints("contacts/batch", "contacts/batch", 250)
    writer_type = writer_for(crm)
    assert writer_type is not None
    assert issubclass(writer_type, CreatesMany) and issubclass(writer_type, UpdatesMany)
    with writer_type(crm, "contacts", token=None) as writer:
        assert isinstance(writer, CreatesMany) and writer.max_items == 250


def test_a_batch_path_the_driver_cannot_use_is_refused_and_nothing_is_written(engine: sa.Engine) -> None:
    with pytest.raises(ConfigError) as caught:
        apply(engine, "rest-create-only", policy="create_only")
    assert caught.value.problems == [
        "connections[0].batch.update_path: connection 'crm' names a batch update path, "
        "but driver 'rest-create-only' does not offer the 'update' verb at all: remove batch.update_path"
    ]
    with engine.connect() as conn:
        assert catalog.list_connections(conn) == []
