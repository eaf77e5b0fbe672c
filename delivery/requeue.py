"""Requeue as a service: what `delivery requeue`, `delivery requeues` and the `delivery-requeue`
flow call, so that neither the command line nor the flow reaches into the store for it.

The selection and its checks (`Selection.of`, `check_request`, `RequeueInputError` naming the
parameter) are the store's, re-exported here: a caller names them through this module. Each
function runs in the caller's connection or transaction, as `delivery.apply.apply_config` does."""

from __future__ import annotations

from datetime import datetime
from typing import Any

import sqlalchemy as sa

from delivery.clock import utcnow
from delivery.store import catalog
from delivery.store.requeue import (
    DEFAULT_STATUSES,
    REQUESTED_BY_MAX,
    RequeueInputError,
    Selection,
    check_request,
    list_requeues,
    requeue_or_preview,
)

__all__ = [
    "DEFAULT_STATUSES",
    "REQUESTED_BY_MAX",
    "RequeueInputError",
    "Selection",
    "check_request",
    "history",
    "requeue",
    "rule_target",
]


def requeue(
    conn: sa.Connection,
    rule: str,
    selection: Selection,
    by: str,
    *,
    dry_run: bool,
    flow_run_id: str | None = None,
    now: datetime | None = None,
) -> list[dict[str, Any]]:
    """Put the rows `selection` takes back into play (a requeue recorded as asked by `by`), or,
    with `dry_run`, only list them; inside the caller's transaction. `UnknownName` for a rule
    that does not exist."""
    return requeue_or_preview(conn, rule, selection, by, now or utcnow(), dry_run=dry_run, flow_run_id=flow_run_id)


def history(conn: sa.Connection, rule: str | None = None) -> list[dict[str, Any]]:
    """The requeues recorded, newest first (of `rule` only when named: `UnknownName` if it does
    not exist)."""
    if rule is not None:
        catalog.get_rule(conn, rule)
    return list_requeues(conn, rule)


def rule_target(conn: sa.Connection, rule: str) -> str:
    """The name of `rule`'s target (`UnknownName` if the rule does not exist)."""
    return catalog.get_rule(conn, rule).target.name
