"""Mirror loading: upsert records by (source, domain, external id), moving the change signal only
when the payload or the deleted flag really changes."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from itertools import islice
from typing import Any

import sqlalchemy as sa

from delivery.clock import utcnow
from delivery.errors import InputError, UnknownName
from delivery.store.tables import connections, mirror_records

#: Rows per round trip: large enough to amortise the statement, small enough for SQLite's
#: bound-parameter limit in the IN (...) look-up.
CHUNK = 500


@dataclass(frozen=True)
class MirrorInput:
    external_id: str
    payload: dict[str, Any]
    deleted: bool = False


@dataclass
class LoadReport:
    inserted: int = 0
    changed: int = 0
    unchanged: int = 0

    @property
    def total(self) -> int:
        return self.inserted + self.changed + self.unchanged


def content_hash(payload: dict[str, Any], deleted: bool) -> str:
    canonical = json.dumps([payload, deleted], sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(canonical.encode()).hexdigest()


def _chunks(items: Iterable[MirrorInput], size: int) -> Iterator[list[MirrorInput]]:
    iterator = iter(items)
    while chunk := list(islice(iterator, size)):
        yield chunk


def source_id(conn: sa.Connection, source: str) -> int:
    found = conn.execute(sa.select(connections.c.id).where(connections.c.name == source)).scalar()
    if found is None:
        raise UnknownName(f"source connection {source!r} does not exist (apply a config that declares it)")
    return int(found)


def load_records(conn: sa.Connection, source: str, domain: str, records: Iterable[MirrorInput]) -> LoadReport:
    """Upsert `records` inside the caller's transaction, so a caller that fails part-way (a bad
    line further on) rolls back everything. `records` is consumed lazily, chunk by chunk."""
    if not 1 <= len(domain) <= 200:
        raise InputError(f"--domain: {domain[:40]!r} must be 1 to 200 characters, as a rule's domain is")
    src = source_id(conn, source)
    report = LoadReport()
    for chunk in _chunks(records, CHUNK):
        # Within one chunk the last line for an id wins, as it would row by row.
        latest = {item.external_id: item for item in chunk}
        existing = {
            row.external_id: row
            for row in conn.execute(
                sa.select(mirror_records.c.id, mirror_records.c.external_id, mirror_records.c.content_hash).where(
                    mirror_records.c.source_id == src,
                    mirror_records.c.domain == domain,
                    mirror_records.c.external_id.in_(latest),
                )
            )
        }
        now = utcnow()
        inserts: list[dict[str, Any]] = []
        updates: list[dict[str, Any]] = []
        for item in latest.values():
            digest = content_hash(item.payload, item.deleted)
            row = existing.get(item.external_id)
            if row is None:
                inserts.append(
                    {
                        "source_id": src,
                        "domain": domain,
                        "external_id": item.external_id,
                        "payload": item.payload,
                        "content_hash": digest,
                        "deleted": item.deleted,
                        "changed_at": now,
                        "created_at": now,
                    }
                )
            elif row.content_hash != digest:
                updates.append(
                    {
                        "b_id": row.id,
                        "b_payload": item.payload,
                        "b_hash": digest,
                        "b_deleted": item.deleted,
                        "b_changed_at": now,
                    }
                )
            else:
                report.unchanged += 1
        if inserts:
            conn.execute(mirror_records.insert(), inserts)
            report.inserted += len(inserts)
        if updates:
            conn.execute(
                mirror_records.update()
                .where(mirror_records.c.id == sa.bindparam("b_id"))
                .values(
                    payload=sa.bindparam("b_payload", type_=mirror_records.c.payload.type),
                    content_hash=sa.bindparam("b_hash"),
                    deleted=sa.bindparam("b_deleted"),
                    changed_at=sa.bindparam("b_changed_at", type_=mirror_records.c.changed_at.type),
                ),
                updates,
            )
            report.changed += len(updates)
        report.unchanged += len(chunk) - len(latest)
    return report
