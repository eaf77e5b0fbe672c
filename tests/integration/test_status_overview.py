"""The words `delivery status` uses for a rule's route, its target's breaker, how its last chain ended
and its lag, pinned exactly, on SQLite and PostgreSQL. The overview takes the route and breaker
decisions from where the chain takes them (the route from `decisions.closed_connection`, the reopening
from `breaker.reopens_at`); these pin that doing so changed none of its JSON."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
import sqlalchemy as sa

from delivery.apply import apply_config
from delivery.config import parse_config
from delivery.domain import ChainEnd, ChainReport
from delivery.status import overview, plain_duration, plain_time
from delivery.store import chains
from delivery.store.tables import breaker_states_table, connections_table, rules_table

NOW = datetime(2026, 12, 1, 8, 0, 0, tzinfo=UTC)

CONFIG = """
connections:
  - {name: shop}
  - {name: crm, driver: rest, base_url: "http://127.0.0.1:9/api", breaker: {reset_seconds: 90}}
rules:
  - {name: contacts-to-crm, source: shop, domain: contact, target: crm, collection: contacts}
"""


def _apply(engine: sa.Engine) -> int:
    with engine.begin() as conn:
        apply_config(conn, parse_config(CONFIG))
        return int(
            conn.execute(sa.select(connections_table.c.id).where(connections_table.c.name == "crm")).scalar_one()
        )


def _set_status(engine: sa.Engine, name: str, status: str) -> None:
    with engine.begin() as conn:
        conn.execute(connections_table.update().where(connections_table.c.name == name).values(status=status))


def _set_breaker(engine: sa.Engine, crm: int, state: str, fail_counter: int, opened_at: datetime | None) -> None:
    with engine.begin() as conn:
        conn.execute(breaker_states_table.delete().where(breaker_states_table.c.connection_id == crm))
        conn.execute(
            breaker_states_table.insert().values(
                connection_id=crm, state=state, fail_counter=fail_counter, success_counter=0, opened_at=opened_at
            )
        )


def _row(engine: sa.Engine) -> dict[str, Any]:
    with engine.connect() as conn:
        [row] = overview(conn, NOW)
    return row


def test_the_route_as_status_words_it(engine: sa.Engine) -> None:
    _apply(engine)
    assert (_row(engine)["route_open"], _row(engine)["route"]) == (True, "open")
    _set_status(engine, "crm", "error")
    assert (_row(engine)["route_open"], _row(engine)["route"]) == (False, "target crm is error")
    # Both closed: the source is named, as the chain's gate names it first.
    _set_status(engine, "shop", "disabled")
    assert (_row(engine)["route_open"], _row(engine)["route"]) == (False, "source shop is disabled")


def test_a_disabled_rule_on_an_open_route_shows_the_route_open(engine: sa.Engine) -> None:
    _apply(engine)
    with engine.begin() as conn:
        apply_config(
            conn, parse_config(CONFIG.replace("collection: contacts}", "collection: contacts, enabled: false}"))
        )
    row = _row(engine)
    assert (row["enabled"], row["route_open"], row["route"]) == (False, True, "open")


def test_the_breaker_as_status_words_it(engine: sa.Engine) -> None:
    crm = _apply(engine)
    assert _row(engine)["breaker"] == "closed"
    _set_breaker(engine, crm, "closed", 0, None)
    assert _row(engine)["breaker"] == "closed"
    _set_breaker(engine, crm, "closed", 2, None)
    assert _row(engine)["breaker"] == "closed (2 failures)"
    # Opened 30 s ago with a 90 s reset: the trial call is 60 s away.
    _set_breaker(engine, crm, "open", 5, NOW - timedelta(seconds=30))
    assert _row(engine)["breaker"] == "open until 08:01:00 UTC"
    _set_breaker(engine, crm, "open", 5, NOW - timedelta(seconds=90))
    assert _row(engine)["breaker"] == "open (a trial call is due)"
    _set_breaker(engine, crm, "open", 5, None)
    assert _row(engine)["breaker"] == "open"
    _set_breaker(engine, crm, "half-open", 0, NOW - timedelta(seconds=120))
    assert _row(engine)["breaker"] == "half-open"


def _end_last_chain(engine: sa.Engine, ended_by: ChainEnd, message: str, started: datetime, ended: datetime) -> None:
    with engine.begin() as conn:
        rule_id = int(
            conn.execute(sa.select(rules_table.c.id).where(rules_table.c.name == "contacts-to-crm")).scalar_one()
        )
        token = chains.start_chain(conn, rule_id, None, started)
        chains.end_chain(conn, ChainReport("contacts-to-crm", token, ended_by, message), ended)


def test_how_the_last_chain_ended_as_status_words_it(engine: sa.Engine) -> None:
    _apply(engine)
    row = _row(engine)
    assert (row["last_chain"], row["last_ending"], row["last_since"]) == (None, "never ran", None)
    assert plain_time(row["last_since"]) == "-"

    with engine.begin() as conn:
        rule_id = int(
            conn.execute(sa.select(rules_table.c.id).where(rules_table.c.name == "contacts-to-crm")).scalar_one()
        )
        chains.start_chain(conn, rule_id, None, NOW - timedelta(minutes=2))
    row = _row(engine)
    assert (row["last_ending"], row["last_since"]) == ("running", "2026-12-01T07:58:00+00:00")
    assert (row["last_chain"]["state_name"], row["last_chain"]["fault"]) == (None, None)
    assert plain_time(row["last_since"]) == "2026-12-01 07:58:00 UTC"

    fault = "MissingWriter: rule 'contacts-to-crm': no writer is registered for target driver 'soap'"
    _end_last_chain(engine, ChainEnd.RULE_FAULT, fault, NOW - timedelta(minutes=1), NOW)
    row = _row(engine)
    assert (row["last_ending"], row["last_since"]) == ("Failed: MissingWriter", "2026-12-01T08:00:00+00:00")
    assert (row["last_chain"]["state_name"], row["last_chain"]["fault"]) == ("Failed", "MissingWriter")
    assert row["last_chain"]["ended_by"] == "rule_fault" and row["last_chain"]["message"] == fault

    _end_last_chain(engine, ChainEnd.RULE_FAULT, "TimeoutError: batch over 600 s", NOW, NOW + timedelta(seconds=1))
    assert _row(engine)["last_ending"] == "Failed: TimedOut"
    # Each chain starts after the one before: the last chain is the latest started, and a tie
    # would leave the pick to the order the database happens to return.
    _end_last_chain(engine, ChainEnd.RULE_FAULT, "", NOW + timedelta(seconds=1), NOW + timedelta(seconds=2))
    assert _row(engine)["last_ending"] == "Failed"  # no message to name the fault by

    for later, (end, name) in enumerate(
        [
            (ChainEnd.CAUGHT_UP, "CaughtUp"),
            (ChainEnd.BREAKER_OPEN, "BreakerOpen"),
            (ChainEnd.ROUTE_CLOSED, "RouteClosed"),
            (ChainEnd.SUPERSEDED, "Superseded"),
            (ChainEnd.DISABLED, "Disabled"),
            (ChainEnd.CANCELLED, "Cancelled"),
        ],
        start=2,
    ):
        started = NOW + timedelta(seconds=later)
        _end_last_chain(engine, end, "Word: not a fault", started, started + timedelta(seconds=1))
        row = _row(engine)
        assert (row["last_ending"], row["last_chain"]["state_name"], row["last_chain"]["fault"]) == (name, name, None)


@pytest.mark.parametrize(
    ("seconds", "words"),
    [
        (0.0, "none"),
        (0.4, "under a second"),
        (1.0, "1 second"),
        (59.9, "59 seconds"),
        (60.0, "1 minute"),
        (3599.0, "59 minutes"),
        (3600.0, "1 hour"),
        (3660.0, "1 hour 1 minute"),
        (7500.0, "2 hours 5 minutes"),
        (86400.0, "1 day"),
        (2 * 86400 + 4 * 3600 + 5, "2 days 4 hours"),
    ],
)
def test_the_lag_in_words(seconds: float, words: str) -> None:
    assert plain_duration(seconds) == words
