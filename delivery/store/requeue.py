"""Putting parked records back: selected ledger rows become due retries, and every requeue is
recorded (who, when, what, how many) so an operator can see it later."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import sqlalchemy as sa

from delivery.domain import LedgerStatus, Rule
from delivery.errors import InputError
from delivery.storable import text_problem
from delivery.store import catalog
from delivery.store.tables import ledger_table, mirror_records_table, requeues_table, rules_table

#: Statuses requeued when none is named: the parked (terminal) ones.
DEFAULT_STATUSES = (LedgerStatus.EXHAUSTED, LedgerStatus.REMOTE_GONE)
#: The only statuses a requeue may select: a delivered or suppressed row is not waiting for anything.
REQUEUABLE = frozenset({LedgerStatus.EXHAUSTED, LedgerStatus.REMOTE_GONE, LedgerStatus.FAILED})


#: The longest `by` the audit row keeps (`requeues.requested_by`).
REQUESTED_BY_MAX = 200


class RequeueInputError(InputError):
    """A requeue's input refused, the message the bare reason; `parameter` names the input as the
    `delivery-requeue` flow does (`statuses`, `ids`, `error_contains`, `rule`, `by`), for the
    caller to say which option or parameter held it."""

    def __init__(self, parameter: str, reason: str) -> None:
        self.parameter = parameter
        super().__init__(reason)


def _check_text(parameter: str, value: str, max_length: int | None = None) -> None:
    problem = text_problem(value, max_length)
    if problem is not None:
        raise RequeueInputError(parameter, f"the value {problem}")


def check_request(rule: str, by: str) -> None:
    """The rule's name and who asks, checked alike for the command line and the flow before anything
    is read or written: `by` must fit the audit row (PostgreSQL refuses a longer one, SQLite would
    keep it), and neither may hold a NUL or a lone surrogate (no database takes those alike)."""
    _check_text("rule", rule)
    _check_text("by", by, REQUESTED_BY_MAX)


@dataclass(frozen=True)
class Selection:
    statuses: tuple[LedgerStatus, ...] = DEFAULT_STATUSES
    external_ids: tuple[str, ...] = ()
    error_contains: str | None = None
    since: datetime | None = None

    @classmethod
    def of(
        cls,
        statuses: Iterable[LedgerStatus | str] | None = None,
        external_ids: Iterable[str] | None = None,
        error_contains: str | None = None,
        since: datetime | None = None,
    ) -> Selection:
        """The selection an operator asked for, from the command line or the `delivery-requeue`
        flow alike, checked the same way: a `RequeueInputError` for a status that cannot be
        requeued, or an id or error text no database takes alike (a NUL, a lone surrogate); the
        message is the bare reason, the caller says which option held it."""
        chosen: list[LedgerStatus] = []
        for status in statuses or DEFAULT_STATUSES:
            try:
                value = LedgerStatus(status)
            except ValueError:
                raise RequeueInputError("statuses", f"{status!r} is not a ledger status") from None
            if value not in REQUEUABLE:
                raise RequeueInputError("statuses", "only exhausted, remote_gone and failed rows can be requeued")
            if value not in chosen:
                chosen.append(value)
        for external_id in external_ids or ():
            _check_text("ids", external_id)
        if error_contains:
            _check_text("error_contains", error_contains)
        if since is not None:
            if since.tzinfo is None:
                since = since.replace(tzinfo=UTC)  # a time with no zone is UTC, as everywhere else
            try:
                since = since.astimezone(UTC)  # as the database compares it
            except OverflowError:
                raise RequeueInputError("since", "falls outside the years 1 to 9999 once in UTC") from None
        return cls(tuple(chosen), tuple(external_ids or ()), error_contains or None, since)

    def as_json(self) -> dict[str, Any]:
        return {
            "statuses": [s.value for s in self.statuses],
            "external_ids": list(self.external_ids),
            "error_contains": self.error_contains,
            "since": self.since.isoformat() if self.since else None,
        }


def _selected(rule: Rule, selection: Selection) -> sa.Select[Any]:
    query = (
        sa.select(
            ledger_table.c.id,
            mirror_records_table.c.external_id,
            ledger_table.c.status,
            ledger_table.c.remote_id,
            ledger_table.c.attempts,
            ledger_table.c.last_error,
            ledger_table.c.updated_at,
            ledger_table.c.version,
        )
        .join(mirror_records_table, mirror_records_table.c.id == ledger_table.c.record_id)
        .where(ledger_table.c.rule_id == rule.id, ledger_table.c.status.in_([s.value for s in selection.statuses]))
        .order_by(ledger_table.c.updated_at, ledger_table.c.id)
    )
    if selection.external_ids:
        query = query.where(mirror_records_table.c.external_id.in_(selection.external_ids))
    if selection.error_contains:
        # LIKE's wildcards in operator input are meant literally.
        escaped = selection.error_contains.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_")
        query = query.where(ledger_table.c.last_error.like(f"%{escaped}%", escape="\\"))
    if selection.since is not None:
        query = query.where(ledger_table.c.updated_at >= sa.literal(selection.since, ledger_table.c.updated_at.type))
    return query


def preview(conn: sa.Connection, rule: Rule, selection: Selection) -> list[dict[str, Any]]:
    return [row._asdict() for row in conn.execute(_selected(rule, selection))]


def requeue(
    conn: sa.Connection,
    rule: Rule,
    selection: Selection,
    by: str,
    now: datetime,
    *,
    flow_run_id: str | None = None,
) -> list[dict[str, Any]]:
    """Turn the selected rows into retries due now (attempts reset). A `remote_gone` row also loses
    its remote id and takes a new create generation: the next chain creates the record again, with
    a new Idempotency-Key so the target does not answer with the old, deleted record.
    Each row is written only at the version it was read at: a chain that settled it in between
    keeps its outcome, and the row is left out of what this requeue reports and records.
    `flow_run_id`: the `delivery-requeue` flow run asking, kept on the audit row (None: the CLI).
    A `by` the audit row cannot keep is refused before anything is written (`check_request`)."""
    check_request(rule.name, by)
    changed = []
    for row in preview(conn, rule, selection):
        values: dict[str, Any] = {
            "status": LedgerStatus.FAILED.value,
            "attempts": 0,
            "next_attempt_at": now,
            "last_error": f"requeued by {by} (was {row['status']}: {row['last_error'] or '-'})"[:1000],
            "updated_at": now,
            "version": row["version"] + 1,
        }
        if row["status"] == LedgerStatus.REMOTE_GONE.value:
            # A new key: no body has been sent under it yet.
            values.update(
                remote_id=None,
                fingerprint=None,
                create_fingerprint=None,
                create_generation=ledger_table.c.create_generation + 1,
                in_doubt=False,  # nothing is known of a record the target no longer has
            )
        result = conn.execute(
            ledger_table.update()
            .where(ledger_table.c.id == row["id"], ledger_table.c.version == row["version"])
            .values(**values)
        )
        if result.rowcount == 1:
            changed.append({k: v for k, v in row.items() if k != "version"})
    if changed:
        conn.execute(
            requeues_table.insert().values(
                rule_id=rule.id,
                requested_by=by,
                requested_at=now,
                criteria=selection.as_json(),
                count=len(changed),
                external_ids=[r["external_id"] for r in changed],
                flow_run_id=flow_run_id,
            )
        )
    return changed


def requeue_or_preview(
    conn: sa.Connection,
    rule_name: str,
    selection: Selection,
    by: str,
    now: datetime,
    *,
    dry_run: bool,
    flow_run_id: str | None = None,
) -> list[dict[str, Any]]:
    """What `delivery requeue` and the delivery-requeue flow both do once their input is checked:
    the rows the selection takes, requeued, or only listed when `dry_run`."""
    rule = catalog.get_rule(conn, rule_name)
    if dry_run:
        return preview(conn, rule, selection)
    return requeue(conn, rule, selection, by, now, flow_run_id=flow_run_id)


def list_requeues(conn: sa.Connection, rule: str | None = None, limit: int = 50) -> list[dict[str, Any]]:
    query = (
        sa.select(
            rules_table.c.name.label("rule"),
            requeues_table.c.requested_by,
            requeues_table.c.requested_at,
            requeues_table.c.count,
            requeues_table.c.criteria,
            requeues_table.c.flow_run_id,
        )
        .join(rules_table, rules_table.c.id == requeues_table.c.rule_id)
        .order_by(requeues_table.c.requested_at.desc())
        .limit(limit)
    )
    if rule is not None:
        query = query.where(rules_table.c.name == rule)
    return [row._asdict() for row in conn.execute(query)]
