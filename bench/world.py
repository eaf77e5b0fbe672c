"""What every part of the bench sets up the same way: the database in use, connections and rules,
the records, and a count of the SQL the engine sends."""

from __future__ import annotations

import os
from typing import Any

import sqlalchemy as sa
import yaml

from bench import mirror
from bench.target import SandboxProcess
from delivery import db
from delivery.apply import apply_config
from delivery.config import parse_config


def use_database(url: str) -> sa.Engine:
    """Point `DELIVERY_DATABASE_URL` (what the flow uses) at `url`; migrated on first use."""
    db.dispose_engines()
    os.environ[db.DATABASE_URL_ENV] = url
    return db.shared_engine()


#: The target connection `apply` always declares (the sandbox given to it, settled in groups).
SANDBOX = "sandbox"


def rule_entry(
    name: str,
    source: str,
    collection: str,
    batch: int,
    concurrency: int,
    overlap: int = 300,
    target: str = SANDBOX,
) -> dict[str, Any]:
    return {
        "name": name,
        "source": source,
        "domain": mirror.DOMAIN,
        "target": target,
        "collection": collection,
        "batch_size": batch,
        "concurrency": concurrency,
        "overlap_seconds": overlap,
    }


def target_connection(name: str, sandbox: SandboxProcess, settle: str = "grouped") -> dict[str, Any]:
    """A `rest` connection to `sandbox` whose chains settle `settle` (`grouped` or `per_record`)."""
    return {"name": name, "driver": "rest", "base_url": sandbox.api, "timeout_seconds": 10, "settle": settle}


def apply(
    engine: sa.Engine,
    sandbox: SandboxProcess,
    source: str,
    rules: list[dict[str, Any]],
    targets: list[dict[str, Any]] | None = None,
) -> None:
    """Upsert the `sandbox` connection (grouped settles), the `targets` given (`target_connection`),
    the source and the rules."""
    config = {
        "connections": [target_connection(SANDBOX, sandbox), *(targets or []), {"name": source}],
        "rules": rules,
    }
    with engine.begin() as conn:
        apply_config(conn, parse_config(yaml.safe_dump(config), "bench config"))


def records(prefix: str, n: int) -> list[tuple[str, dict[str, Any]]]:
    """(external id, payload); the body sent is the whole payload (a rule without `fields`)."""
    return [(f"{prefix}-{i}", mirror.payload(i)) for i in range(1, n + 1)]


class StatementCounter:
    """SQL statements and commits the engine's database sees while counting."""

    def __init__(self, engine: sa.Engine) -> None:
        self.engine, self.statements, self.commits = engine, 0, 0
        sa.event.listen(engine, "before_cursor_execute", self._statement)
        sa.event.listen(engine, "commit", self._commit)

    def _statement(self, *_: Any) -> None:
        self.statements += 1

    def _commit(self, *_: Any) -> None:
        self.commits += 1

    def stop(self) -> None:
        sa.event.remove(self.engine, "before_cursor_execute", self._statement)
        sa.event.remove(self.engine, "commit", self._commit)
