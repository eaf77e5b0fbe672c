"""The reads behind what the flows report to the operator: a rule's parked set (the `parked-RULE`
artifact), the records one chain left behind (`chain-RULE-records`), how the rule's chain before
this one ended (its health events) and the report a run's chain recorded (`delivery run`'s summary).

A service, as `delivery.listings` is for the command line: no module of `flows` reads the store
(a contract in pyproject.toml), so the flows call these. Each runs in the caller's connection,
a read-only one in every caller."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import sqlalchemy as sa

from delivery.domain import LedgerStatus, Rule
from delivery.store import catalog, chains, ledger

__all__ = [
    "CREATE_IN_FLIGHT",
    "LEFT_BEHIND",
    "ParkedSet",
    "chain_report",
    "has_parked_set",
    "left_behind_since",
    "parked_set",
    "previous_end",
]

#: The last error of a row whose create was sent and whose outcome is not recorded yet.
CREATE_IN_FLIGHT = ledger.CREATE_IN_FLIGHT
#: What a chain leaves for an operator to look at: the rows it parked, and those it left failed.
LEFT_BEHIND: tuple[LedgerStatus, ...] = ledger.LEFT_BEHIND


@dataclass(frozen=True)
class ParkedSet:
    """A rule's parked set as it stands: how many rows in each status, the `listed` changed last
    (most recent first) and the (status, last error) of the `counted` changed last."""

    rule: Rule
    counts: dict[str, int]
    latest: list[dict[str, Any]]
    errors: list[tuple[str, str | None]]

    @property
    def total(self) -> int:
        return sum(self.counts.values())


def parked_set(conn: sa.Connection, rule_name: str, listed: int, counted: int) -> ParkedSet:
    """The rule's parked set, every read an index seek; the rows only when there are any.
    `UnknownName` for a rule that does not exist."""
    rule = catalog.get_rule(conn, rule_name)
    counts = ledger.parked_counts(conn, rule.id)
    if not any(counts.values()):
        return ParkedSet(rule, counts, [], [])
    latest = ledger.parked_latest(conn, rule.id, listed)
    return ParkedSet(rule, counts, latest, ledger.parked_errors(conn, rule.id, counted))


def has_parked_set(conn: sa.Connection, rule_id: int) -> bool:
    """Whether the rule has any row in its parked set (parked or failed), on the index alone."""
    return any(ledger.parked_counts(conn, rule_id).values())


def left_behind_since(
    conn: sa.Connection, rule_id: int, since: datetime, limit: int
) -> tuple[list[dict[str, Any]], dict[str, int]]:
    """The rule's rows parked or left failed since `since` (a chain's start), the first `limit` in
    the order they were written, and how many there are of each status."""
    return ledger.left_behind_since(conn, rule_id, since, limit)


def previous_end(conn: sa.Connection, rule_id: int, token: str, telling: Iterable[str]) -> str | None:
    """How the rule's last chain before `token` that ended in one of the `telling` ways ended."""
    return chains.previous_end(conn, rule_id, token, telling)


def chain_report(conn: sa.Connection, flow_run_id: str) -> dict[str, Any] | None:
    """The report the chain of the `deliver-rule` run `flow_run_id` recorded at its end; None when
    the run made no chain or its chain has not ended."""
    chain = chains.chain_by_flow_run(conn, flow_run_id)
    return chain.report if chain else None
