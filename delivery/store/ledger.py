"""The ledger: the drain and scan pages (each an index seek), settling outcomes, and reading rows."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from datetime import datetime
from typing import Any

import sqlalchemy as sa
from sqlalchemy.exc import IntegrityError

from delivery.domain import Candidate, Cursor, DeletePolicy, LedgerRow, LedgerStatus, MirrorRecord, Outcome, Rule
from delivery.errors import LedgerRowConflict
from delivery.store import attempts
from delivery.store.tables import ledger_table, mirror_records_table, rules_table

_L = [c.label(f"l_{c.name}") for c in ledger_table.c]
_M = [c.label(f"m_{c.name}") for c in mirror_records_table.c]
#: The ledger columns whose `LedgerRow` field is named otherwise (the columns keep their first names).
_COLUMN_OF = {"delivered_digest": "fingerprint", "create_digest": "create_fingerprint"}
#: Rows the scan offers again once their record's change signal moves.
_REOFFERED = (LedgerStatus.DELIVERED.value, LedgerStatus.SUPPRESSED.value, LedgerStatus.DELETED.value)


def _candidate(row: Any) -> Candidate:
    record = MirrorRecord(
        id=row.m_id,
        source_id=row.m_source_id,
        domain=row.m_domain,
        external_id=row.m_external_id,
        payload=row.m_payload,
        deleted=row.m_deleted,
        changed_at=row.m_changed_at,
    )
    row_ledger = None
    if row.l_id is not None:
        row_ledger = LedgerRow(
            id=row.l_id,
            rule_id=row.l_rule_id,
            record_id=row.l_record_id,
            status=LedgerStatus(row.l_status),
            remote_id=row.l_remote_id,
            attempts=row.l_attempts,
            next_attempt_at=row.l_next_attempt_at,
            last_error=row.l_last_error,
            settled_changed_at=row.l_settled_changed_at,
            delivered_digest=row.l_fingerprint,
            create_generation=row.l_create_generation,
            version=row.l_version,
            create_digest=row.l_create_fingerprint,
            in_doubt=row.l_in_doubt,
            deleting=row.l_deleting,
        )
    return Candidate(record, row_ledger)


def changes_query(rule: Rule, after: Cursor | None, limit: int, *where: sa.ColumnElement[bool]) -> sa.Select[Any]:
    """The rule's records in the mirror, each with its ledger row if it has one, that meet
    `where`: in the scan's (changed_at, id) order, after `after`, at most `limit`. A keyset page,
    so a page far into the mirror costs what the first one does."""
    m, lg = mirror_records_table, ledger_table
    query = (
        sa.select(*_M, *_L)
        .select_from(m.outerjoin(lg, sa.and_(lg.c.rule_id == rule.id, lg.c.record_id == m.c.id)))
        .where(m.c.source_id == rule.source.id, m.c.domain == rule.domain, *where)
        .order_by(m.c.changed_at, m.c.id)
        .limit(limit)
    )
    if after is None:
        return query
    return query.where(
        sa.tuple_(m.c.changed_at, m.c.id)
        > sa.tuple_(sa.literal(after.changed_at, m.c.changed_at.type), sa.literal(after.record_id))
    )


def scan_page(conn: sa.Connection, rule: Rule, after: Cursor | None, limit: int) -> list[Candidate]:
    """The rule's changes after `after` in (changed_at, id) order, skipping what the ledger already
    settled at this change signal, terminal rows and failed rows (the drain owns those). A record
    deleted in the source is offered only to a rule that propagates deletes, and only where its
    row holds a remote id (this rule delivered it) or a create went out under its current key
    whose answer was never recorded: nothing else is ever deleted."""
    m, lg = mirror_records_table, ledger_table
    unsettled = sa.and_(
        lg.c.status.in_(_REOFFERED),
        sa.or_(lg.c.settled_changed_at.is_(None), lg.c.settled_changed_at != m.c.changed_at),
    )
    if rule.deletes is DeletePolicy.PROPAGATE:
        where: tuple[sa.ColumnElement[bool], ...] = (
            sa.or_(
                sa.and_(m.c.deleted.is_(False), sa.or_(lg.c.id.is_(None), unsettled)),
                # A copy this rule made, or may have made: a create went out under the row's
                # current key and its id was never learnt (`decisions.create_may_have_landed`).
                sa.and_(
                    m.c.deleted.is_(True),
                    sa.or_(lg.c.remote_id.is_not(None), lg.c.create_fingerprint.is_not(None)),
                    unsettled,
                ),
            ),
        )
    else:
        where = (m.c.deleted.is_(False), sa.or_(lg.c.id.is_(None), unsettled))
    query = changes_query(rule, after, limit, *where)
    return [_candidate(row) for row in conn.execute(query)]


def drain_page(conn: sa.Connection, rule: Rule, due_by: datetime, limit: int) -> list[Candidate]:
    """Failed rows due by the chain's start, oldest due first. Every row a batch attempts lands, or
    is given a time after `due_by`, or turns terminal, so repeating this query ends."""
    m, lg = mirror_records_table, ledger_table
    query = (
        sa.select(*_M, *_L)
        .select_from(lg.join(m, m.c.id == lg.c.record_id))
        .where(
            lg.c.rule_id == rule.id,
            lg.c.status == LedgerStatus.FAILED.value,
            lg.c.next_attempt_at <= sa.literal(due_by, ledger_table.c.next_attempt_at.type),
        )
        .order_by(lg.c.next_attempt_at, lg.c.id)
        .limit(limit)
    )
    return [_candidate(row) for row in conn.execute(query)]


#: Built once: the settle runs once per record, and building a statement costs more Python than
#: the database spends running it.
_INSERT = ledger_table.insert()
_INSERT_RETURNING_ID = ledger_table.insert().returning(ledger_table.c.id, sort_by_parameter_order=True)
#: The columns every settle writes (`_settled_values`).
_SETTLED_COLUMNS = (
    "status",
    "remote_id",
    "attempts",
    "next_attempt_at",
    "last_error",
    "settled_changed_at",
    "fingerprint",
    "create_generation",
    "in_doubt",
    "deleting",
    "updated_at",
)
#: Every write of a row names the version it read and moves it on: a settle and a requeue racing
#: for one row cannot overwrite each other unseen, the later one finds no row to write.
_UPDATE = ledger_table.update().where(
    ledger_table.c.id == sa.bindparam("row_id"), ledger_table.c.version == sa.bindparam("read_version")
)
#: `_UPDATE` and the outcome's one attempt in one statement, where the database can
#: (`attempts.after`): by whether the row's key moved on (which writes `create_fingerprint` too).
_UPDATE_AND_ATTEMPT = {
    renewed: attempts.after(
        _UPDATE.values(
            {
                name: sa.bindparam(name, type_=ledger_table.c[name].type)
                for name in (*_SETTLED_COLUMNS, "version", *(("create_fingerprint",) if renewed else ()))
            }
        )
    )
    for renewed in (False, True)
}
_DELETE = ledger_table.delete().where(
    ledger_table.c.id == sa.bindparam("row_id"), ledger_table.c.version == sa.bindparam("read_version")
)

#: What an intent row says until its create's outcome is settled: after a crash an operator
#: reads it in the ledger, and the next chain's drain sends the create again under the same key.
CREATE_IN_FLIGHT = "create sent, outcome not recorded yet (a retry repeats its Idempotency-Key)"


def _insert(conn: sa.Connection, rule: Rule, candidate: Candidate, values: dict[str, Any]) -> int:
    try:
        result = conn.execute(_INSERT, {"rule_id": rule.id, "record_id": candidate.record.id, **values})
    except IntegrityError as exc:
        # The scan said there was no row: one that exists all the same is an invariant broken,
        # not a row to overwrite. The whole transaction goes with it (nothing else is in it).
        raise LedgerRowConflict(rule.name, candidate.record.external_id) from exc
    assert result.inserted_primary_key is not None
    return int(result.inserted_primary_key[0])


def record_create_intent(
    conn: sa.Connection, rule: Rule, candidate: Candidate, digest: str, now: datetime, *, follow_up: bool = False
) -> LedgerRow | None:
    """Before a create goes out: remember the digest of the first body sent under the row's key,
    and make sure a row exists, so a crash before the settle leaves a due retry (the drain's) and
    not a record nobody knows was sent. `follow_up`: the create may be a replay, to be followed by
    an update whose answer may never be recorded, so the row is put in doubt too.
    A row the scan did not see raises `LedgerRowConflict` here, before any request. Returns the row
    as it now stands, or None when its version moved since the page was read (a requeue got there
    first: the row is the requeue's now)."""
    row = candidate.ledger
    if row is None:
        row_id = _insert(conn, rule, candidate, _intent_values(digest, now))
        return _intent_row(rule, candidate, digest, now, row_id)
    changes: dict[str, Any] = {}  # by LedgerRow field
    if row.create_digest is None:
        changes["create_digest"] = digest
    if follow_up and not row.in_doubt:
        changes["in_doubt"] = True
    if not changes:
        return row  # the first body under this key is known already, and no doubt to declare
    columns = {_COLUMN_OF.get(name, name): value for name, value in changes.items()}
    result = conn.execute(
        _UPDATE, {"row_id": row.id, "read_version": row.version, "version": row.version + 1, **columns}
    )
    if result.rowcount == 0:
        return None
    return dataclasses.replace(row, version=row.version + 1, **changes)


def record_create_intents(
    conn: sa.Connection, rule: Rule, creates: Sequence[tuple[Candidate, str, bool]], now: datetime
) -> list[LedgerRow | None]:
    """`record_create_intent` for a window's creates, each `(candidate, digest, follow_up)`: the
    rows made for records never delivered in one statement (an executemany, ids returned in
    order), the others each as `record_create_intent` writes them (a retry's row mostly holds its
    first body's digest already: nothing to write). A conflicting row raises `LedgerRowConflict`
    for the record it belongs to, as the one-by-one writes would."""
    results: list[LedgerRow | None] = [None] * len(creates)
    fresh = [i for i, (candidate, _, _) in enumerate(creates) if candidate.ledger is None]
    done: set[int] = set()
    if len(fresh) > 1:
        params = [
            {"rule_id": rule.id, "record_id": creates[i][0].record.id, **_intent_values(creates[i][1], now)}
            for i in fresh
        ]
        try:
            # Under a savepoint: after a conflict the rows are written one by one, naming the record.
            with conn.begin_nested():
                ids = [row_id for (row_id,) in conn.execute(_INSERT_RETURNING_ID, params)]
        except IntegrityError:
            pass
        else:
            for i, row_id in zip(fresh, ids, strict=True):
                results[i] = _intent_row(rule, creates[i][0], creates[i][1], now, row_id)
            done = set(fresh)
    for i, (candidate, digest, follow_up) in enumerate(creates):
        if i not in done:
            results[i] = record_create_intent(conn, rule, candidate, digest, now, follow_up=follow_up)
    return results


def _intent_values(digest: str, now: datetime) -> dict[str, Any]:
    return {
        "status": LedgerStatus.FAILED.value,
        "remote_id": None,
        "attempts": 0,
        "next_attempt_at": now,
        "last_error": CREATE_IN_FLIGHT,
        "settled_changed_at": None,
        "fingerprint": None,
        "create_generation": 0,
        "create_fingerprint": digest,
        "in_doubt": False,
        "version": 0,
        "created_at": now,
        "updated_at": now,
    }


def _intent_row(rule: Rule, candidate: Candidate, digest: str, now: datetime, row_id: int) -> LedgerRow:
    return LedgerRow(
        id=row_id,
        rule_id=rule.id,
        record_id=candidate.record.id,
        status=LedgerStatus.FAILED,
        remote_id=None,
        attempts=0,
        next_attempt_at=now,
        last_error=CREATE_IN_FLIGHT,
        settled_changed_at=None,
        delivered_digest=None,
        create_generation=0,
        version=0,
        create_digest=digest,
    )


def record_update_intents(conn: sa.Connection, rows: Sequence[LedgerRow]) -> list[LedgerRow | None]:
    """Before updates go out: put each row in doubt, so a crash, a timeout or a cut between the
    send and the settle leaves a row whose next offer is sent whatever its body (an update the
    target applied unanswered must not make a later revert look identical to what it holds). One
    statement for all of them. Returns each row as it now stands, or None where its version moved
    since the page was read (a requeue's row now). A row already in doubt is left as it is."""
    return _mark(conn, rows, "in_doubt")


def record_delete_intents(conn: sa.Connection, rows: Sequence[LedgerRow]) -> list[LedgerRow | None]:
    """Before deletes go out: mark each row `deleting`, so a crash, a timeout or a cut between the
    send and the settle leaves a row whose next offer finishes the delete first (a record restored
    meanwhile is then created again, never updated at an id the target may have dropped). As
    `record_update_intents` otherwise."""
    return _mark(conn, rows, "deleting")


def _mark(conn: sa.Connection, rows: Sequence[LedgerRow], flag: str) -> list[LedgerRow | None]:
    """Set the boolean `flag` (a `LedgerRow` field and its column) on each row, in one statement."""
    marking = [row for row in rows if not getattr(row, flag)]
    written: set[int] = set()
    if marking:
        result = conn.execute(
            ledger_table.update()
            .where(sa.tuple_(ledger_table.c.id, ledger_table.c.version).in_([(row.id, row.version) for row in marking]))
            .values({flag: True, "version": ledger_table.c.version + 1})
            .returning(ledger_table.c.id)
        )
        written = {row_id for (row_id,) in result}
    return [
        row
        if getattr(row, flag)
        else (dataclasses.replace(row, version=row.version + 1, **{flag: True}) if row.id in written else None)  # type: ignore[arg-type]
        for row in rows
    ]


def withdraw_intent(conn: sa.Connection, before: LedgerRow | None, intent: LedgerRow) -> None:
    """Take back an intent whose write never went out (the breaker refused the call, the batch was
    cut first, the target refused the credentials), so the row says what happened: nothing. A row
    the intent made goes again."""
    if before is None:
        conn.execute(_DELETE, {"row_id": intent.id, "read_version": intent.version})
    elif intent.version != before.version:
        conn.execute(
            _UPDATE,
            {
                "row_id": intent.id,
                "read_version": intent.version,
                "version": intent.version + 1,
                "create_fingerprint": before.create_digest,
                "in_doubt": before.in_doubt,
                "deleting": before.deleting,
            },
        )


def settle_many(
    conn: sa.Connection, rule: Rule, settles: Sequence[tuple[Candidate, Outcome]], now: datetime
) -> list[bool]:
    """`settle` for a group's outcomes: the rows made in one executemany, the rows written in
    another. Returns, per outcome, whether it was written (False: a requeue moved the row's
    version first, and keeps it). The updates run under a savepoint: when fewer rows than sent
    were written, it is rolled back and they are written one by one, to learn which. A row made
    where one exists raises `LedgerRowConflict` (the caller settles the group one by one to name it)."""
    inserts = [(c, o) for c, o in settles if c.ledger is None]
    updates = [(c, o) for c, o in settles if c.ledger is not None]
    #: Outcomes written together here, whose requests are written together after (one by one, a
    #: `settle` writes its own).
    together_written: list[tuple[Candidate, Outcome]] = []
    if len(inserts) == 1:
        settle(conn, rule, *inserts[0], now)
    elif inserts:
        params = [
            {
                "rule_id": rule.id,
                "record_id": c.record.id,
                **_settled_values(c, o, now),
                "version": 0,
                "create_fingerprint": None,
                "created_at": now,
            }
            for c, o in inserts
        ]
        try:
            conn.execute(_INSERT, params)
        except IntegrityError as exc:
            raise LedgerRowConflict(rule.name, inserts[0][0].record.external_id) from exc
        together_written.extend(inserts)
    written: dict[int, bool] = {}
    # One executemany needs one set of columns: a row whose key moved on (a delete) writes one more.
    together = [(c, o) for c, o in updates if not o.key_renewed]
    if len(together) > 1:
        params = []
        for c, o in together:
            assert c.ledger is not None
            versions = {"row_id": c.ledger.id, "read_version": c.ledger.version, "version": c.ledger.version + 1}
            params.append({**versions, **_settled_values(c, o, now)})
        savepoint = conn.begin_nested()
        if conn.execute(_UPDATE, params).rowcount == len(together):
            savepoint.commit()
            written = {id(c): True for c, _ in together}
            together_written.extend(together)
        else:
            savepoint.rollback()
    for c, o in updates:
        if id(c) not in written:
            written[id(c)] = settle(conn, rule, c, o, now)
    attempts.write(conn, rule.id, together_written)
    return [True if c.ledger is None else written[id(c)] for c, _ in settles]


def _settled_values(candidate: Candidate, outcome: Outcome, now: datetime) -> dict[str, Any]:
    renewed = {"create_fingerprint": None} if outcome.key_renewed else {}
    return {
        **renewed,
        "status": outcome.status.value,
        "remote_id": outcome.remote_id,
        "attempts": outcome.attempts,
        "next_attempt_at": outcome.next_attempt_at,
        "last_error": outcome.last_error,
        "settled_changed_at": candidate.record.changed_at,
        "fingerprint": outcome.delivered_digest,
        "create_generation": outcome.create_generation,
        "in_doubt": outcome.in_doubt,
        "deleting": outcome.deleting,
        "updated_at": now,
    }


def settle(conn: sa.Connection, rule: Rule, candidate: Candidate, outcome: Outcome, now: datetime) -> bool:
    """Write one record's outcome, and the requests that led to it (its history). The change
    signal it settles is the one the candidate carried. Run in the transaction of the fence check
    that guards it. Returns False, writing nothing, when the row's version moved since it was
    read: whoever wrote it (a requeue) keeps it."""
    row = candidate.ledger
    if row is not None and len(outcome.tried) == 1 and attempts.one_statement(conn):
        # The common case of a per_record settle on PostgreSQL, a row and its one request, in one
        # statement: one round trip and one execution less per record.
        parameters = {
            "row_id": row.id,
            "read_version": row.version,
            "version": row.version + 1,
            **_settled_values(candidate, outcome, now),
            **attempts.parameters_after(rule.id, candidate, outcome),
        }
        return conn.execute(_UPDATE_AND_ATTEMPT[outcome.key_renewed], parameters).rowcount == 1
    written = _settle(conn, rule, candidate, outcome, now)
    if written:
        attempts.write(conn, rule.id, [(candidate, outcome)])
    return written


def _settle(conn: sa.Connection, rule: Rule, candidate: Candidate, outcome: Outcome, now: datetime) -> bool:
    values = _settled_values(candidate, outcome, now)
    row = candidate.ledger
    if row is None:
        _insert(conn, rule, candidate, {**values, "version": 0, "create_fingerprint": None, "created_at": now})
        return True
    versions = {"row_id": row.id, "read_version": row.version, "version": row.version + 1}
    result = conn.execute(_UPDATE, {**versions, **values})
    return result.rowcount == 1


def settled_since(conn: sa.Connection, rule_id: int, since: datetime) -> int:
    """Rows the rule's chains wrote since `since` (a progress figure, not a hot path)."""
    return int(
        conn.execute(
            sa.select(sa.func.count()).where(
                ledger_table.c.rule_id == rule_id,
                ledger_table.c.updated_at >= sa.literal(since, ledger_table.c.updated_at.type),
            )
        ).scalar_one()
    )


def counts_by_status(conn: sa.Connection, rule_id: int) -> dict[str, int]:
    rows = conn.execute(
        sa.select(ledger_table.c.status, sa.func.count())
        .where(ledger_table.c.rule_id == rule_id)
        .group_by(ledger_table.c.status)
    )
    counts = {status.value: 0 for status in LedgerStatus}
    counts.update({status: n for status, n in rows})
    return counts


def ledger_rows(
    conn: sa.Connection,
    rule: str | None = None,
    status: LedgerStatus | None = None,
    limit: int | None = None,
    external_id: str | None = None,
) -> list[dict[str, Any]]:
    query = (
        sa.select(
            rules_table.c.name.label("rule"),
            mirror_records_table.c.external_id,
            ledger_table.c.status,
            ledger_table.c.remote_id,
            ledger_table.c.attempts,
            ledger_table.c.next_attempt_at,
            ledger_table.c.last_error,
            ledger_table.c.in_doubt,
            ledger_table.c.deleting,
            ledger_table.c.updated_at,
        )
        .select_from(
            ledger_table.join(rules_table, rules_table.c.id == ledger_table.c.rule_id).join(
                mirror_records_table, mirror_records_table.c.id == ledger_table.c.record_id
            )
        )
        .order_by(rules_table.c.name, ledger_table.c.updated_at, ledger_table.c.id)
    )
    if rule is not None:
        query = query.where(rules_table.c.name == rule)
    if status is not None:
        query = query.where(ledger_table.c.status == status.value)
    if external_id is not None:
        query = query.where(mirror_records_table.c.external_id == external_id)
    if limit is not None:
        query = query.limit(limit)
    return [row._asdict() for row in conn.execute(query)]


#: What a chain leaves for an operator to look at: the rows it parked, and those it left failed.
LEFT_BEHIND = (LedgerStatus.FAILED, LedgerStatus.EXHAUSTED, LedgerStatus.REMOTE_GONE)


def left_behind_since(
    conn: sa.Connection, rule_id: int, since: datetime, limit: int
) -> tuple[list[dict[str, Any]], dict[str, int]]:
    """The rule's rows parked or left failed since `since` (a chain's start: one chain of a rule
    writes at a time, the fence sees to it), first `limit` of them in the order they were written,
    and how many there are of each status. The same rows `delivery requeue RULE --status ...
    --since SINCE` selects (updated_at >= since)."""
    where = (
        ledger_table.c.rule_id == rule_id,
        ledger_table.c.status.in_([s.value for s in LEFT_BEHIND]),
        ledger_table.c.updated_at >= sa.literal(since, ledger_table.c.updated_at.type),
    )
    rows = conn.execute(
        sa.select(
            mirror_records_table.c.external_id,
            ledger_table.c.status,
            ledger_table.c.attempts,
            ledger_table.c.last_error,
            ledger_table.c.next_attempt_at,
            ledger_table.c.updated_at,
        )
        .select_from(ledger_table.join(mirror_records_table, mirror_records_table.c.id == ledger_table.c.record_id))
        .where(*where)
        .order_by(ledger_table.c.updated_at, ledger_table.c.id)
        .limit(limit)
    )
    counts = conn.execute(
        sa.select(ledger_table.c.status, sa.func.count()).where(*where).group_by(ledger_table.c.status)
    )
    return [row._asdict() for row in rows], {status: n for status, n in counts}


def left_behind_of(conn: sa.Connection, rule_id: int, record_ids: Sequence[int]) -> dict[int, Any]:
    """The error, next attempt and attempts of the rule's rows for these records (one job's worth:
    a seek on the (rule, record) key), by record id."""
    if not record_ids:
        return {}
    rows = conn.execute(
        sa.select(
            ledger_table.c.record_id, ledger_table.c.last_error, ledger_table.c.next_attempt_at, ledger_table.c.attempts
        ).where(ledger_table.c.rule_id == rule_id, ledger_table.c.record_id.in_(list(record_ids)))
    )
    return {row.record_id: row for row in rows}


#: A rule's parked set as an operator is shown it: the parked (terminal) rows, and the failed ones
#: waiting for their next attempt.
PARKED_SET = (LedgerStatus.EXHAUSTED, LedgerStatus.REMOTE_GONE, LedgerStatus.FAILED)


def _latest_in_parked_set(rule_id: int, columns: Sequence[Any], limit: int, *, with_record: bool) -> sa.Select[Any]:
    """The rule's `limit` rows of the parked set changed last, most recent first: one backward seek
    of `ix_ledger_rule_id_status_updated_at_id` per status (each reading at most `limit` rows),
    merged. A single query over the three statuses would sort every parked row of the rule."""
    source = (
        ledger_table.join(mirror_records_table, mirror_records_table.c.id == ledger_table.c.record_id)
        if with_record
        else ledger_table
    )
    parts = [
        sa.select(*columns, ledger_table.c.updated_at.label("changed_at"), ledger_table.c.id.label("row_id"))
        .select_from(source)
        .where(ledger_table.c.rule_id == rule_id, ledger_table.c.status == status.value)
        .order_by(ledger_table.c.updated_at.desc(), ledger_table.c.id.desc())
        .limit(limit)
        .subquery()
        for status in PARKED_SET
    ]
    merged = sa.union_all(*(sa.select(part) for part in parts)).subquery()
    return sa.select(merged).order_by(merged.c.changed_at.desc(), merged.c.row_id.desc()).limit(limit)


def parked_counts(conn: sa.Connection, rule_id: int) -> dict[str, int]:
    """How many rows of the rule's parked set there are in each status (every status of
    `PARKED_SET` present, 0 when none), counted on the index alone."""
    rows = conn.execute(
        sa.select(ledger_table.c.status, sa.func.count())
        .where(ledger_table.c.rule_id == rule_id, ledger_table.c.status.in_([s.value for s in PARKED_SET]))
        .group_by(ledger_table.c.status)
    )
    counts = {status.value: 0 for status in PARKED_SET}
    counts.update({status: n for status, n in rows})
    return counts


def parked_latest(conn: sa.Connection, rule_id: int, limit: int) -> list[dict[str, Any]]:
    """The rule's parked and failed rows changed last, most recent first, the first `limit` of them:
    external id, status, attempts, last error, next attempt (failed rows) and `updated_at`, the time
    of the row's last change."""
    query = _latest_in_parked_set(
        rule_id,
        [
            mirror_records_table.c.external_id,
            ledger_table.c.status,
            ledger_table.c.attempts,
            ledger_table.c.last_error,
            ledger_table.c.next_attempt_at,
        ],
        limit,
        with_record=True,
    )
    return [
        {
            "external_id": row.external_id,
            "status": row.status,
            "attempts": row.attempts,
            "last_error": row.last_error,
            "next_attempt_at": row.next_attempt_at,
            "updated_at": row.changed_at,
        }
        for row in conn.execute(query)
    ]


def parked_errors(conn: sa.Connection, rule_id: int, limit: int) -> list[tuple[str, str | None]]:
    """(status, last error) of the rule's `limit` parked and failed rows changed last: what their
    reasons are counted from, read with the same seeks as `parked_latest`."""
    query = _latest_in_parked_set(rule_id, [ledger_table.c.status, ledger_table.c.last_error], limit, with_record=False)
    return [(row.status, row.last_error) for row in conn.execute(query)]
