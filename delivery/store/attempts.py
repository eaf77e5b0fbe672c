"""A record's history of requests (`delivery_attempts`): written with the settle each belongs to,
read newest first (one index seek), pruned in bounded deletes."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from datetime import datetime
from typing import Any, NamedTuple

import sqlalchemy as sa

from delivery.domain import Attempt, Candidate, Outcome
from delivery.storable import storable_text
from delivery.store.tables import attempts_table, mirror_records_table

#: Built once: written with every grouped settle that carries requests.
_INSERT = attempts_table.insert()

#: The fields of one attempt as `delivery attempts --json` prints them, in order.
FIELDS = (
    "at",
    "chain_run_id",
    "verb",
    "method",
    "path",
    "status_code",
    "error",
    "duration_ms",
    "answer_excerpt",
    "outcome",
)


#: The columns an attempt's row is written with (the id is the database's).
_COLUMNS = ("rule_id", "record_id", *FIELDS)


class _OneRowInsert(NamedTuple):
    """The INSERT of one attempt as a dialect's driver takes it: its SQL text, the order of its
    parameters (None for a driver taking them by name), and each column's value conversion."""

    sql: str
    order: tuple[str, ...] | None
    convert: Mapping[str, Callable[[Any], Any] | None]

    def parameters(self, row: dict[str, Any]) -> tuple[Any, ...] | dict[str, Any]:
        convert = self.convert
        if self.order is None:
            return {name: value if (f := convert[name]) is None else f(value) for name, value in row.items()}
        return tuple([row[name] if (f := convert[name]) is None else f(row[name]) for name in self.order])


_one_row_inserts: dict[tuple[type[sa.Dialect], str], _OneRowInsert] = {}


def _one_row_insert(dialect: sa.Dialect) -> _OneRowInsert:
    """`_OneRowInsert` for `dialect`, compiled on first use: SQLAlchemy's own SQL and bind processors."""
    key = (type(dialect), dialect.paramstyle)
    found = _one_row_inserts.get(key)
    if found is None:
        # As for an executemany: no RETURNING of the id, which nobody reads.
        compiled = attempts_table.insert().compile(dialect=dialect, column_keys=list(_COLUMNS), for_executemany=True)
        order = tuple(compiled.positiontup) if compiled.positiontup else None
        # The type as the dialect implements it (SQLite's DATETIME writes a fixed-width text: the
        # generic type's processor alone would leave the driver's adapter to write it).
        convert = {name: attempts_table.c[name].type.dialect_impl(dialect).bind_processor(dialect) for name in _COLUMNS}
        found = _one_row_inserts[key] = _OneRowInsert(str(compiled), order, convert)
    return found


def _row(rule_id: int, candidate: Candidate, outcome: Outcome, attempt: Attempt) -> dict[str, Any]:
    return {
        "rule_id": rule_id,
        "record_id": candidate.record.id,
        "at": attempt.at,
        "chain_run_id": attempt.chain_run_id,
        "verb": attempt.verb,
        "method": attempt.method,
        # Text as both databases store it alike (a NUL or a lone surrogate in an answer is kept as �).
        "path": storable_text(attempt.path)[:2000],
        "status_code": attempt.status_code,
        "error": None if attempt.error is None else storable_text(attempt.error),
        "duration_ms": attempt.duration_ms,
        "answer_excerpt": None if attempt.answer_excerpt is None else storable_text(attempt.answer_excerpt),
        "outcome": outcome.status.value,
    }


#: The prefix of an attempt's parameters in a statement that writes a ledger row too (`after`).
_PREFIX = "attempt_"


def after(update: sa.Update) -> sa.Insert:
    """One statement that runs `update` (of at most one row) and writes one attempt's row only if
    it wrote one: a data-modifying WITH, which PostgreSQL has (`one_statement`) and SQLite has not.
    Its row count is 1 when both were written, 0 when neither was. The attempt's values are
    parameters named with the prefix `attempt_` (`parameters_after`)."""
    settled = update.returning(sa.literal_column("1")).cte("settled")
    values = (sa.bindparam(_PREFIX + name, type_=attempts_table.c[name].type) for name in _COLUMNS)
    insert = attempts_table.insert().from_select(list(_COLUMNS), sa.select(*values).select_from(settled))
    # SQLAlchemy keeps the row count of an UPDATE or DELETE only, unless asked.
    return insert.execution_options(preserve_rowcount=True)


def one_statement(conn: sa.Connection) -> bool:
    """Whether the database runs an update and an attempt's row as one statement (`after`)."""
    return conn.dialect.name == "postgresql"


def parameters_after(rule_id: int, candidate: Candidate, outcome: Outcome) -> dict[str, Any]:
    """The parameters of the outcome's one attempt in a statement made by `after`."""
    (attempt,) = outcome.tried
    return {_PREFIX + name: value for name, value in _row(rule_id, candidate, outcome, attempt).items()}


def write(conn: sa.Connection, rule_id: int, settled: Sequence[tuple[Candidate, Outcome]]) -> None:
    """The requests behind each settled outcome, in the caller's transaction (the settle's): no
    commit of their own. One executemany for all of them."""
    rows = [_row(rule_id, candidate, outcome, attempt) for candidate, outcome in settled for attempt in outcome.tried]
    if len(rows) == 1:
        # A per_record settle's one row, one per record: the statement compiled once and its values
        # converted as SQLAlchemy would, then handed to the driver (`exec_driver_sql`, which the
        # engine's events still see). A Core execute looks its compiled form up and builds its
        # parameters anew every time: 52 µs a row on SQLite against 25 here, measured alone.
        insert = _one_row_insert(conn.dialect)
        conn.exec_driver_sql(insert.sql, insert.parameters(rows[0]))
    elif rows:
        conn.execute(_INSERT, rows)


def of_record(conn: sa.Connection, rule_id: int, record_id: int, limit: int) -> list[dict[str, Any]]:
    """The record's requests under the rule, newest first, at most `limit`."""
    t = attempts_table
    query = (
        sa.select(*(t.c[name] for name in FIELDS))
        .where(t.c.rule_id == rule_id, t.c.record_id == record_id)
        .order_by(t.c.at.desc(), t.c.id.desc())
        .limit(limit)
    )
    return [row._asdict() for row in conn.execute(query)]


def prune(conn: sa.Connection, before: datetime, limit: int) -> int:
    """Delete at most `limit` of the oldest requests made before `before` (one bounded delete,
    an index seek on `at`); how many went. Called again until it deletes fewer than `limit`."""
    t = attempts_table
    oldest = sa.select(t.c.id).where(t.c.at < sa.literal(before, t.c.at.type)).order_by(t.c.at, t.c.id).limit(limit)
    ids = [row_id for (row_id,) in conn.execute(oldest)]
    if ids:
        conn.execute(t.delete().where(t.c.id.in_(ids)))
    return len(ids)


def record_id(conn: sa.Connection, source_id: int, domain: str, external_id: str) -> int | None:
    """The mirror's id of the record `external_id` of that source and domain, or None."""
    m = mirror_records_table
    found = conn.execute(
        sa.select(m.c.id).where(m.c.source_id == source_id, m.c.domain == domain, m.c.external_id == external_id)
    ).scalar()
    return None if found is None else int(found)
