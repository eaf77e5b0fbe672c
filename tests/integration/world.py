"""A small world for chain tests: one source, one REST target (the real local server), one rule."""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any

import sqlalchemy as sa
import yaml

from delivery.apply import apply_config
from delivery.clock import SYSTEM, Clock
from delivery.config import parse_config
from delivery.domain import Cursor, MirrorInput
from delivery.store import catalog, ledger
from delivery.store.mirror import load_records
from delivery.store.tables import ledger_table, mirror_records_table, rules_table
from flows.deliver_rule import run_now
from tests.support import chains
from tests.target_server import TargetServer

RULE = "contacts-to-crm"
#: The target's request timeout: long enough that a loaded 2-core machine (an event loop or a thread
#: starved for half a second) never times out a request the test did not mean to.
REQUEST_TIMEOUT_SECONDS = 5.0
#: For a test whose subject is a timeout (`World.set_timeout`), with `Answer.given_up()` (the target
#: answers only after the client gave up).
SHORT_TIMEOUT_SECONDS = 0.5


def email(external_id: str) -> str:
    return f"{external_id}@example.com"


class World:
    """`through_prefect`: whether `run` runs the `deliver-rule` flow (on the session's Prefect API) or
    drives the chain in this process without Prefect, for tests of the engine's behaviour alone.
    `clock`: the chains' clock when driven in this process (a `FakeClock` moves time by hand; the
    flow makes its own, the system's)."""

    def __init__(
        self, engine: sa.Engine, target: TargetServer, *, through_prefect: bool = True, clock: Clock = SYSTEM
    ) -> None:
        self.engine = engine
        self.target = target
        self.through_prefect = through_prefect
        self.clock = clock

    def config(self, *, target: dict[str, Any] | None = None, rule: dict[str, Any] | None = None) -> dict[str, Any]:
        return {
            "connections": [
                {
                    "name": "crm",
                    "driver": "rest",
                    "base_url": self.target.url,
                    "token_env": "CRM_TOKEN",
                    "timeout_seconds": REQUEST_TIMEOUT_SECONDS,
                    "breaker": {"fail_max": 3, "reset_seconds": 60},
                    **(target or {}),
                },
                {"name": "shop"},
            ],
            "rules": [
                {
                    "name": RULE,
                    "source": "shop",
                    "domain": "contact",
                    "target": "crm",
                    "collection": "contacts",
                    "policy": "create_and_update",
                    "batch_size": 10,
                    "overlap_seconds": 300,
                    "max_attempts": 3,
                    "retry_schedule_seconds": [60, 600],
                    **(rule or {}),
                }
            ],
        }

    def apply(self, **overrides: Any) -> World:
        with self.engine.begin() as conn:
            apply_config(conn, parse_config(yaml.safe_dump(self.config(**overrides))))
        return self

    def load(
        self, *ids: str, deleted: bool = False, domain: str = "contact", at: datetime | None = None, **fields: Any
    ) -> None:
        """Upsert records whose payload is {email, name, **fields}; the email is the target's record key.
        `at`: when they changed (by default, now on the world's clock)."""
        items = [MirrorInput(i, {"email": email(i), "name": f"Name {i}", **fields}, deleted) for i in ids]
        with self.engine.begin() as conn:
            load_records(conn, "shop", domain, items, at or self.clock.now())

    def run(self, rule: str = RULE) -> dict[str, Any]:
        """One chain of `rule`, summarised as `delivery run --json` prints it."""
        return run_now(rule) if self.through_prefect else chains.run(self.engine, rule, clock=self.clock)

    def ledger(self, rule: str = RULE) -> dict[str, dict[str, Any]]:
        with self.engine.connect() as conn:
            return {row["external_id"]: row for row in ledger.ledger_rows(conn, rule)}

    def full_ledger_row(self, external_id: str) -> dict[str, Any]:
        with self.engine.connect() as conn:
            row = conn.execute(
                sa.select(ledger_table)
                .join(mirror_records_table, mirror_records_table.c.id == ledger_table.c.record_id)
                .where(mirror_records_table.c.external_id == external_id)
            ).one()
            return row._asdict()

    def make_due(self) -> None:
        """Time travel: every failed row is due now."""
        with self.engine.begin() as conn:
            conn.execute(
                ledger_table.update()
                .where(ledger_table.c.status == "failed")
                .values(next_attempt_at=self.clock.now() - timedelta(seconds=1))
            )

    def cursor(self, rule: str = RULE) -> Cursor | None:
        with self.engine.connect() as conn:
            return catalog.get_rule(conn, rule).cursor

    def record_id(self, external_id: str) -> int:
        with self.engine.connect() as conn:
            return int(
                conn.execute(
                    sa.select(mirror_records_table.c.id).where(mirror_records_table.c.external_id == external_id)
                ).scalar_one()
            )

    def set_timeout(self, seconds: float = SHORT_TIMEOUT_SECONDS) -> None:
        """The target's request timeout from now on (the next chain's writer), other settings kept."""
        self._update_target(timeout_seconds=seconds)

    def set_driver(self, driver: str) -> None:
        """What an uninstalled or changed driver looks like after the rule was saved."""
        self._update_target(driver=driver)

    def _update_target(self, **values: Any) -> None:
        """Change the target connection's row in place, as if edited after the config was applied."""
        from delivery.store.tables import connections_table

        with self.engine.begin() as conn:
            conn.execute(connections_table.update().where(connections_table.c.name == "crm").values(**values))

    def rule_row(self, rule: str = RULE) -> dict[str, Any]:
        with self.engine.connect() as conn:
            return conn.execute(sa.select(rules_table).where(rules_table.c.name == rule)).one()._asdict()

    def key(self, external_id: str) -> str:
        return email(external_id)
