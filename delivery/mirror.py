"""Mirror loading as a service: what `delivery mirror load` calls, so that the command line does
not reach into the store for it. A JSONL file read line by line (`delivery.mirror_file`), upserted
all or nothing in the caller's transaction (`delivery.store.mirror.load_records`). A source or a
domain refused raises `MirrorInputError` naming the input (`parameter`), for the caller to name its
own option."""

from __future__ import annotations

from pathlib import Path

import sqlalchemy as sa

from delivery.mirror_file import read_mirror_file
from delivery.store.mirror import LoadReport, MirrorInputError, load_records

__all__ = ["LoadReport", "MirrorInputError", "load_file"]


def load_file(conn: sa.Connection, source: str, domain: str, file: Path) -> LoadReport:
    """Upsert the records of the JSONL `file` as `source`'s records of `domain`, inside the
    caller's transaction (a bad line rolls back the whole load)."""
    return load_records(conn, source, domain, read_mirror_file(file))
