"""Mirror loading: upsert records by (source, domain, external id), moving the change signal only
when the payload or the deleted flag really changes."""

from __future__ import annotations

import enum
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from datetime import datetime
from itertools import islice
from typing import Any

import sqlalchemy as sa

from delivery.clock import utcnow
from delivery.digest import canonical_digest
from delivery.domain import MirrorInput
from delivery.errors import InputError, MirrorLoadError, UnknownName
from delivery.storable import mirror_input_problem, text_problem
from delivery.store.tables import connections_table, mirror_records_table

#: Rows per round trip: large enough to amortise the statement, small enough for SQLite's
#: bound-parameter limit in the IN (...) look-up.
CHUNK = 500


class MirrorInputError(InputError):
    """A load's source or domain refused, the message naming it in the domain's words (the source
    connection, the record domain); `parameter` (`source` or `domain`) and `reason` let a caller
    say which of its own inputs held it (the command line names its option)."""

    def __init__(self, parameter: str, reason: str) -> None:
        self.parameter = parameter
        self.reason = reason
        super().__init__(f"{_NAMES[parameter]} name: {reason}")


#: How a load's inputs are named in its errors.
_NAMES = {"source": "source connection", "domain": "record domain"}


@dataclass
class LoadReport:
    """Each id is counted once, however often the load gives it: its last record is the one stored."""

    inserted: int = 0
    changed: int = 0
    unchanged: int = 0
    #: Records whose id came earlier in the same load (each replaced by the later one).
    repeated: int = 0

    @property
    def total(self) -> int:
        """The ids loaded."""
        return self.inserted + self.changed + self.unchanged

    @property
    def read(self) -> int:
        """The records read, repeats included."""
        return self.total + self.repeated


def _refuse_unloadable(records: Iterable[MirrorInput]) -> Iterator[MirrorInput]:
    # Counted from 1 like the lines of a mirror file, so an API caller's message reads the same.
    for position, item in enumerate(records, start=1):
        problem = mirror_input_problem(item)
        if problem is not None:
            raise MirrorLoadError(position, problem)
        yield item


class _Counted(enum.Enum):
    INSERTED = "inserted"
    CHANGED = "changed"
    UNCHANGED = "unchanged"


def record_digest(payload: dict[str, Any], deleted: bool) -> str:
    """The change signal's digest: stored on every mirror row, so its recipe must never change."""
    return canonical_digest([payload, deleted])


def _chunks(items: Iterable[MirrorInput], size: int) -> Iterator[list[MirrorInput]]:
    iterator = iter(items)
    while chunk := list(islice(iterator, size)):
        yield chunk


def source_id(conn: sa.Connection, source: str) -> int:
    found = conn.execute(sa.select(connections_table.c.id).where(connections_table.c.name == source)).scalar()
    if found is None:
        raise UnknownName(f"source connection {source!r} does not exist (apply a config that declares it)")
    return int(found)


def load_records(
    conn: sa.Connection, source: str, domain: str, records: Iterable[MirrorInput], now: datetime | None = None
) -> LoadReport:
    """Upsert `records` inside the caller's transaction, so a caller that fails part-way (a bad
    line further on) rolls back everything. `records` is consumed lazily, chunk by chunk.

    A record that cannot be stored alike on SQLite and PostgreSQL, or never sent (an empty or
    over-long id, NaN or ±Infinity, a NUL or a lone surrogate in the id or the payload) is refused
    with `MirrorLoadError` naming its position in `records` (from 1, as a line number) and where
    in the payload it sits.

    An id given more than once is stored as its last record and counted once (`repeated` counts
    the others), as what its last record did to the row the load started from. Every row is
    stamped `now` (the system's time as each chunk is written, if not given)."""
    for parameter, value in (("source", source), ("domain", domain)):
        problem = text_problem(value)
        if problem is not None:
            raise MirrorInputError(parameter, problem)
    if not 1 <= len(domain) <= 200:
        raise MirrorInputError("domain", f"{domain[:40]!r} must be 1 to 200 characters, as a rule's domain is")
    src = source_id(conn, source)
    report = LoadReport()
    # How each id loaded so far was counted. One entry per id, not per record: a repeat in a later
    # chunk finds the row this load wrote, and must neither count again nor as a change of its own.
    counted: dict[str, _Counted] = {}
    for chunk in _chunks(_refuse_unloadable(records), CHUNK):
        # Within one chunk the last line for an id wins, as it would row by row.
        latest: dict[str, MirrorInput] = {}
        for item in chunk:
            if item.external_id in latest or item.external_id in counted:
                report.repeated += 1
            latest[item.external_id] = item
        existing = {
            row.external_id: row
            for row in conn.execute(
                sa.select(
                    mirror_records_table.c.id, mirror_records_table.c.external_id, mirror_records_table.c.content_hash
                ).where(
                    mirror_records_table.c.source_id == src,
                    mirror_records_table.c.domain == domain,
                    mirror_records_table.c.external_id.in_(latest),
                )
            )
        }
        stamped = now or utcnow()
        inserts: list[dict[str, Any]] = []
        updates: list[dict[str, Any]] = []
        for item in latest.values():
            digest = record_digest(item.payload, item.deleted)
            row = existing.get(item.external_id)
            before = counted.get(item.external_id)
            if row is None:
                counted[item.external_id] = _Counted.INSERTED
                inserts.append(
                    {
                        "source_id": src,
                        "domain": domain,
                        "external_id": item.external_id,
                        "payload": item.payload,
                        "content_hash": digest,
                        "deleted": item.deleted,
                        "changed_at": stamped,
                        "created_at": stamped,
                    }
                )
            elif row.content_hash != digest:
                if before is None:
                    report.changed += 1
                elif before is _Counted.UNCHANGED:
                    report.unchanged -= 1
                    report.changed += 1
                # Inserted earlier in this load: still new, with its last record.
                counted[item.external_id] = before if before is _Counted.INSERTED else _Counted.CHANGED
                updates.append(
                    {
                        "b_id": row.id,
                        "b_payload": item.payload,
                        "b_hash": digest,
                        "b_deleted": item.deleted,
                        "b_changed_at": stamped,
                    }
                )
            elif before is None:
                report.unchanged += 1
                counted[item.external_id] = _Counted.UNCHANGED
        if inserts:
            conn.execute(mirror_records_table.insert(), inserts)
            report.inserted += len(inserts)
        if updates:
            conn.execute(
                mirror_records_table.update()
                .where(mirror_records_table.c.id == sa.bindparam("b_id"))
                .values(
                    payload=sa.bindparam("b_payload", type_=mirror_records_table.c.payload.type),
                    content_hash=sa.bindparam("b_hash"),
                    deleted=sa.bindparam("b_deleted"),
                    changed_at=sa.bindparam("b_changed_at", type_=mirror_records_table.c.changed_at.type),
                ),
                updates,
            )
    return report
